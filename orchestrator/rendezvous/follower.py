"""The stored state as a node holds it (see "Scale" in the package docstring): read whole, or
followed by the deltas of its writes; asked first whether anything changed at all; and the
handler's view of it (`overlay`), kept up to date by what changed."""

from __future__ import annotations

import binascii
import dataclasses
import math
import threading
import time
from datetime import datetime
from typing import Any

from pyetcd.etcdrpc import rpc_pb2 as pb
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from pipetransformer.orchestrator.rendezvous.codec import copy_state, decode_state, encode_state
from pipetransformer.orchestrator.rendezvous.delta import (
    _PROMOTED,
    apply_diff,
    decode_delta,
    encode_delta,
    state_diff,
)
from pipetransformer.orchestrator.rendezvous.layout import (
    _NodeKey,
    delta_prefix,
    intern_state,
    written_key,
)
from pipetransformer.orchestrator.rendezvous.leases import LeaseView, NodeLease
from pipetransformer.orchestrator.rendezvous.replay import ALIVE
from pipetransformer.orchestrator.rendezvous.wire import Wire, _prefix_end, _put, _rng

# The ring of the state's last deltas (see "Scale"): a node that fell further behind than this
# many writes reads the state whole.
DELTA_SLOTS = 64


@dataclasses.dataclass(frozen=True, eq=False)
class _Followed:
    """A delta as one backend of the process applied it: to the state at mod revision `base`
    (one state: the state key's revisions name its writes), making `state` (version
    `version`), changing the heartbeats of `beats`."""

    base: int
    state: _RendezvousState
    version: int
    beats: frozenset[_NodeDesc]


# What every backend of a process shares (see "Scale", and `leases._ALIVE_ENTRIES`) includes
# the states they hold, which are never changed once held: the states read whole
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


class StateFollower:
    """What this node last read of the state, kept up to date at the cost of what changed:
    the stored state (`stored`: -1 for `revision` when never read, 0 when absent), the alive
    keys (through `LeaseView`), and the handler's view of both (`view`)."""

    def __init__(
        self,
        wire: Wire,
        leases: LeaseView,
        node_lease: NodeLease,
        nodes: dict[_NodeKey, _NodeDesc],
    ) -> None:
        self._wire = wire
        self._leases = leases
        self._node_lease = node_lease  # this node's own heartbeat, in the view
        self._nodes = nodes  # one object per node for everything this node holds (see `_node`)
        self._key = wire.key
        self._me: _NodeDesc | None = None  # bound (`bind`)
        self._refresh_s = 0.0
        # what this node last read: the stored state (-1: never read, 0: absent) ...
        self.revision = -1
        self.present = False
        self._value: str | None = None  # as read whole (None: made from deltas, or absent)
        self._state: _RendezvousState | None = None
        self.version = 0  # the state key's version (etcd counts its writes): a delta's slot
        # ... and the store revision it is as of (the next read asks what changed since)
        self._seen = 0
        # the heartbeats of the handler's view (`overlay`), kept up to date by the nodes whose
        # beat or lease changed (None: build again), so that following a delta or a new lease
        # costs O(what changed), not O(nodes), per node
        self._vb: dict[_NodeDesc, datetime] | None = None
        self._vb_dirty: set[_NodeDesc] = set()
        # a read spans the alive keys and the deltas, not the state key (see "Scale")
        self._delta_prefix = delta_prefix(wire.run_id)
        self._span_start = self._key + "."
        self._span_end = _prefix_end(self._delta_prefix)
        self._written = written_key(wire.run_id)
        self._delta_keys: dict[bytes, int] = {}  # delta slot -> mod revision (for the count)
        self._relisted_at = -math.inf
        # what the state handed out last was made of (stored revision, alive keys' version):
        # unchanged, the holder keeps its own copy
        self._handed: tuple[int, int] | None = None

    def bind(self, node: _NodeDesc, refresh_s: float) -> None:
        """The view is `node`'s (its own heartbeat is its lease's); `refresh_s`: a heartbeat
        interval, the most a relist is made."""
        self._me, self._refresh_s = node, refresh_s

    # -- reads ---------------------------------------------------------------------------

    def read_op(self) -> pb.RequestOp:
        """What a read needs, as one range over the alive keys and the deltas (right after the
        state key, which it leaves out): what was written there since the last read; its count
        is the number of keys before that filter, so a lapsed lease shows as one key missing."""
        return _rng(self._span_start, self._span_end, min_mod=self._seen + 1)

    def unchanged(self) -> bool:
        """Whether nothing this node reads changed since its last read, from two reads that
        cost etcd O(1) and O(log nodes) (`read` costs it O(nodes): etcd loads every key of
        the span to filter them, and every waiting node reads once a second): no state
        written since (`written_key`), and as many alive keys and deltas as known (a lapsed
        lease, a new node). A lapse and a new node at once cancel out in the count, but a new
        node's join writes the state soon after."""
        if self.revision < 0 or not self._seen:
            return False
        # both serializable (answered by the member from what it has applied, no read-index
        # round): at 1,024 nodes on a slower machine etcd's linearizable reads took 3 to 5.8 s,
        # serializable ones at most 0.3 s. A stale answer costs one more read
        # (a full, linearizable `read`) or notices a change one poll later; a member too far
        # behind to answer fresh cannot keep this node's lease alive either.
        asked = _rng(self._written, keys_only=True, serializable=True).request_range
        written = self._wire.range("written", asked)
        if not written.kvs and self.present:
            return False  # written by a writer that does not mark its writes
        if written.kvs and int(written.kvs[0].mod_revision) > self._seen:
            return False
        leases = self._leases
        if leases.search_at is not None and time.monotonic() >= leases.search_at:
            return False  # time to look for the lapsed leases counted
        request = _rng(
            self._span_start, self._span_end, count_only=True, serializable=True
        ).request_range
        count = int(self._wire.range("count", request).count)
        same = count == len(leases.keys) + len(self._delta_keys) - leases.unfound
        self._wire.stats["reads_unchanged"] += same
        return same

    def read(self) -> None:
        # a range, not a transaction: etcd before 3.5.5 crashes when a client gives up on a
        # read-only transaction it is still running (etcd-io/etcd#14110), and overloaded
        # etcds are where clients give up
        request = self.read_op().request_range
        self.absorb(self._wire.range("read", request), self._wire.header_revision)

    def absorb(self, answer: pb.RangeResponse, revision: int) -> None:
        """Take in a `read_op` answered as of store `revision`: the alive keys, and the state
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
            self._leases.see(alive)
        self._seen = max(self._seen, revision)
        whole = self.revision < 0
        for kv in sorted(deltas, key=lambda kv: int(kv.mod_revision)):
            if whole or int(kv.mod_revision) <= self.revision:
                continue
            if not self.follow(kv):
                whole = True
        if whole:
            self._read_state()
        gone = len(self._leases.keys) + len(self._delta_keys) - int(answer.count)
        if self._leases.settle_gone(gone, revision, self.stored):
            self._relist()

    def follow(self, kv: Any) -> bool:
        """Apply the delta `kv` to the state held; False if it does not lead on from it. A
        delta another backend of the process applied to the same state is not applied again:
        its result is taken (`_PROCESS_FOLLOWED`)."""
        if not self.present:
            return False
        shared = (self._wire.secret, kv.key, kv.value)
        done = _PROCESS_FOLLOWED.get(shared)
        if done is None or done.base != self.revision:
            held = self.stored()
            assert held is not None
            try:
                opened = self._wire.open(kv.key.decode(), kv.value.decode())
                delta = decode_delta(opened, self._nodes)
            except (RendezvousStateError, ValueError, binascii.Error):
                delta = None
            if delta is None or delta[0] != self.revision:
                return False
            try:
                state = apply_diff(held, delta[2])
            except (TypeError, ValueError, AttributeError):
                return False
            beats = {*delta[2][10], *delta[2][11]}
            if any(change[0] == _PROMOTED for change in delta[2][12]):
                beats.update(held.wait_list)
            done = _Followed(self.revision, state, delta[1], frozenset(beats))
            _remember(_PROCESS_FOLLOWED, shared, done)
        else:
            self._wire.stats["deltas_shared"] += 1
        self._value, self._state = None, done.state
        self.revision, self.version = int(kv.mod_revision), done.version
        self._vb_dirty.update(done.beats)
        self._wire.stats["deltas"] += 1
        return True

    def _read_state(self) -> None:
        """The state key, whole."""
        self._wire.stats["state_reads"] += 1
        answer = self._wire.range("state", _rng(self._key).request_range)
        kv = answer.kvs[0] if answer.kvs else None
        if kv is None:
            self.set_stored(None, 0)
        else:
            self.set_stored(kv.value.decode(), int(kv.mod_revision), int(kv.version))

    def _relist(self) -> None:
        """List the state, the alive keys and the deltas again, at most once a heartbeat
        interval (every node does it when one lease lapses; a death is noticed that much later
        at worst). Keys only: see `LeaseView.relisted`."""
        now = time.monotonic()
        if now - self._relisted_at < self._refresh_s:
            return
        self._relisted_at = now
        self._wire.stats["relists"] += 1
        request = _rng(self._key, self._span_end, keys_only=True).request_range
        answer = self._wire.range("relist", request)
        listed, deltas, state_rev = [], {}, 0
        for kv in answer.kvs:
            if kv.key == self._key.encode():
                state_rev = int(kv.mod_revision)
            elif kv.key.startswith(self._delta_prefix.encode()):
                deltas[kv.key] = int(kv.mod_revision)
            else:
                listed.append(kv)
        self._delta_keys = deltas
        self._vb = None
        self._leases.relisted(listed)
        if state_rev != max(self.revision, 0):
            self._read_state()
        self._seen = self._wire.header_revision

    def set_stored(self, value: str | None, revision: int, version: int = 0) -> None:
        """The state as read (or written) whole: `value` at `revision` (None, 0: absent)."""
        if revision != self.revision or value != self._value or not self.present:
            self._value, self.revision, self._state = value, revision, None
            self._vb = None
        self.present = value is not None
        self.version = version if value is not None else 0

    def stored(self) -> _RendezvousState | None:
        """The stored state, verified and unpickled with torch's classes only (once a revision)."""
        if not self.present:
            return None
        if self._state is None:
            assert self._value is not None
            shared = (self._wire.secret, self._key, self._value)
            state = _PROCESS_STATES.get(shared)
            if state is None:
                state = decode_state(self._wire.decode(self._value))
                intern_state(state, self._nodes)
                _remember(_PROCESS_STATES, shared, state)
            self._state = state
        return self._state

    # -- the handler's view ----------------------------------------------------------------

    def view(self, held: _RendezvousState | None = None) -> _RendezvousState | None:
        """The state as this node's handler sees it (`overlay`): `held` when nothing changed
        since it was handed out, else a fresh one."""
        stored = self.stored()
        if stored is None:
            return None
        made_of = (self.revision, self._leases.version)
        if held is not None and made_of == self._handed:
            # this node's own heartbeat is its lease's last refresh, whoever refreshed it
            me, beat = self._me, self._node_lease.heartbeat
            if me is not None and beat is not None and me in held.last_heartbeats:
                held.last_heartbeats[me] = beat
            return held
        self._handed = made_of
        return self.overlaid(stored)

    def mark_handed(self) -> None:
        """The handler holds a view of the state as it is now (see `view`)."""
        self._handed = (self.revision, self._leases.version)

    def overlaid(self, stored: _RendezvousState) -> _RendezvousState:
        """`overlay(stored, alive nodes, this node, its heartbeat)`, from the view's heartbeats
        kept up to date (`_vb`)."""
        beats, alive, me = stored.last_heartbeats, self._leases.alive, self._me
        dirty = self._vb_dirty
        dirty |= self._leases.changed  # the nodes whose lease came or went, too
        self._leases.changed.clear()
        # set operations between sets and with dicts use the hashes stored in the set: a node
        # descriptor's own hash and equality are Python code, called per node otherwise
        if self._vb is None:
            self._vb = dict(beats)
            changed = alive - alive.difference(beats)
        else:
            left = dirty.difference(beats)
            changed = dirty - left
            for n in left:
                self._vb.pop(n, None)
        live = changed & alive
        live.discard(me)
        self._vb.update(dict.fromkeys(live, ALIVE))
        for n in changed - live:  # nodes whose lease lapsed, and this node
            self._vb[n] = beats[n]
        dirty.clear()
        view = copy_state(stored)
        view.last_heartbeats = dict(self._vb)
        beat = self._node_lease.heartbeat
        if me is not None and me in view.last_heartbeats and beat is not None:
            view.last_heartbeats[me] = beat
        return view

    # -- writes ----------------------------------------------------------------------------

    def writes(
        self, written: _RendezvousState, stored: _RendezvousState | None, base: int
    ) -> tuple[str, list[pb.RequestOp], tuple[int, bytes]]:
        """Writing `written` over `stored` (at mod revision `base`): the state whole, for
        torch's format and whoever reads it whole, and its delta in the ring of
        `DELTA_SLOTS` for the nodes that hold `stored`; (the value, the puts, (the state's
        version after, the delta's key))."""
        value = self._wire.seal(self._key, encode_state(written))
        version = self.version + 1 if self.present else 1
        slot = f"{self._delta_prefix}{version % DELTA_SLOTS:02d}"
        diff = state_diff(stored or _RendezvousState(), written)
        delta = self._wire.seal(slot, encode_delta(base, version, diff))
        puts = [_put(self._key, value), _put(slot, delta), _put(self._written, str(version))]
        return value, puts, (version, slot.encode())

    def wrote(
        self, value: str, written: _RendezvousState, after: tuple[int, bytes], revision: int
    ) -> None:
        """Hold what `writes` wrote at `revision` as the state read."""
        self.set_stored(value, revision, after[0])
        intern_state(written, self._nodes)
        self._state = written
        self._vb = None
        self._delta_keys[after[1]] = revision
