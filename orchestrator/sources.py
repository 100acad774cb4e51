"""What a spec points at on disk, resolved when the job is submitted, before anything is stored
or started: a Hugging Face checkpoint (`model.pretrained`, a directory or a hub id in the local
cache), the data files (`data.train`, `data.test`, `data.path`) and a fine-tuning checkpoint
(`init`, orchestrator/pretrained.py). A missing file or a spec that contradicts the checkpoint's
config.json is a SpecError naming the field; the resolved spec holds absolute paths and the
architecture read from config.json, so workers and a restarted controller never resolve again.
This side reads JSON and file headers only: no torch, no transformers."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from pipetransformer.core.families import Architecture
from pipetransformer.core.spec import JobSpec, ModelSpec, SpecError, parse_spec
from pipetransformer.core.tasks import CLASSIFICATION, task_of
from pipetransformer.edge.hf_files import fingerprint, read_architecture
from pipetransformer.orchestrator.pretrained import resolve_init

DEFAULT_SEQ_LEN = 128
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _problem(field: str, message: str) -> SpecError:
    return SpecError([(field, message)])


def _absolute(value: str, cwd: Path) -> Path:
    path = Path(value).expanduser()
    return (path if path.is_absolute() else cwd / path).resolve()


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or os.sep in source[:1]


def hub_cache() -> str:
    """The Hugging Face hub cache as the environment names it now (huggingface_hub reads it
    once, at import): $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return cache
    home = os.environ.get("HF_HOME") or os.path.join("~", ".cache", "huggingface")
    return os.path.expanduser(os.path.join(home, "hub"))


def locate_checkpoint(source: str, revision: str | None, cwd: Path) -> tuple[Path, str | None]:
    """The local directory of a checkpoint and, for a hub id, the cached snapshot's commit."""
    directory = _absolute(source, cwd)
    if directory.is_dir():
        if revision is not None:
            raise _problem(
                "model.pretrained.revision",
                f"{source} is a directory; a revision only selects a cached hub snapshot",
            )
        return directory, None
    if _looks_like_path(source) or not _HUB_ID.match(source):
        raise _problem("model.pretrained.source", f"no such directory: {directory}")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise _problem(
            "model.pretrained.source",
            f"{source!r} is not a directory here, and hub ids need the `hf` extra "
            "(pip install 'pipetransformer[hf]')",
        ) from None
    cache = hub_cache()
    try:
        # local_files_only: a job never downloads; offline clusters fetch ahead (docs/models-and-data.md)
        path = Path(
            snapshot_download(source, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        raise _problem(
            "model.pretrained.source",
            f"{source!r}{at} is neither a directory here nor in the local Hugging Face cache "
            f"({cache}); fetch it first: `hf download {source}"
            f"{f' --revision {revision}' if revision else ''}` (docs/models-and-data.md)",
        ) from None
    except Exception as exc:  # a malformed cache entry, an invalid revision name
        raise _problem("model.pretrained.source", f"{source!r}: {exc}") from None
    commit = path.name if _COMMIT.match(path.name) else None
    return path, commit


def _differs(field: str, mine: Any, theirs: Any) -> bool:
    if field == "mlp_ratio":
        return not math.isclose(float(mine), float(theirs), rel_tol=1e-9)
    return mine != theirs


_CONFIG_NAMES = {
    "family": "model_type",
    "dim": "hidden_size",
    "depth": "num_hidden_layers",
    "heads": "num_attention_heads",
    "mlp_ratio": "intermediate_size / hidden_size",
    "vocab_size": "vocab_size",
    "image_size": "image_size",
    "patch_size": "patch_size",
    "channels": "num_channels",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "tie_embeddings": "tie_word_embeddings",
    "max_positions": "n_positions",
}


def pretrained_model(model: ModelSpec, arch: Architecture, source: str) -> dict[str, Any]:
    """The model section with the checkpoint's architecture filled in (pure). Raises SpecError
    naming each field the spec sets to another value than config.json. The spec may choose
    another task or label count than the checkpoint's head (a new head); a checkpoint without a
    usable head (a base model or a pretraining head) needs the label count from the spec."""
    family = arch.family_info
    given = model.model_dump(include=model.model_fields_set - {"pretrained"})
    decided = family.spec_fields(arch)
    task = given.get("task", decided.get("task", CLASSIFICATION.name))
    outputs = task_of(task)
    if (
        arch.task == "body"
        and outputs.fixed_outputs is None
        and not outputs.vocab_outputs  # a language model's outputs are its vocabulary
        and "num_classes" not in given
    ):
        raise _problem(
            "model.num_classes",
            f"the checkpoint ({source}: config.json architectures {arch.architecture}) has no "
            "classification head, so the job gets a new one: set its number of labels",
        )
    problems = [
        (
            f"model.{field}",
            f"{given[field]!r} contradicts the checkpoint ({source}: config.json "
            f"{_CONFIG_NAMES[field]} gives {decided[field]!r}); leave it out, the checkpoint "
            "decides it",
        )
        for field in decided
        if field in given
        and field not in ("num_classes", "task")
        and _differs(field, given[field], decided[field])
    ]
    if problems:
        raise SpecError(problems)
    out = {**decided, **given}
    out["task"] = task
    if task not in family.tasks:
        raise _problem(
            "model.task",
            f"{task} is not available for {family.name} models; choose one of "
            f"{', '.join(family.tasks)}",
        )
    if (fixed := task_of(task).fixed_outputs) is not None:
        if given.get("num_classes", fixed) != fixed:
            raise _problem(
                "model.num_classes",
                f"{task} has {fixed} outputs (question answering: a start and an end): leave "
                f"it out or set {fixed} (got {given['num_classes']})",
            )
        out["num_classes"] = fixed
    if family.is_text:
        limit = family.max_seq_len(arch) or DEFAULT_SEQ_LEN
        seq_len = given.get("seq_len") or min(DEFAULT_SEQ_LEN, limit)
        if seq_len > limit:
            raise _problem(
                "model.seq_len",
                f"{seq_len} is longer than the checkpoint's position table holds ({limit}, "
                f"config.json max_position_embeddings); lower it",
            )
        out["seq_len"] = seq_len
    return out


def resolve_pretrained(spec: JobSpec, cwd: Path) -> JobSpec:
    """`spec` with `model.pretrained` located, fingerprinted and its architecture filled in
    (unchanged when the spec has no pretrained model or was resolved already)."""
    pre = spec.model.pretrained
    if pre is None or (pre.resolved and pre.fingerprint):
        return spec
    path, commit = locate_checkpoint(pre.source, pre.revision, cwd)
    try:
        arch = read_architecture(path)
        digest = fingerprint(path)
    except (ValueError, OSError) as exc:
        raise _problem("model.pretrained.source", str(exc)) from None
    model = pretrained_model(spec.model, arch, pre.source)
    model["pretrained"] = {
        **pre.model_dump(),
        "path": str(path),
        "fingerprint": digest,
        "commit": commit,
    }
    return parse_spec({**spec.model_dump(mode="json"), "model": model})


def resolve_data(spec: JobSpec, cwd: Path) -> JobSpec:
    """`spec` with a data source's paths made absolute, each checked to exist."""
    data = spec.data
    if not data.is_source:
        return spec
    update: dict[str, Any] = {}
    for field in ("train", "test"):
        paths = getattr(data, field)
        if paths is None:
            continue
        resolved = []
        for value in paths:
            path = _absolute(value, cwd)
            if not path.exists():
                raise _problem(f"data.{field}", f"no such file or directory: {path}")
            if data.kind.folders() and not path.is_dir():
                raise _problem(f"data.{field}", f"{path} is not a folder of <class>/<image> files")
            resolved.append(str(path))
        update[field] = resolved
    if data.path is not None:
        path = _absolute(data.path, cwd)
        if not (path / "dataset_dict.json").is_file():
            raise _problem(
                "data.path",
                f"{path} is not a DatasetDict written by save_to_disk (no dataset_dict.json)",
            )
        update["path"] = str(path)
    return spec.model_copy(update={"data": data.model_copy(update=update)})


def resolve_submission(spec: JobSpec, cwd: Path | None = None) -> JobSpec:
    """Everything a spec points at, resolved and checked (SpecError naming the field)."""
    cwd = cwd or Path.cwd()
    return resolve_init(resolve_data(resolve_pretrained(spec, cwd), cwd), cwd)
