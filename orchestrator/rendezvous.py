"""torchrun rendezvous over etcd v3: ``--rdzv-backend etcd3 --rdzv-endpoint HOST:PORT``.

torch ships two etcd backends and both speak the v2 HTTP API, which etcd 3.4+ disables by
default; this one speaks v3 (gRPC, through :mod:`core.etcd_client`). It plugs into
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
    Blocking reads poll with capped backoff (10 ms to 200 ms) rather than watch: the agents'
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

Options (``--rdzv-conf k=v,...``), besides torch's join_timeout, last_call_timeout,
close_timeout, heartbeat_timeout, keep_alive_interval and keep_alive_max_attempt:

    read_timeout   seconds a blocking store read waits, and how long an etcd outage is ridden
                   out (retries) before a ``RendezvousConnectionError``; default 60, as c10d.
    rpc_timeout    seconds for one etcd RPC; default 5.
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
    return create_etcd3_handler(params)


import binascii
import hashlib
import hmac
import os
import random
import socket
import time
from base64 import b64decode, b64encode
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from core import keys
from core.etcd_client import EtcdClient, EtcdConfigError, EtcdError
from core.protocol import RendezvousRefused

__all__ = [
    "BACKEND_NAME",
    "EtcdRendezvousBackend",
    "EtcdStore",
    "create_backend",
    "create_etcd3_handler",
    "delete_rendezvous",
    "handler_factory",
    "load_secret",
    "sign_state",
    "state_key",
    "store_prefix",
    "verify_state",
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


# -- backend --------------------------------------------------------------------------------


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key, fenced by its mod revision."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        secret: bytes | None = None,
        job_id: str | None = None,
    ) -> None:
        """`secret`: sign what is written and refuse what does not verify (see "Trust");
        `job_id`: where a refusal is reported for the controller."""
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._run_id = run_id
        self._key = state_key(run_id)
        self._secret = secret
        self._job_id = job_id

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """Current state and its token (mod revision), or None if there is none."""
        value, revision = self._etcd(self._client.get_with_revision, self._key)
        if value is None:
            return None
        return self._decode(value), revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if ``token`` is still current (None: only if no state exists)."""
        if token is None:
            revision = 0
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            revision = token
        else:
            # Not a token we ever handed out: it cannot match, report what is there.
            current = self.get_state()
            return None if current is None else (*current, False)
        value = _b64(state) if self._secret is None else sign_state(self._secret, self._key, state)
        applied, value, new_revision = self._etcd(
            self._client.try_put_at_revision, self._key, value, revision
        )
        if value is None:  # lost the race to a delete: no state at all
            return None
        return self._decode(value), new_revision, applied

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
    _POLL_MAX = 0.2

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
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
        values = self._etcd(self._client.get_many, [self._k(k) for k in keys])
        return all(v is not None for v in values)

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
            values = self._etcd(self._client.get_many, full)
            if all(v is not None for v in values):
                return values
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise dist.DistStoreError(
                    f"etcd store: timed out after {budget:.1f}s waiting for keys {missing} "
                    f"under {self._prefix}"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, self._POLL_MAX)


# -- handler --------------------------------------------------------------------------------


class _EtcdRendezvousHandler(DynamicRendezvousHandler):
    """``DynamicRendezvousHandler`` that rebuilds MASTER_ADDR/PORT every round.

    See "Re-rendezvous fix" in the module docstring; touches two private members of torch's
    handler, both present since the TCPStore-sharing change (torch 2.4) through 2.13.
    """

    def next_rendezvous(self) -> RendezvousInfo:
        self._bootstrap_store_info = None
        return super().next_rendezvous()

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


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Build the etcd client, state backend and c10d store for ``params``."""
    if not params.endpoint:
        raise ValueError("The etcd3 rendezvous needs --rdzv-endpoint HOST:PORT of etcd.")
    read_timeout = _positive(params, "read_timeout", DEFAULT_READ_TIMEOUT)
    rpc_timeout = _positive(params, "rpc_timeout", DEFAULT_RPC_TIMEOUT)
    try:  # TLS and identity from the environment, as every client here (core/etcd_client.py)
        client = EtcdClient(params.endpoint, timeout=rpc_timeout, retry_timeout=read_timeout)
    except EtcdConfigError as exc:
        raise RendezvousConnectionError(f"The etcd3 rendezvous cannot use etcd: {exc}") from None
    try:
        # Fail fast and clearly on a wrong endpoint instead of deep inside the join loop.
        client.wait_ready(timeout=read_timeout)
    except EtcdError as exc:
        client.close()
        raise RendezvousConnectionError(
            f"The etcd3 rendezvous cannot reach etcd at {params.endpoint}: {exc}"
        ) from exc
    try:
        secret = load_secret()
    except ValueError as exc:
        client.close()
        raise RendezvousStateError(str(exc)) from None
    job = params.get("job") or None
    backend = EtcdRendezvousBackend(client, params.run_id, secret, job)
    store = EtcdStore(client, store_prefix(params.run_id), timedelta(seconds=read_timeout))
    return backend, store


def _timeout(params: RendezvousParameters, name: str) -> timedelta | None:
    seconds = params.get_as_int(f"{name}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def create_etcd3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun handler creator for ``--rdzv-backend etcd3``."""
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
    backend, store = create_backend(params)
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
