"""torchrun rendezvous over etcd v3: ``--rdzv-backend etcd3 --rdzv-endpoint HOST:PORT``.

torch ships two etcd backends and both speak the v2 HTTP API, which etcd 3.4+ disables by
default; this one speaks v3 (gRPC, through :mod:`edge.etcd_client`). It plugs into
torch's own ``DynamicRendezvousHandler``, so join/last-call/heartbeat/close semantics are
exactly those of the ``c10d`` backend, and it is registered through the
``torchrun.handlers`` entry point (``handler_factory``).

Rendezvous state
    ``DynamicRendezvousHandler`` keeps one pickled state blob and updates it by
    compare-and-swap. We store it base64-encoded at ``keys.rendezvous(run_id) + "/state"``;
    the fencing token is the key's etcd *mod revision*, and ``set_state`` is one etcd
    transaction "if mod_revision == token: put; then read the key back", so a writer holding
    a stale token loses and is handed the winner's state and token in the same round trip.

The store (why an etcd-backed c10d ``Store``)
    The handler also needs a c10d ``Store`` *before* anyone knows who rank 0 is. The agents
    use it for a handful of small operations per round: rank 0 publishes MASTER_ADDR/PORT
    (``RendezvousStoreInfo``), the agents exchange role info and worker ranks, and they meet
    at the exit barrier. The alternatives were a TCPStore hosted by one agent (what ``c10d``
    does: it needs a designated host known in advance, and that agent's death takes the store
    with it, the very failure an elastic job must survive) or a TCPStore started lazily by
    the winner (which needs a store to announce it: circular). Backing the store with etcd
    itself has no special node, survives any agent's loss and costs nothing new to deploy.
    :class:`EtcdStore` implements set/get/add/compare_set/wait/check/multi_get/multi_set/
    num_keys/delete_key with c10d's semantics (blocking reads wait up to the store timeout and
    raise ``DistStoreError``); keys live under ``keys.rendezvous(run_id) + "/store/"``.
    Blocking reads poll with capped backoff (10 ms to 200 ms; to 1 s beyond 64 nodes, where
    every agent waits on torchrun's rank assignment at once) rather than watch: the agents'
    operations are few, and polling is immune to lost watch events across etcd restarts.

    The *workers'* store is not this one either: each round's rank-0 worker hosts a fresh
    TCPStore (torch's store sharing is turned off, see ``create_etcd3_handler`` for why), so
    the hot path of process-group setup never touches etcd.

Trust (the state is signed)
    The state blob is a pickle (torch's format): whoever can write its key could run code in
    every agent. With a job secret (``$PIPETRANSFORMER_RDZV_SECRET``, or a file named by
    ``$PIPETRANSFORMER_RDZV_SECRET_FILE``: a Kubernetes Secret, or the file a local run makes
    per job) every state is written as ``v1:<HMAC-SHA256>:<base64>``, the MAC over the key and
    the bytes, and a state that does not verify (unsigned, another secret, another run's key)
    raises ``RendezvousStateError`` before torch unpickles it; the refusal is put under
    ``keys.alert`` for the controller to record (rdzv conf ``job=<id>``). An attacker can at
    most replay a state this run once wrote, which unpickles to torch's own state class.
    Without a secret (a foreign torchrun job) states are plain base64, as before, and a
    signed one is refused: it cannot be checked. The c10d store's values are not pickles.

Re-rendezvous fixes
    Workers do not share the agent's TCPStore (torch's opt-out, set by
    ``create_etcd3_handler``): their keys would be namespaced by each agent's restart count,
    which diverges between nodes after a worker failure. MASTER_ADDR/PORT are then built fresh
    every round. The handler subclass also drops torch 2.13's cached store info every round
    (it caches it on nodes that are not rank 0, which would point the survivors of a lost
    rank-0 node at the dead node's store when sharing is on).

Scale (why the state is not simply compare-and-swapped by every node)
    torch's handler writes the whole state (every node's descriptor and last heartbeat) for
    each join and each heartbeat, and a writer that loses the race unpickles the winner's
    state, runs its state machine again and writes again. At N nodes a round costs O(N^2)
    writes of an O(N) blob: measured at 256 simulated agents, 156,059 etcd requests and 316 MB
    written in 240 s, and at most 39 of the 256 ever in the round. Bound to its handler
    (``bind``: torchrun's handler, built by ``create_etcd3_handler``), the backend keeps
    torch's state machine and semantics but changes what reaches etcd:

    - A heartbeat is a lease. Each node holds ``state.alive/<node>`` under a lease of
      keep_alive_interval x keep_alive_max_attempt seconds and refreshes it over its etcd
      client's one keep-alive stream, from the handler's heartbeats and waits and from a
      thread of its own (a stalled handler loop must not make a live node dead: that re-forms
      the whole job); the state is never rewritten for a heartbeat. The handler sees every
      node whose lease lives with a heartbeat that never expires (``overlay``, kept up to date
      by what changed rather than rebuilt for all nodes), so torch's own ``_sanitize``
      removes exactly the nodes whose lease lapsed; that mark is never written
      (``persisted``).
    - A node follows the state by its deltas. Every state write also writes what changed
      (``state_diff``: O(what changed); a round that takes its whole wait list, and the ranks
      a completed round hands out, are named rather than listed)
      into a ring of ``DELTA_SLOTS`` keys ``state.delta/<version mod 64>``, signed like the
      state, in the same transaction. A read is one range over the alive keys and the deltas
      (which sort right after the state key, and leave it out) asking only for what changed
      since the last read; a delta that leads on from the revision held is applied
      (``apply_diff``), and the state is read whole only when the node never read it, fell
      further behind than the ring, or finds a write without a delta (an unbound writer
      leaves ``RELOAD``). Without deltas every node read the whole O(N) state after each
      change: 148 MB for one rendezvous at 512 nodes. A delta names nodes as plain tuples,
      read into one object per node (``decode_delta``): unpickling torch's node dataclass,
      and finding it in the state's dicts by its Python-level hash and equality, cost each
      node of a 1,024-node re-rendezvous about 35 ms of CPU.
    - A read the handler makes while it waits (once a second on every waiting node) first
      asks whether anything changed (``_unchanged``): the mod revision of one key written
      with every state (``written_key``) and the number of alive keys and deltas, which etcd
      answers from its index. The range over the span costs etcd O(N) (it loads every key
      to filter them): a thousand waiting nodes took a core of etcd's.
    - A lapsed lease shows as a key missing from the read's count, and every node counts it
      within the same second. A node first counts the keys of the likely nodes, one read of
      one key each (``_probe_likely``): nodes that the last write took out of the state, and
      beyond 64 nodes the few participants of a round (the lost node of a re-rendezvous is
      the one that never left the old round). Beyond 64 nodes a lapse it cannot place waits
      a random part of a heartbeat interval for a write that places it (``_settle_gone``):
      1,023 nodes each searching at once held a re-rendezvous up for seconds. Searching, a
      node finds up to four lapsed keys by count-only reads of halves of the keys it knows
      (``_find_gone``: about log2(N) reads of a few bytes each), and lists every alive key
      again only past that (at most once per heartbeat interval).
    - A membership change (join, leave, complete, close) is combined. In one transaction a
      node either takes the combiner lock (a key under its lease) or leaves its change as an
      intent (``intent/<node>``, under its lease, signed like the state). The lock holder
      applies its own change and up to ``MAX_BATCH`` pending intents to the current state by
      replaying torch's own operations (``replay``: a change decided on an older state is
      taken only where torch's operation would still take it on the newer one, so the result
      is what the handler would have written after losing the race), writes the state once,
      deletes the intents it applied (each compared by revision: a withdrawn one is never
      applied behind its owner's back), and lets the lock go with the write that carries its
      own change. A waiter polls with a back-off that grows with the intents pending; its
      intent gone means applied (or refused), and the state it then reads says which. Out of
      time, it withdraws its intent and the handler runs its state machine again.
    - The combiner also makes the writes its batch's handlers would make next (``replay``):
      a node leaving a complete round to join the next one (torch's ``next_rendezvous``:
      exit, then join) is queued in the wait list in the same change; a join goes on as
      torch's join operation would (queued when the round is full, completing a round whose
      last call is over); and a round that opens again takes its whole wait list
      (``promote``), as each waiting node's join does on its first sync after. The survivors
      of a lost node then cost one change each and the new round one write, instead of
      three changes each (leave, wait, join) queued behind one another: 4,000 changes
      for 1,023 survivors. Completing (or closing) a round, and a waiting node's join of the
      round that opened, are decided by every node at about the same moment and made by one
      for all: a node that finds the lock held waits for it (or for the change to be made)
      rather than queueing an intent, and a batch of changes all made already writes no
      state.
    - A state is unpickled with torch's rendezvous classes only (``decode_state``).
    - The backends of one process share what they parse: one object per node, the nodes by
      their names in keys, each alive key as read (per secret, key, value, lease and
      revisions), and the last few states, read whole or made by applying a delta (per
      secret, key and value: states are never changed once held). An agent runs one backend;
      a simulator host runs a hundred, and each parsing every other node's alive key, and
      decoding and applying every delta to a state of its own, took most of its CPU.

    A round of N joins is then about N/``MAX_BATCH`` state writes plus one small intent per
    node, each node reads each write's delta once, and a steady round costs each node one lease
    refresh per heartbeat interval and a range read that returns nothing new. Unbound (the
    backend used through torch's ``RendezvousBackend`` interface alone) it is the plain
    compare-and-swap described under "Rendezvous state", so any torchrun job still works on
    it; both kinds of writer fence on the state key's revision and can share a run.
    ``bench/control_plane_scale.py`` measures it (results in ``bench/results/issue26-scale/``).

Options (``--rdzv-conf k=v,...``), besides torch's join_timeout, last_call_timeout,
close_timeout, heartbeat_timeout, keep_alive_interval and keep_alive_max_attempt:

    read_timeout   seconds a blocking store read waits, and how long an etcd outage is ridden
                   out (retries) before a ``RendezvousConnectionError``; default 60, as c10d.
    rpc_timeout    seconds for one etcd RPC; default 5.
    first_call_timeout
                   seconds the first round (a launch) waits for more nodes once ``min`` have
                   joined, where later rounds wait last_call_timeout; default: the same. The
                   nodes of one launch start together, but not at the same moment (a loaded
                   machine, a slow image pull): a short last call that serves recovery well
                   starts a launch narrower than it was asked for, and a node that missed the
                   first round widens the job a round later, re-forming it.
    job            the pipetransformer job the run belongs to: where a refused state is reported.
"""

from __future__ import annotations

# ruff: noqa: E402  (the entry point below must precede the torch imports)


# torch's rendezvous package, when first imported, loads every ``torchrun.handlers`` entry
# point, this module's ``handler_factory`` included. When *this* module is what imports that
# package first (the controller, tests), the entry point is loaded from a half-initialised
# module; so it is defined before any torch import and looks the real creator up when called.
def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``torchrun.handlers:etcd3``; torch calls it with no arguments and
    registers the returned creator."""
    return _create_etcd3_handler_deferred


def _create_etcd3_handler_deferred(params: RendezvousParameters) -> RendezvousHandler:
    # torchrun's agent, ending, would hold its exit (and the launcher waiting on it) a second
    # in the interpreter's last collection over torch's objects, which nothing needs: the
    # collector skips whatever exists once the exit handlers run (registered once)
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    return create_etcd3_handler(params)


import atexit
import binascii
import collections
import dataclasses
import gc
import hashlib
import hmac
import io
import logging
import math
import os
import pickle
import random
import socket
import threading
import time
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote, unquote

import torch.distributed as dist
from pyetcd import utils as etcd_utils
from pyetcd.etcdrpc import rpc_pb2 as pb
from torch.distributed import Store
from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.events.handlers import get_logging_handler
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    Token,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousCloseOp,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousState,
)

from pipetransformer.core import keys
from pipetransformer.core.protocol import RendezvousRefused
from pipetransformer.edge.etcd_client import (
    EtcdClient,
    EtcdConfigError,
    EtcdError,
    Lease,
    LeaseExpired,
)

__all__ = [
    "ALIVE",
    "BACKEND_NAME",
    "EtcdRendezvousBackend",
    "EtcdStore",
    "alive_prefix",
    "create_backend",
    "create_etcd3_handler",
    "decode_state",
    "delete_rendezvous",
    "encode_state",
    "handler_factory",
    "load_secret",
    "overlay",
    "persisted",
    "read_rendezvous",
    "replay",
    "sign_state",
    "state_key",
    "store_prefix",
    "verify_state",
    "written_key",
]

BACKEND_NAME = "etcd3"
DEFAULT_READ_TIMEOUT = 60
DEFAULT_RPC_TIMEOUT = 5.0


def state_key(run_id: str) -> str:
    """etcd key of the rendezvous state blob of ``run_id``."""
    return f"{keys.rendezvous(run_id)}/state"


def store_prefix(run_id: str) -> str:
    """etcd prefix of the c10d store keys of ``run_id``."""
    return f"{keys.rendezvous(run_id)}/store/"


def alive_prefix(run_id: str) -> str:
    """etcd prefix of the keys a live node holds under its lease (see "Scale"): right after
    the state key, so that one range read returns both."""
    return f"{state_key(run_id)}.alive/"


def delta_prefix(run_id: str) -> str:
    """etcd prefix of the state's deltas (see "Scale"): after the alive keys, so that one range
    read returns both, and the state key itself is not in it."""
    return f"{state_key(run_id)}.delta/"


def written_key(run_id: str) -> str:
    """etcd key written with every state (see "Scale"): its mod revision says whether the state
    changed since a node's last read, at the cost of one key."""
    return f"{keys.rendezvous(run_id)}/written"


def read_rendezvous(
    client: EtcdClient, run_id: str, secret: bytes | None = None
) -> tuple[_RendezvousState | None, set[_NodeDesc], int]:
    """What a monitor sees of a rendezvous (the benchmark; read-only, O(nodes) a call): its
    stored state (verified, unpickled with torch's classes only), the nodes whose lease is
    alive, and the stored state's size in bytes."""
    value = client.get(state_key(run_id))
    state = None
    if value is not None:
        state = decode_state(verify_state(secret, state_key(run_id), value))
    alive = set()
    prefix = alive_prefix(run_id)
    for key, _ in client.get_prefix(prefix):
        node = parse_node_id(key[len(prefix) :])
        if node is not None:
            alive.add(node)
    return state, alive, 0 if value is None else len(value) * 3 // 4


def delete_rendezvous(client: EtcdClient, run_id: str) -> int:
    """Drop the state and store keys of ``run_id`` (a finished run's rendezvous is closed and
    cannot be joined again); returns the number of keys removed."""
    return client.delete_prefix(f"{keys.rendezvous(run_id)}/")


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return b64decode(text.encode(), validate=True)


# -- signed state -----------------------------------------------------------------------------

SIGNED_PREFIX = "v1:"
_MIN_SECRET_BYTES = 16


def load_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's rendezvous secret from the environment (its value, else the file it names);
    None when neither is set. A file that cannot be read, or a secret shorter than 16 bytes,
    is an error: signing with a guessable key would only look safe."""
    value = environ.get(keys.RDZV_SECRET_ENV)
    where = f"${keys.RDZV_SECRET_ENV}"
    if not value and (path := environ.get(keys.RDZV_SECRET_FILE_ENV)):
        where = f"${keys.RDZV_SECRET_FILE_ENV} ({path})"
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read(4096)
        except OSError as exc:
            raise ValueError(f"{where}: the rendezvous secret cannot be read: {exc}") from None
    if not value:
        return None
    secret = value.strip().encode()
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: the rendezvous secret must be at least {_MIN_SECRET_BYTES} characters "
            "(make one with `openssl rand -hex 32`)"
        )
    return secret


def _mac(secret: bytes, key: str, state: bytes) -> str:
    # the key is in the MAC: a state signed for one run cannot be moved to another's key
    return hmac.new(secret, key.encode() + b"\0" + state, hashlib.sha256).hexdigest()


def sign_state(secret: bytes, key: str, state: bytes) -> str:
    """The etcd value for `state` at `key`: ``v1:<hex HMAC-SHA256>:<base64 state>``."""
    return f"{SIGNED_PREFIX}{_mac(secret, key, state)}:{_b64(state)}"


class StateRefused(RendezvousStateError):
    """A rendezvous state that does not verify; nothing unpickled it."""


def verify_state(secret: bytes | None, key: str, value: str) -> bytes:
    """The state bytes of an etcd value written by `sign_state` (with a secret) or plain base64
    (without one), or StateRefused saying why."""
    signed = value.startswith(SIGNED_PREFIX)
    if secret is None:
        if signed:
            raise StateRefused(
                f"The rendezvous state at {key} is signed, and this agent has no secret to check "
                f"it with: set ${keys.RDZV_SECRET_ENV} (or ${keys.RDZV_SECRET_FILE_ENV}) as the "
                "job's other agents have it."
            )
        return _unb64(value)
    if not signed:
        raise StateRefused(
            f"The rendezvous state at {key} is not signed with the job's secret (someone without "
            "it wrote the key); refused before unpickling it."
        )
    mac, sep, body = value[len(SIGNED_PREFIX) :].partition(":")
    state = _unb64(body) if sep else b""
    # bytes, not str: compare_digest refuses (TypeError) a str with non-ASCII characters
    if not sep or not hmac.compare_digest(mac.encode(), _mac(secret, key, state).encode()):
        raise StateRefused(
            f"The rendezvous state at {key} does not verify against the job's secret (forged, "
            "or written by an agent given another secret); refused before unpickling it."
        )
    return state


# -- merging: torch's own state machine, replayed on the current state -----------------------

_TORCH_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# everything a pickled `_RendezvousState` refers to; anything else is not one
_STATE_CLASSES: dict[tuple[str, str], type] = {
    (_TORCH_RDZV, "_RendezvousState"): _RendezvousState,
    (_TORCH_RDZV, "_NodeDesc"): _NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
}

# What the backend hands the handler as the last heartbeat of a node whose lease is alive: it
# never expires in torch's `_sanitize`, and is never written back to etcd (`persisted`).
ALIVE = datetime.max.replace(tzinfo=UTC)

# The handler's actions that change who is in the round: they go through intents and combining.
_JOIN_ACTIONS = frozenset(
    {
        _Action.ADD_TO_PARTICIPANTS,
        _Action.ADD_TO_WAIT_LIST,
        _Action.ADD_TO_REDUNDANCY_LIST,
        _Action.REMOVE_FROM_REDUNDANCY_LIST,
        _Action.MARK_RENDEZVOUS_COMPLETE,
    }
)
MEMBERSHIP_ACTIONS = _JOIN_ACTIONS | {
    _Action.REMOVE_FROM_PARTICIPANTS,
    _Action.REMOVE_FROM_WAIT_LIST,
    _Action.MARK_RENDEZVOUS_CLOSED,
}


def _mark_complete(executor: _DistributedRendezvousOpExecutor) -> None:
    """torch's `_mark_rendezvous_complete`, its ranks sorted by the nodes' fields as a tuple
    (`_rank_order`: the same order) where torch sorts the node dataclasses, whose comparison
    is Python code: every node of a round makes this change in its own view (at 1,023 nodes
    2.1 ms of CPU against 0.8 ms idle, more on a simulator host running a hundred)."""
    state = executor._state
    ranked, held = _rank_order(state), state.participants
    state.participants = {}  # torch's own method, with nothing to sort
    try:
        _DistributedRendezvousOpExecutor._mark_rendezvous_complete(executor)
    finally:
        state.participants = held
    held.update(zip(ranked, range(len(ranked)), strict=True))


_APPLY: dict[_Action, Callable[[_DistributedRendezvousOpExecutor], None]] = {
    _Action.ADD_TO_PARTICIPANTS: _DistributedRendezvousOpExecutor._add_to_participants,
    _Action.ADD_TO_WAIT_LIST: _DistributedRendezvousOpExecutor._add_to_wait_list,
    _Action.ADD_TO_REDUNDANCY_LIST: _DistributedRendezvousOpExecutor._add_to_redundancy_list,
    _Action.REMOVE_FROM_PARTICIPANTS: _DistributedRendezvousOpExecutor._remove_from_participants,
    _Action.REMOVE_FROM_WAIT_LIST: _DistributedRendezvousOpExecutor._remove_from_wait_list,
    _Action.REMOVE_FROM_REDUNDANCY_LIST: (
        _DistributedRendezvousOpExecutor._remove_from_redundancy_list
    ),
    _Action.MARK_RENDEZVOUS_COMPLETE: _mark_complete,
    _Action.MARK_RENDEZVOUS_CLOSED: _DistributedRendezvousOpExecutor._mark_rendezvous_closed,
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _STATE_CLASSES[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of a rendezvous state"
            ) from None


def decode_state(data: bytes) -> _RendezvousState:
    """torch's pickled rendezvous state, unpickled with nothing but its own classes allowed (the
    backend reads states to merge them; a pickle naming anything else is refused unread)."""
    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise RendezvousStateError(f"The rendezvous state is not torch's: {exc}") from None
    if not isinstance(state, _RendezvousState):
        raise RendezvousStateError("The rendezvous state is not torch's.")
    return state


def encode_state(state: _RendezvousState) -> bytes:
    return pickle.dumps(state)  # as torch's state holder does


def copy_state(state: _RendezvousState) -> _RendezvousState:
    """A copy that shares only immutable parts (node descriptors, datetimes)."""
    new = _RendezvousState()
    new.round, new.complete, new.deadline, new.closed = (
        state.round,
        state.complete,
        state.deadline,
        state.closed,
    )
    new.participants = dict(state.participants)
    new.wait_list = set(state.wait_list)
    new.redundancy_list = set(state.redundancy_list)
    new.last_heartbeats = dict(state.last_heartbeats)
    return new


# A state's delta: (round, complete, deadline, closed, participants set, participants removed,
# wait list added, removed, redundancy list added, removed, heartbeats set, removed, bulk
# changes: see `state_diff`)
StateDiff = tuple[
    int,
    bool,
    datetime | None,
    bool,
    dict[_NodeDesc, int],
    list[_NodeDesc],
    set[_NodeDesc],
    set[_NodeDesc],
    set[_NodeDesc],
    set[_NodeDesc],
    dict[_NodeDesc, datetime],
    list[_NodeDesc],
    tuple[tuple[Any, ...], ...],
]
_GONE = object()
# Changes a delta names instead of listing their nodes (see `state_diff`): the round that
# opened took its wait list (applied first), the round that completed ranked its participants
# (applied last); worth it from this many nodes on.
_PROMOTED, _RANKED = "promoted", "ranked"
_BULK_MIN = 8


def _promote_all(state: _RendezvousState, beat: datetime) -> None:
    """`state` (changed in place) with its whole wait list in the round at rank 0, each with
    heartbeat `beat` (what `promote` writes; dict.fromkeys of a set hashes nothing again)."""
    moved, state.wait_list = state.wait_list, set()
    state.participants.update(dict.fromkeys(moved, 0))
    state.last_heartbeats.update(dict.fromkeys(moved, beat))


def _rank_order(state: _RendezvousState) -> list[_NodeDesc]:
    """The participants in torch's rank order (sorted: the dataclass orders by these fields)."""
    return sorted(state.participants, key=_key)


def state_diff(old: _RendezvousState, new: _RendezvousState) -> StateDiff:
    """What turns `old` into `new` (`apply_diff`): O(what changed), not O(nodes). Two changes
    of every node are named rather than listed (a thousand nodes' entries are ~150 kB, read
    by each of them): a round that opened and took the whole wait list (`promote`), and the
    ranks a completed round hands out (torch's order, which the reader sorts for itself);
    the listed changes then are what these do not cover. A node removed and added again
    comes back at its old place, not at the end: nothing reads the order of the state's dicts
    (torch ranks participants by sorting them), and keeping it would cost a delta of every
    node after it, for each node that leaves a round to wait for the next."""
    bulk: list[tuple[Any, ...]] = []
    base, moved = old, old.wait_list
    if (
        len(moved) >= _BULK_MIN
        and moved.isdisjoint(new.wait_list)
        and len(moved.difference(new.participants)) <= len(moved) // 2
    ):
        beat = new.last_heartbeats.get(min(moved, key=_key))
        if beat is not None:
            bulk.append((_PROMOTED, beat))
            base = copy_state(old)
            _promote_all(base, beat)
    op, ob = base.participants, base.last_heartbeats
    p_set = {n: r for n, r in new.participants.items() if op.get(n, _GONE) != r}
    if new.complete and len(p_set) >= _BULK_MIN:
        order = _rank_order(new)
        if all(new.participants[n] == rank for rank, n in enumerate(order)):
            bulk.append((_RANKED,))
            p_set = {n: r for n, r in p_set.items() if n not in op}  # joined: ranked below
    return (
        new.round,
        new.complete,
        new.deadline,
        new.closed,
        p_set,
        [n for n in op if n not in new.participants],
        new.wait_list - base.wait_list,
        base.wait_list - new.wait_list,
        new.redundancy_list - base.redundancy_list,
        base.redundancy_list - new.redundancy_list,
        {n: b for n, b in new.last_heartbeats.items() if ob.get(n, _GONE) != b},
        [n for n in ob if n not in new.last_heartbeats],
        tuple(bulk),
    )


def apply_diff(old: _RendezvousState, diff: StateDiff) -> _RendezvousState:
    """`old` (unchanged) with `diff` applied: equal to the state the diff was taken to (its
    dicts' order aside, see `state_diff`)."""
    new = copy_state(old)
    bulk = diff[12]
    for change in bulk:
        if change[0] == _PROMOTED:
            _promote_all(new, change[1])
    (new.round, new.complete, new.deadline, new.closed) = diff[:4]
    p_set, p_del, w_add, w_del, r_add, r_del, b_set, b_del = diff[4:12]
    for node in p_del:
        new.participants.pop(node, None)
    new.participants.update(p_set)
    new.wait_list = (new.wait_list - w_del) | w_add
    new.redundancy_list = (new.redundancy_list - r_del) | r_add
    for node in b_del:
        new.last_heartbeats.pop(node, None)
    new.last_heartbeats.update(b_set)
    if (_RANKED,) in bulk:
        order = _rank_order(new)
        new.participants.update(zip(order, range(len(order)), strict=True))
    return new


def _bulk_valid(change: Any) -> bool:
    if type(change) is not tuple:
        return False
    if len(change) == 2 and change[0] == _PROMOTED:
        return isinstance(change[1], datetime)
    return change == (_RANKED,)


# A delta as stored: (the state's mod revision it applies to, the state's version after it,
# the diff with each node as a plain (addr, pid, local_id) tuple); a state written whole by a
# writer that keeps no deltas leaves `RELOAD`.
RELOAD = b"reload"
_NodeKey = tuple[str, int, int]
# a delta's fields that hold nodes: dict keys, lists and sets (see StateDiff)
_NODE_DICTS, _NODE_LISTS, _NODE_SETS = (4, 10), (5, 11), (6, 7, 8, 9)


def _key(node: _NodeDesc) -> _NodeKey:
    return (node.addr, node.pid, node.local_id)


def encode_delta(base: int, version: int, diff: StateDiff) -> bytes:
    wire: list[Any] = list(diff)
    for i in _NODE_DICTS:
        wire[i] = {_key(n): v for n, v in diff[i].items()}  # type: ignore[union-attr]
    for i in (*_NODE_LISTS, *_NODE_SETS):
        wire[i] = [_key(n) for n in diff[i]]  # type: ignore[union-attr]
    return pickle.dumps((base, version, tuple(wire)))


def _node(nodes: dict[_NodeKey, _NodeDesc], key: Any) -> _NodeDesc:
    """The node of `key`, one object per node (`nodes`): dicts and sets of the state then find
    their keys by identity, not by the dataclass's Python-level hash and equality."""
    node = nodes.get(key)
    if node is None:
        if not (
            type(key) is tuple
            and len(key) == 3
            and type(key[0]) is str
            and type(key[1]) is int
            and type(key[2]) is int
        ):
            raise TypeError("not a node")
        node = nodes.setdefault(key, _NodeDesc(*key))  # atomic: nodes may be shared
    return node


def decode_delta(
    data: bytes, nodes: dict[_NodeKey, _NodeDesc] | None = None
) -> tuple[int, int, StateDiff] | None:
    """A stored delta (plain data, unpickled with torch's rendezvous classes only), its nodes
    taken from `nodes` (and added there); None for `RELOAD` or anything that is not a delta:
    the reader then reads the whole state."""
    if data == RELOAD:
        return None
    nodes = {} if nodes is None else nodes
    try:
        base, version, wire = _StateUnpickler(io.BytesIO(data)).load()
        if not (isinstance(base, int) and isinstance(version, int) and isinstance(wire, tuple)):
            return None
        if len(wire) == 12:  # written before bulk changes
            wire = (*wire, ())
        if len(wire) != 13 or type(wire[12]) is not tuple:
            return None
        if not all(_bulk_valid(change) for change in wire[12]):
            return None  # a change this version does not know: read the state whole
        diff: list[Any] = list(wire)
        known = nodes.get  # most nodes are known: no call of `_node` for them
        for i in _NODE_DICTS:
            diff[i] = {(known(k) or _node(nodes, k)): v for k, v in wire[i].items()}
        for i in _NODE_LISTS:
            diff[i] = [known(k) or _node(nodes, k) for k in wire[i]]
        for i in _NODE_SETS:
            diff[i] = {known(k) or _node(nodes, k) for k in wire[i]}
    except Exception:
        return None
    return base, version, tuple(diff)  # type: ignore[return-value]


def intern_state(state: _RendezvousState, nodes: dict[_NodeKey, _NodeDesc]) -> None:
    """`state` (changed in place) holding one object per node, those of `nodes` (see `_node`)."""

    def one(node: _NodeDesc) -> _NodeDesc:
        return nodes.setdefault(_key(node), node)

    state.participants = {one(n): r for n, r in state.participants.items()}
    state.wait_list = {one(n) for n in state.wait_list}
    state.redundancy_list = {one(n) for n in state.redundancy_list}
    state.last_heartbeats = {one(n): b for n, b in state.last_heartbeats.items()}


def overlay(
    stored: _RendezvousState,
    alive: Iterable[_NodeDesc],
    me: _NodeDesc | None = None,
    my_heartbeat: datetime | None = None,
) -> _RendezvousState:
    """The state the handler sees: the stored one, with every other node whose lease is alive
    marked ALIVE, and this node's heartbeat its last lease refresh (the handler decides from it
    when to send the next, which is what keeps the lease alive)."""
    view = copy_state(stored)
    beats = view.last_heartbeats
    for node in alive:
        if node in beats and node != me:
            beats[node] = ALIVE
    if me is not None and me in beats and my_heartbeat is not None:
        beats[me] = my_heartbeat
    return view


def persisted(view: _RendezvousState, stored: _RendezvousState | None) -> _RendezvousState:
    """What is written back: `view` with each ALIVE mark replaced by the stored heartbeat (a
    lease says a node is alive only while it lasts; written down it would never expire)."""
    new = copy_state(view)
    old = stored.last_heartbeats if stored is not None else {}
    now = datetime.now(UTC)
    for node, beat in new.last_heartbeats.items():
        if beat == ALIVE:
            new.last_heartbeats[node] = old.get(node, now)
    return new


def sanitize(state: _RendezvousState, settings: RendezvousSettings) -> list[_NodeDesc]:
    """torch's own removal of nodes whose heartbeat expired (what the handler does after every
    sync); returns the nodes removed."""
    holder = _BackendRendezvousStateHolder(_NO_BACKEND, settings)
    holder._state = state
    holder._sanitize()
    return list(holder._dead_nodes)


def _quiet(*_args: Any, **_kwargs: Any) -> None:
    pass


def action_valid(
    state: _RendezvousState, node: _NodeDesc, action: _Action, settings: RendezvousSettings
) -> bool:
    """Whether `node`'s handler, had it read `state`, would have taken `action`: torch's own
    operations decide (with no deadline passed). A change decided on an older state is applied
    to a newer one only then, so the result is what the handler would have written after
    losing the race and running its state machine again."""
    ctx = _RendezvousContext(node, state, settings)
    try:
        if action in _JOIN_ACTIONS:
            return _RendezvousJoinOp()(ctx, math.inf) == action
        if action is _Action.REMOVE_FROM_PARTICIPANTS:  # the exit op, or a join rolled back
            return _RendezvousExitOp()(ctx, math.inf) == action
        if action is _Action.REMOVE_FROM_WAIT_LIST:  # only a join rolled back
            return node in state.wait_list
        if action is _Action.MARK_RENDEZVOUS_CLOSED:
            return _RendezvousCloseOp()(ctx, math.inf) == action
    except RendezvousError:  # closed, or a graceful exit: the handler raises, it writes nothing
        return False
    return False


def apply_action(
    state: _RendezvousState, node: _NodeDesc, action: _Action, settings: RendezvousSettings
) -> None:
    """`action` of `node` applied to `state` by torch's own executor code."""
    executor = _DistributedRendezvousOpExecutor(node, _NO_HOLDER, settings)
    executor._state = state
    # torch names the caller of every event with inspect.stack(), even when events are
    # discarded: a millisecond each, per intent applied
    executor._record = _quiet  # type: ignore[method-assign]
    _APPLY[action](executor)


# torch's join operation takes these only for a node that is not a participant in its view
_ADDS = frozenset(
    {_Action.ADD_TO_PARTICIPANTS, _Action.ADD_TO_WAIT_LIST, _Action.ADD_TO_REDUNDANCY_LIST}
)


def forget(state: _RendezvousState, node: _NodeDesc, settings: RendezvousSettings) -> None:
    """Remove `node` as torch's expiry does (`_sanitize`, with its epilogue)."""
    state.last_heartbeats.pop(node, None)
    state.wait_list.discard(node)
    state.redundancy_list.discard(node)
    if state.participants.pop(node, None) is not None:
        _remove_participant_epilogue(state, settings)


# what torch's join operation does next for a node that the combiner can do for it: the same
# write, made in the combiner's batch instead of the node's next sync (see "Scale")
_FOLLOWED = _ADDS | {_Action.MARK_RENDEZVOUS_COMPLETE}
# ... after a node's exit from a complete round: queueing for the next one, not joining it (the
# exit operation would otherwise find the node in the round it is leaving, and leave it again)
_QUEUED = frozenset({_Action.ADD_TO_WAIT_LIST, _Action.ADD_TO_REDUNDANCY_LIST})


def join_next(
    state: _RendezvousState, node: _NodeDesc, settings: RendezvousSettings
) -> _Action | None:
    """The membership change torch's join operation would make next for `node` on `state`
    (joining, queueing, completing the round); None where it would wait, finish or fail."""
    try:
        action = _RendezvousJoinOp()(_RendezvousContext(node, state, settings), math.inf)
    except RendezvousError:
        return None
    return action if action in _FOLLOWED else None


def follow(
    state: _RendezvousState,
    node: _NodeDesc,
    settings: RendezvousSettings,
    only: frozenset[_Action] = _FOLLOWED,
) -> None:
    """`node`'s join operation run on `state` until it would wait: the changes its handler
    would write on its next syncs, one after the other."""
    for _ in range(len(_FOLLOWED)):  # each step moves the node on: a few at most
        action = join_next(state, node, settings)
        if action is None or action not in only:
            return
        apply_action(state, node, action, settings)


def promote(state: _RendezvousState, settings: RendezvousSettings) -> None:
    """A round that is open again takes the nodes of its wait list, in torch's rank order:
    each waits for exactly this (torch's join operation adds a waiting node to the next round
    on its first sync after it opens), and a thousand of them would otherwise queue a thousand
    changes at once."""
    if state.complete or state.closed or not state.wait_list:
        return
    beat = datetime.now(UTC)  # one heartbeat for all: the delta names the move (`state_diff`)
    for node in sorted(state.wait_list):
        if join_next(state, node, settings) is _Action.ADD_TO_PARTICIPANTS:
            apply_action(state, node, _Action.ADD_TO_PARTICIPANTS, settings)
            state.last_heartbeats[node] = beat


# (node, action[, rejoin[, the round of the state the node decided on]])
Change = (
    tuple[_NodeDesc, _Action]
    | tuple[_NodeDesc, _Action, bool]
    | tuple[_NodeDesc, _Action, bool, int | None]
)


def _moved_on(
    state: _RendezvousState, node: _NodeDesc, action: _Action, seen_round: int | None
) -> bool | None:
    """For a join (`_ADDS`) by a node that `state` has as a participant: True where the node
    is in the round it asked for already (it decided on an older state: it was moved into
    the round since), False where it expired itself in its own view (torch's handler would
    write its removal with the join), None for any other change."""
    if action not in _ADDS or node not in state.participants:
        return None
    seen = state.round if seen_round is None else seen_round
    if seen != state.round:
        return seen < state.round  # behind: moved on; ahead: its own expiry opened a round
    return action is _Action.ADD_TO_PARTICIPANTS  # in the round it asked to join


def replay(
    state: _RendezvousState,
    changes: Sequence[Change],
    settings: RendezvousSettings,
) -> list[bool]:
    """Apply each (node, action[, rejoin[, round seen]]) in order to `state` (changed in place)
    where it is still valid (`action_valid`), after torch's expiry of dead nodes; which ones
    were applied.

    The combiner also makes the writes that these nodes' handlers would make next (their own
    state machines agree on reading the result, and write nothing more):

    - a node in torch's join operation (a join action) goes on as that operation would
      (`follow`): a join refused on a full round queues in the redundancy list, a join made
      after the round's last call completes it;
    - a node that leaves a complete round to join the next one (``rejoin``: torch's
      ``next_rendezvous`` runs the exit operation, then the join) joins its wait list at once;
    - a round that opens again takes its wait list (`promote`).

    A node that asks to join while the state has it as a participant either decided on an
    older state (it was moved into the round meanwhile: nothing to do) or expired itself in
    its own view (its heartbeats were late: torch's handler would write that removal with
    its join, so it is applied first here too, else the node stays in a round it has left);
    the round the node saw tells which (`_moved_on`)."""
    applied = []
    sanitize(state, settings)
    promote(state, settings)
    for node, action, *more in changes:
        rejoin = bool(more) and bool(more[0])
        moved_on = _moved_on(state, node, action, more[1] if len(more) > 1 else None)
        ok = False
        if not moved_on:
            if moved_on is False:
                forget(state, node, settings)
            ok = action in MEMBERSHIP_ACTIONS and action_valid(state, node, action, settings)
            if ok:
                apply_action(state, node, action, settings)
        if action in _FOLLOWED:
            follow(state, node, settings)
        elif rejoin and action is _Action.REMOVE_FROM_PARTICIPANTS:
            follow(state, node, settings, _QUEUED)
        promote(state, settings)
        applied.append(ok)
    return applied


def same_membership(a: _RendezvousState, b: _RendezvousState) -> bool:
    """Equal but for heartbeats (which are leases: writing one changes nothing for a bound
    reader)."""
    return (
        a.round == b.round
        and a.complete == b.complete
        and a.deadline == b.deadline
        and a.closed == b.closed
        and a.participants == b.participants
        and a.wait_list == b.wait_list
        and a.redundancy_list == b.redundancy_list
        and a.last_heartbeats.keys() == b.last_heartbeats.keys()
    )


def action_done(state: _RendezvousState, node: _NodeDesc, action: _Action) -> bool:
    """Whether `state` shows `action` of `node` done (someone else applied a node's intent:
    the handler only logs this answer, its state machine reads the state itself)."""
    if action is _Action.ADD_TO_PARTICIPANTS:
        return node in state.participants
    if action is _Action.REMOVE_FROM_PARTICIPANTS:
        return node not in state.participants
    if action is _Action.ADD_TO_WAIT_LIST:
        return node in state.wait_list
    if action is _Action.REMOVE_FROM_WAIT_LIST:
        return node not in state.wait_list
    if action is _Action.ADD_TO_REDUNDANCY_LIST:
        return node in state.redundancy_list
    if action is _Action.REMOVE_FROM_REDUNDANCY_LIST:
        return node not in state.redundancy_list
    if action is _Action.MARK_RENDEZVOUS_COMPLETE:
        return state.complete
    if action is _Action.MARK_RENDEZVOUS_CLOSED:
        return state.closed
    return False


def node_id(node: _NodeDesc) -> str:
    """A node's name in etcd keys (its address quoted: it may hold ':' or '/')."""
    return f"{quote(node.addr, safe='')}:{node.pid}:{node.local_id}"


def parse_node_key(text: str) -> _NodeKey | None:
    """(addr, pid, local_id) of a node's name in etcd keys (`node_id`); None if it is none."""
    addr, _, rest = text.partition(":")
    pid, _, local_id = rest.partition(":")
    try:
        return unquote(addr), int(pid), int(local_id)
    except ValueError:
        return None


def parse_node_id(text: str) -> _NodeDesc | None:
    key = parse_node_key(text)
    return None if key is None else _NodeDesc(*key)


# -- etcd transactions ----------------------------------------------------------------------


def _b(text: str) -> bytes:
    return text.encode()


def _rng(
    key: str,
    end: bytes = b"",
    *,
    keys_only: bool = False,
    count_only: bool = False,
    min_mod: int = 0,
    max_create: int = 0,
    limit: int = 0,
    oldest_first: bool = False,
    revision: int = 0,
    serializable: bool = False,
) -> pb.RequestOp:
    request = pb.RangeRequest(
        key=_b(key),
        range_end=end,
        keys_only=keys_only,
        count_only=count_only,
        min_mod_revision=min_mod,
        max_create_revision=max_create,
        limit=limit,
        revision=revision,
        serializable=serializable,
    )
    if oldest_first:
        request.sort_target = pb.RangeRequest.CREATE
        request.sort_order = pb.RangeRequest.ASCEND
    return pb.RequestOp(request_range=request)


def _put(key: str, value: str, lease: int = 0) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=_b(key), value=_b(value), lease=lease))


def _delete(key: str) -> pb.RequestOp:
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=_b(key)))


def _nested(
    compare: Sequence[pb.Compare],
    success: Sequence[pb.RequestOp],
    failure: Sequence[pb.RequestOp] = (),
) -> pb.RequestOp:
    return pb.RequestOp(
        request_txn=pb.TxnRequest(compare=compare, success=success, failure=failure)
    )


def _mod_is(key: str, revision: int) -> pb.Compare:
    """True while `key` was last written at `revision` (0: the key does not exist)."""
    return pb.Compare(
        key=_b(key), target=pb.Compare.MOD, result=pb.Compare.EQUAL, mod_revision=revision
    )


def _absent(key: str) -> pb.Compare:
    return pb.Compare(
        key=_b(key), target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=0
    )


def _prefix_end(prefix: str) -> bytes:
    return bytes(etcd_utils.prefix_range_end(_b(prefix)))


def _lease_gone(exc: Exception) -> bool:
    """Whether etcd refused a write because the lease it was put under had expired."""
    return "requested lease not found" in str(exc)


_NO_BACKEND: Any = None  # torch's state holder and executor, used here only for their rules
_NO_HOLDER: Any = None


# -- backend --------------------------------------------------------------------------------

# Intents applied by one combining transaction: etcd refuses more than --max-txn-ops (128)
# compares or operations in one, and each intent takes a compare and a delete.
MAX_BATCH = 100
# The ring of the state's last deltas (see "Scale"): a node that fell further behind than this
# many writes reads the state whole.
DELTA_SLOTS = 64
# Lapsed leases a node looks for by counting (`_find_gone`) before it lists every alive key.
_FIND_GONE_MAX = 4
# Beyond this many alive keys a node that counts a lapsed lease waits a random part of a
# heartbeat interval before it looks for it (`_settle_gone`): every node counts the lapse
# within the same second, and one of them finding it first is enough (see "Scale").
_SPREAD_SEARCH_NODES = 64
# What every backend of a process shares (see "Scale"): one object per node (`_node`), the
# nodes by their names in keys (`_named`), and each alive key as read, its value verified
# ((secret, key, value, lease, create and mod revision) -> (key, entry), see `_see_alive`).
# Each is cleared past `_SHARED_MAX` entries (then rebuilt as read).
_PROCESS_NODES: dict[_NodeKey, _NodeDesc] = {}
_PROCESS_NAMES: dict[str, _NodeDesc] = {}
_ALIVE_ENTRIES: dict[tuple[bytes | None, bytes, bytes, int, int, int], tuple[bytes, Any]] = {}
_SHARED_MAX = 1 << 16


def _bounded(table: dict) -> dict:
    if len(table) > _SHARED_MAX:
        table.clear()
    return table


@dataclasses.dataclass(frozen=True, eq=False)
class _Followed:
    """A delta as one backend of the process applied it: to the state at mod revision `base`
    (one state: the state key's revisions name its writes), making `state` (version
    `version`), changing the heartbeats of `beats`."""

    base: int
    state: _RendezvousState
    version: int
    beats: frozenset[_NodeDesc]


# ... and the states they hold, which are never changed once held: the states read whole
# (secret, state key, value -> state) and the deltas followed ((secret, delta key, value) ->
# `_Followed`: a delta names the revision it applies to), so that of a process's backends only
# the first to read a state or a delta unpickles and applies it (an agent runs one backend; a
# simulator host's hundred each decoding and applying every delta to a state of its own was a
# third of its CPU, and their copies of an O(nodes) state much of what its garbage collector
# walked). States are O(nodes): only the last few are kept, those the backends are following.
_PROCESS_STATES: dict[tuple[bytes | None, str, str], _RendezvousState] = {}
_PROCESS_FOLLOWED: dict[tuple[bytes | None, bytes, bytes], _Followed] = {}
_SHARED_STATES_MAX = 8
_SHARED_STATES_LOCK = threading.Lock()


def _remember(table: dict, key: Any, value: Any) -> None:
    """`table[key] = value`, the oldest entries dropped past `_SHARED_STATES_MAX`."""
    with _SHARED_STATES_LOCK:
        while len(table) >= _SHARED_STATES_MAX:
            del table[next(iter(table))]
        table[key] = value


class _Intent:
    """A pending membership change under ``intent/<node>``: (key, its revision, the node and
    the action, None for a value that does not verify, which is deleted unapplied; whether the
    node leaves to join again, and the round it decided on: see `replay`)."""

    __slots__ = ("action", "key", "node", "rejoin", "revision", "round")

    def __init__(
        self,
        key: str,
        revision: int,
        node: _NodeDesc | None,
        action: _Action | None,
        rejoin: bool = False,
        round_seen: int | None = None,
    ) -> None:
        self.key, self.revision, self.node, self.action = key, revision, node, action
        self.rejoin, self.round = rejoin, round_seen


# An intent's value: the action's name, `_REJOIN` when the node leaves to join again, and
# "@<round>" of the state the node decided on (see `replay`).
_REJOIN = "+join"


def _intent_text(action: _Action, rejoin: bool, round_seen: int | None) -> str:
    seen = "" if round_seen is None else f"@{round_seen}"
    return f"{action.name}{_REJOIN if rejoin else ''}{seen}"


def _parse_intent(text: str) -> tuple[_Action, bool, int | None]:
    """(action, rejoin, round seen) of an intent's text; KeyError/ValueError if it is none."""
    name, at, seen = text.partition("@")
    return _Action[name.removesuffix(_REJOIN)], name.endswith(_REJOIN), int(seen) if at else None


# Changes that one node makes for all (completing or closing the round; see also a waiting
# node's join, `note`): a node that finds the combine lock held waits for it rather than
# queueing one more intent behind it, since every node of a round decides to make them at
# about the same moment.
_SHARED = frozenset({_Action.MARK_RENDEZVOUS_COMPLETE, _Action.MARK_RENDEZVOUS_CLOSED})


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key, fenced by its mod revision; bound to its handler
    (`bind`), heartbeats become leases and membership changes are combined (see "Scale")."""

    # A waiting intent's owner looks again (and may take the combine lock) after about as long
    # as the pending intents take to apply (all of them: etcd's count of a prefix ignores a
    # create-revision filter), growing while nothing moves, jittered: waiters spread out
    # instead of polling etcd in step.
    _POLL_FIRST = 0.02
    # ... and a node waiting on a change made for all looks first after about one combine
    # (a whole round's nodes wait at once: they must not all read the state at once)
    _POLL_SHARED = 0.2
    _POLL_PER_INTENT = 0.0005
    _POLL_CAP = 1.0

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        secret: bytes | None = None,
        job_id: str | None = None,
        first_call: timedelta | None = None,
    ) -> None:
        """`secret`: sign what is written and refuse what does not verify (see "Trust");
        `job_id`: where a refusal is reported for the controller; `first_call`: the first
        round's last call (``first_call_timeout``), where the handler's settings have later
        rounds'."""
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._run_id = run_id
        self._key = state_key(run_id)
        self._secret = secret
        self._job_id = job_id
        # requests, bytes, heartbeats, combines ...: what this node cost etcd (the benchmark)
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        prefix = keys.rendezvous(run_id)
        self._alive_prefix = alive_prefix(run_id)
        self._intent_prefix = f"{prefix}/intent/"
        self._lock_key = f"{prefix}/combiner"
        # bound mode (`bind`): this node, its settings, the action its next write carries
        self._me: _NodeDesc | None = None
        self._settings: RendezvousSettings | None = None
        self._first_call = first_call
        # thread -> (action, rejoin, the round it was decided on, shared: see `note`)
        self._notes: dict[int, tuple[_Action, bool, int | None, bool]] = {}
        # what this node last read: the stored state (-1: never read, 0: absent) ...
        self._m_rev = -1
        self._m_present = False
        self._m_value: str | None = None  # as read whole (None: made from deltas, or absent)
        self._m_state: _RendezvousState | None = None
        self._m_version = 0  # the state key's version (etcd counts its writes): a delta's slot
        # ... the alive keys (key -> (node or None if it does not verify, create revision, mod
        # revision)), and the store revision all of this is as of (the next read asks what
        # changed since)
        self._alive_keys: dict[bytes, tuple[_NodeDesc | None, int, int]] = {}
        # one object per node for everything this node holds (see `_node`)
        self._nodes = _bounded(_PROCESS_NODES)
        self._alive_set: set[_NodeDesc] = set()  # the nodes of those that verify
        self._alive_version = 0
        # the heartbeats of the handler's view (`overlay`), kept up to date by the nodes whose
        # beat or lease changed (None: build again), so that following a delta or a new lease
        # costs O(what changed), not O(nodes), per node
        self._vb: dict[_NodeDesc, datetime] | None = None
        self._vb_dirty: set[_NodeDesc] = set()
        self._seen = 0
        # a read spans the alive keys and the deltas, not the state key (see "Scale")
        self._delta_prefix = delta_prefix(run_id)
        self._span_start = self._key + "."
        self._span_end = _prefix_end(self._delta_prefix)
        self._written = written_key(run_id)
        self._delta_keys: dict[bytes, int] = {}  # delta slot -> mod revision (for the count)
        self._relisted_at = -math.inf
        # lapsed alive keys counted but not yet found, and when this node looks for them
        # itself (`_settle_gone`)
        self._unfound = 0
        self._search_at: float | None = None
        # ... the pending intents (oldest first), and what the state handed out last was made
        # of (stored revision, alive keys' version): unchanged, the holder keeps its own copy
        self._intents: list[_Intent] = []
        self._handed: tuple[int, int] | None = None
        self._lease: Lease | None = None
        self._header_revision = 0
        self._lease_at = 0.0
        self._refresher: threading.Event | None = None  # set: the refresher stops
        self._combining = False  # holding the combine lock: the refresher leaves the lease be
        self._my_heartbeat: datetime | None = None

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    # -- binding ----------------------------------------------------------------------------

    def bind(self, node: _NodeDesc, settings: RendezvousSettings) -> None:
        """Serve the handler of `node` (and only it): from now on heartbeats refresh the node's
        lease and the actions `note`d before a write are combined (see "Scale")."""
        with self._lock:
            self._me, self._settings = self._nodes.setdefault(_key(node), node), settings
            self._my_alive = self._alive_prefix + node_id(node)
            self._my_intent = self._intent_prefix + node_id(node)
            window = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
            # a node is dead once it missed keep_alive_max_attempt heartbeats, as in torch
            self._ttl = max(1, math.ceil(window))
            self._refresh_s = settings.keep_alive_interval.total_seconds()
            self._budget = max(10.0, 3.0 * self._ttl)

    @property
    def bound(self) -> bool:
        return self._me is not None

    def note(
        self,
        action: _Action,
        rejoin: bool = False,
        round_seen: int | None = None,
        waiting: bool = False,
    ) -> None:
        """The action the calling thread's next `set_state` carries (`_NotingExecutor`), as
        decided on a state of round `round_seen`; `rejoin`: a participant leaving its round
        in order to join the next (see `replay`); `waiting`: the node joins from the wait
        list, which whoever opens the round does for it (`promote`), so that like completing
        the round it is one change for all (`_SHARED`)."""
        shared = action in _SHARED or (waiting and action is _Action.ADD_TO_PARTICIPANTS)
        self._notes[threading.get_ident()] = (action, rejoin, round_seen, shared)

    # -- the RendezvousBackend interface ---------------------------------------------------------

    def get_state(self) -> tuple[bytes, Token] | None:
        """Current state and its token (the state key's mod revision), or None if there is none."""
        if self._me is None:
            with self._lock:
                self.stats["get_state"] += 1
                return self._get_plain()
        state, token = self.read()
        return None if state is None else (encode_state(state), token)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if ``token`` is still current (None: only if no state exists); bound,
        as `write`."""
        if self._me is None:
            with self._lock:
                self.stats["set_state"] += 1
                return self._set_plain(state, token)
        new, new_token, applied = self.write(decode_state(state), token)
        return None if new is None else (encode_state(new), new_token, applied)

    # -- bound: the state as objects (`_EtcdStateHolder`) ---------------------------------------

    def read(self, held: _RendezvousState | None = None) -> tuple[_RendezvousState | None, Token]:
        """The state as this node's handler sees it (`overlay`) and its token; `held` itself
        when that is what was handed out last and nothing changed since (torch's holder would
        unpickle and re-check the whole state every second on every node)."""
        with self._lock:
            self.stats["get_state"] += 1
            if not self._unchanged():
                self._read()
            return self._view(held), self._m_rev

    def write(
        self, state: _RendezvousState, token: Token | None
    ) -> tuple[_RendezvousState | None, Token, bool]:
        """Write what the handler's noted action did to ``state``: a heartbeat refreshes the
        node's lease (``state`` itself comes back); a membership change is applied to the
        current state where torch's own operation would still take it there, and the state
        after it comes back (see "Scale"); a write with no action noted is a plain
        compare-and-swap of ``state``. The flag says whether this node's change is in."""
        with self._lock:
            self.stats["set_state"] += 1
            noted = self._notes.pop(threading.get_ident(), None)
            action = noted[0] if noted is not None else None
            try:
                if action is _Action.KEEP_ALIVE:
                    return self._heartbeat(state, token)
                if noted is not None and action in MEMBERSHIP_ACTIONS:
                    return self._change(*noted)
                return self._write_as_is(state, token)
            except BaseException:
                if noted is not None:  # the handler writes again after a failed sync
                    self._notes.setdefault(threading.get_ident(), noted)
                raise

    # -- unbound: one compare-and-swap of the whole state -----------------------------------

    def _get_plain(self) -> tuple[bytes, Token] | None:
        value, revision = self._etcd(self._client.get_with_revision, self._key)
        self.stats["requests"] += 1
        if value is None:
            return None
        self.stats["bytes_in"] += len(value)
        return self._decode(value), revision

    def _set_plain(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            revision = 0
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            revision = token
        else:
            # Not a token we ever handed out: it cannot match, report what is there.
            current = self._get_plain()
            return None if current is None else (*current, False)
        value = self._seal(self._key, state)
        # a node that follows the deltas reads a state written without one whole (`RELOAD`)
        plain = f"{self._delta_prefix}plain"
        reply = self._txn(
            "write",
            [_mod_is(self._key, revision)],
            [
                _put(self._key, value),
                _put(plain, self._seal(plain, RELOAD)),
                _put(self._written, ""),
                _rng(self._key),
            ],
            [_rng(self._key)],
        )
        applied = bool(reply.succeeded)
        self.stats["cas_won" if applied else "cas_lost"] += 1
        kvs = reply.responses[-1].response_range.kvs
        if not kvs:  # lost the race to a delete: no state at all
            return None
        return self._decode(kvs[0].value.decode()), int(kvs[0].mod_revision), applied

    # -- bound: reads ------------------------------------------------------------------------

    def _read_op(self) -> pb.RequestOp:
        """What a read needs, as one range over the alive keys and the deltas (right after the
        state key, which it leaves out): what was written there since the last read; its count
        is the number of keys before that filter, so a lapsed lease shows as one key missing."""
        return _rng(self._span_start, self._span_end, min_mod=self._seen + 1)

    def _unchanged(self) -> bool:
        """Whether nothing this node reads changed since its last read, from two reads that
        cost etcd O(1) and O(log nodes) (`_read` costs it O(nodes): etcd loads every key of
        the span to filter them, and every waiting node reads once a second): no state
        written since (`written_key`), and as many alive keys and deltas as known (a lapsed
        lease, a new node). A lapse and a new node at once cancel out in the count, but a new
        node's join writes the state soon after."""
        if self._m_rev < 0 or not self._seen:
            return False
        # both serializable (answered by the member from what it has applied, no read-index
        # round): at 1,024 nodes on a slower machine etcd's linearizable reads took 3 to 5.8 s,
        # serializable ones at most 0.3 s. A stale answer costs one more read
        # (a full, linearizable `_read`) or notices a change one poll later; a member too far
        # behind to answer fresh cannot keep this node's lease alive either.
        asked = _rng(self._written, keys_only=True, serializable=True).request_range
        written = self._range("written", asked)
        if not written.kvs and self._m_present:
            return False  # written by a writer that does not mark its writes
        if written.kvs and int(written.kvs[0].mod_revision) > self._seen:
            return False
        if self._search_at is not None and time.monotonic() >= self._search_at:
            return False  # time to look for the lapsed leases counted
        request = _rng(
            self._span_start, self._span_end, count_only=True, serializable=True
        ).request_range
        count = int(self._range("count", request).count)
        same = count == len(self._alive_keys) + len(self._delta_keys) - self._unfound
        self.stats["reads_unchanged"] += same
        return same

    def _read(self) -> None:
        # a range, not a transaction: etcd before 3.5.5 crashes when a client gives up on a
        # read-only transaction it is still running (etcd-io/etcd#14110), and overloaded
        # etcds are where clients give up
        request = self._read_op().request_range
        self._absorb(self._range("read", request), self._header_revision)

    def _absorb(self, answer: pb.RangeResponse, revision: int) -> None:
        """Take in a `_read_op` answered as of store `revision`: the alive keys, and the state
        moved along the deltas written since (read whole when they do not lead on from the
        revision held: never read yet, a slot overwritten before it was read, a writer that
        keeps no deltas)."""
        deltas, delta, alive = [], self._delta_prefix.encode(), []
        for kv in answer.kvs:
            key = kv.key
            if key.startswith(delta):
                self._delta_keys[key] = int(kv.mod_revision)
                deltas.append(kv)
            else:
                alive.append((key, kv))
        if alive:
            self._see_alive(alive)
        self._seen = max(self._seen, revision)
        whole = self._m_rev < 0
        for kv in sorted(deltas, key=lambda kv: int(kv.mod_revision)):
            if whole or int(kv.mod_revision) <= self._m_rev:
                continue
            if not self._follow(kv):
                whole = True
        if whole:
            self._read_state()
        self._settle_gone(
            len(self._alive_keys) + len(self._delta_keys) - int(answer.count), revision
        )

    def _settle_gone(self, gone: int, revision: int) -> None:
        """Account for `gone` alive keys (or deltas) that the count at store `revision` misses:
        leases that lapsed (or the rendezvous deleted). The likely nodes are looked up first,
        by their keys alone (`_probe_likely`: one the last write took out of the state, the
        lost node of a re-rendezvous). Beyond `_SPREAD_SEARCH_NODES` a lapse not placed so
        waits a random part of a heartbeat interval for a write that places it before this
        node looks for it itself (`_find_gone`): every node counts a lapse within the same
        second, and 1,023 nodes each making ~10 reads at once held a re-rendezvous up for
        seconds."""
        if gone > 0:
            gone -= self._probe_likely(revision, gone)
        if 0 < gone <= _FIND_GONE_MAX and len(self._alive_keys) > _SPREAD_SEARCH_NODES:
            now = time.monotonic()
            if self._search_at is None:
                self._search_at = now + random.uniform(0.0, self._refresh_s)
                self.stats["gone_deferred"] += 1
            if now < self._search_at:
                self._unfound = gone
                return
        self._unfound, self._search_at = 0, None
        if gone and not (0 < gone <= _FIND_GONE_MAX and self._find_gone(revision, gone)):
            self._relist()  # leases lapsed (or the rendezvous was deleted)

    def _probe_likely(self, revision: int, gone: int) -> int:
        """How many of the lapsed keys are those of the likely nodes, each looked up by its key
        as of store `revision` (they are forgotten): alive nodes the state no longer holds (a
        write took them out; only where there are few: a new node's key precedes its join),
        and beyond `_SPREAD_SEARCH_NODES` the participants of a round that has few (in a
        re-rendezvous, the lost node is the one that never left the old round)."""
        stored = self._stored()
        if stored is None:
            return 0
        alive = self._alive_set
        likely = alive.difference(stored.last_heartbeats)  # C: the set's own hashes
        if len(likely) > _FIND_GONE_MAX:
            likely = set()
        few = len(stored.participants) <= _FIND_GONE_MAX
        if few and len(self._alive_keys) > _SPREAD_SEARCH_NODES:
            likely.update(n for n in stored.participants if n in alive)
        found = 0
        for node in sorted(likely, key=_key):
            key = (self._alive_prefix + node_id(node)).encode()
            if key not in self._alive_keys:
                continue
            request = _rng(key.decode(), count_only=True, revision=revision).request_range
            try:
                if int(self._range("probe", request).count):
                    continue
            except RendezvousConnectionError:
                break  # e.g. that revision was compacted away: searched for later
            self._forget_alive(key)
            found += 1
            if found == gone:
                break
        self.stats["found_probed"] += found
        return found

    def _forget_alive(self, key: bytes) -> None:
        """The alive key `key` lapsed: its node is no longer alive in this node's view."""
        node = self._alive_keys.pop(key)[0]
        if node is not None:
            self._alive_set.discard(node)
            self._vb_dirty.add(node)
        self._alive_version += 1

    def _find_gone(self, revision: int, gone: int) -> bool:
        """Find the `gone` alive keys that lapsed by store `revision` by counting halves of
        the keys known (about gone x log2(nodes) count-only reads of a few bytes, where a
        relist reads every key: every node does this when one lease lapses); False if they
        are not all alive keys (then relist)."""
        known = sorted(self._alive_keys)
        if gone > len(known):
            return False
        todo, found = [(0, len(known), gone)], []
        try:
            while todo:
                lo, hi, missing = todo.pop()
                if missing == hi - lo:
                    found.extend(known[lo:hi])
                    continue
                mid = (lo + hi) // 2
                end = known[mid - 1] + b"\0"
                op = _rng(known[lo].decode(), end, count_only=True, revision=revision)
                left = (mid - lo) - int(self._range("find gone", op.request_range).count)
                for part in ((lo, mid, left), (mid, hi, missing - left)):
                    if part[2] < 0 or part[2] > part[1] - part[0]:
                        return False  # keys this node does not know of: relist
                    if part[2]:
                        todo.append(part)
        except RendezvousConnectionError:
            return False  # e.g. that revision was compacted away: relist
        for key in found:
            self._forget_alive(key)
        self.stats["found_gone"] += len(found)
        return True

    def _follow(self, kv: Any) -> bool:
        """Apply the delta `kv` to the state held; False if it does not lead on from it. A
        delta another backend of the process applied to the same state is not applied again:
        its result is taken (`_PROCESS_FOLLOWED`)."""
        if not self._m_present:
            return False
        shared = (self._secret, kv.key, kv.value)
        done = _PROCESS_FOLLOWED.get(shared)
        if done is None or done.base != self._m_rev:
            held = self._stored()
            assert held is not None
            try:
                delta = decode_delta(self._open(kv.key.decode(), kv.value.decode()), self._nodes)
            except (RendezvousStateError, ValueError, binascii.Error):
                delta = None
            if delta is None or delta[0] != self._m_rev:
                return False
            try:
                state = apply_diff(held, delta[2])
            except (TypeError, ValueError, AttributeError):
                return False
            beats = {*delta[2][10], *delta[2][11]}
            if any(change[0] == _PROMOTED for change in delta[2][12]):
                beats.update(held.wait_list)
            done = _Followed(self._m_rev, state, delta[1], frozenset(beats))
            _remember(_PROCESS_FOLLOWED, shared, done)
        else:
            self.stats["deltas_shared"] += 1
        self._m_value, self._m_state = None, done.state
        self._m_rev, self._m_version = int(kv.mod_revision), done.version
        self._vb_dirty.update(done.beats)
        self.stats["deltas"] += 1
        return True

    def _read_state(self) -> None:
        """The state key, whole."""
        self.stats["state_reads"] += 1
        answer = self._range("state", _rng(self._key).request_range)
        kv = answer.kvs[0] if answer.kvs else None
        if kv is None:
            self._set_stored(None, 0)
        else:
            self._set_stored(kv.value.decode(), int(kv.mod_revision), int(kv.version))

    def _relist(self) -> None:
        """List the state, the alive keys and the deltas again, at most once a heartbeat
        interval (every node does it when one lease lapses; a death is noticed that much later
        at worst). Keys only: an alive key already verified at the same revision is not read or
        checked again, so a relist costs etcd and this node O(nodes) small keys, not O(nodes)
        signatures."""
        now = time.monotonic()
        if now - self._relisted_at < self._refresh_s:
            return
        self._relisted_at = now
        self.stats["relists"] += 1
        request = _rng(self._key, self._span_end, keys_only=True).request_range
        answer = self._range("relist", request)
        old, alive, deltas = self._alive_keys, {}, {}
        stale, state_rev = [], 0
        for kv in answer.kvs:
            if kv.key == self._key.encode():
                state_rev = int(kv.mod_revision)
            elif kv.key.startswith(self._delta_prefix.encode()):
                deltas[kv.key] = int(kv.mod_revision)
            elif (known := old.get(kv.key)) is not None and known[2] == int(kv.mod_revision):
                alive[kv.key] = known
            else:
                stale.append(int(kv.mod_revision))
        self._alive_keys, self._delta_keys = alive, deltas
        self._alive_set = {node for node, _, _ in alive.values() if node is not None}
        self._vb = None
        if stale:
            # the values of the alive keys that changed: written at or after the oldest of them
            end = _prefix_end(self._alive_prefix)
            request = _rng(self._alive_prefix, end, min_mod=min(stale)).request_range
            self._see_alive([(kv.key, kv) for kv in self._range("relist", request).kvs])
        if state_rev != max(self._m_rev, 0):
            self._read_state()
        if set(alive) != set(old) or stale:
            self._alive_version += 1
        self._seen = self._header_revision

    def _set_stored(self, value: str | None, revision: int, version: int = 0) -> None:
        """The state as read (or written) whole: `value` at `revision` (None, 0: absent)."""
        if revision != self._m_rev or value != self._m_value or not self._m_present:
            self._m_value, self._m_rev, self._m_state = value, revision, None
            self._vb = None
        self._m_present = value is not None
        self._m_version = version if value is not None else 0

    def _stored(self) -> _RendezvousState | None:
        """The stored state, verified and unpickled with torch's classes only (once a revision)."""
        if not self._m_present:
            return None
        if self._m_state is None:
            assert self._m_value is not None
            shared = (self._secret, self._key, self._m_value)
            state = _PROCESS_STATES.get(shared)
            if state is None:
                state = decode_state(self._decode(self._m_value))
                intern_state(state, self._nodes)
                _remember(_PROCESS_STATES, shared, state)
            self._m_state = state
        return self._m_state

    def _see_alive(self, kvs: list[tuple[bytes, Any]]) -> None:
        """Take in alive keys as read ((key, kv) each): the node of each, if its value
        verifies. Each key's entry is made once per process (`_ALIVE_ENTRIES`): every node reads
        every other node's key, and the simulator's hosts read each a hundred times."""
        known, entries = self._alive_keys, _ALIVE_ENTRIES
        came, went = set(), set()
        for key, kv in kvs:
            # all that the entry is made of, so that it is the same for whoever reads the key
            seen = (self._secret, key, kv.value, kv.lease, kv.create_revision, kv.mod_revision)
            shared = entries.get(seen)
            if shared is None:
                shared = self._alive_entry(key, kv)
                _bounded(entries)[seen] = shared
            key, entry = shared
            old = known.get(key)
            if old == entry:
                continue
            known[key] = entry
            self._alive_version += 1
            if old is not None and old[0] is not None:
                went.add(old[0])
            if entry[0] is not None:
                came.add(entry[0])
        if came or went:
            # set operations on sets reuse the hashes they hold: a node descriptor's own hash
            # is Python code (see `_overlaid`)
            self._alive_set -= went - came
            self._alive_set |= came
            self._vb_dirty |= came
            self._vb_dirty |= went

    def _alive_entry(self, key: bytes, kv: Any) -> tuple[bytes, tuple[_NodeDesc | None, int, int]]:
        """(key, (its node, or None if its value does not verify; create and mod revision))."""
        text = key.decode()
        node = self._named(text[len(self._alive_prefix) :])
        if node is not None and not self._verified_alive(text, kv.value, int(kv.lease)):
            node = None
        return key, (node, int(kv.create_revision), int(kv.mod_revision))

    def _verified_alive(self, key: str, value: bytes, lease: int) -> bool:
        """Whether an alive key's value is the lease it was put under, signed with the key
        (once per process and value: `_see_alive`)."""
        try:
            return int(self._open(key, value.decode()), 16) == lease
        except (RendezvousStateError, ValueError, binascii.Error):
            return False

    def _named(self, text: str) -> _NodeDesc | None:
        """The node named `text` in a key (`node_id`), one object per node and process: every
        node reads every other node's alive key, and parsing the name, building torch's
        dataclass and verifying the value for each was a third of a simulator host's
        rendezvous at 1,024 nodes (each host runs a hundred nodes; an agent runs one)."""
        node = _PROCESS_NAMES.get(text)
        if node is None:
            key = parse_node_key(text)
            if key is None:
                return None
            node = _bounded(_PROCESS_NAMES).setdefault(text, _node(self._nodes, key))
        return node

    def _alive_nodes(self) -> set[_NodeDesc]:
        return self._alive_set

    def _view(self, held: _RendezvousState | None = None) -> _RendezvousState | None:
        """The state as this node's handler sees it (`overlay`): `held` when nothing changed
        since it was handed out, else a fresh one."""
        stored = self._stored()
        if stored is None:
            return None
        made_of = (self._m_rev, self._alive_version)
        if held is not None and made_of == self._handed:
            # this node's own heartbeat is its lease's last refresh, whoever refreshed it
            me, beat = self._me, self._my_heartbeat
            if me is not None and beat is not None and me in held.last_heartbeats:
                held.last_heartbeats[me] = beat
            return held
        self._handed = made_of
        return self._overlaid(stored)

    def _overlaid(self, stored: _RendezvousState) -> _RendezvousState:
        """`overlay(stored, alive nodes, this node, its heartbeat)`, from the view's heartbeats
        kept up to date (`_vb`)."""
        beats, alive, me = stored.last_heartbeats, self._alive_set, self._me
        # set operations between sets and with dicts use the hashes stored in the set: a node
        # descriptor's own hash and equality are Python code, called per node otherwise
        if self._vb is None:
            self._vb = dict(beats)
            changed = alive - alive.difference(beats)
        else:
            left = self._vb_dirty.difference(beats)
            changed = self._vb_dirty - left
            for n in left:
                self._vb.pop(n, None)
        live = changed & alive
        live.discard(me)
        self._vb.update(dict.fromkeys(live, ALIVE))
        for n in changed - live:  # nodes whose lease lapsed, and this node
            self._vb[n] = beats[n]
        self._vb_dirty.clear()
        view = copy_state(stored)
        view.last_heartbeats = dict(self._vb)
        if me is not None and me in view.last_heartbeats and self._my_heartbeat is not None:
            view.last_heartbeats[me] = self._my_heartbeat
        return view

    # -- bound: heartbeats -------------------------------------------------------------------

    def _heartbeat(
        self, state: _RendezvousState, token: Token | None
    ) -> tuple[_RendezvousState | None, Token, bool]:
        self.stats["heartbeats"] += 1
        self._keep_lease(force=True)
        if token == self._m_rev and self._m_present:
            return state, token, True  # nothing newer known: the handler's own state stands
        return self._view(), self._m_rev, True

    def _keep_lease(self, force: bool = False) -> None:
        """This node's lease (and its alive key): refreshed when `force`d or due, granted again
        if it lapsed."""
        self._start_refresher()  # (again, after `close`: the node is in use again)
        now = time.monotonic()
        if self._lease is not None and not force and now - self._lease_at < self._refresh_s:
            return
        if self._lease is not None:
            self.stats["requests"] += 1
            self.stats["lease_refreshes"] += 1
            if self._refresh(self._lease) <= 0:  # dead to the others meanwhile; alive from now
                self.stats["lease_lapsed"] += 1
                self._lease = None
        if self._lease is None:
            self._lease = self._grant()
        self._refreshed(now)

    def _refreshed(self, now: float) -> None:
        """The lease was refreshed (or granted) at monotonic `now`, by the handler or the
        refresher: this node's own heartbeat, and the longest gap between two refreshes."""
        if self._lease_at:
            gap_ms = int(1000 * (now - self._lease_at))
            self.stats["lease_gap_max_ms"] = max(self.stats["lease_gap_max_ms"], gap_ms)
        self._lease_at = now
        self._my_heartbeat = datetime.now(UTC)

    def _start_refresher(self) -> None:
        """Keep the lease alive from a thread of its own as well: the handler refreshes it
        from its loop (a heartbeat, a wait for a change), and a loop that stalls (a slow etcd
        call, a starved process) must not let the node be taken for dead, which re-forms the
        whole job. Not while the node holds the combine lock (under the same lease): a
        combiner that hangs must let the lock go. Nothing here takes the backend's lock; a
        lease that lapsed is left to the handler's next refresh, which grants a new one."""
        if self._refresher is not None:
            return
        stop = self._refresher = threading.Event()

        def run() -> None:
            while not stop.wait(self._refresh_s / 2):
                lease = self._lease
                if lease is None or self._combining:
                    continue
                if time.monotonic() - self._lease_at < self._refresh_s:
                    continue
                self.stats["requests"] += 1
                try:
                    self._client.refresh_lease(lease.id)
                except EtcdError:  # gone (LeaseExpired) or etcd away: the handler's turn
                    continue
                if lease is self._lease:
                    self._refreshed(time.monotonic())
                    self.stats["lease_refreshes_timer"] += 1

        threading.Thread(target=run, name="rdzv-lease", daemon=True).start()

    def close(self) -> None:
        """Stop refreshing the lease (it lapses unless the handler refreshes it again, which
        starts the refresher again)."""
        if self._refresher is not None:
            self._refresher.set()
            self._refresher = None

    def _grant(self) -> Lease:
        """A new lease and this node's alive key under it (a second time if the lease lapsed
        before the key reached etcd: a node starved that long is behind in everything)."""
        for attempt in (1, 2):
            self.stats["requests"] += 2
            self.stats["lease_grants"] += 1
            lease = self._etcd(self._client.lease, self._ttl)
            value = self._seal(self._my_alive, b"%x" % lease.id)
            try:
                self._etcd(self._client.put, self._my_alive, value, lease)
                return lease
            except RendezvousConnectionError as exc:
                if attempt == 2 or not _lease_gone(exc):
                    raise
        raise AssertionError("unreachable")

    def _refresh(self, lease: Lease) -> int:
        """The lease's TTL after a refresh, 0 if it expired."""
        try:
            return int(self._client.refresh_lease(lease.id))
        except LeaseExpired:
            return 0
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd at {self._client.endpoint} has failed: {exc}"
            ) from exc

    def _leased_txn(
        self,
        what: str,
        build: Callable[[], tuple[list[pb.Compare], list[pb.RequestOp], list[pb.RequestOp]]],
    ) -> pb.TxnResponse:
        """A transaction that puts keys under this node's lease, again under a new lease if
        the lease lapsed before it reached etcd (which refuses the whole transaction then)."""
        try:
            return self._txn(what, *build())
        except RendezvousConnectionError as exc:
            if not _lease_gone(exc):
                raise
        self.stats["lease_lapsed"] += 1
        self._lease = None
        self._keep_lease()
        return self._txn(what, *build())

    # -- bound: membership changes -------------------------------------------------------------

    def _intents_op(self) -> pb.RequestOp:
        end = _prefix_end(self._intent_prefix)
        return _rng(self._intent_prefix, end, limit=MAX_BATCH, oldest_first=True)

    def _take_intents(self, response: pb.ResponseOp) -> None:
        intents = []
        for kv in response.response_range.kvs:
            key = kv.key.decode()
            node = self._named(key[len(self._intent_prefix) :])
            action, rejoin, seen = None, False, None
            try:
                action, rejoin, seen = _parse_intent(self._open(key, kv.value.decode()).decode())
            except (RendezvousStateError, ValueError, KeyError, binascii.Error):
                node = None
            intents.append(_Intent(key, int(kv.mod_revision), node, action, rejoin, seen))
        self._intents = intents

    def _lock_ops(self) -> list[pb.RequestOp]:
        """Taking the combine lock: the lock itself, then what combining reads."""
        assert self._lease is not None and self._me is not None
        return [
            _put(self._lock_key, node_id(self._me), self._lease.id),
            self._read_op(),
            self._intents_op(),
        ]

    def _lock_is_mine(self, response: pb.ResponseOp) -> bool:
        # a retried transaction may have taken the lock on its first, unanswered attempt
        kvs = response.response_range.kvs
        return bool(kvs) and self._me is not None and kvs[0].value.decode() == node_id(self._me)

    def _change(
        self,
        action: _Action,
        rejoin: bool = False,
        round_seen: int | None = None,
        shared: bool = False,
    ) -> tuple[_RendezvousState | None, Token, bool]:
        """Apply this node's membership `action`: as the combiner (holding the lock), or by
        leaving an intent that the combiner applies; returns the state after it. A change one
        node makes for all (`shared`: completing or closing the round, a waiting node joining
        the round that opened) leaves no intent: its node waits for the lock, or for the state
        to show that the change is no longer due (someone made it)."""
        assert self._me is not None and self._settings is not None
        self.stats["changes"] += 1
        self._keep_lease()
        assert self._lease is not None
        deadline = time.monotonic() + self._budget
        queue = not shared
        name = _intent_text(action, rejoin, round_seen).encode()
        count_intents = _rng(self._intent_prefix, _prefix_end(self._intent_prefix), count_only=True)

        # take the lock, or leave the intent for whoever holds it: one round trip either way
        def first() -> tuple[list[pb.Compare], list[pb.RequestOp], list[pb.RequestOp]]:
            assert self._lease is not None
            if queue:
                last = _put(self._my_intent, self._seal(self._my_intent, name), self._lease.id)
            else:
                last = self._read_op()
            return (
                [_absent(self._lock_key)],
                self._lock_ops(),
                [_rng(self._lock_key), count_intents, last],
            )

        reply = self._leased_txn("change", first)
        direct: _Action | None = action
        intent = 0  # the revision of this node's pending intent (0: none)
        holding = reply.succeeded
        ahead = 0
        if holding:
            self._absorb(reply.responses[1].response_range, reply.header.revision)
            self._take_intents(reply.responses[2])
        else:
            ahead = int(reply.responses[1].response_range.count)
            if queue:
                self.stats["intents"] += 1
                direct, intent = None, int(reply.header.revision)
                ahead = max(0, ahead - 1)
            else:
                self.stats["shared_waits"] += 1
                self._absorb(reply.responses[2].response_range, reply.header.revision)
            if self._lock_is_mine(reply.responses[0]):
                holding = True
                self._reread_for_combining()
            elif not queue and not self._due(action):
                return self._result(action)
        stalled = 0
        while True:
            if holding:
                # the lock lives with this node's lease, which only the combining itself keeps
                # alive meanwhile: a combiner that hangs lets the lock go after one lease
                self._combining = True
                try:
                    result = self._combine(direct, (rejoin, round_seen), action, intent, deadline)
                except BaseException:
                    self._unlock_quietly()  # the others would wait out this node's lease
                    raise
                finally:
                    self._combining = False
                if result is not None:
                    return result
                holding = False  # the time is up: withdraw below
            if time.monotonic() > deadline:
                return self._withdraw(action, intent) if queue else self._result(action)
            first_wait = self._POLL_FIRST if queue else self._POLL_SHARED
            wait = (first_wait + ahead * self._POLL_PER_INTENT) * 1.5 ** min(stalled, 8)
            time.sleep(min(self._POLL_CAP, wait) * random.uniform(0.75, 1.25))
            self._keep_lease()  # still alive while waiting: the intent lives with the lease
            self.stats["polls"] += 1

            def poll() -> tuple[list[pb.Compare], list[pb.RequestOp], list[pb.RequestOp]]:
                end = _prefix_end(self._intent_prefix)
                lock = _nested([_absent(self._lock_key)], self._lock_ops(), [_rng(self._lock_key)])
                if not queue:  # no intent to wait on: the lock, and what is ahead
                    return [], [lock, count_intents], []
                return (
                    [_mod_is(self._my_intent, intent)],
                    [lock, _rng(self._intent_prefix, end, count_only=True)],
                    [self._read_op()],
                )

            reply = self._leased_txn("poll", poll)
            if not reply.succeeded:  # the intent is gone: applied or refused by a combiner
                self._absorb(reply.responses[0].response_range, reply.header.revision)
                return self._result(action)
            now_ahead = int(reply.responses[1].response_range.count)
            stalled = stalled + 1 if now_ahead >= ahead else 0
            ahead = now_ahead
            inner = reply.responses[0].response_txn
            if inner.succeeded:
                holding = True
                self._absorb(inner.responses[1].response_range, reply.header.revision)
                self._take_intents(inner.responses[2])
            elif self._lock_is_mine(inner.responses[0]):
                holding = True
                self._reread_for_combining()
            elif not queue:
                if not self._unchanged():
                    self._read()
                if not self._due(action):
                    return self._result(action)

    def _due(self, action: _Action) -> bool:
        """Whether this node's handler would still take `action` on the state last read (as
        its view: the nodes whose lease lapsed taken out)."""
        stored = self._stored()
        if stored is None or self._me is None or self._settings is None:
            return False
        view = self._overlaid(stored)
        sanitize(view, self._settings)
        return action_valid(view, self._me, action, self._settings)

    def _reread_for_combining(self) -> None:
        self._read()
        answer = self._range("intents", self._intents_op().request_range)
        self._take_intents(pb.ResponseOp(response_range=answer))

    def _result(self, action: _Action) -> tuple[_RendezvousState | None, Token, bool]:
        stored = self._stored()
        done = stored is not None and self._me is not None and action_done(stored, self._me, action)
        return self._view(), self._m_rev, done

    def _combine(
        self,
        direct: _Action | None,
        how: tuple[bool, int | None],
        action: _Action,
        intent: int,
        deadline: float,
    ) -> tuple[_RendezvousState | None, Token, bool] | None:
        """Holding the lock: apply this node's `direct` action, then the pending intents, to the
        current state, batch after batch, until this node's own change is in; then release
        the lock in that same write and return the state (`how`: the direct change's rejoin
        flag and round seen, see `replay`). None when the time is up. A batch that changes
        nothing but heartbeats (every change refused: made by someone already) writes no
        state, it only takes the intents away."""
        assert self._me is not None and self._settings is not None
        while True:
            self._keep_lease()  # each batch is progress: the lease (and the lock) live on
            batch = self._intents[:MAX_BATCH]
            changes: list[Change] = []
            mine: int | None = None
            if direct is not None:
                mine = 0
                changes.append((self._me, direct, *how))
            for it in batch:
                own = it.key == self._my_intent and it.revision == intent
                if it.node is None or it.action is None:  # did not verify: deleted unapplied
                    mine = -1 if own else mine
                    continue
                if own:
                    mine = len(changes)
                changes.append((it.node, it.action, it.rejoin, it.round))
            if mine is None and len(self._intents) < MAX_BATCH:
                # this node's intent is not pending any more (its lease lapsed meanwhile)
                self._unlock()
                return self._result(action)
            stored = self._stored()
            base = max(self._m_rev, 0)
            view = overlay(
                stored or _RendezvousState(), self._alive_nodes(), self._me, self._my_heartbeat
            )
            deadline_before = view.deadline
            applied = replay(view, changes, self._settings)
            self._first_call_deadline(view, deadline_before)
            written = persisted(view, stored)
            if stored is not None and same_membership(stored, written):
                value, writes, after = "", [], None
            else:
                value, writes, after = self._writes(written, stored, base)
            done = mine is not None
            late = time.monotonic() > deadline
            # what changed since the last read, then the write (the read is as of the revision
            # before it)
            success = [self._read_op(), *writes]
            success += [_delete(it.key) for it in batch]
            if done or late:
                success.append(_delete(self._lock_key))
            success.append(self._intents_op())
            # each intent compared: one withdrawn meanwhile (or gone with its owner's lease) must
            # not be applied behind its owner's back
            reply = self._txn(
                "combine",
                [_mod_is(self._key, base), *(_mod_is(it.key, it.revision) for it in batch)],
                success,
                [self._read_op(), self._intents_op()],
            )
            if reply.succeeded:
                self.stats["combines" if after else "combines_unwritten"] += 1
                self.stats["combined"] += len(changes)
                self._absorb(reply.responses[0].response_range, reply.header.revision)
                if after is not None:
                    self._wrote(value, written, after, int(reply.header.revision))
                self._take_intents(reply.responses[-1])
                if done:
                    # the handler's view: the state just written, as replayed (leases ALIVE)
                    beats = view.last_heartbeats
                    if self._me in beats and self._my_heartbeat is not None:
                        beats[self._me] = self._my_heartbeat
                    self._handed = (self._m_rev, self._alive_version)
                    return view, self._m_rev, mine is not None and mine >= 0 and applied[mine]
                if late:
                    return None
                continue
            # an intent went (withdrawn, or with its owner's lease), or someone wrote around the
            # lock (its holder's lease lapsed): read, and again
            self.stats["combine_lost"] += 1
            self._absorb(reply.responses[0].response_range, reply.header.revision)
            self._take_intents(reply.responses[1])
            if late:
                self._unlock()
                return None

    def _first_call_deadline(self, state: _RendezvousState, before: datetime | None) -> None:
        """A first round (round 0, a launch) whose deadline the replay just set (torch's
        executor sets it, to now + last_call, when the round's min_nodes-th node joins) gets
        the first call instead, where one is set (``first_call_timeout``). Decided on the
        state after the replay: a replay that opens round 1 (a node lost) sets round 1's."""
        if self._first_call is None or self._settings is None:
            return
        if state.round != 0 or state.complete or state.deadline in (None, before):
            return
        state.deadline += self._first_call - self._settings.timeout.last_call

    def _unlock_quietly(self) -> None:
        try:
            self._unlock()
        except RendezvousError:
            pass

    def _unlock(self) -> None:
        assert self._me is not None
        mine = pb.Compare(
            key=_b(self._lock_key),
            target=pb.Compare.VALUE,
            result=pb.Compare.EQUAL,
            value=_b(node_id(self._me)),
        )
        self._txn("unlock", [mine], [_delete(self._lock_key)])

    def _withdraw(
        self, action: _Action, intent: int
    ) -> tuple[_RendezvousState | None, Token, bool]:
        """Out of time: take this node's intent back unless a combiner took it first; the
        handler then runs its state machine again on the state returned."""
        self.stats["withdrawn"] += 1
        reply = self._txn(
            "withdraw",
            [_mod_is(self._my_intent, intent)],
            [_delete(self._my_intent), self._read_op()],
            [self._read_op()],
        )
        self._absorb(reply.responses[-1].response_range, reply.header.revision)
        state, token, done = self._result(action)
        return state, token, done and not (reply.succeeded and intent)

    def _write_as_is(
        self, state: _RendezvousState, token: Token | None
    ) -> tuple[_RendezvousState | None, Token, bool]:
        """A write that no action was noted for (not expected from `_NotingExecutor`): the
        handler's state, as a plain compare-and-swap."""
        self.stats["writes_as_is"] += 1
        stored = self._stored()
        written = persisted(state, stored)
        # None or 0: no state yet (mod revision 0); anything else not handed out cannot match
        base = 0 if token is None else token if isinstance(token, int) and token >= 0 else -1
        value, writes, after = self._writes(written, stored, base)
        reply = self._txn(
            "write", [_mod_is(self._key, base)], [self._read_op(), *writes], [self._read_op()]
        )
        self._absorb(reply.responses[0].response_range, reply.header.revision)
        if reply.succeeded:
            self._wrote(value, written, after, int(reply.header.revision))
            self._handed = (self._m_rev, self._alive_version)
            return state, self._m_rev, True
        return self._view(), self._m_rev, False

    def _writes(
        self, written: _RendezvousState, stored: _RendezvousState | None, base: int
    ) -> tuple[str, list[pb.RequestOp], tuple[int, bytes]]:
        """Writing `written` over `stored` (at mod revision `base`): the state whole, for
        torch's format and whoever reads it whole, and its delta in the ring of
        `DELTA_SLOTS` for the nodes that hold `stored`; (the value, the puts, (the state's
        version after, the delta's key))."""
        value = self._seal(self._key, encode_state(written))
        version = self._m_version + 1 if self._m_present else 1
        slot = f"{self._delta_prefix}{version % DELTA_SLOTS:02d}"
        diff = state_diff(stored or _RendezvousState(), written)
        delta = self._seal(slot, encode_delta(base, version, diff))
        puts = [_put(self._key, value), _put(slot, delta), _put(self._written, str(version))]
        return value, puts, (version, slot.encode())

    def _wrote(
        self, value: str, written: _RendezvousState, after: tuple[int, bytes], revision: int
    ) -> None:
        """Hold what `_writes` wrote at `revision` as the state read."""
        self._set_stored(value, revision, after[0])
        intern_state(written, self._nodes)
        self._m_state = written
        self._vb = None
        self._delta_keys[after[1]] = revision

    # -- etcd, signing ---------------------------------------------------------------------------

    def _txn(
        self,
        what: str,
        compare: Sequence[pb.Compare],
        success: Sequence[pb.RequestOp],
        failure: Sequence[pb.RequestOp] = (),
    ) -> pb.TxnResponse:
        """One etcd transaction, under the client's retry policy (edge/etcd_client.py offers
        no keys-only, count-only or nested reads; this is the one place that goes below it)."""
        request = pb.TxnRequest(compare=compare, success=success, failure=failure)
        return self._rpc("Txn", what, request)

    def _range(self, what: str, request: pb.RangeRequest) -> pb.RangeResponse:
        """One etcd range read under the client's retry policy; `_header_revision` is the store
        revision it was answered at."""
        answer = self._rpc("Range", what, request)
        self._header_revision = int(answer.header.revision)
        return answer

    def _rpc(self, method: str, what: str, request: Any) -> Any:
        """`request` to etcd's KV service `method`, retried as the client retries, counted."""
        client = self._client

        def call() -> Any:
            raw = client._client  # pyetcd; the client's sign-in keeps its token in `metadata`
            return getattr(raw.kvstub, method)(
                request, client.timeout, credentials=raw.call_credentials, metadata=raw.metadata
            )

        reply = self._etcd(client._call, f"rendezvous {what}", call)
        self.stats["requests"] += 1
        self.stats["bytes_out"] += request.ByteSize()
        self.stats["bytes_in"] += reply.ByteSize()
        return reply

    def _seal(self, key: str, data: bytes) -> str:
        return _b64(data) if self._secret is None else sign_state(self._secret, key, data)

    def _open(self, key: str, value: str) -> bytes:
        return verify_state(self._secret, key, value)

    def _etcd(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd at {self._client.endpoint} has failed: {exc}"
            ) from exc

    def _decode(self, value: str) -> bytes:
        try:
            return verify_state(self._secret, self._key, value)
        except StateRefused as exc:
            self._report(str(exc))
            raise
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError(
                f"The rendezvous state at {self._key} is corrupt (not base64)."
            ) from exc

    def _report(self, reason: str) -> None:
        """Tell the controller (keys.alert), best effort: the refusal itself is what protects."""
        if self._job_id is None:
            return
        host, pid = socket.gethostname(), os.getpid()
        alert = RendezvousRefused(
            run_id=self._run_id, key=self._key, reason=reason[:400], host=host, pid=pid
        )
        try:
            self._client.put(keys.alert(self._job_id, host, pid), alert.model_dump_json())
        except EtcdError:
            pass


# -- c10d store -----------------------------------------------------------------------------


class EtcdStore(Store):
    """A c10d ``Store`` whose keys live in etcd under ``prefix`` (values base64 encoded)."""

    _POLL_MIN = 0.01

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta | None = None,
        poll_max: float = 0.2,
    ) -> None:
        """`poll_max`: the longest pause between two reads of a blocking wait."""
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._poll_max = poll_max
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _k(self, key: str | bytes) -> str:
        return self._prefix + (key.decode() if isinstance(key, bytes) else key)

    def _etcd(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except EtcdError as exc:
            # c10d raises DistStoreError (a RuntimeError) for store failures; callers such as
            # torch's elastic agent catch RuntimeError.
            raise dist.DistStoreError(f"etcd store at {self._client.endpoint}: {exc}") from exc

    # Plain operations ------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._etcd(self._client.put, self._k(key), _b64(value))

    def get(self, key: str) -> bytes:
        """Value of ``key``, waiting up to the store timeout for it to be set."""
        return self.multi_get([key])[0]

    def check(self, keys: Sequence[str]) -> bool:
        """True if every key exists now (no waiting)."""
        return all(v is not None for v in self._get_many([self._k(k) for k in keys]))

    def _get_many(self, keys: Sequence[str]) -> list[str | None]:
        # Range reads, not a transaction: etcd takes at most --max-txn-ops (128) reads in one
        # (torchrun's rank 0 reads every agent's role at once: 1,024 keys at 1,024), and before
        # 3.5.5 it crashes when a client gives up on a read-only one (etcd-io/etcd#14110). The
        # keys of one call share a prefix (torchrun's role_info/0..N-1): one range reads them.
        if len(keys) == 1:
            return [self._etcd(self._client.get, keys[0])]
        common = os.path.commonprefix(list(keys))
        if not common.startswith(self._prefix):  # not expected; read them one by one
            return [self._etcd(self._client.get, key) for key in keys]
        found = dict(self._etcd(self._client.get_prefix, common))
        return [found.get(key) for key in keys]

    def num_keys(self) -> int:
        return int(self._etcd(self._client.count_prefix, self._prefix))

    def delete_key(self, key: str) -> bool:
        return bool(self._etcd(self._client.delete, self._k(key)))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set: keys and values differ in length")
        items = [(self._k(k), _b64(v)) for k, v in zip(keys, values, strict=True)]
        self._etcd(self._client.put_many, items)

    # Atomic read-modify-write (CAS on the key's mod revision) ----------------------------

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (absent = 0)."""
        full = self._k(key)
        value, revision = self._etcd(self._client.get_with_revision, full)
        while True:
            current = int(_unb64(value).decode()) if value is not None else 0
            result = current + int(amount)
            applied, value, revision = self._etcd(
                self._client.try_put_at_revision, full, _b64(str(result)), revision
            )
            if applied:
                return result
            time.sleep(random.uniform(0, 0.01))  # contended: spread the retries

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """c10d compare_set: set ``desired`` if the value is ``expected`` (``""``: absent);
        return the value now stored (``expected`` if the key is absent and expected non-empty)."""
        full = self._k(key)
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        value, revision = self._etcd(self._client.get_with_revision, full)
        while True:
            current = _unb64(value) if value is not None else None
            if (current is None and want == b"") or (current is not None and current == want):
                applied, value, revision = self._etcd(
                    self._client.try_put_at_revision, full, _b64(new), revision
                )
                if applied:
                    return new
                continue
            return current if current is not None else want

    def append(self, key: str, value: bytes | str) -> None:
        full = self._k(key)
        extra = value.encode() if isinstance(value, str) else bytes(value)
        current, revision = self._etcd(self._client.get_with_revision, full)
        while True:
            base = _unb64(current) if current is not None else b""
            applied, current, revision = self._etcd(
                self._client.try_put_at_revision, full, _b64(base + extra), revision
            )
            if applied:
                return

    # Blocking reads ----------------------------------------------------------------------

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Wait until every key exists (``timeout`` defaults to the store timeout)."""
        self._wait_values(keys, timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys``, waiting up to the store timeout for all of them."""
        return [_unb64(v) for v in self._wait_values(keys, None)]

    def _wait_values(self, keys: Sequence[str], timeout: timedelta | None) -> list[str]:
        budget = (timeout if timeout is not None else self.timeout).total_seconds()
        # c10d's kNoTimeout (0) means wait forever.
        deadline = time.monotonic() + budget if budget > 0 else float("inf")
        full = [self._k(k) for k in keys]
        delay = self._POLL_MIN
        while True:
            values = self._get_many(full)
            if all(v is not None for v in values):
                return [v for v in values if v is not None]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise dist.DistStoreError(
                    f"etcd store: timed out after {budget:.1f}s waiting for keys {missing} "
                    f"under {self._prefix}"
                )
            time.sleep(min(delay * random.uniform(0.75, 1.25), remaining))
            delay = min(delay * 2, self._poll_max)


# -- handler --------------------------------------------------------------------------------


def _events_discarded() -> bool:
    """torch records a rendezvous event per action and sync, and names its caller with
    inspect.stack() (about a millisecond) before looking whether anyone listens; nobody does
    unless a 'dynamic_rendezvous' logging handler was configured."""
    return isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler)


class _NotingExecutor(_DistributedRendezvousOpExecutor):
    """torch's executor, telling the backend which action its next write carries (see "Scale");
    an action's inner steps (a join's keep-alive, a join that completes the round) are part of
    it, not actions of their own."""

    def __init__(
        self,
        node: _NodeDesc,
        state_holder: Any,
        settings: RendezvousSettings,
        backend: EtcdRendezvousBackend,
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._backend = backend
        self._local = threading.local()

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        if not _events_discarded():
            super()._record(message, node_state)

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        # torch runs the exit operation only in next_rendezvous, right before the join: a
        # participant leaving there is leaving to join again (see `replay`)
        self._local.exiting = isinstance(state_handler, _RendezvousExitOp)
        try:
            super().run(state_handler, deadline, update_deadline)
        finally:
            self._local.exiting = False

    def _act(
        self, action: _Action, step: Callable[[_DistributedRendezvousOpExecutor], None]
    ) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            # as decided: before `step` applies the action to the handler's own state
            exiting = getattr(self._local, "exiting", False)
            seen = getattr(self, "_state", None)  # set by `run`, which takes every action
            self._backend.note(
                action,
                exiting and action is _Action.REMOVE_FROM_PARTICIPANTS,
                None if seen is None else seen.round,
                seen is not None and self._node in seen.wait_list,
            )
        self._local.depth = depth + 1
        try:
            step(self)
        finally:
            self._local.depth = depth

    def _keep_alive(self) -> None:
        self._act(_Action.KEEP_ALIVE, _DistributedRendezvousOpExecutor._keep_alive)

    def _add_to_participants(self) -> None:
        self._act(_Action.ADD_TO_PARTICIPANTS, _APPLY[_Action.ADD_TO_PARTICIPANTS])

    def _add_to_wait_list(self) -> None:
        self._act(_Action.ADD_TO_WAIT_LIST, _APPLY[_Action.ADD_TO_WAIT_LIST])

    def _add_to_redundancy_list(self) -> None:
        self._act(_Action.ADD_TO_REDUNDANCY_LIST, _APPLY[_Action.ADD_TO_REDUNDANCY_LIST])

    def _remove_from_participants(self) -> None:
        self._act(_Action.REMOVE_FROM_PARTICIPANTS, _APPLY[_Action.REMOVE_FROM_PARTICIPANTS])

    def _remove_from_wait_list(self) -> None:
        self._act(_Action.REMOVE_FROM_WAIT_LIST, _APPLY[_Action.REMOVE_FROM_WAIT_LIST])

    def _remove_from_redundancy_list(self) -> None:
        action = _Action.REMOVE_FROM_REDUNDANCY_LIST
        self._act(action, _APPLY[action])

    def _mark_rendezvous_complete(self) -> None:
        self._act(_Action.MARK_RENDEZVOUS_COMPLETE, _APPLY[_Action.MARK_RENDEZVOUS_COMPLETE])

    def _mark_rendezvous_closed(self) -> None:
        self._act(_Action.MARK_RENDEZVOUS_CLOSED, _APPLY[_Action.MARK_RENDEZVOUS_CLOSED])


class _EtcdStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder over a bound `EtcdRendezvousBackend`, the state passed as objects:
    an unchanged state is not reloaded and a heartbeat is not pickled (torch's holder pickles,
    unpickles and re-checks the whole O(nodes) state for each, every second on every node;
    simulating 1,024 of them on two cores spent most of its time there). Otherwise it is
    torch's `sync`: the same cache window, the same sanitizing, the same answers."""

    _backend: EtcdRendezvousBackend

    def sync(self) -> bool | None:
        has_set: bool | None
        if self._dirty:
            state, token, has_set = self._backend.write(self._state, self._token)
        else:
            if self._cache_duration > 0 and self._last_sync_time >= max(
                time.monotonic() - self._cache_duration, 0
            ):
                return None
            state, token = self._backend.read(self._state)
            has_set = None
        self._state = state if state is not None else _RendezvousState()
        self._token = token
        self._dirty = False
        self._last_sync_time = time.monotonic()
        self._sanitize()
        return has_set


class _EtcdRendezvousHandler(DynamicRendezvousHandler):
    """``DynamicRendezvousHandler`` that rebuilds MASTER_ADDR/PORT every round, and binds its
    etcd backend to itself (see "Re-rendezvous fixes" and "Scale" in the module docstring);
    touches private members of torch's handler, present from torch 2.4 through 2.13.
    """

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        state_holder: Any,
    ) -> None:
        backend = getattr(state_holder, "_backend", None)
        if isinstance(backend, EtcdRendezvousBackend):
            backend.bind(node, settings)
            state_holder = _EtcdStateHolder(backend, settings)
        super().__init__(node, settings, backend_name, store, state_holder)
        if isinstance(backend, EtcdRendezvousBackend):
            self._op_executor = _NotingExecutor(node, state_holder, settings, backend)

    def _record(
        self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None
    ) -> None:
        if not _events_discarded():
            super()._record(message, node_state, rank)

    def next_rendezvous(self) -> RendezvousInfo:
        self._bootstrap_store_info = None
        try:
            return super().next_rendezvous()
        except BaseException:
            # torch's heartbeats stay stopped after a failed rendezvous, so the others see this
            # node die; the backend's own refresher would keep it alive (and waiting) for good
            backend = getattr(self._state_holder, "_backend", None)
            if isinstance(backend, EtcdRendezvousBackend):
                backend.close()
            raise

    def shutdown(self) -> bool:
        try:
            return super().shutdown()
        finally:
            backend = getattr(self._state_holder, "_backend", None)
            if isinstance(backend, EtcdRendezvousBackend):
                backend.close()

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        server = self._shared_tcp_store_server
        if isinstance(server, dist.TCPStore):
            return server
        return super()._create_tcp_store_server(master_addr, master_port)


def _positive(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"The rendezvous configuration option '{key}' must be a number.") from None
    if value <= 0:
        raise ValueError(f"The rendezvous configuration option '{key}' must be positive.")
    return value


def create_backend(
    params: RendezvousParameters, client: EtcdClient | None = None
) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Build the etcd client, state backend and c10d store for ``params``; `client`: an etcd
    client to use instead (several handlers of one process sharing one connection, as the
    benchmark's simulated agents do; its own timeouts apply then)."""
    if not params.endpoint:
        raise ValueError("The etcd3 rendezvous needs --rdzv-endpoint HOST:PORT of etcd.")
    read_timeout = _positive(params, "read_timeout", DEFAULT_READ_TIMEOUT)
    rpc_timeout = _positive(params, "rpc_timeout", DEFAULT_RPC_TIMEOUT)
    own = client is None
    if client is None:
        try:  # TLS and identity from the environment, as every client here (edge/etcd_client.py)
            client = EtcdClient(params.endpoint, timeout=rpc_timeout, retry_timeout=read_timeout)
        except EtcdConfigError as exc:
            raise RendezvousConnectionError(
                f"The etcd3 rendezvous cannot use etcd: {exc}"
            ) from None
    try:
        # Fail fast and clearly on a wrong endpoint instead of deep inside the join loop.
        client.wait_ready(timeout=read_timeout)
        secret = load_secret()
    except (EtcdError, ValueError) as exc:
        if own:
            client.close()
        if isinstance(exc, ValueError):
            raise RendezvousStateError(str(exc)) from None
        raise RendezvousConnectionError(
            f"The etcd3 rendezvous cannot reach etcd at {params.endpoint}: {exc}"
        ) from exc
    job = params.get("job") or None
    first_call = None
    if params.get("first_call_timeout") is not None:
        first_call = timedelta(seconds=_positive(params, "first_call_timeout", 0))
    backend = EtcdRendezvousBackend(client, params.run_id, secret, job, first_call)
    # a large job's agents all wait on torchrun's rank assignment at once: poll less often
    poll_max = 0.2 if params.max_nodes <= 64 else 1.0
    store = EtcdStore(
        client, store_prefix(params.run_id), timedelta(seconds=read_timeout), poll_max
    )
    return backend, store


def _timeout(params: RendezvousParameters, name: str) -> timedelta | None:
    seconds = params.get_as_int(f"{name}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def create_etcd3_handler(
    params: RendezvousParameters, client: EtcdClient | None = None
) -> RendezvousHandler:
    """torchrun handler creator for ``--rdzv-backend etcd3`` (`client`: see `create_backend`)."""
    # Workers get a fresh TCPStore per round, hosted by their rank 0, not the agent's (torch's
    # documented opt-out; it also turns off `use_agent_store`). With the agent's store, workers
    # namespace their keys by the *agent's* restart count, and those diverge between nodes: a
    # failed worker group increments it, a restart for a membership change does not. Two nodes
    # then look under different prefixes and one reads the previous round's gloo addresses
    # (connection refused) until it times out.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Same option parsing as torch's create_handler, but building our handler subclass.
    keep_alive_interval = params.get_as_int("keep_alive_interval", 5)
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if keep_alive_interval is None or keep_alive_max_attempt is None:
        raise TypeError("keep_alive_interval and keep_alive_max_attempt must be integers")
    timeout = RendezvousTimeout(
        _timeout(params, "join"),
        _timeout(params, "last_call"),
        _timeout(params, "close"),
        _timeout(params, "heartbeat"),
    )
    backend, store = create_backend(params, client)
    return _EtcdRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
