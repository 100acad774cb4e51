"""The client: :class:`EtcdClient` over one endpoint, its retry policy and sign-in, and the
key/value, transaction, lease and Auth calls the control plane, workers and rendezvous use."""

from __future__ import annotations

import collections
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc
from pyetcd import utils as etcd_utils
from pyetcd.etcdrpc import rpc_pb2

from pipetransformer.edge.etcd_client.errors import (
    EtcdAuthFailed,
    EtcdError,
    EtcdPermissionDenied,
    EtcdTlsRefused,
    EtcdUnavailable,
    LeaseExpired,
    _code,
    _describe,
    _is_auth_failure,
    _is_tls_refusal,
    _is_transient,
)
from pipetransformer.edge.etcd_client.leases import KeepAlive, Lease, _KeepAliveStream
from pipetransformer.edge.etcd_client.tls import (
    CACERT_ENV,
    CERT_ENV,
    FROM_ENV,
    KEY_ENV,
    EtcdTls,
    _FromEnv,
    parse_endpoint,
)

log = logging.getLogger(__name__)

# gRPC reconnects with exponential backoff (up to 120 s by default); after an etcd restart we
# want the channel back within about a second.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# etcd's default --max-txn-ops: more operations in one transaction are rejected.
_MAX_TXN_OPS = 128


P = ParamSpec("P")
R = TypeVar("R")


def _retrying(method: Callable[P, R]) -> Callable[P, R]:
    """Run an ``EtcdClient`` method under the client's retry policy (see ``_call``)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        self = args[0]
        assert isinstance(self, EtcdClient)
        key = args[1] if len(args) > 1 and isinstance(args[1], str) else None
        return self._call(method.__name__, functools.partial(method, *args, **kwargs), key=key)

    return wrapper


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    # etcd reads key "\0" with range_end "\0" as "all keys"; prefix_range_end(b"") would not.
    if not prefix:
        return b"\0", b"\0"
    raw = prefix.encode()
    return raw, etcd_utils.prefix_range_end(raw)


@dataclass(frozen=True)
class EtcdStatus:
    version: str
    db_size: int
    raft_index: int
    raft_term: int


class EtcdClient:
    """etcd v3 client over one endpoint (``host:port``).

    ``timeout`` bounds each RPC; ``retry_timeout`` bounds the total time spent retrying
    transient failures of one call (0 disables retries). ``tls``: the TLS settings and
    identity (:class:`EtcdTls`), None for plaintext, by default those in the environment; a
    setting that cannot work (a missing file, a certificate without its key) is an
    :class:`EtcdConfigError` here, before anything is sent.
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float = 5.0,
        retry_timeout: float = 10.0,
        tls: EtcdTls | None | _FromEnv = FROM_ENV,
    ) -> None:
        host, port = parse_endpoint(endpoint)
        self.host, self.port = host, port
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.tls: EtcdTls | None = EtcdTls.from_env() if isinstance(tls, _FromEnv) else tls
        self._closed = False
        # (operation, seconds) of calls that succeeded only after riding out an outage, for
        # whoever reports them (the controller turns them into events); bounded
        self.recoveries: collections.deque[tuple[str, float]] = collections.deque(maxlen=100)
        # a password identity's token: fetched before the first call, again when etcd drops it
        self._auth_lock = threading.Lock()
        self._token: str | None = None
        self._auth_off = False  # etcd said auth is not enabled: no token to fetch (yet)
        creds = self.tls.credentials() if self.tls is not None else None
        # pyetcd joins host and port as they are: an IPv6 address needs its brackets for gRPC
        target = f"[{host}]" if ":" in host else host
        ep = pyetcd.Endpoint(
            target, port, secure=creds is not None, creds=creds, time_retry=0.0, opts=_GRPC_OPTIONS
        )
        self._client = pyetcd.MultiEndpointEtcd3Client(endpoints=[ep], timeout=timeout)
        self._keepalive_stream = _KeepAliveStream(self)

    @property
    def identity(self) -> str:
        """Who etcd takes this client for, for errors and logs."""
        return self.tls.identity if self.tls is not None else "a plaintext client"

    # -- authentication --------------------------------------------------------------------

    def _authenticate(self) -> None:
        """Fetch a token for the password identity (once; again after `_drop_token`)."""
        tls = self.tls
        if tls is None or not tls.user or self._token is not None or self._auth_off:
            return
        with self._auth_lock:
            if self._token is not None or self._auth_off:
                return
            request = rpc_pb2.AuthenticateRequest(name=tls.user, password=tls.password or "")
            try:
                reply = self._client.authstub.Authenticate(request, self.timeout)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (
                    exc.details() or ""
                ):
                    self._auth_off = True  # everything is allowed; look again on a refusal
                    return
                raise
            self._token = str(reply.token)
            # pyetcd sends its `metadata` with every call (watches aside, which we do not use)
            self._client.metadata = (("token", self._token),)

    def _drop_token(self) -> None:
        with self._auth_lock:
            self._token = None
            self._auth_off = False
            self._client.metadata = None

    # -- retry policy ----------------------------------------------------------------------

    def _call(
        self, op: str, fn: Callable[[], R], budget: float | None = None, key: str | None = None
    ) -> R:
        """Run ``fn``, retrying transient failures with capped exponential backoff + jitter.

        A password identity's token is fetched first; a token etcd no longer knows (it expires
        when idle, and dies with a restart) is fetched again and the call repeated. A user
        etcd refuses when this client signs in is retried like an outage: it may not exist yet.
        """
        budget = self.retry_timeout if budget is None else budget
        start = time.monotonic()
        delay = 0.05
        reauth = 0
        what = f"{op} {key}" if key is not None else op
        while True:
            if self._closed:
                raise EtcdError(f"etcd client for {self.endpoint} is closed")
            signing_in = True
            try:
                self._authenticate()
                signing_in = False
                result = fn()
            except ValueError as exc:
                if not self._closed:
                    raise
                # a call racing `close()`: gRPC refuses it on the closed channel with a
                # ValueError, which a caller expecting the client's errors would not catch (a
                # lease's refresher thread died of it with a traceback at every agent's exit)
                raise EtcdError(f"etcd client for {self.endpoint} is closed ({op})") from exc
            except (etcd_exc.Etcd3Exception, grpc.RpcError) as exc:
                code = _code(exc)
                user = self.tls is not None and bool(self.tls.user)
                stale = (
                    code == grpc.StatusCode.UNAUTHENTICATED
                    or (code == grpc.StatusCode.PERMISSION_DENIED and self._token is None)
                    or (
                        code == grpc.StatusCode.INVALID_ARGUMENT
                        and "auth store is old" in _describe(exc)
                    )
                )
                if user and stale and reauth < 3:
                    # the token expired or etcd restarted; or auth was enabled after we looked
                    reauth += 1
                    self._drop_token()
                    continue
                if _is_tls_refusal(exc):
                    raise EtcdTlsRefused(
                        f"the TLS handshake with etcd at {self.endpoint} failed ({what}: "
                        f"{_describe(exc)}); check {self._tls_settings()}, and that etcd's "
                        "certificate names the address dialled"
                    ) from exc
                if code == grpc.StatusCode.PERMISSION_DENIED:
                    raise EtcdPermissionDenied(
                        f"etcd refused {what} to {self.identity}: permission denied (its etcd "
                        "roles do not allow it; k8s/README.md, 'etcd: TLS and roles')"
                    ) from exc
                auth_failed = signing_in and _is_auth_failure(exc)
                if not auth_failed and not _is_transient(exc):
                    raise EtcdError(f"etcd {what} failed: {_describe(exc)}") from exc
                elapsed = time.monotonic() - start
                if elapsed + delay > budget:
                    if auth_failed:
                        raise EtcdAuthFailed(
                            f"etcd at {self.endpoint} refused the password of {self.identity} "
                            f"for {elapsed:.1f}s: a wrong password, or a user that was never "
                            "created (a job's trainer user is made by its controller)"
                        ) from exc
                    raise EtcdUnavailable(
                        self.endpoint, f"{op}: {_describe(exc)}{self._plaintext_hint(exc)}", elapsed
                    ) from exc
                log.debug("etcd %s: %s; retrying in %.2fs", op, _describe(exc), delay)
                time.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 1.0)
                continue
            if delay > 0.05:  # it failed at least once before succeeding
                self.recoveries.append((op, time.monotonic() - start))
            return result

    def _tls_settings(self) -> str:
        tls = self.tls
        if tls is None:
            return f"the server's address: a plaintext client reached a TLS port ({CACERT_ENV})"
        names = [f"{tls._name('ca_cert')}={tls.ca_cert}"]
        if tls.cert:
            names.append(f"{tls._name('cert')}={tls.cert}")
        else:
            names.append(f"{CERT_ENV}/{KEY_ENV} (no client certificate given)")
        return ", ".join(names)

    def _plaintext_hint(self, exc: BaseException) -> str:
        # a TLS-only etcd closes a plaintext connection without a word
        if self.tls is None and "Socket closed" in _describe(exc):
            return f" (a TLS etcd closes plaintext connections: is {CACERT_ENV} needed?)"
        return ""

    # -- key/value -------------------------------------------------------------------------

    @_retrying
    def get(self, key: str) -> str | None:
        """Value of ``key`` or ``None``."""
        value, _ = self._client.get(key)
        return _text(value)

    @_retrying
    def get_with_revision(self, key: str) -> tuple[str | None, int]:
        """(value, mod revision); ``(None, 0)`` when the key does not exist."""
        value, meta = self._client.get(key)
        if meta is None:
            return None, 0
        return _text(value), int(meta.mod_revision)

    @_retrying
    def put(self, key: str, value: str, lease: Lease | None = None) -> None:
        """Set ``key``; with ``lease`` the key is deleted when the lease ends."""
        self._client.put(key, value, lease=lease.id if lease is not None else 0)

    @_retrying
    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return bool(self._client.delete(key))

    @_retrying
    def delete_at_revision(self, key: str, revision: int) -> bool:
        """Delete ``key`` if its mod revision is still ``revision``; True if deleted."""
        tx = self._client.transactions
        ok, _ = self._client.transaction(
            compare=[tx.mod(key) == int(revision)], success=[tx.delete(key)], failure=[]
        )
        return bool(ok)

    @_retrying
    def get_prefix(self, prefix: str) -> list[tuple[str, str]]:
        """All (key, value) pairs under ``prefix``, sorted by key (``""`` = every key)."""
        start, end = _prefix_range(prefix)
        response = self._client.get_range_response(
            start, end, sort_order="ascend", sort_target="key"
        )
        return [(kv.key.decode(), kv.value.decode()) for kv in response.kvs]

    @_retrying
    def count_prefix(self, prefix: str) -> int:
        """Number of keys under ``prefix``."""
        start, end = _prefix_range(prefix)
        return int(self._client.get_range_response(start, end, count_only=True).count)

    @_retrying
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (``""`` = every key); returns how many."""
        start, end = _prefix_range(prefix)
        tx = self._client.transactions
        _, responses = self._client.transaction(
            compare=[], success=[tx.delete(start, range_end=end)], failure=[]
        )
        return int(responses[0].response_delete_range.deleted)

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys``, in one transaction per ``_MAX_TXN_OPS`` keys (etcd's --max-txn-ops)
        instead of one request each; returns how many existed."""
        return sum(
            self._delete_batch(keys[start : start + _MAX_TXN_OPS])
            for start in range(0, len(keys), _MAX_TXN_OPS)
        )

    @_retrying
    def _delete_batch(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        tx = self._client.transactions
        _, responses = self._client.transaction(
            compare=[], success=[tx.delete(k) for k in keys], failure=[]
        )
        return sum(int(r.response_delete_range.deleted) for r in responses)

    @_retrying
    def get_many(self, keys: Sequence[str]) -> list[str | None]:
        """Values of ``keys`` (None where absent), read in one transaction (one snapshot)."""
        if not keys:
            return []
        tx = self._client.transactions
        _, responses = self._client.transaction(
            compare=[], success=[tx.get(k) for k in keys], failure=[]
        )
        return [kvs[0][0].decode() if kvs else None for kvs in responses]

    def put_many(self, items: Sequence[tuple[str, str]]) -> None:
        """Put several keys; atomic per batch of ``_MAX_TXN_OPS`` (etcd's --max-txn-ops)."""
        for start in range(0, len(items), _MAX_TXN_OPS):
            self._put_batch(items[start : start + _MAX_TXN_OPS])

    @_retrying
    def _put_batch(self, items: Sequence[tuple[str, str]]) -> None:
        tx = self._client.transactions
        self._client.transaction(compare=[], success=[tx.put(k, v) for k, v in items], failure=[])

    # -- conditional writes (transactions) -------------------------------------------------

    @_retrying
    def put_if_absent(self, key: str, value: str, lease: Lease | None = None) -> bool:
        """Create ``key`` only if it does not exist; True if we created it."""
        tx = self._client.transactions
        ok, _ = self._client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, value, lease=lease.id if lease is not None else 0)],
            failure=[],
        )
        return bool(ok)

    @_retrying
    def compare_and_swap(self, key: str, expected: str | None, value: str) -> bool:
        """Set ``key`` to ``value`` if it currently holds ``expected`` (None = absent)."""
        tx = self._client.transactions
        compare = tx.create(key) == 0 if expected is None else tx.value(key) == expected
        ok, _ = self._client.transaction(
            compare=[compare], success=[tx.put(key, value)], failure=[]
        )
        return bool(ok)

    def put_if_revision(self, key: str, value: str, revision: int) -> bool:
        """Set ``key`` if its mod revision is ``revision`` (0 = key must not exist)."""
        return self.try_put_at_revision(key, value, revision)[0]

    @_retrying
    def try_put_at_revision(
        self, key: str, value: str, revision: int
    ) -> tuple[bool, str | None, int]:
        """Conditional put on the mod revision, plus what is stored afterwards, atomically.

        Returns ``(applied, value, mod_revision)`` read in the same transaction: our value and
        its new revision when applied, otherwise the current value (None, 0 if absent).
        """
        tx = self._client.transactions
        ok, responses = self._client.transaction(
            # A missing key compares as mod revision 0, so revision 0 means "create".
            compare=[tx.mod(key) == int(revision)],
            success=[tx.put(key, value), tx.get(key)],
            failure=[tx.get(key)],
        )
        kvs = responses[-1]  # pyetcd turns a range response into [(value, KVMetadata)]
        if not kvs:
            return bool(ok), None, 0
        raw, meta = kvs[0]
        return bool(ok), raw.decode(), int(meta.mod_revision)

    # -- leases ----------------------------------------------------------------------------

    @_retrying
    def lease(self, ttl: int) -> Lease:
        """Grant a lease of ``ttl`` seconds (etcd may round small TTLs up)."""
        granted = self._client.lease(int(ttl))
        return Lease(self, int(granted.id), int(granted.ttl))

    @_retrying
    def refresh_lease(self, lease_id: int) -> int:
        """Send one keep-alive; returns the new TTL or raises :class:`LeaseExpired`."""
        ttl = self._keepalive_stream.refresh(lease_id)
        if ttl is None:  # the shared stream could not answer: one stream of its own
            responses = list(self._client.refresh_lease(lease_id))
            ttl = int(responses[0].TTL) if responses else 0
        if ttl <= 0:  # etcd answers TTL 0 (not an error) for an unknown lease
            raise LeaseExpired(f"etcd lease {lease_id:#x} has expired or was revoked")
        return ttl

    @_retrying
    def lease_remaining(self, lease_id: int) -> int:
        """Seconds left on the lease, -1 if it no longer exists."""
        return int(self._client.get_lease_info(lease_id).TTL)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease; a lease that is already gone is not an error."""
        try:
            self._revoke(lease_id)
        except EtcdError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise

    @_retrying
    def _revoke(self, lease_id: int) -> None:
        self._client.revoke_lease(lease_id)

    def keep_alive(
        self,
        lease: Lease,
        interval: float | None = None,
        on_expired: Callable[[Lease], None] | None = None,
    ) -> KeepAlive:
        """Start and return a :class:`KeepAlive` for ``lease``."""
        return KeepAlive(lease, interval, on_expired).start()

    # -- users and roles (etcd's Auth service) ---------------------------------------------

    def auth_rpc(self, method: str, request: Any) -> Any:
        """One call of etcd's Auth service (``"RoleAdd"``, ``"UserGet"``, ...: user and role
        management, orchestrator/etcd_auth.py) under the retry policy; its answer as is."""
        call = getattr(self._client.authstub, method)
        return self._call(
            method, lambda: call(request, self.timeout, metadata=self._client.metadata)
        )

    # -- cluster ---------------------------------------------------------------------------

    def _status_once(self) -> EtcdStatus:
        s = self._client.status()
        return EtcdStatus(str(s.version), int(s.db_size), int(s.raft_index), int(s.raft_term))

    @_retrying
    def status(self) -> EtcdStatus:
        """Status of the member we talk to (a cheap liveness probe)."""
        return self._status_once()

    def wait_ready(self, timeout: float) -> EtcdStatus:
        """Block until etcd answers, or raise :class:`EtcdUnavailable` after ``timeout`` s."""
        return self._call("wait_ready", self._status_once, budget=timeout)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdClient({self.endpoint!r})"

    def __getstate__(self) -> dict[str, Any]:
        # A gRPC channel cannot cross a process boundary; pickle the address (and the settings
        # it was made with, not a token) and reconnect.
        return {
            "endpoint": self.endpoint,
            "timeout": self.timeout,
            "retry": self.retry_timeout,
            "tls": self.tls,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["endpoint"], state["timeout"], state["retry"], tls=state.get("tls", FROM_ENV)
        )
