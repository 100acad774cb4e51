"""Checkpoints with `torch.distributed.checkpoint`, keyed by stable block names.

Each rank contributes its blocks' weights and optimizer state, packed into one flat tensor per
partition unit and part (`model.blocks.3`, `optim.blocks.3`, `model.embed`, ...; members in
parameter-name order). Units move whole between layouts, so the keys are the same under every
partition and a checkpoint written under one layout loads under any other (DCP reshards by
key). Only tensors are saved: optimizer hyper-parameters come from the spec and the LR schedule,
and loading unpickles nothing but DCP's own index classes.

Commit protocol: shards are written into `<name>.partial/`; after every rank has finished, rank 0
writes `manifest.json` (size and sha256 of every file) and `meta.json`, fsyncs, and renames the
directory to `<name>/`. The checkpoint is *usable* only once the controller has verified it and
recorded it in the SQL store; anything else on disk is ignored.

`AsyncCheckpointer` does the same without stopping training: the training thread only copies the
state into memory (a snapshot); `dcp.async_save` writes it from a background thread over a
dedicated gloo group, and a second background thread seals it once every rank's shards are
durable. `checkpoint_due` is the (pure) interval rule of `CheckpointSpec`. `save_checkpoint` is
the synchronous original, kept for tests and tools.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import timedelta
from hashlib import file_digest
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from pipetransformer.core.spec import CheckpointSpec, ModelSpec
from pipetransformer.edge.manifest import (
    MANIFEST,
    META,
    CheckpointError,
    manifest_checksum,
    verify_checkpoint,
)
from pipetransformer.models.adapters import in_state, is_adapter

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class SavedCheckpoint:
    path: str
    size_bytes: int
    checksum: str
    meta: dict[str, Any]
    blocked_s: float = 0.0  # time the training thread spent on it (snapshot, or all of it if sync)
    seconds: float = 0.0  # start to sealed


class CheckpointWriteError(RuntimeError):
    """Writing or sealing a checkpoint failed; it was not sealed (its `.partial` stays behind)."""


def _describe(exc: BaseException) -> str:
    """One line per failure; DCP's CheckpointException (a BaseException) carries each rank's."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items()
        )
    return f"{type(exc).__name__}: {exc}"


def checkpoint_due(
    spec: CheckpointSpec,
    *,
    steps_since: int,
    epoch: int,
    epoch_end: bool,
    seconds_since: float | None = None,
) -> str | None:
    """Which periodic interval, if any, makes a checkpoint due now ("epoch", "steps" or
    "seconds"; None if none): a checkpoint is due as soon as any configured interval has elapsed
    since the last one. `steps_since` counts optimizer steps since the last checkpoint (0: this
    step is saved already); `epoch` is the number of completed epochs when `epoch_end`;
    `seconds_since` is None where the clock was not consulted at this step."""
    if steps_since <= 0:
        return None  # nothing new to save
    if epoch_end and spec.every_epochs is not None and epoch % spec.every_epochs == 0:
        return "epoch"
    if spec.every_steps is not None and steps_since >= spec.every_steps:
        return "steps"
    if (
        spec.every_seconds is not None
        and seconds_since is not None
        and seconds_since >= spec.every_seconds
    ):
        return "seconds"
    return None


def _optimizer_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`state.<parameter name>.<state key>` -> tensor, as get_optimizer_state_dict flattens it.
    Once every parameter has state (after the first step) it is read directly: the same keys
    and tensors at a fraction of the cost (it runs in the training thread at each checkpoint)."""
    names = {p: n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:  # nothing trains on this rank (all its blocks frozen in place): no state
        return {}
    if all(p in names and optimizer.state.get(p) for p in params):
        return {f"state.{names[p]}.{k}": v for p in params for k, v in optimizer.state[p].items()}
    # fresh optimizer: this initialises the state, giving load_checkpoint its keys
    full = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    return {k: v for k, v in full.items() if k.startswith("state.")}


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's part of the training state: every tensor of its state dict, or, for a model
    with LoRA adapters (`model.adapters`), only what trains: the adapters (frozen ones too: a
    merged block is rebuilt from them) and a new head. The base weights are the pretrained
    checkpoint's, read from it wherever they are needed and never written."""
    state = module.state_dict()
    if not any(is_adapter(name) for name in state):
        return state
    kept = {n for n, p in module.named_parameters() if in_state(n, p)}
    return {name: tensor for name, tensor in state.items() if name in kept}


def state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A rank's training state as `{"model": {name: tensor}, "optim": {"state.<name>.<key>":
    tensor}}`: what a checkpoint holds of it, and what an in-memory re-layout moves. The
    tensors are the live ones (no copies), once the optimizer has state."""
    return {"model": model_tensors(module), "optim": _optimizer_tensors(module, optimizer)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _entry(path: Path) -> dict[str, Any]:
    """A manifest entry, as edge.manifest.build_manifest computes it."""
    with open(path, "rb") as f:
        return {"size": path.stat().st_size, "sha256": file_digest(f, "sha256").hexdigest()}


def _shard_files(directory: Path, prefix: str = "") -> list[Path]:
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and p.name.startswith(prefix) and p.name not in (MANIFEST, META)
    )


def _check_complete(partial: Path, hashed: dict[str, dict[str, Any]]) -> None:
    """Refuse to seal unless every byte DCP's index refers to is on disk, and every shard a
    writing rank hashed is still there as hashed: a shard lost or cut short before the commit
    must fail the checkpoint, not become part of a committed one."""
    try:
        with open(partial / ".metadata", "rb") as f:
            index = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointError(f"{partial}: no readable .metadata ({exc})") from None
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, entry in hashed.items():
        needed[name] = max(needed.get(name, 0), entry["size"])
    for name, end in sorted(needed.items()):
        shard = partial / name
        if not shard.is_file():
            raise CheckpointError(f"{partial}: shard {name} is missing")
        size = shard.stat().st_size
        if size < end or (name in hashed and size != hashed[name]["size"]):
            raise CheckpointError(f"{partial}: shard {name} has {size} bytes, expected {end}")


def _write_json(path: Path, content: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _seal(
    path: Path, meta: dict[str, Any], hashed: dict[str, dict[str, Any]] | None = None
) -> tuple[int, str]:
    """Rank 0, once every shard is durable: manifest + meta, fsync, rename `.partial` away.
    `hashed` holds entries the writing ranks computed for their own shards; every other file
    is hashed here. Returns (size in bytes, manifest checksum)."""
    partial = _partial(path)
    hashed = hashed or {}
    _check_complete(partial, hashed)
    _write_json(partial / META, meta)  # first: the manifest covers it like any shard
    manifest = {p.name: hashed.get(p.name) or _entry(p) for p in _shard_files(partial)}
    manifest[META] = _entry(partial / META)
    _write_json(partial / MANIFEST, manifest)
    _fsync_dir(partial)
    if path.exists():  # an uncommitted directory of the same step from an earlier attempt
        shutil.rmtree(path)
    os.replace(partial, path)
    _fsync_dir(path.parent)
    return sum(e["size"] for e in manifest.values()), manifest_checksum(manifest)


def save_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    tied: Tied | None = None,
) -> SavedCheckpoint | None:
    """Collective over `group` (all ranks): write this rank's shard; rank 0 seals the directory
    and returns what the controller needs to commit it (other ranks return None). `tied`: the
    model's tied pair (`tied_names`), written once."""
    path = Path(path)
    partial = _partial(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a torn attempt from before a crash
        partial.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier(group)
    packed = _SnapshotStager(tied).stage(state_tensors(module, optimizer))
    dcp.save(packed, checkpoint_id=str(partial), process_group=group)
    if dist.is_initialized():
        dist.barrier(group)  # every shard is written (FileSystemWriter fsyncs each file)
    if rank != 0:
        return None
    size, checksum = _seal(path, meta)
    return SavedCheckpoint(str(path), size, checksum, meta)


def unit_of(name: str) -> str:
    """The partition unit (`embed`, `blocks.<i>`, `head`) a parameter or its optimizer state
    belongs to."""
    first, _, rest = name.removeprefix("state.").partition(".")
    return f"{first}.{rest.partition('.')[0]}" if first == "blocks" else first


# A tied pair (`Family.tied_parameters`: a language model's output projection tied to its input
# embedding), as this rank's state names it: (the embedding's copy, the head's copy). Both copies
# are packed as one tensor under a key of its own (`embed+<parameter>`): a checkpoint holds the pair
# once (the ranks holding a copy write the same key, which DCP writes once, as for replicas), and
# the head's copy loads from it wherever it sits. The key is its own because the pair can stop
# training while the head trains on (it freezes with the embedding: `trainer.pipeline.RankModel`),
# and a unit's packed optimizer state must hold the same members whatever is frozen.
Tied = tuple[str, str]


def tied_names(model: ModelSpec) -> Tied | None:
    """The tied pair of `model` under its state names (`embed.<name>`, `head.<name>`), or None."""
    pair = model.family_info.tied_parameters(model)
    return None if pair is None else (".".join(pair[0]), ".".join(pair[1]))


def _member(name: str, tied: Tied | None) -> tuple[str, str]:
    """(the key `name` is packed under, less its dtype; the member it is in that key): its unit
    and itself, or for either copy of a tied pair (and its optimizer state) the pair's key and
    the embedding copy's name."""
    if tied is not None:
        state = name.startswith("state.")
        base = name.removeprefix("state.")
        for copy in tied:
            if base == copy or base.startswith(copy + "."):
                unit, _, parameter = tied[0].partition(".")
                member = tied[0] + base[len(copy) :]
                return f"{unit}+{parameter}", f"state.{member}" if state else member
    return unit_of(name), name


def key_unit(key: str) -> str:
    """The unit a packing key belongs to (without its dtype or tied-pair suffix)."""
    return key.partition("@")[0].partition("+")[0]


def _units(
    tensors: dict[str, Any], tied: Tied | None = None
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Tensors grouped by the DCP key they are packed under: their unit (plus the dtype, for any
    that are not float32), members in name order. A tied pair's two copies are one member, the
    first copy met (they are equal bit for bit)."""
    units: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(tensors):
        value = tensors[name]
        if not isinstance(value, torch.Tensor):  # would be pickled: never in a checkpoint
            raise TypeError(f"{name}: only tensors are checkpointed, not {type(value).__name__}")
        key, member = _member(name, tied)
        if value.dtype != torch.float32:
            key += "@" + str(value.dtype).removeprefix("torch.")
        units.setdefault(key, {}).setdefault(member, value)
    return {key: sorted(members.items()) for key, members in units.items()}


def _unpack(
    state: dict[str, Any], packed: dict[str, Any], tied: Tied | None = None
) -> dict[str, Any]:
    """Per-name views into `packed`, for the names and shapes of `state`; a tied pair's second
    copy on the same rank gets a copy of its one member (the optimizer keeps the tensors it is
    given: shared moments would be stepped twice)."""
    out: dict[str, Any] = {}
    for part, tensors in state.items():
        views: dict[str, torch.Tensor] = {}
        for key, members in _units(tensors, tied).items():
            flat, offset = packed[part][key], 0
            for member, value in members:
                views[member] = flat[offset : offset + value.numel()].view(value.shape)
                offset += value.numel()
        out[part], given = {}, set()
        for name in tensors:
            member = _member(name, tied)[1]
            out[part][name] = views[member].clone() if member in given else views[member]
            given.add(member)
    return out


class _SnapshotStager:
    """The snapshot: copies this rank's state ({"model"|"optim": {name: tensor}}) into one flat
    tensor per partition unit and part (`model.blocks.3`, `optim.blocks.3`, ...).

    Units move whole between layouts, so these keys are as stable as parameter names and a
    checkpoint still loads under any partition (DCP reshards by key); but a few large items cost
    DCP far less to plan and write than hundreds of small ones, and the copy is a single
    `torch.cat` per unit. As dcp's AsyncStager, buffers are kept from one checkpoint to the next
    (no fresh allocation; safe because a write ends before the next snapshot starts), holding
    one copy of this rank's state in between."""

    should_synchronize_after_execute = False

    def __init__(self, tied: Tied | None = None) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.tied = tied  # the model's tied pair, packed once

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        buffers, packed = {}, {}
        for part, tensors in state_dict.items():
            packed[part] = {}
            for key, members in _units(tensors, self.tied).items():
                size = sum(v.numel() for _, v in members)
                buf = self._buffers.get((part, key))
                if buf is None or buf.numel() != size or buf.dtype != members[0][1].dtype:
                    buf = torch.empty(size, dtype=members[0][1].dtype)
                flat = [v.detach().reshape(-1) for _, v in members]
                device = next((t.device for t in flat if t.device.type != "cpu"), None)
                if device is None:
                    torch.cat(flat, out=buf)
                else:
                    # one concatenation on the GPU (AdamW keeps its `step` counts on the CPU,
                    # beside moments on the GPU), then one copy to host memory
                    buf.copy_(torch.cat([t.to(device) for t in flat]))
                buffers[part, key] = packed[part][key] = buf
        self._buffers = buffers  # units of an earlier layout are dropped
        return packed

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers = {}


BACKGROUND_NICE = 10


def _lower_priority(nice: int) -> None:
    """Run the calling thread `nice` steps below the training thread (Linux nice values are per
    thread): the background write then mostly fills the CPU time that training leaves idle
    (pipeline bubbles, waits on peers) instead of taking turns with it. Best effort."""
    if nice <= 0 or sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


class _BackgroundWriter(dcp.FileSystemWriter):
    """FileSystemWriter that lowers the priority of the thread dcp.async_save writes from (it is
    dcp's own, short-lived thread; this is the first call made in it)."""

    def __init__(self, path: Path, nice: int) -> None:
        super().__init__(path)
        self._nice = nice

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        _lower_priority(self._nice)
        super().set_up_storage_writer(*args, **kwargs)


@dataclass
class _Job:
    path: Path
    meta: dict[str, Any]
    started: float
    blocked_s: float = 0.0
    future: Future | None = None  # dcp.async_save's upload
    thread: threading.Thread | None = None  # waits for the upload, then seals
    result: SavedCheckpoint | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class AsyncCheckpointer:
    """Checkpoints that persist while training continues; one per process, used collectively.

    `start()` (all ranks, same step) snapshots this rank's weights and optimizer state into
    memory (`_SnapshotStager`: one memcpy per unit, the only part that holds up training) and
    hands them to `dcp.async_save`, which writes the shard from a background thread. A second
    background thread waits for that write, whose final collective means every rank's shards are
    durable (and `.metadata` written); each rank hashes its own shard files, rank 0 writes the
    manifest, seals the directory and tells the other ranks the outcome. `poll()` (non-blocking)
    and `wait()` return the `SavedCheckpoint` once it is sealed, on every rank, exactly once; a
    failure is raised there as `CheckpointWriteError` and leaves only the uncommitted `.partial`
    directory (a process killed mid-write leaves the same).

    The background collectives use their own gloo group (created here, so the constructor is a
    collective over the default group), never the training or control groups, so they can
    interleave freely with training collectives. The background threads run `nice` steps below
    the training thread. At most one checkpoint is in flight: `start()` first waits for the
    previous one. With `async_save=False` all of it happens inside `start()` (training waits),
    and the next `poll()` returns the result.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        nice: int = BACKGROUND_NICE,
    ):
        self.async_save, self.nice = async_save, nice
        self._dist = dist.is_available() and dist.is_initialized()
        if self._dist and group is None:
            group = dist.new_group(backend="gloo", timeout=timeout)
        self.group = group
        self.rank = dist.get_rank(group) if self._dist else 0
        self._job: _Job | None = None
        self._stager = _SnapshotStager()

    @property
    def in_flight(self) -> bool:
        """A checkpoint was started and not yet collected by poll()/wait()."""
        return self._job is not None

    def start(
        self,
        path: str | Path,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: dict[str, Any],
        tied: Tied | None = None,
    ) -> SavedCheckpoint | None:
        """Collective: snapshot and start writing a checkpoint to `path` (`tied`: the model's
        tied pair, written once). Waits for the previous one first and returns its result if
        nobody collected it yet (else None)."""
        previous = self.wait()
        self._stager.tied = tied
        path = Path(path)
        t0 = time.monotonic()
        job = _Job(path, json.loads(json.dumps(meta)), t0)  # meta is snapshotted too
        if self.rank == 0:
            # A torn attempt from before a crash. No barrier is needed before the other ranks
            # write: dcp writes only after its first collective, which rank 0 joins after this.
            shutil.rmtree(_partial(path), ignore_errors=True)
        state = state_tensors(module, optimizer)
        if not self.async_save:
            self._write_and_seal(job, state)  # a failure is kept for poll()/wait()
            if job.result is not None:  # all of it blocked training
                job.result = replace(job.result, blocked_s=job.result.seconds)
            job.done.set()
            self._job = job
            return previous
        # the stager copies every tensor before this returns: later optimizer steps cannot leak
        # into the checkpoint
        job.future = dcp.async_save(
            state,
            checkpoint_id=str(_partial(path)),
            storage_writer=_BackgroundWriter(_partial(path), self.nice),
            process_group=self.group,
            async_stager=self._stager,
            no_dist=not self._dist,
        )
        job.blocked_s = time.monotonic() - t0
        # daemon: a process leaving (abort) must not wait for a checkpoint nobody will commit
        job.thread = threading.Thread(
            target=self._finish, args=(job,), name="checkpoint-seal", daemon=True
        )
        self._job = job  # only now: if anything above raised, nothing is in flight
        job.thread.start()
        return previous

    def poll(self) -> SavedCheckpoint | None:
        """The sealed checkpoint if the one in flight has finished (once), else None."""
        if self._job is None or not self._job.done.is_set():
            return None
        return self._collect()

    def wait(self, timeout: float | None = None) -> SavedCheckpoint | None:
        """Block until the checkpoint in flight is sealed and return it (None if there is none,
        or on timeout)."""
        if self._job is None or not self._job.done.wait(timeout):
            return None
        return self._collect()

    def _collect(self) -> SavedCheckpoint | None:
        job, self._job = self._job, None
        assert job is not None
        if job.error is not None:
            raise CheckpointWriteError(
                f"checkpoint {job.path} was not sealed: {_describe(job.error)}"
            ) from job.error
        return job.result

    def _finish(self, job: _Job) -> None:
        """Background: wait for this rank's upload, then seal (rank 0) and share the outcome."""
        _lower_priority(self.nice)
        try:
            assert job.future is not None
            job.future.result()
            self._seal_and_share(job)
        except BaseException as exc:  # reported by poll()/wait() in the training thread
            job.error = exc
        finally:
            job.done.set()

    def _write_and_seal(self, job: _Job, state: dict[str, Any]) -> None:
        try:
            dcp.save(
                self._stager.stage(state),
                checkpoint_id=str(_partial(job.path)),
                process_group=self.group,
                no_dist=not self._dist,
            )
            self._seal_and_share(job)
        except BaseException as exc:
            job.error = exc

    def _seal_and_share(self, job: _Job) -> None:
        """dcp.save has returned on this rank. Its last step gathers every rank's write results
        on rank 0 (each file fsynced), writes `.metadata`, and then releases all ranks, so every
        shard is durable now. Rank 0 seals; every rank learns the outcome."""
        # each rank hashes its own shards (DCP names them `__<rank>_<n>.distcp`), so the
        # sealing work is spread instead of all on rank 0
        multi = self._dist and dist.get_world_size(self.group) > 1
        try:
            own = {p.name: _entry(p) for p in _shard_files(_partial(job.path), f"__{self.rank}_")}
        except OSError:
            own = {}  # rank 0 hashes them instead (or reports why it cannot)
        everyone: list[Any] = [None] * (dist.get_world_size(self.group) if multi else 1)
        if multi:
            dist.gather_object(
                own, everyone if self.rank == 0 else None, group=self.group, group_dst=0
            )
        else:
            everyone = [own]
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome[0] = _seal(
                    job.path, job.meta, {k: v for d in everyone for k, v in d.items()}
                )
            except Exception as exc:  # shared with the other ranks, then raised
                outcome[0] = _describe(exc)
        if multi:
            dist.broadcast_object_list(outcome, group=self.group, group_src=0)
        if isinstance(outcome[0], str):
            raise CheckpointWriteError(f"sealing on rank 0 failed: {outcome[0]}")
        size, checksum = outcome[0]
        job.result = SavedCheckpoint(
            str(job.path),
            size,
            checksum,
            job.meta,
            blocked_s=job.blocked_s,
            seconds=time.monotonic() - job.started,
        )


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; rebuild only the classes a checkpoint's index consists of,
    so a tampered file cannot run code when loaded."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a checkpoint never holds; "
            "refusing to load it"
        )


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` is read with `_MetadataUnpickler` instead of pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}: .metadata is not a checkpoint index")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _TensorOnlyPlanner(DefaultLoadPlanner):
    """Refuses entries stored as bytes: DCP would `torch.load(weights_only=False)` them, and
    our checkpoints only ever hold tensors."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        objects = sorted(i.dest_index.fqn for i in plan.items if i.type == LoadItemType.BYTE_IO)
        if objects:
            raise CheckpointError(
                f"checkpoint stores {', '.join(objects)} as pickled objects, not tensors; "
                "refusing to load them"
            )
        return plan


def _load_packed(
    path: str | Path,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    tied: Tied | None = None,
) -> dict[str, Any]:
    """Read the units of `state` ({part: {name: tensor}}) from a checkpoint: per-name tensors of
    the same shapes. Collective over `group` when a process group is initialised."""
    packed = {
        part: {
            key: torch.empty(sum(v.numel() for _, v in members), dtype=members[0][1].dtype)
            for key, members in _units(tensors, tied).items()
        }
        for part, tensors in state.items()
    }
    try:
        dcp.load(
            packed,
            storage_reader=_SafeReader(str(path)),
            planner=_TensorOnlyPlanner(),
            process_group=group,
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
    except CheckpointException as exc:  # a BaseException: make it an ordinary error
        raise CheckpointError(f"{path}: cannot load: {_describe(exc)}") from exc
    return _unpack(state, packed, tied)


def load_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
    tied: Tied | None = None,
) -> None:
    """Fill this rank's blocks and their optimizer state from a checkpoint written under any
    layout (DCP reshards by key; a tied pair's copies from its one tensor). Reads tensors only:
    nothing in the checkpoint is unpickled beyond DCP's own index classes."""
    state = state_tensors(module, optimizer)  # initialises optimizer state, giving load its keys
    loaded = _load_packed(path, state, group, tied)
    # what the checkpoint does not hold is a model with adapters' base weights, and only that
    missing, unexpected = module.load_state_dict(loaded["model"], strict=False)
    if unexpected or set(missing) != set(module.state_dict()) - set(state["model"]):
        raise CheckpointError(f"{path}: missing {missing}, unexpected {unexpected}")
    if not any(group["params"] for group in optimizer.param_groups):
        return  # nothing trains here: no optimizer state to load (DCP refuses an empty one)
    full = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    full.update(loaded["optim"])
    set_optimizer_state_dict(module, optimizer, full, options=_OPTIONS)


class UnitsDiffer(CheckpointError):
    """A checkpoint lacks some units of a model, or holds them at another size."""

    def __init__(self, path: str | Path, problems: str) -> None:
        super().__init__(f"{path}: its units differ from the model's: {problems}")
        self.problems = problems


def read_weights(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    tied: Tied | None = None,
) -> dict[str, torch.Tensor]:
    """The model tensors named in `tensors` (name -> a tensor of the wanted shape and dtype; on
    the meta device is enough) from a checkpoint written under any layout: views into one flat
    tensor per unit. Raises `UnitsDiffer` naming each unit the checkpoint lacks or holds at another size,
    before anything is read. Collective over `group` where a process group is initialised; in a
    process without one (`pipetransformer export`) it reads alone."""
    stored = _SafeReader(str(path)).read_metadata().state_dict_metadata
    problems = []
    for key, members in _units(tensors, tied).items():
        size = sum(v.numel() for _, v in members)
        entry = stored.get(f"model.{key}")
        if entry is None:
            problems.append(f"it has no {key}")
        elif not hasattr(entry, "size") or entry.size.numel() != size:
            held = entry.size.numel() if hasattr(entry, "size") else "no tensor"
            problems.append(f"its {key} holds {held} values, this model's {size}")
    if problems:
        raise UnitsDiffer(path, "; ".join(problems))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        return _load_packed(path, {"model": tensors}, group, tied)["model"]


def load_weights(
    path: str | Path,
    module: nn.Module,
    skip: list[str] | tuple[str, ...] = (),
    checksum: str | None = None,
    group: dist.ProcessGroup | None = None,
    tied: Tied | None = None,
) -> list[str]:
    """Fine-tuning: fill this rank's units of `module` with the weights of a checkpoint another
    job wrote (under any layout), except the units in `skip`, which keep their initialisation.
    Nothing else is taken from it (no optimizer state). With `checksum`, the checkpoint is
    verified against it first. Returns the units loaded.

    Raises CheckpointError naming each unit the checkpoint lacks or holds at another size (the
    model spec differs from the checkpoint's), before anything is read. Collective."""
    if checksum is not None:
        verify_checkpoint(path, checksum)
    tensors = model_tensors(module)  # with adapters: the adapters (and a new head) only
    wanted = {
        name: value
        for name, value in tensors.items()
        if key_unit(_member(name, tied)[0]) not in skip
    }
    try:
        loaded = {"model": read_weights(path, wanted, group, tied)}
    except UnitsDiffer as exc:
        raise CheckpointError(
            f"{path}: cannot initialise this model from it: {exc.problems}. The model spec must "
            "have the checkpoint's architecture (or list the unit in init.skip)"
        ) from None
    missing, unexpected = module.load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(n not in wanted for n in missing), (missing, unexpected)
    return sorted({unit_of(name) for name in wanted})
