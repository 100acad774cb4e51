"""Checkpoints with `torch.distributed.checkpoint`, keyed by stable parameter names.

Each rank contributes its stage's weights and optimizer state (flattened per parameter, so keys
like `state.blocks.3.mlp.0.weight.exp_avg` are the same under every partition and a checkpoint
written under one layout loads under any other). Only tensors are saved: optimizer
hyper-parameters come from the spec and the LR schedule, so loading never unpickles anything.

Commit protocol: shards are written into `<name>.partial/`; after every rank has finished, rank 0
writes `manifest.json` (size and sha256 of every file) and `meta.json`, fsyncs, and renames the
directory to `<name>/`. The checkpoint is *usable* only once the controller has verified it and
recorded it in the SQL store; anything else on disk is ignored.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from orchestrator.manifest import MANIFEST, META, build_manifest, manifest_checksum

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class SavedCheckpoint:
    path: str
    size_bytes: int
    checksum: str
    meta: dict[str, Any]


def _optimizer_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    full = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    return {k: v for k, v in full.items() if k.startswith("state.")}


def _state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": module.state_dict(), "optim": _optimizer_tensors(module, optimizer)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> SavedCheckpoint | None:
    """Collective over `group` (all ranks): write this rank's shard; rank 0 seals the directory
    and returns what the controller needs to commit it (other ranks return None)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a torn attempt from before a crash
        partial.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier(group)
    dcp.save(_state_dict(module, optimizer), checkpoint_id=str(partial), process_group=group)
    if dist.is_initialized():
        dist.barrier(group)  # every shard is written (FileSystemWriter fsyncs each file)
    if rank != 0:
        return None
    manifest = build_manifest(partial)
    for name, content in ((MANIFEST, manifest), (META, meta)):
        with open(partial / name, "w") as f:
            json.dump(content, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(partial)
    if path.exists():  # an uncommitted directory of the same step from an earlier attempt
        shutil.rmtree(path)
    os.replace(partial, path)
    _fsync_dir(path.parent)
    size = sum(e["size"] for e in manifest.values())
    return SavedCheckpoint(str(path), size, manifest_checksum(manifest), meta)


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def load_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Fill this rank's blocks and their optimizer state from a checkpoint written under any
    layout (DCP reshards by key)."""
    state = _state_dict(module, optimizer)  # initialises optimizer state, giving load its keys
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    module.load_state_dict(state["model"])
    full = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    full.update(state["optim"])
    set_optimizer_state_dict(module, optimizer, full, options=_OPTIONS)
