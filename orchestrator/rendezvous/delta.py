"""A state write's delta (see "Scale" in the package docstring): what changed (`state_diff`),
applied by the nodes that follow the state (`apply_diff`), stored with its nodes as plain tuples
(`encode_delta`, `decode_delta`)."""

from __future__ import annotations

import io
import pickle
from datetime import datetime
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from pipetransformer.orchestrator.rendezvous.codec import _StateUnpickler, copy_state
from pipetransformer.orchestrator.rendezvous.layout import _key, _node, _NodeKey, _rank_order

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
# a delta's fields that hold nodes: dict keys, lists and sets (see StateDiff)
_NODE_DICTS, _NODE_LISTS, _NODE_SETS = (4, 10), (5, 11), (6, 7, 8, 9)


def encode_delta(base: int, version: int, diff: StateDiff) -> bytes:
    wire: list[Any] = list(diff)
    for i in _NODE_DICTS:
        wire[i] = {_key(n): v for n, v in diff[i].items()}  # type: ignore[union-attr]
    for i in (*_NODE_LISTS, *_NODE_SETS):
        wire[i] = [_key(n) for n in diff[i]]  # type: ignore[union-attr]
    return pickle.dumps((base, version, tuple(wire)))


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
