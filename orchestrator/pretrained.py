"""Fine-tuning from another job's checkpoint (`init` in the job spec): the checkpoint is found,
checked and pinned when the job is submitted, before anything is stored or started, so a wrong
path or a checkpoint of another architecture is a spec error, not a failed worker. The workers
load the weights (trainer/checkpoint.load_weights); this side needs no torch."""

from __future__ import annotations

from pathlib import Path

from pipetransformer.core.spec import JobSpec, ModelSpec, SpecError
from pipetransformer.edge.manifest import (
    MANIFEST,
    CheckpointError,
    checkpoint_checksum,
    read_meta,
    verify_checkpoint,
)

# the fields that decide the shape and meaning of the weights (dropout does not)
_DECODER = ("vocab_size", "kv_heads", "head_dim", "tie_embeddings")  # and a tied pair's keys
_ARCHITECTURE = {
    "any": ("family", "dim", "depth", "heads", "mlp_ratio"),
    "vit": ("image_size", "patch_size", "channels"),
    "bert": ("vocab_size", "seq_len"),
    **dict.fromkeys(("llama", "qwen2", "qwen3", "mistral", "gpt2"), _DECODER),
}


def _verified(path: Path) -> str:
    """The checksum of a checkpoint whose files match its own manifest (CheckpointError if not)."""
    checksum = checkpoint_checksum(path)
    verify_checkpoint(path, checksum)
    return checksum


def _newest_complete(directory: Path) -> tuple[Path, str] | None:
    """The newest `step-*` checkpoint under `directory` whose files match its manifest, with
    its checksum."""
    sealed = [
        p
        for p in directory.glob("step-*")
        if not p.name.endswith(".partial") and (p / MANIFEST).is_file()
    ]
    for path in sorted(sealed, key=lambda p: p.name, reverse=True):
        try:
            return path, _verified(path)
        except (CheckpointError, OSError):
            continue
    return None


def architecture_mismatch(saved: dict, model: ModelSpec, skip: list[str]) -> list[str]:
    """How the model a checkpoint's meta records differs from `model` where it matters for
    loading its weights (`num_classes` only when the head is loaded), as 'field: A there, B here'."""
    fields = [*_ARCHITECTURE["any"], *_ARCHITECTURE.get(model.family, ())]
    if "head" not in skip:
        fields.append("num_classes")
    return [
        f"model.{f}: {saved.get(f)!r} there, {getattr(model, f)!r} here"
        for f in fields
        if saved.get(f) != getattr(model, f)
    ]


def adapters_mismatch(saved: dict, model: ModelSpec) -> str | None:
    """Why a checkpoint whose meta records the model `saved` cannot start `model`'s adapters
    (or `model` without adapters from a checkpoint of adapters), or None: adapters fit only the
    base they were trained on (its fingerprint) and only adapters of the same shape."""
    theirs, ours = saved.get("adapters"), model.adapters
    if theirs is None and ours is None:
        return None
    if ours is None:
        return (
            "it holds LoRA adapters, not a model (its base is not in it): export it with "
            "`pipetransformer export --merge` and start from that as model.pretrained, or "
            "set model.adapters as that job had them"
        )
    if theirs is None:
        return (
            "it holds a whole model's weights, not adapters: export it and start from that as "
            "model.pretrained, or drop model.adapters"
        )
    base = (saved.get("pretrained") or {}).get("fingerprint")
    here = model.pretrained.fingerprint if model.pretrained else None
    if base != here:
        return (
            f"its adapters were trained on another base model (fingerprint {base}); this "
            f"job's model.pretrained is {here}: start from the base they were trained on"
        )
    differ = [
        f"model.adapters.{f}: {theirs.get(f)!r} there, {getattr(ours, f)!r} here"
        for f in ("rank", "targets")
        if theirs.get(f) != getattr(ours, f)
    ]
    return f"its adapters have another shape: {'; '.join(differ)}" if differ else None


def resolve_init(spec: JobSpec, cwd: Path | None = None) -> JobSpec:
    """`spec` with `init.checkpoint` made absolute (a checkpoints directory resolved to its newest
    complete checkpoint) and `init.checksum` pinned to that checkpoint's manifest; unchanged when
    the spec does not fine-tune. Raises SpecError naming the field when the checkpoint is missing,
    damaged, not the pinned one, or was written by a model of another architecture."""
    init = spec.init
    if init.checkpoint is None:
        return spec

    def problem(field: str, message: str) -> SpecError:
        return SpecError([(f"init.{field}", message)])

    path = Path(init.checkpoint).expanduser()
    path = (path if path.is_absolute() else (cwd or Path.cwd()) / path).resolve()
    if not path.is_dir():
        raise problem("checkpoint", f"no such directory: {path}")
    checksum = None  # each checkpoint is hashed once: it may be gigabytes
    if not (path / MANIFEST).is_file():
        newest = _newest_complete(path)
        if newest is None:
            raise problem(
                "checkpoint",
                f"{path} is neither a checkpoint (it has no {MANIFEST}) nor a directory holding "
                "complete ones (step-*/manifest.json); point it at a job's "
                "`checkpoints/step-NNNNNNNN` directory",
            )
        path, checksum = newest
    try:
        checksum = checksum or _verified(path)
        saved = read_meta(path).get("model")
    except (CheckpointError, OSError, ValueError) as exc:
        raise problem("checkpoint", f"{path} is damaged: {exc}") from None
    if init.checksum is not None and init.checksum != checksum:
        raise problem(
            "checksum",
            f"{path} has manifest checksum {checksum}, not the pinned {init.checksum}; "
            "it was replaced since: point init.checkpoint at the pinned one or drop "
            "init.checksum",
        )
    if saved is not None:  # checkpoints record their model since fine-tuning exists
        differences = architecture_mismatch(saved, spec.model, init.skip)
        if differences:
            hint = (
                " (a new classifier head for another num_classes: init.skip: [head])"
                if any(d.startswith("model.num_classes") for d in differences)
                else ""
            )
            raise problem(
                "checkpoint",
                f"{path} holds weights of another architecture: {'; '.join(differences)}. "
                f"Set these model fields as the checkpoint has them{hint}",
            )
        if (why := adapters_mismatch(saved, spec.model)) is not None:
            raise problem("checkpoint", f"{path}: {why}")
    pinned = init.model_copy(update={"checkpoint": str(path), "checksum": checksum})
    return spec.model_copy(update={"init": pinned})
