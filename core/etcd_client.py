"""A thin, typed etcd v3 client: the small API the controller, workers and rendezvous use.

It wraps ``pyetcd`` (the ``etcd-sdk-python`` fork of python-etcd3) and adds what that
library leaves to the caller:

* **str in, str out.** Keys and values are text (callers JSON-encode); an empty prefix means
  "every key".
* **Retries.** A transient failure (etcd down, restarting, or a deadline hit) is retried with
  bounded exponential backoff for up to ``retry_timeout`` seconds, then surfaces as
  :class:`EtcdUnavailable` naming the endpoint. Other server errors become :class:`EtcdError`.
  Note a retried conditional write (txn) whose first attempt was applied but whose answer was
  lost reports "not applied" on the retry; the callers here re-read and converge.
* **A usable single endpoint.** pyetcd marks an endpoint "failed" for 300 s after one
  UNAVAILABLE error and then refuses to use it at all (``ValueError``) unless failover to
  another endpoint is possible; we build the endpoint with ``time_retry=0`` so a restarted
  etcd is used again at once, and cap gRPC's reconnect backoff at one second.
* **Leases** with :class:`KeepAlive`, a background refresher that notices expiry.
"""

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

__all__ = [
    "EtcdClient",
    "EtcdError",
    "EtcdStatus",
    "EtcdUnavailable",
    "KeepAlive",
    "Lease",
    "LeaseExpired",
    "parse_endpoint",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379

# gRPC reconnects with exponential backoff (up to 120 s by default); after an etcd restart we
# want the channel back within about a second.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# etcd's default --max-txn-ops: more operations in one transaction are rejected.
_MAX_TXN_OPS = 128

_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_TRANSIENT_ERRORS = (
    etcd_exc.ConnectionFailedError,  # UNAVAILABLE: refused, reset, no leader
    etcd_exc.ConnectionTimeoutError,  # DEADLINE_EXCEEDED
    etcd_exc.NoServerAvailableError,
)


class EtcdError(Exception):
    """etcd answered with an error (or the client is closed)."""


class EtcdUnavailable(EtcdError, ConnectionError):
    """etcd could not be reached within the retry budget."""

    def __init__(self, endpoint: str, detail: str = "", elapsed: float | None = None) -> None:
        self.endpoint = endpoint
        self.detail = detail
        self.elapsed = elapsed
        took = f" after {elapsed:.1f}s" if elapsed is not None else ""
        super().__init__(f"etcd at {endpoint} is unavailable{took}: {detail or 'no answer'}")


class LeaseExpired(EtcdError):
    """The lease is gone (expired or revoked); keys attached to it were deleted."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (optionally ``http://``-prefixed, port defaults to 2379) -> (host, port)."""
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
    text = text.rstrip("/")
    if not text:
        raise ValueError(f"empty etcd endpoint {endpoint!r}")
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not host:
        raise ValueError(f"etcd endpoint {endpoint!r} has no host")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"etcd endpoint {endpoint!r} has a bad port {port!r}") from None


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT_ERRORS):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in _TRANSIENT_CODES


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


P = ParamSpec("P")
R = TypeVar("R")


def _retrying(method: Callable[P, R]) -> Callable[P, R]:
    """Run an ``EtcdClient`` method under the client's retry policy (see ``_call``)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        self = args[0]
        assert isinstance(self, EtcdClient)
        return self._call(method.__name__, functools.partial(method, *args, **kwargs))

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


class Lease:
    """An etcd lease; keys put with it are deleted when it expires or is revoked."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int) -> None:
        self._client = client
        self.id = lease_id
        self.ttl = ttl

    def refresh(self) -> int:
        """Reset the TTL; returns it. Raises :class:`LeaseExpired` if the lease is gone."""
        return self._client.refresh_lease(self.id)

    def remaining(self) -> int:
        """Seconds left (-1 once expired)."""
        return self._client.lease_remaining(self.id)

    def revoke(self) -> None:
        """Drop the lease now (its keys go with it). Revoking a gone lease is a no-op."""
        self._client.revoke_lease(self.id)

    def __repr__(self) -> str:
        return f"Lease(id={self.id:#x}, ttl={self.ttl})"


class KeepAlive:
    """Background thread refreshing a lease every ``interval`` (default ttl/3) seconds.

    It keeps trying through etcd outages (etcd extends leases when it comes back); it stops
    for good only when the lease is reported gone, then sets :attr:`expired` and calls
    ``on_expired`` once (from the keep-alive thread).
    """

    def __init__(
        self,
        lease: Lease,
        interval: float | None = None,
        on_expired: Callable[[Lease], None] | None = None,
    ) -> None:
        self.lease = lease
        self.interval = interval if interval is not None else max(lease.ttl / 3.0, 0.1)
        self.on_expired = on_expired
        self.expired = threading.Event()
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-keepalive-{lease.id:x}", daemon=True
        )

    def start(self) -> KeepAlive:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.lease.refresh()
                self.last_error = None
            except LeaseExpired as exc:
                if self._stop.is_set():  # revoked by our own stop(revoke=True): not a loss
                    return
                self.last_error = exc
                self.expired.set()
                log.warning("etcd lease %#x expired", self.lease.id)
                if self.on_expired is not None:
                    self.on_expired(self.lease)
                return
            except EtcdError as exc:  # unavailable for a while: try again next tick
                self.last_error = exc
                log.warning("etcd lease %#x refresh failed: %s", self.lease.id, exc)

    def stop(self, revoke: bool = False) -> None:
        """Stop refreshing; ``revoke=True`` also drops the lease (and its keys) now."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if revoke and not self.expired.is_set():
            self.lease.revoke()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> KeepAlive:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdClient:
    """etcd v3 client over one endpoint (``host:port``).

    ``timeout`` bounds each RPC; ``retry_timeout`` bounds the total time spent retrying
    transient failures of one call (0 disables retries).
    """

    def __init__(self, endpoint: str, timeout: float = 5.0, retry_timeout: float = 10.0) -> None:
        host, port = parse_endpoint(endpoint)
        self.host, self.port = host, port
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self._closed = False
        # (operation, seconds) of calls that succeeded only after riding out an outage, for
        # whoever reports them (the controller turns them into events); bounded
        self.recoveries: collections.deque[tuple[str, float]] = collections.deque(maxlen=100)
        ep = pyetcd.Endpoint(host, port, secure=False, time_retry=0.0, opts=_GRPC_OPTIONS)
        self._client = pyetcd.MultiEndpointEtcd3Client(endpoints=[ep], timeout=timeout)

    # -- retry policy ----------------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[], R], budget: float | None = None) -> R:
        """Run ``fn``, retrying transient failures with capped exponential backoff + jitter."""
        budget = self.retry_timeout if budget is None else budget
        start = time.monotonic()
        delay = 0.05
        while True:
            if self._closed:
                raise EtcdError(f"etcd client for {self.endpoint} is closed")
            try:
                result = fn()
            except (etcd_exc.Etcd3Exception, grpc.RpcError) as exc:
                if not _is_transient(exc):
                    raise EtcdError(f"etcd {op} failed: {_describe(exc)}") from exc
                elapsed = time.monotonic() - start
                if elapsed + delay > budget:
                    raise EtcdUnavailable(
                        self.endpoint, f"{op}: {_describe(exc)}", elapsed
                    ) from exc
                log.debug("etcd %s: %s; retrying in %.2fs", op, _describe(exc), delay)
                time.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 1.0)
                continue
            if delay > 0.05:  # it failed at least once before succeeding
                self.recoveries.append((op, time.monotonic() - start))
            return result

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
        # A gRPC channel cannot cross a process boundary; pickle the address and reconnect.
        return {"endpoint": self.endpoint, "timeout": self.timeout, "retry": self.retry_timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["endpoint"], state["timeout"], state["retry"])  # type: ignore[misc]
