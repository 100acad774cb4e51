"""torch's handler over the etcd backend: `create_etcd3_handler` (what ``handler_factory``
registers), `create_backend` (the client, backend and c10d store of a run), and the subclasses of
torch's executor, state holder and handler that bind the backend to its handler (see
"Re-rendezvous fixes" and "Scale" in the package docstring)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.events.handlers import get_logging_handler
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousState,
)

from pipetransformer.edge.etcd_client import EtcdClient, EtcdConfigError, EtcdError
from pipetransformer.orchestrator.rendezvous.backend import EtcdRendezvousBackend
from pipetransformer.orchestrator.rendezvous.codec import load_secret
from pipetransformer.orchestrator.rendezvous.layout import store_prefix
from pipetransformer.orchestrator.rendezvous.replay import _APPLY
from pipetransformer.orchestrator.rendezvous.store import EtcdStore

DEFAULT_READ_TIMEOUT = 60
DEFAULT_RPC_TIMEOUT = 5.0


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
    etcd backend to itself (see "Re-rendezvous fixes" and "Scale" in the package docstring);
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
        try:  # TLS and identity from the environment, as every client here (edge/etcd_client/)
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
