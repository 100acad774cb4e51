"""torch's ``RendezvousBackend`` over etcd: `EtcdRendezvousBackend`. Unbound it is one
compare-and-swap of the whole state (see "Rendezvous state" in the package docstring); bound to
its handler (`bind`) it serves the state as objects through its collaborators (see "Scale"):
`LeaseView` and `NodeLease` (heartbeats as leases), `StateFollower` (the state followed by its
deltas, and the handler's view of it) and `Combiner` (membership changes, combined)."""

from __future__ import annotations

import threading
from datetime import timedelta

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousSettings,
    Token,
    _Action,
    _NodeDesc,
    _RendezvousState,
)

from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.rendezvous.codec import decode_state, encode_state
from pipetransformer.orchestrator.rendezvous.combiner import _SHARED, Combiner
from pipetransformer.orchestrator.rendezvous.delta import RELOAD
from pipetransformer.orchestrator.rendezvous.follower import StateFollower
from pipetransformer.orchestrator.rendezvous.layout import (
    _PROCESS_NODES,
    _bounded,
    _key,
    delta_prefix,
    written_key,
)
from pipetransformer.orchestrator.rendezvous.leases import LeaseView, NodeLease
from pipetransformer.orchestrator.rendezvous.replay import MEMBERSHIP_ACTIONS, persisted
from pipetransformer.orchestrator.rendezvous.wire import Wire, _mod_is, _put, _rng

BACKEND_NAME = "etcd3"


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key, fenced by its mod revision; bound to its handler
    (`bind`), heartbeats become leases and membership changes are combined (see "Scale")."""

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
        self._wire = Wire(client, run_id, secret, job_id)
        # requests, bytes, heartbeats, combines ...: what this node cost etcd (the benchmark)
        self.stats = self._wire.stats
        self._lock = threading.RLock()
        # one object per node for everything this node holds (see `_node`)
        self._nodes = _bounded(_PROCESS_NODES)
        self._leases = LeaseView(self._wire, self._nodes)
        self._node_lease = NodeLease(self._wire)
        self._follower = StateFollower(self._wire, self._leases, self._node_lease, self._nodes)
        self._combiner = Combiner(
            self._wire, self._leases, self._node_lease, self._follower, first_call
        )
        # bound mode (`bind`): this node, its settings, the action its next write carries
        self._me: _NodeDesc | None = None
        self._settings: RendezvousSettings | None = None
        # thread -> (action, rejoin, the round it was decided on, shared: see `note`)
        self._notes: dict[int, tuple[_Action, bool, int | None, bool]] = {}
        # what an unbound write leaves for the nodes that follow the deltas (`_set_plain`)
        self._delta_prefix = delta_prefix(run_id)
        self._written = written_key(run_id)

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._wire.key

    # -- binding ----------------------------------------------------------------------------

    def bind(self, node: _NodeDesc, settings: RendezvousSettings) -> None:
        """Serve the handler of `node` (and only it): from now on heartbeats refresh the node's
        lease and the actions `note`d before a write are combined (see "Scale")."""
        with self._lock:
            self._me, self._settings = self._nodes.setdefault(_key(node), node), settings
            self._node_lease.bind(self._me, settings)
            refresh_s = self._node_lease.refresh_s
            self._leases.refresh_s = refresh_s
            self._follower.bind(self._me, refresh_s)
            self._combiner.bind(self._me, settings, max(10.0, 3.0 * self._node_lease.ttl))

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

    def close(self) -> None:
        """Stop refreshing the lease (it lapses unless the handler refreshes it again, which
        starts the refresher again)."""
        self._node_lease.close()

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
            if not self._follower.unchanged():
                self._follower.read()
            return self._follower.view(held), self._follower.revision

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
                    return self._combiner.change(*noted)
                return self._write_as_is(state, token)
            except BaseException:
                if noted is not None:  # the handler writes again after a failed sync
                    self._notes.setdefault(threading.get_ident(), noted)
                raise

    def _heartbeat(
        self, state: _RendezvousState, token: Token | None
    ) -> tuple[_RendezvousState | None, Token, bool]:
        self.stats["heartbeats"] += 1
        self._node_lease.keep(force=True)
        follower = self._follower
        if token == follower.revision and follower.present:
            return state, token, True  # nothing newer known: the handler's own state stands
        return follower.view(), follower.revision, True

    def _write_as_is(
        self, state: _RendezvousState, token: Token | None
    ) -> tuple[_RendezvousState | None, Token, bool]:
        """A write that no action was noted for (not expected from `_NotingExecutor`): the
        handler's state, as a plain compare-and-swap."""
        self.stats["writes_as_is"] += 1
        follower = self._follower
        stored = follower.stored()
        written = persisted(state, stored)
        # None or 0: no state yet (mod revision 0); anything else not handed out cannot match
        base = 0 if token is None else token if isinstance(token, int) and token >= 0 else -1
        value, writes, after = follower.writes(written, stored, base)
        reply = self._wire.txn(
            "write",
            [_mod_is(self._wire.key, base)],
            [follower.read_op(), *writes],
            [follower.read_op()],
        )
        follower.absorb(reply.responses[0].response_range, reply.header.revision)
        if reply.succeeded:
            follower.wrote(value, written, after, int(reply.header.revision))
            follower.mark_handed()
            return state, follower.revision, True
        return follower.view(), follower.revision, False

    # -- unbound: one compare-and-swap of the whole state -----------------------------------

    def _get_plain(self) -> tuple[bytes, Token] | None:
        wire = self._wire
        value, revision = wire.etcd(wire.client.get_with_revision, wire.key)
        self.stats["requests"] += 1
        if value is None:
            return None
        self.stats["bytes_in"] += len(value)
        return wire.decode(value), revision

    def _set_plain(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            revision = 0
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            revision = token
        else:
            # Not a token we ever handed out: it cannot match, report what is there.
            current = self._get_plain()
            return None if current is None else (*current, False)
        wire, key = self._wire, self._wire.key
        value = wire.seal(key, state)
        # a node that follows the deltas reads a state written without one whole (`RELOAD`)
        plain = f"{self._delta_prefix}plain"
        reply = wire.txn(
            "write",
            [_mod_is(key, revision)],
            [
                _put(key, value),
                _put(plain, wire.seal(plain, RELOAD)),
                _put(self._written, ""),
                _rng(key),
            ],
            [_rng(key)],
        )
        applied = bool(reply.succeeded)
        self.stats["cas_won" if applied else "cas_lost"] += 1
        kvs = reply.responses[-1].response_range.kvs
        if not kvs:  # lost the race to a delete: no state at all
            return None
        return wire.decode(kvs[0].value.decode()), int(kvs[0].mod_revision), applied
