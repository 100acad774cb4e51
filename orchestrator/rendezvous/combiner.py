"""Membership changes, combined (see "Scale" in the package docstring): a node either takes the
combine lock or leaves its change as an intent under ``intent/<node>``; the lock holder applies
its own change and the pending intents to the current state by replaying torch's operations
(`replay`), and writes the state (and its delta) once for all of them."""

from __future__ import annotations

import binascii
import random
import time
from datetime import datetime, timedelta

from pyetcd.etcdrpc import rpc_pb2 as pb
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    Token,
    _Action,
    _NodeDesc,
    _RendezvousState,
)

from pipetransformer.core import keys
from pipetransformer.orchestrator.rendezvous.follower import StateFollower
from pipetransformer.orchestrator.rendezvous.layout import node_id
from pipetransformer.orchestrator.rendezvous.leases import LeaseView, NodeLease
from pipetransformer.orchestrator.rendezvous.replay import (
    Change,
    action_done,
    action_valid,
    overlay,
    persisted,
    replay,
    same_membership,
    sanitize,
)
from pipetransformer.orchestrator.rendezvous.wire import (
    Wire,
    _absent,
    _b,
    _delete,
    _mod_is,
    _nested,
    _prefix_end,
    _put,
    _rng,
)

# Intents applied by one combining transaction: etcd refuses more than --max-txn-ops (128)
# compares or operations in one, and each intent takes a compare and a delete.
MAX_BATCH = 100


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


class Combiner:
    """A bound node's membership changes (`change`): as the combiner, holding the lock, or by
    leaving an intent that the combiner applies."""

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
        wire: Wire,
        leases: LeaseView,
        node_lease: NodeLease,
        follower: StateFollower,
        first_call: timedelta | None = None,
    ) -> None:
        """`first_call`: the first round's last call (``first_call_timeout``), where the
        handler's settings have later rounds'."""
        self._wire = wire
        self._leases = leases
        self._node_lease = node_lease  # the lock lives with this node's lease
        self._follower = follower
        prefix = keys.rendezvous(wire.run_id)
        self._intent_prefix = f"{prefix}/intent/"
        self._lock_key = f"{prefix}/combiner"
        self.first_call = first_call
        # the pending intents (oldest first)
        self._intents: list[_Intent] = []
        # bound (`bind`): this node, its settings, its intent's key, how long a change may take
        self._me: _NodeDesc | None = None
        self._settings: RendezvousSettings | None = None
        self._my_intent = ""
        self.budget = 0.0

    def bind(self, node: _NodeDesc, settings: RendezvousSettings, budget: float) -> None:
        self._me, self._settings = node, settings
        self._my_intent = self._intent_prefix + node_id(node)
        self.budget = budget

    def _intents_op(self) -> pb.RequestOp:
        end = _prefix_end(self._intent_prefix)
        return _rng(self._intent_prefix, end, limit=MAX_BATCH, oldest_first=True)

    def _take_intents(self, response: pb.ResponseOp) -> None:
        intents = []
        for kv in response.response_range.kvs:
            key = kv.key.decode()
            node = self._leases.named(key[len(self._intent_prefix) :])
            action, rejoin, seen = None, False, None
            try:
                action, rejoin, seen = _parse_intent(
                    self._wire.open(key, kv.value.decode()).decode()
                )
            except (RendezvousStateError, ValueError, KeyError, binascii.Error):
                node = None
            intents.append(_Intent(key, int(kv.mod_revision), node, action, rejoin, seen))
        self._intents = intents

    def _lock_ops(self) -> list[pb.RequestOp]:
        """Taking the combine lock: the lock itself, then what combining reads."""
        assert self._node_lease.lease is not None and self._me is not None
        return [
            _put(self._lock_key, node_id(self._me), self._node_lease.lease.id),
            self._follower.read_op(),
            self._intents_op(),
        ]

    def _lock_is_mine(self, response: pb.ResponseOp) -> bool:
        # a retried transaction may have taken the lock on its first, unanswered attempt
        kvs = response.response_range.kvs
        return bool(kvs) and self._me is not None and kvs[0].value.decode() == node_id(self._me)

    def change(
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
        self._wire.stats["changes"] += 1
        self._node_lease.keep()
        assert self._node_lease.lease is not None
        deadline = time.monotonic() + self.budget
        queue = not shared
        name = _intent_text(action, rejoin, round_seen).encode()
        count_intents = _rng(self._intent_prefix, _prefix_end(self._intent_prefix), count_only=True)

        # take the lock, or leave the intent for whoever holds it: one round trip either way
        def first() -> tuple[list[pb.Compare], list[pb.RequestOp], list[pb.RequestOp]]:
            assert self._node_lease.lease is not None
            if queue:
                last = _put(
                    self._my_intent,
                    self._wire.seal(self._my_intent, name),
                    self._node_lease.lease.id,
                )
            else:
                last = self._follower.read_op()
            return (
                [_absent(self._lock_key)],
                self._lock_ops(),
                [_rng(self._lock_key), count_intents, last],
            )

        reply = self._node_lease.leased_txn("change", first)
        direct: _Action | None = action
        intent = 0  # the revision of this node's pending intent (0: none)
        holding = reply.succeeded
        ahead = 0
        if holding:
            self._follower.absorb(reply.responses[1].response_range, reply.header.revision)
            self._take_intents(reply.responses[2])
        else:
            ahead = int(reply.responses[1].response_range.count)
            if queue:
                self._wire.stats["intents"] += 1
                direct, intent = None, int(reply.header.revision)
                ahead = max(0, ahead - 1)
            else:
                self._wire.stats["shared_waits"] += 1
                self._follower.absorb(reply.responses[2].response_range, reply.header.revision)
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
                self._node_lease.combining = True
                try:
                    result = self._combine(direct, (rejoin, round_seen), action, intent, deadline)
                except BaseException:
                    self._unlock_quietly()  # the others would wait out this node's lease
                    raise
                finally:
                    self._node_lease.combining = False
                if result is not None:
                    return result
                holding = False  # the time is up: withdraw below
            if time.monotonic() > deadline:
                return self._withdraw(action, intent) if queue else self._result(action)
            first_wait = self._POLL_FIRST if queue else self._POLL_SHARED
            wait = (first_wait + ahead * self._POLL_PER_INTENT) * 1.5 ** min(stalled, 8)
            time.sleep(min(self._POLL_CAP, wait) * random.uniform(0.75, 1.25))
            self._node_lease.keep()  # still alive while waiting: the intent lives with the lease
            self._wire.stats["polls"] += 1

            def poll() -> tuple[list[pb.Compare], list[pb.RequestOp], list[pb.RequestOp]]:
                end = _prefix_end(self._intent_prefix)
                lock = _nested([_absent(self._lock_key)], self._lock_ops(), [_rng(self._lock_key)])
                if not queue:  # no intent to wait on: the lock, and what is ahead
                    return [], [lock, count_intents], []
                return (
                    [_mod_is(self._my_intent, intent)],
                    [lock, _rng(self._intent_prefix, end, count_only=True)],
                    [self._follower.read_op()],
                )

            reply = self._node_lease.leased_txn("poll", poll)
            if not reply.succeeded:  # the intent is gone: applied or refused by a combiner
                self._follower.absorb(reply.responses[0].response_range, reply.header.revision)
                return self._result(action)
            now_ahead = int(reply.responses[1].response_range.count)
            stalled = stalled + 1 if now_ahead >= ahead else 0
            ahead = now_ahead
            inner = reply.responses[0].response_txn
            if inner.succeeded:
                holding = True
                self._follower.absorb(inner.responses[1].response_range, reply.header.revision)
                self._take_intents(inner.responses[2])
            elif self._lock_is_mine(inner.responses[0]):
                holding = True
                self._reread_for_combining()
            elif not queue:
                if not self._follower.unchanged():
                    self._follower.read()
                if not self._due(action):
                    return self._result(action)

    def _due(self, action: _Action) -> bool:
        """Whether this node's handler would still take `action` on the state last read (as
        its view: the nodes whose lease lapsed taken out)."""
        stored = self._follower.stored()
        if stored is None or self._me is None or self._settings is None:
            return False
        view = self._follower.overlaid(stored)
        sanitize(view, self._settings)
        return action_valid(view, self._me, action, self._settings)

    def _reread_for_combining(self) -> None:
        self._follower.read()
        answer = self._wire.range("intents", self._intents_op().request_range)
        self._take_intents(pb.ResponseOp(response_range=answer))

    def _result(self, action: _Action) -> tuple[_RendezvousState | None, Token, bool]:
        stored = self._follower.stored()
        done = stored is not None and self._me is not None and action_done(stored, self._me, action)
        return self._follower.view(), self._follower.revision, done

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
            self._node_lease.keep()  # each batch is progress: the lease (and the lock) live on
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
            stored = self._follower.stored()
            base = max(self._follower.revision, 0)
            view = overlay(
                stored or _RendezvousState(),
                self._leases.alive,
                self._me,
                self._node_lease.heartbeat,
            )
            deadline_before = view.deadline
            applied = replay(view, changes, self._settings)
            self._first_call_deadline(view, deadline_before)
            written = persisted(view, stored)
            if stored is not None and same_membership(stored, written):
                value, writes, after = "", [], None
            else:
                value, writes, after = self._follower.writes(written, stored, base)
            done = mine is not None
            late = time.monotonic() > deadline
            # what changed since the last read, then the write (the read is as of the revision
            # before it)
            success = [self._follower.read_op(), *writes]
            success += [_delete(it.key) for it in batch]
            if done or late:
                success.append(_delete(self._lock_key))
            success.append(self._intents_op())
            # each intent compared: one withdrawn meanwhile (or gone with its owner's lease) must
            # not be applied behind its owner's back
            reply = self._wire.txn(
                "combine",
                [_mod_is(self._wire.key, base), *(_mod_is(it.key, it.revision) for it in batch)],
                success,
                [self._follower.read_op(), self._intents_op()],
            )
            if reply.succeeded:
                self._wire.stats["combines" if after else "combines_unwritten"] += 1
                self._wire.stats["combined"] += len(changes)
                self._follower.absorb(reply.responses[0].response_range, reply.header.revision)
                if after is not None:
                    self._follower.wrote(value, written, after, int(reply.header.revision))
                self._take_intents(reply.responses[-1])
                if done:
                    # the handler's view: the state just written, as replayed (leases ALIVE)
                    beats = view.last_heartbeats
                    if self._me in beats and self._node_lease.heartbeat is not None:
                        beats[self._me] = self._node_lease.heartbeat
                    self._follower.mark_handed()
                    return (
                        view,
                        self._follower.revision,
                        mine is not None and mine >= 0 and applied[mine],
                    )
                if late:
                    return None
                continue
            # an intent went (withdrawn, or with its owner's lease), or someone wrote around the
            # lock (its holder's lease lapsed): read, and again
            self._wire.stats["combine_lost"] += 1
            self._follower.absorb(reply.responses[0].response_range, reply.header.revision)
            self._take_intents(reply.responses[1])
            if late:
                self._unlock()
                return None

    def _first_call_deadline(self, state: _RendezvousState, before: datetime | None) -> None:
        """A first round (round 0, a launch) whose deadline the replay just set (torch's
        executor sets it, to now + last_call, when the round's min_nodes-th node joins) gets
        the first call instead, where one is set (``first_call_timeout``). Decided on the
        state after the replay: a replay that opens round 1 (a node lost) sets round 1's."""
        if self.first_call is None or self._settings is None:
            return
        if state.round != 0 or state.complete or state.deadline in (None, before):
            return
        state.deadline += self.first_call - self._settings.timeout.last_call

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
        self._wire.txn("unlock", [mine], [_delete(self._lock_key)])

    def _withdraw(
        self, action: _Action, intent: int
    ) -> tuple[_RendezvousState | None, Token, bool]:
        """Out of time: take this node's intent back unless a combiner took it first; the
        handler then runs its state machine again on the state returned."""
        self._wire.stats["withdrawn"] += 1
        reply = self._wire.txn(
            "withdraw",
            [_mod_is(self._my_intent, intent)],
            [_delete(self._my_intent), self._follower.read_op()],
            [self._follower.read_op()],
        )
        self._follower.absorb(reply.responses[-1].response_range, reply.header.revision)
        state, token, done = self._result(action)
        return state, token, done and not (reply.succeeded and intent)
