"""Checkpoint manifests: the contract between the trainer that writes a checkpoint and the
controller that commits it. A manifest lists the size and sha256 of every other file (the shards
and `meta.json`, the training state besides tensors); its own digest is the checksum recorded in
the store at commit time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint on disk is torn, truncated, altered or missing."""


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: {"size": p.stat().st_size, "sha256": _file_digest(p)}
        for p in sorted(Path(directory).iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def manifest_checksum(manifest: dict[str, dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None


def checkpoint_checksum(path: str | Path) -> str:
    """The checksum of a sealed checkpoint's manifest, as it would be committed (for one that
    no store of ours committed, such as another job's checkpoint a fine-tuning job starts from);
    verify the files against it with `verify_checkpoint`."""
    return manifest_checksum(_read_manifest(Path(path)))


def verify_checkpoint(path: str | Path, checksum: str) -> int:
    """Raise CheckpointError unless every file matches the manifest and the manifest matches
    `checksum`; return the checkpoint's size in bytes."""
    path = Path(path)
    manifest = _read_manifest(path)
    if manifest_checksum(manifest) != checksum:
        raise CheckpointError(f"{path}: manifest does not match the committed checksum")
    actual = build_manifest(path)
    if actual != manifest:
        bad = sorted(k for k in set(manifest) | set(actual) if actual.get(k) != manifest.get(k))
        raise CheckpointError(f"{path}: files differ from the manifest: {', '.join(bad)}")
    return sum(e["size"] for e in manifest.values())


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `meta.json` (epoch, step, sampler cursor, the layout training continues
    under, AutoFreeze's memory...; `core.train_state.TrainState.state_dict`); verify the
    checkpoint first, the manifest covers it."""
    return json.loads((Path(path) / META).read_text())


def meta_boundary(meta: dict[str, Any]) -> int | None:
    """The freeze boundary a checkpoint's state continues with: that of the layout its meta
    records (checkpoints written before layouts were recorded kept it in their freeze state);
    None if it says neither."""
    layout = meta.get("layout")
    value = layout.get("freeze_boundary") if isinstance(layout, dict) else None
    if value is None:
        value = (meta.get("freeze") or {}).get("boundary")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
