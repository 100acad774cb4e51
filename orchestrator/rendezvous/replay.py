"""torch's own state machine, replayed on the current state: the rules the combiner applies a
batch of membership changes by (`replay`, `follow`, `promote`), and the handler's view of the
state with leases for heartbeats (`overlay`, `persisted`). Pure: no etcd."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
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

from pipetransformer.orchestrator.rendezvous.codec import copy_state
from pipetransformer.orchestrator.rendezvous.layout import _rank_order

_NO_BACKEND: Any = None  # torch's state holder and executor, used here only for their rules
_NO_HOLDER: Any = None

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
