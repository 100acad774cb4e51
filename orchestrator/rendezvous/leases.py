"""Heartbeats as leases (see "Scale" in the package docstring): the lease view (`LeaseView`:
every node's alive key under ``state.alive/``, the likely nodes probed and the lapsed keys found
when the count says some are gone) and this node's own lease (`NodeLease`: its alive key, kept
alive from the handler's calls and from a thread of its own)."""

from __future__ import annotations

import binascii
import math
import random
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pyetcd.etcdrpc import rpc_pb2 as pb
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _NodeDesc,
    _RendezvousState,
)

from pipetransformer.edge.etcd_client import EtcdError, Lease, LeaseExpired
from pipetransformer.orchestrator.rendezvous.layout import (
    _bounded,
    _key,
    _node,
    _NodeKey,
    alive_prefix,
    node_id,
    parse_node_key,
)
from pipetransformer.orchestrator.rendezvous.wire import Wire, _lease_gone, _prefix_end, _rng

# Lapsed leases a node looks for by counting (`_find_gone`) before it lists every alive key.
_FIND_GONE_MAX = 4
# Beyond this many alive keys a node that counts a lapsed lease waits a random part of a
# heartbeat interval before it looks for it (`settle_gone`): every node counts the lapse
# within the same second, and one of them finding it first is enough (see "Scale").
_SPREAD_SEARCH_NODES = 64
# What every backend of a process shares (see "Scale"), besides one object per node
# (`layout._PROCESS_NODES`): the nodes by their names in keys (`named`), and each alive key as
# read, its value verified ((secret, key, value, lease, create and mod revision) -> (key,
# entry), see `see`). Each is cleared past `_SHARED_MAX` entries (then rebuilt as read).
_PROCESS_NAMES: dict[str, _NodeDesc] = {}
_ALIVE_ENTRIES: dict[tuple[bytes | None, bytes, bytes, int, int, int], tuple[bytes, Any]] = {}


class LeaseView:
    """The alive keys of the run's nodes as this node last read them: which nodes are alive
    (`alive`), and which keys lapsed when a read counts fewer than it knows (`settle_gone`)."""

    def __init__(self, wire: Wire, nodes: dict[_NodeKey, _NodeDesc]) -> None:
        self._wire = wire
        self.prefix = alive_prefix(wire.run_id)
        # one object per node for everything this node holds (see `_node`)
        self._nodes = nodes
        # the alive keys (key -> (node or None if it does not verify, create revision, mod
        # revision))
        self.keys: dict[bytes, tuple[_NodeDesc | None, int, int]] = {}
        self.alive: set[_NodeDesc] = set()  # the nodes of those that verify
        self.version = 0
        # the nodes whose key came or went since the handler's view took them in
        # (`StateFollower.overlaid`)
        self.changed: set[_NodeDesc] = set()
        # lapsed alive keys counted but not yet found, and when this node looks for them
        # itself (`settle_gone`)
        self.unfound = 0
        self.search_at: float | None = None
        self.refresh_s = 0.0  # a heartbeat interval (bound: `EtcdRendezvousBackend.bind`)

    def see(self, kvs: list[tuple[bytes, Any]]) -> None:
        """Take in alive keys as read ((key, kv) each): the node of each, if its value
        verifies. Each key's entry is made once per process (`_ALIVE_ENTRIES`): every node reads
        every other node's key, and the simulator's hosts read each a hundred times."""
        known, entries = self.keys, _ALIVE_ENTRIES
        came, went = set(), set()
        for key, kv in kvs:
            # all that the entry is made of, so that it is the same for whoever reads the key
            seen = (self._wire.secret, key, kv.value, kv.lease, kv.create_revision, kv.mod_revision)
            shared = entries.get(seen)
            if shared is None:
                shared = self._entry(key, kv)
                _bounded(entries)[seen] = shared
            key, entry = shared
            old = known.get(key)
            if old == entry:
                continue
            known[key] = entry
            self.version += 1
            if old is not None and old[0] is not None:
                went.add(old[0])
            if entry[0] is not None:
                came.add(entry[0])
        if came or went:
            # set operations on sets reuse the hashes they hold: a node descriptor's own hash
            # is Python code (see `StateFollower.overlaid`)
            self.alive -= went - came
            self.alive |= came
            self.changed |= came
            self.changed |= went

    def _entry(self, key: bytes, kv: Any) -> tuple[bytes, tuple[_NodeDesc | None, int, int]]:
        """(key, (its node, or None if its value does not verify; create and mod revision))."""
        text = key.decode()
        node = self.named(text[len(self.prefix) :])
        if node is not None and not self._verified(text, kv.value, int(kv.lease)):
            node = None
        return key, (node, int(kv.create_revision), int(kv.mod_revision))

    def _verified(self, key: str, value: bytes, lease: int) -> bool:
        """Whether an alive key's value is the lease it was put under, signed with the key
        (once per process and value: `see`)."""
        try:
            return int(self._wire.open(key, value.decode()), 16) == lease
        except (RendezvousStateError, ValueError, binascii.Error):
            return False

    def named(self, text: str) -> _NodeDesc | None:
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

    def relisted(self, listed: list[Any]) -> None:
        """Take in the alive keys listed again, keys only (`StateFollower`'s relist): an alive
        key already verified at the same revision is not read or checked again, so a relist
        costs etcd and this node O(nodes) small keys, not O(nodes) signatures."""
        old, alive, stale = self.keys, {}, []
        for kv in listed:
            if (known := old.get(kv.key)) is not None and known[2] == int(kv.mod_revision):
                alive[kv.key] = known
            else:
                stale.append(int(kv.mod_revision))
        self.keys = alive
        self.alive = {node for node, _, _ in alive.values() if node is not None}
        if stale:
            # the values of the alive keys that changed: written at or after the oldest of them
            end = _prefix_end(self.prefix)
            request = _rng(self.prefix, end, min_mod=min(stale)).request_range
            self.see([(kv.key, kv) for kv in self._wire.range("relist", request).kvs])
        if set(alive) != set(old) or stale:
            self.version += 1

    def settle_gone(
        self, gone: int, revision: int, stored: Callable[[], _RendezvousState | None]
    ) -> bool:
        """Account for `gone` alive keys (or deltas) that the count at store `revision` misses:
        leases that lapsed (or the rendezvous deleted); True when only listing every key again
        places them. The likely nodes are looked up first, by their keys alone
        (`_probe_likely`: one the last write took out of the `stored` state, the lost node of a
        re-rendezvous). Beyond `_SPREAD_SEARCH_NODES` a lapse not placed so waits a random part
        of a heartbeat interval for a write that places it before this node looks for it itself
        (`_find_gone`): every node counts a lapse within the same second, and 1,023 nodes each
        making ~10 reads at once held a re-rendezvous up for seconds."""
        if gone > 0:
            gone -= self._probe_likely(revision, gone, stored())
        if 0 < gone <= _FIND_GONE_MAX and len(self.keys) > _SPREAD_SEARCH_NODES:
            now = time.monotonic()
            if self.search_at is None:
                self.search_at = now + random.uniform(0.0, self.refresh_s)
                self._wire.stats["gone_deferred"] += 1
            if now < self.search_at:
                self.unfound = gone
                return False
        self.unfound, self.search_at = 0, None
        # leases lapsed (or the rendezvous was deleted)
        return bool(gone) and not (0 < gone <= _FIND_GONE_MAX and self._find_gone(revision, gone))

    def _probe_likely(self, revision: int, gone: int, stored: _RendezvousState | None) -> int:
        """How many of the lapsed keys are those of the likely nodes, each looked up by its key
        as of store `revision` (they are forgotten): alive nodes the state no longer holds (a
        write took them out; only where there are few: a new node's key precedes its join),
        and beyond `_SPREAD_SEARCH_NODES` the participants of a round that has few (in a
        re-rendezvous, the lost node is the one that never left the old round)."""
        if stored is None:
            return 0
        alive = self.alive
        likely = alive.difference(stored.last_heartbeats)  # C: the set's own hashes
        if len(likely) > _FIND_GONE_MAX:
            likely = set()
        few = len(stored.participants) <= _FIND_GONE_MAX
        if few and len(self.keys) > _SPREAD_SEARCH_NODES:
            likely.update(n for n in stored.participants if n in alive)
        found = 0
        for node in sorted(likely, key=_key):
            key = (self.prefix + node_id(node)).encode()
            if key not in self.keys:
                continue
            request = _rng(key.decode(), count_only=True, revision=revision).request_range
            try:
                if int(self._wire.range("probe", request).count):
                    continue
            except RendezvousConnectionError:
                break  # e.g. that revision was compacted away: searched for later
            self._forget(key)
            found += 1
            if found == gone:
                break
        self._wire.stats["found_probed"] += found
        return found

    def _forget(self, key: bytes) -> None:
        """The alive key `key` lapsed: its node is no longer alive in this node's view."""
        node = self.keys.pop(key)[0]
        if node is not None:
            self.alive.discard(node)
            self.changed.add(node)
        self.version += 1

    def _find_gone(self, revision: int, gone: int) -> bool:
        """Find the `gone` alive keys that lapsed by store `revision` by counting halves of
        the keys known (about gone x log2(nodes) count-only reads of a few bytes, where a
        relist reads every key: every node does this when one lease lapses); False if they
        are not all alive keys (then relist)."""
        known = sorted(self.keys)
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
                left = (mid - lo) - int(self._wire.range("find gone", op.request_range).count)
                for part in ((lo, mid, left), (mid, hi, missing - left)):
                    if part[2] < 0 or part[2] > part[1] - part[0]:
                        return False  # keys this node does not know of: relist
                    if part[2]:
                        todo.append(part)
        except RendezvousConnectionError:
            return False  # e.g. that revision was compacted away: relist
        for key in found:
            self._forget(key)
        self._wire.stats["found_gone"] += len(found)
        return True


class NodeLease:
    """This node's heartbeat: its lease, and its alive key under it (see "Scale"), refreshed
    from the handler's heartbeats and waits and from a thread of its own."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        self.lease: Lease | None = None
        self._lease_at = 0.0
        self.refresher: threading.Event | None = None  # set: the refresher stops
        self.combining = False  # holding the combine lock: the refresher leaves the lease be
        self.heartbeat: datetime | None = None  # the last refresh: this node's own heartbeat
        # bound (`bind`): the alive key, the lease's TTL, and a heartbeat interval
        self._key = ""
        self.ttl = 0
        self.refresh_s = 0.0

    def bind(self, node: _NodeDesc, settings: RendezvousSettings) -> None:
        """Keep `node` alive, at the handler's heartbeat interval."""
        self._key = alive_prefix(self._wire.run_id) + node_id(node)
        window = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
        # a node is dead once it missed keep_alive_max_attempt heartbeats, as in torch
        self.ttl = max(1, math.ceil(window))
        self.refresh_s = settings.keep_alive_interval.total_seconds()

    def keep(self, force: bool = False) -> None:
        """This node's lease (and its alive key): refreshed when `force`d or due, granted again
        if it lapsed."""
        self._start_refresher()  # (again, after `close`: the node is in use again)
        now = time.monotonic()
        if self.lease is not None and not force and now - self._lease_at < self.refresh_s:
            return
        stats = self._wire.stats
        if self.lease is not None:
            stats["requests"] += 1
            stats["lease_refreshes"] += 1
            if self._refresh(self.lease) <= 0:  # dead to the others meanwhile; alive from now
                stats["lease_lapsed"] += 1
                self.lease = None
        if self.lease is None:
            self.lease = self._grant()
        self._refreshed(now)

    def _refreshed(self, now: float) -> None:
        """The lease was refreshed (or granted) at monotonic `now`, by the handler or the
        refresher: this node's own heartbeat, and the longest gap between two refreshes."""
        if self._lease_at:
            gap_ms = int(1000 * (now - self._lease_at))
            stats = self._wire.stats
            stats["lease_gap_max_ms"] = max(stats["lease_gap_max_ms"], gap_ms)
        self._lease_at = now
        self.heartbeat = datetime.now(UTC)

    def _start_refresher(self) -> None:
        """Keep the lease alive from a thread of its own as well: the handler refreshes it
        from its loop (a heartbeat, a wait for a change), and a loop that stalls (a slow etcd
        call, a starved process) must not let the node be taken for dead, which re-forms the
        whole job. Not while the node holds the combine lock (under the same lease): a
        combiner that hangs must let the lock go. Nothing here takes the backend's lock; a
        lease that lapsed is left to the handler's next refresh, which grants a new one."""
        if self.refresher is not None:
            return
        stop = self.refresher = threading.Event()

        def run() -> None:
            while not stop.wait(self.refresh_s / 2):
                lease = self.lease
                if lease is None or self.combining:
                    continue
                if time.monotonic() - self._lease_at < self.refresh_s:
                    continue
                self._wire.stats["requests"] += 1
                try:
                    self._wire.client.refresh_lease(lease.id)
                except EtcdError:  # gone (LeaseExpired) or etcd away: the handler's turn
                    continue
                if lease is self.lease:
                    self._refreshed(time.monotonic())
                    self._wire.stats["lease_refreshes_timer"] += 1

        threading.Thread(target=run, name="rdzv-lease", daemon=True).start()

    def close(self) -> None:
        """Stop refreshing the lease (it lapses unless the handler refreshes it again, which
        starts the refresher again)."""
        if self.refresher is not None:
            self.refresher.set()
            self.refresher = None

    def _grant(self) -> Lease:
        """A new lease and this node's alive key under it (a second time if the lease lapsed
        before the key reached etcd: a node starved that long is behind in everything)."""
        wire = self._wire
        for attempt in (1, 2):
            wire.stats["requests"] += 2
            wire.stats["lease_grants"] += 1
            lease = wire.etcd(wire.client.lease, self.ttl)
            value = wire.seal(self._key, b"%x" % lease.id)
            try:
                wire.etcd(wire.client.put, self._key, value, lease)
                return lease
            except RendezvousConnectionError as exc:
                if attempt == 2 or not _lease_gone(exc):
                    raise
        raise AssertionError("unreachable")

    def _refresh(self, lease: Lease) -> int:
        """The lease's TTL after a refresh, 0 if it expired."""
        try:
            return int(self._wire.client.refresh_lease(lease.id))
        except LeaseExpired:
            return 0
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd at {self._wire.client.endpoint} has failed: {exc}"
            ) from exc

    def leased_txn(
        self,
        what: str,
        build: Callable[[], tuple[list[pb.Compare], list[pb.RequestOp], list[pb.RequestOp]]],
    ) -> pb.TxnResponse:
        """A transaction that puts keys under this node's lease, again under a new lease if
        the lease lapsed before it reached etcd (which refuses the whole transaction then)."""
        try:
            return self._wire.txn(what, *build())
        except RendezvousConnectionError as exc:
            if not _lease_gone(exc):
                raise
        self._wire.stats["lease_lapsed"] += 1
        self.lease = None
        self.keep()
        return self._wire.txn(what, *build())
