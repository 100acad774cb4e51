"""A committed checkpoint of a job on a Hugging Face model (`model.pretrained`) written back as
a directory `transformers` loads like any other (`from_pretrained`): `config.json` (the
pretrained checkpoint's, with the job's label count), `model.safetensors` (every weight of the
checkpoint) and the tokenizer or image processor files the model came with.

`pipetransformer export` runs this as `python -m pipetransformer.trainer.export` once it has found the job and
its checkpoint in the store (the data plane never reaches the store, and the control plane
never imports the data plane). It needs no process group.

The checkpoint holds one flat tensor per unit (`model.embed`, `model.blocks.<i>`,
`model.head`; trainer/checkpoint.py) whose members are the unit's parameters named
`<unit>.<checkpoint key>`, the key being the pretrained checkpoint's own (models/vit.py, models/bert.py);
so the unit's meta-built parameters give the names and shapes to cut it up with, and dropping the
unit prefix gives the names `transformers` loads. The tensors are written as they are
(float32): nothing is converted.

A causal language model (`model.task: causal-lm`) is written as its family's `*ForCausalLM`
class, its config.json's labels untouched (its outputs are the vocabulary). Where its output
projection is tied to the input embedding (`tie_word_embeddings`, `Family.tied_parameters`),
the pipeline held a copy in each unit and the checkpoint holds the pair once; the embedding's
tensor is written, once, as save_pretrained writes a tied pair.

A job with LoRA adapters (`model.adapters`) is written in PEFT's format: `adapter_config.json`
and `adapter_model.safetensors` (the adapters, and a new head as a module PEFT saves whole), with
the tokenizer or image processor, which `PeftModel.from_pretrained(base, dir)` loads onto the
pretrained model; or, with `merge`, the adapters merged into the base weights (`peft`'s own
`merge_and_unload`) as a plain `save_pretrained` directory like any other export.

The output directory is written beside its destination and renamed into place when complete: an
interrupted export leaves no half-written model under that name."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from pipetransformer.core.families import checkpoint_family
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.tasks import task_of
from pipetransformer.edge.hf_files import read_config_json
from pipetransformer.edge.manifest import CheckpointError, checkpoint_checksum, verify_checkpoint

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names
ADAPTER_CONFIG = "adapter_config.json"
# what a model directory holds besides config and weights, for its inputs: tokenizers (fast and
# slow, sentencepiece), image processors and processors
PROCESSOR_FILES = (
    "tokenizer*.json",
    "tokenizer.model",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "sentencepiece*.model",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor*.json",
    "video_preprocessor_config.json",
    "chat_template*",
)


class ExportError(ValueError):
    """What stops an export, for the user: printed without a traceback."""


@dataclass(frozen=True)
class Exported:
    directory: Path
    tensors: int
    num_labels: int
    copied: list[str]  # tokenizer / processor files taken from the pretrained directory
    left_out: list[str]  # pretrained checkpoint keys the job's model has no unit for
    adapter: bool = False  # written in PEFT's format (adapters only)


def parse_spec_arg(value: str) -> JobSpec:
    """`--spec-json`: the job's resolved spec as JSON text, or the path of a file holding it."""
    text = value if value.lstrip().startswith("{") else Path(value).read_text()
    try:
        return JobSpec.model_validate_json(text)
    except ValidationError as exc:
        raise ExportError(f"--spec-json is not a job spec: {exc}") from None


def _pretrained_dir(spec: JobSpec) -> Path:
    pre = spec.model.pretrained
    if pre is None:
        raise ExportError(
            f"job {spec.name!r} trained a seeded model, not a Hugging Face checkpoint "
            "(model.pretrained): there is no transformers model to export it as"
        )
    if pre.path is None:
        raise ExportError("model.pretrained is not resolved: the spec was never submitted")
    return Path(pre.path)


def _check_destination(out: Path, force: bool, keep_clear: Iterable[Path]) -> None:
    """Refuse a destination that holds anything (unless `force`), or one that is (or contains)
    a directory the export reads or that must survive it."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--to {out} exists and is not a directory")
    resolved = out.resolve()
    for other in keep_clear:
        other = other.resolve()
        if resolved == other or resolved in other.parents:
            raise ExportError(f"--to {out} would replace {other}; choose a new directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        held = sorted(p.name for p in out.iterdir())
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ExportError(
            f"--to {out} is not empty ({shown}); choose a new directory, or pass --force to "
            "replace it"
        )


def _checkpoint_tensors(spec: JobSpec, checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint under its checkpoint key (unit prefix removed),
    read without a process group."""
    from pipetransformer.models.units import architecture, empty_unit
    from pipetransformer.trainer.checkpoint import UnitsDiffer, read_weights, tied_names

    names = architecture(spec.model).unit_names()
    units = {name: empty_unit(spec.model, name) for name in names}  # meta: names and shapes
    state = {f"{name}.{k}": v for name, unit in units.items() for k, v in unit.state_dict().items()}
    try:
        loaded = read_weights(checkpoint, state, tied=tied_names(spec.model))
    except UnitsDiffer as exc:
        raise ExportError(
            f"{checkpoint}: not a checkpoint of this job's model: {exc.problems}"
        ) from None
    # each in its own storage: safetensors refuses to write views into one tensor separately
    return {
        key: loaded[f"{name}.{key}"].clone() for name in names for key in units[name].state_dict()
    }


def _trained_tensors(spec: JobSpec, checkpoint: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A job with adapters: what its checkpoint holds (the adapters, a new head's output layer)
    under the units' parameter names, read without a process group; and the new head's
    modules (PEFT's `modules_to_save`)."""
    from pipetransformer.models.adapters import new_head_modules, trained_names
    from pipetransformer.models.units import architecture, empty_unit
    from pipetransformer.trainer.checkpoint import UnitsDiffer, read_weights

    names = architecture(spec.model).unit_names()
    units = {name: empty_unit(spec.model, name) for name in names}  # meta: names and shapes
    keys = {f"{name}.{key}": key for name, unit in units.items() for key in trained_names(unit)}
    state = {full: units[full[: -len(key) - 1]].get_parameter(key) for full, key in keys.items()}
    try:
        loaded = read_weights(checkpoint, state)
    except UnitsDiffer as exc:
        raise ExportError(
            f"{checkpoint}: not a checkpoint of this job's adapters: {exc.problems}"
        ) from None
    head = new_head_modules(units["head"]) if "head" in units else []
    return {keys[full]: value.clone() for full, value in loaded.items()}, head


def adapter_config(spec: JobSpec, pretrained: str, new_head: list[str]) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for the job's adapters on `pretrained`: its LoraConfig,
    the base model's path, the task type (a causal LM; a text classifier or question answerer
    with a new head) and, for a new head, the modules PEFT saves whole (`modules_to_save`)."""
    from pipetransformer.models.adapters import lora_config

    assert spec.model.adapters is not None
    config = lora_config(spec.model, spec.model.adapters)
    config.base_model_name_or_path = pretrained
    # PEFT's classifier task types save the head whole (`modules_to_save`) and look for it in
    # the adapter: only for a new head, and only for text (an image classifier is a PeftModel)
    if spec.model.task == "causal-lm" or (new_head and spec.model.family_info.is_text):
        config.task_type = PEFT_TASKS.get(spec.model.task)
    config.modules_to_save = new_head or None
    # as PEFT's save_pretrained writes it: sets (target_modules) as lists
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


# the job's task -> PEFT's task type (what PeftModel.from_pretrained wraps the base model as)
PEFT_TASKS = {
    "causal-lm": "CAUSAL_LM",
    "classification": "SEQ_CLS",
    "question-answering": "QUESTION_ANS",
}


def _label_names(spec: JobSpec, original: dict[str, Any], count: int) -> list[str]:
    """The names of the job's labels: an image folder's class folders (sorted, as the data set
    numbers them), else the pretrained checkpoint's names if it had as many, else LABEL_<i>."""
    data = spec.data
    if data.kind.folders() and data.train:  # class folders: their names are the labels
        root = Path(data.train[0])  # trainer/sources/splits.py reads the first
        if root.is_dir():
            classes = sorted(
                p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
            if len(classes) == count:
                return classes
    id2label = original.get("id2label")
    if isinstance(id2label, dict) and len(id2label) == count:
        try:
            return [str(id2label[k]) for k in sorted(id2label, key=int)]
        except (ValueError, KeyError):
            pass
    return [f"LABEL_{i}" for i in range(count)]


def export_config(spec: JobSpec, original: dict[str, Any]) -> dict[str, Any]:
    """The pretrained checkpoint's config.json with the class the job trained, its label count
    and names, and the dtype of the exported weights."""
    config = json.loads(json.dumps(original))
    # the class the job trained: a base model or another task's checkpoint got a new head
    family = checkpoint_family(original)
    trained = family.for_task(
        family.parse_config(original), spec.model.task, spec.model.num_classes
    )
    config["architectures"] = [trained.architecture]
    task = task_of(spec.model)
    if not task.vocab_outputs:  # a language model's outputs are its vocabulary: no labels
        _set_labels(config, spec, original, trained.num_labels)
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, older ones torch_dtype
        if key in config:
            config[key] = "float32"
    if "dtype" not in config and "torch_dtype" not in config:
        config["dtype"] = "float32"
    return config


def _set_labels(
    config: dict[str, Any], spec: JobSpec, original: dict[str, Any], outputs: int
) -> None:
    if task_of(spec.model).fixed_outputs is not None:  # question answering: start and end
        labels = [f"LABEL_{i}" for i in range(outputs)]
    else:
        labels = _label_names(spec, original, spec.model.num_classes)
    # transformers takes the label count from id2label
    config["id2label"] = {str(i): name for i, name in enumerate(labels)}
    config["label2id"] = {name: i for i, name in enumerate(labels)}
    if len(set(labels)) != len(labels):  # label2id needs distinct names
        config["label2id"] = {f"LABEL_{i}": i for i in range(len(labels))}
    if "num_labels" in config:
        config["num_labels"] = len(labels)


def _write_tied_once(tensors: dict[str, torch.Tensor], spec: JobSpec) -> str | None:
    """Drop the head's copy of a tied pair from `tensors` (the checkpoint holds the pair once;
    the embedding's tensor stands for both, as save_pretrained writes them): its key, or None
    when nothing is tied."""
    tied = spec.model.family_info.tied_parameters(spec.model)
    if tied is None:
        return None
    (_, copy) = tied[1]
    del tensors[copy]
    return copy


def _original_keys(directory: Path, family: str) -> dict[str, str]:
    """The pretrained checkpoint's keys by the units' names (a base model's get the prefix)."""
    from pipetransformer.models.hf import checkpoint_index, unit_keys

    return unit_keys(checkpoint_index(directory), family)


def _processor_files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and any(fnmatch(p.name, pattern) for pattern in PROCESSOR_FILES)
    )


def _share(directory: Path) -> None:
    """The usual permissions (umask applied): mkdtemp makes the directory private, and
    safetensors writes its file so too; a model directory is for sharing."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _metadata(source: str | None) -> dict[str, str]:
    """The safetensors metadata of an export: the format, and the provenance (`--source`)."""
    return {"format": "pt", **({"source": source} if source else {})}


@contextlib.contextmanager
def _staged(out: Path, copied: list[Path]) -> Iterator[Path]:
    """A directory beside `out` to write the export into; once the body is done, the
    tokenizer or image processor files `copied` are added and it is put at `out` whole (on any
    failure it is removed and `out` is untouched)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        yield staging
        for path in copied:
            shutil.copyfile(path, staging / path.name)  # follows links (a hub cache snapshot)
        _share(staging)
        _swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_in(staging: Path, out: Path) -> None:
    """Put the finished `staging` directory at `out`, replacing what is there."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)


def export(
    checkpoint: str | Path,
    spec: JobSpec,
    out: str | Path,
    *,
    checksum: str | None = None,
    force: bool = False,
    source: str | None = None,
    merge: bool = False,
) -> Exported:
    """Write the checkpoint at `checkpoint` of a job with `spec` to `out` (see the module
    docstring); a job with adapters as a PEFT adapter, or with `merge` merged into the base. `checksum` is the one the store committed it with; without it the checkpoint is
    checked against its own manifest. Raises ExportError (or CheckpointError) saying why not."""
    from safetensors.torch import save_file

    from pipetransformer.models.units import CheckpointChanged

    checkpoint, out = Path(checkpoint), Path(out)
    pretrained = _pretrained_dir(spec)
    _check_destination(out, force, [checkpoint, pretrained, Path.cwd()])
    if not (checkpoint / "manifest.json").is_file():
        raise ExportError(f"{checkpoint}: no sealed checkpoint there (no manifest.json)")
    verify_checkpoint(checkpoint, checksum or checkpoint_checksum(checkpoint))
    if spec.model.adapters is not None:
        return _export_adapters(checkpoint, spec, pretrained, out, merge, source)
    try:
        tensors = _checkpoint_tensors(spec, checkpoint)
    except CheckpointChanged as exc:  # its config.json and tokenizer would not be the job's
        raise ExportError(
            f"{exc}. The export takes config.json and the tokenizer or image processor from "
            "there: restore the checkpoint the job was submitted with"
        ) from None
    original = read_config_json(pretrained)
    config = export_config(spec, original)
    tied_copy = _write_tied_once(tensors, spec)
    original_keys = _original_keys(pretrained, checkpoint_family(original).key_prefix)
    written = set(tensors) | ({tied_copy} if tied_copy else set())  # stored: the embedding
    left_out = sorted(original_keys[k] for k in set(original_keys) - written)
    copied = _processor_files(pretrained)

    with _staged(out, copied) as staging:
        save_file(tensors, str(staging / WEIGHTS), metadata=_metadata(source))
        (staging / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Exported(
        directory=out,
        tensors=len(tensors),
        num_labels=len(config.get("id2label") or {}) or spec.model.num_classes,
        copied=[p.name for p in copied],
        left_out=left_out,
    )


def _export_adapters(
    checkpoint: Path,
    spec: JobSpec,
    pretrained: Path,
    out: Path,
    merge: bool,
    source: str | None,
) -> Exported:
    """A job with adapters: its adapters in PEFT's format, or (`merge`) merged into the base
    model as a plain `save_pretrained` directory."""
    from safetensors.torch import save_file

    from pipetransformer.models.adapters import peft_key
    from pipetransformer.models.units import CheckpointChanged, module_key

    try:
        tensors, head = _trained_tensors(spec, checkpoint)
    except CheckpointChanged as exc:  # the adapters were trained on another base
        raise ExportError(
            f"{exc}. The adapters only fit the base they were trained on: restore it"
        ) from None
    copied = _processor_files(pretrained)
    with _staged(out, copied) as staging:
        adapter = staging / "adapter" if merge else staging
        adapter.mkdir(exist_ok=True)
        save_file(
            {peft_key(module_key(spec.model, k)): v for k, v in tensors.items()},
            str(adapter / ADAPTER_WEIGHTS),
            metadata=_metadata(source),
        )
        config = adapter_config(spec, str(pretrained), head)
        (adapter / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if merge:
            _merge_into_base(spec, pretrained, adapter, staging)
            shutil.rmtree(adapter)
    return Exported(
        directory=out,
        tensors=len(tensors),
        num_labels=spec.model.num_classes,
        copied=[p.name for p in copied],
        left_out=[],
        adapter=not merge,
    )


def _merge_into_base(spec: JobSpec, pretrained: Path, adapter: Path, into: Path) -> None:
    """The base model (the class the job trained, with its labels) with the PEFT adapter in
    `adapter` merged by `peft` itself (`merge_and_unload`), saved into `into` as
    `save_pretrained` writes it (float32)."""
    import transformers
    from peft import PeftModel

    config = export_config(spec, read_config_json(pretrained))
    cls = getattr(transformers, config["architectures"][0])
    base = cls.from_pretrained(
        pretrained, config=cls.config_class.from_dict(config), dtype=torch.float32
    )
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(into)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipetransformer.trainer.export",
        description="Write a committed checkpoint of a job on a Hugging Face model as a "
        "directory transformers loads (what `pipetransformer export` runs).",
    )
    p.add_argument("--checkpoint", required=True, help="the committed checkpoint's directory")
    p.add_argument(
        "--spec-json", required=True, help="the job's resolved spec: JSON text or a file of it"
    )
    p.add_argument("--to", required=True, help="the directory to write (new or empty)")
    p.add_argument("--checksum", help="the checksum the store committed the checkpoint with")
    p.add_argument("--force", action="store_true", help="replace a non-empty --to directory")
    p.add_argument("--source", help="provenance kept in model.safetensors' metadata")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a job with adapters: merge them into the base and write a plain model",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = parse_spec_arg(args.spec_json)
        done = export(
            args.checkpoint,
            spec,
            args.to,
            checksum=args.checksum,
            force=args.force,
            source=args.source,
            merge=args.merge,
        )
    except (ExportError, CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outputs = (
        f"a causal language model over {spec.model.vocab_size} tokens"
        if task_of(spec.model).vocab_outputs
        else f"{done.num_labels} labels"
    )
    if done.adapter:
        outputs = f"LoRA adapters for {spec.model.pretrained.source}; PeftModel loads them"
    print(
        f"exported {done.tensors} tensors ({outputs}) to {done.directory}"
        + (f", with {', '.join(done.copied)}" if done.copied else "")
    )
    if done.left_out:
        print(
            f"not exported (the pretrained checkpoint has them, the job's model has no use for "
            f"them): {', '.join(done.left_out)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
