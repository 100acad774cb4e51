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
* **TLS and identity from one place.** Every client, whichever role builds it (controller,
  ``pipetransformer workers``, the workers, torchrun's rendezvous, the dashboard), takes its
  TLS settings and etcd identity from the environment unless given others (:class:`EtcdTls`,
  ``$PIPETRANSFORMER_ETCD_CACERT``/``_CERT``/``_KEY``/``_USER``/``_PASSWORD[_FILE]``), so a pod
  is configured by its environment alone. A password identity's token is fetched lazily and
  fetched again when etcd drops it (tokens expire when idle and die with a restart). What etcd
  refuses (a certificate it does not trust, a permission the identity lacks) is an error at
  once, naming the identity; a user that does not exist yet is waited for like an outage (a
  job's controller creates its trainers' user while they start).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import random
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, ParamSpec, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc
from pyetcd import utils as etcd_utils
from pyetcd.etcdrpc import rpc_pb2

__all__ = [
    "CACERT_ENV",
    "CERT_ENV",
    "FROM_ENV",
    "KEY_ENV",
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "USER_ENV",
    "EtcdAuthFailed",
    "EtcdClient",
    "EtcdConfigError",
    "EtcdError",
    "EtcdPermissionDenied",
    "EtcdStatus",
    "EtcdTls",
    "EtcdTlsRefused",
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
_DEADLINE_TEXT = "context deadline exceeded"
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


class EtcdConfigError(EtcdError, ValueError):
    """The client's TLS or identity settings are wrong (one line naming the setting)."""


class EtcdTlsRefused(EtcdError):
    """The TLS handshake failed on a certificate: the client's (not trusted, none given) or the
    server's (not signed by our CA, not issued for the name we dialled). Retrying cannot help."""


class EtcdPermissionDenied(EtcdError):
    """etcd refused the operation to this client's identity (its roles do not cover the key)."""


class EtcdAuthFailed(EtcdError):
    """etcd refused the user and password (wrong, or the user does not exist)."""


# -- TLS and identity ------------------------------------------------------------------------

# The environment every role's client reads (EtcdTls.from_env): the pod contract's names.
CACERT_ENV = "PIPETRANSFORMER_ETCD_CACERT"  # PEM CA bundle etcd's certificate must chain to
CERT_ENV = "PIPETRANSFORMER_ETCD_CERT"  # PEM client certificate (etcd: user = its CN)
KEY_ENV = "PIPETRANSFORMER_ETCD_KEY"  # its private key
USER_ENV = "PIPETRANSFORMER_ETCD_USER"  # a password identity instead of the certificate's CN
PASSWORD_ENV = "PIPETRANSFORMER_ETCD_PASSWORD"
PASSWORD_FILE_ENV = "PIPETRANSFORMER_ETCD_PASSWORD_FILE"  # a file holding it (a mounted Secret)

_MAX_PEM_BYTES = 1 << 20


def _read_setting(path: str, where: str, what: str, marker: bytes) -> bytes:
    """The bytes of a PEM file, or EtcdConfigError naming the setting and the path."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM_BYTES)
    except OSError as exc:
        raise EtcdConfigError(
            f"{where}={path}: cannot read the {what}: {exc.strerror or exc}"
        ) from None
    if marker not in data:
        raise EtcdConfigError(f"{where}={path}: not a PEM {what} (no '{marker.decode()}' line)")
    return data


@dataclass(frozen=True)
class EtcdTls:
    """How a client reaches a TLS etcd and who it is there.

    ``ca_cert`` (a PEM bundle) turns TLS on and is what the server's certificate must chain to;
    ``cert``/``key`` are the client certificate, needed by an etcd started with
    ``--client-cert-auth`` and, with auth enabled, the identity (the user named by its CN);
    ``user``/``password`` authenticate as that user instead (etcd prefers a token over the
    certificate's CN). A password is only sent over TLS.
    """

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    # what each field is called in errors: the environment variable it came from, or itself
    names: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            given, missing = ("cert", "key") if self.cert else ("key", "cert")
            raise EtcdConfigError(
                f"{self._name(given)} is set but {self._name(missing)} is not: a client "
                "certificate needs both the certificate and its key"
            )
        if bool(self.user) != (self.password is not None):
            given, missing = ("user", "password") if self.user else ("password", "user")
            raise EtcdConfigError(f"{self._name(given)} is set but {self._name(missing)} is not")
        if self.password is not None and not self.password:
            raise EtcdConfigError(f"{self._name('password')} is empty")
        if (self.cert or self.user) and not self.ca_cert:
            what = "a client certificate" if self.cert else "a password"
            raise EtcdConfigError(
                f"{self._name('cert' if self.cert else 'user')} is set but "
                f"{self._name('ca_cert')} is not: {what} is only used over TLS, which needs "
                "the CA that signed etcd's certificate"
            )

    def _name(self, attr: str) -> str:
        return self.names.get(attr, attr)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdTls | None:
        """The settings in the environment; None when none is set (plaintext, no identity).
        A password file that cannot be read is an EtcdConfigError naming it."""
        env = os.environ if environ is None else environ
        names = {
            "ca_cert": CACERT_ENV,
            "cert": CERT_ENV,
            "key": KEY_ENV,
            "user": USER_ENV,
            "password": PASSWORD_ENV,
        }
        password = env.get(PASSWORD_ENV) or None
        if password is None and (path := env.get(PASSWORD_FILE_ENV)):
            names["password"] = PASSWORD_FILE_ENV
            try:
                with open(path, encoding="utf-8") as f:
                    password = f.read(4096).strip()
            except OSError as exc:
                raise EtcdConfigError(
                    f"{PASSWORD_FILE_ENV}={path}: cannot read the password: {exc.strerror or exc}"
                ) from None
        values = {attr: env.get(var) or None for attr, var in names.items() if attr != "password"}
        if not any(values.values()) and password is None:
            return None
        return cls(**values, password=password, names=names)

    @property
    def identity(self) -> str:
        """Who etcd takes this client for, for errors."""
        if self.user:
            return f"user {self.user!r}"
        if self.cert:
            cn = _common_name(self.cert)
            return f"the certificate {self.cert}" + (f" (CN {cn!r})" if cn else "")
        return "a client without a certificate"

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials, after checking each file (EtcdConfigError naming it)."""
        assert self.ca_cert
        ca = _read_setting(self.ca_cert, self._name("ca_cert"), "CA certificate", b"CERTIFICATE")
        try:
            ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise EtcdConfigError(
                f"{self._name('ca_cert')}={self.ca_cert}: not a usable CA certificate ({exc})"
            ) from None
        if not self.cert:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        assert self.key
        chain = _read_setting(self.cert, self._name("cert"), "client certificate", b"CERTIFICATE")
        key = _read_setting(self.key, self._name("key"), "private key", b"PRIVATE KEY")
        if b"ENCRYPTED" in key:
            raise EtcdConfigError(
                f"{self._name('key')}={self.key}: the private key is encrypted; gRPC takes an "
                "unencrypted one (`openssl pkey -in KEY -out PLAIN`), kept in a Secret"
            )
        try:  # a key that does not match the certificate fails here, not in a handshake later
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_cert_chain(self.cert, self.key, password="")  # never a prompt
        except (ssl.SSLError, OSError) as exc:
            raise EtcdConfigError(
                f"{self._name('cert')}={self.cert}, {self._name('key')}={self.key}: the "
                f"certificate and key do not make a pair ({exc})"
            ) from None
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=chain
        )


def _common_name(path: str) -> str | None:
    """The CN of a PEM certificate, best effort (CPython's own decoder; None if it cannot)."""
    try:
        decoded = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except Exception:
        return None
    for rdn in decoded.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return str(value)
    return None


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Final = _FromEnv()
"""`EtcdClient(tls=FROM_ENV)`, the default: the settings in the environment (EtcdTls.from_env)."""

# gRPC's words for a handshake that failed on a certificate (ours refused, theirs not trusted or
# not for this name) or on a server that does not speak TLS: configuration, not an outage.
_TLS_REFUSAL = re.compile(
    r"CERTIFICATE|UNKNOWN_CA|WRONG_VERSION_NUMBER|Hostname Verification|not in peer certificate",
    re.I,
)


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
    code = _code(exc)
    if code in _TRANSIENT_CODES:
        return True
    # a linearizable read whose wait for etcd's apply loop outlived the call's deadline can come
    # back as UNKNOWN "context deadline exceeded" instead of DEADLINE_EXCEEDED (etcd-io/etcd#8809):
    # a busy etcd, not a refusal. Seen at 1,024 rendezvous agents; it failed an agent's join.
    return code == grpc.StatusCode.UNKNOWN and _describe(exc).endswith(_DEADLINE_TEXT)


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind ``exc``: pyetcd turns some codes into its own exceptions, raised
    while handling the gRPC one (which keeps the server's words)."""
    for candidate in (exc, exc.__context__):
        if isinstance(candidate, grpc.RpcError) and hasattr(candidate, "code"):
            return candidate
    return None


def _code(exc: BaseException) -> grpc.StatusCode | None:
    rpc = _rpc_error(exc)
    return rpc.code() if rpc is not None else None


def _describe(exc: BaseException) -> str:
    rpc = _rpc_error(exc)
    if rpc is not None:
        return f"{rpc.code().name}: {rpc.details()}"
    return f"{type(exc).__name__}: {exc}"


def _is_auth_failure(exc: BaseException) -> bool:
    # INVALID_ARGUMENT "etcdserver: authentication failed, invalid user ID or password"
    return _code(exc) == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in (
        _describe(exc)
    )


def _is_tls_refusal(exc: BaseException) -> bool:
    return _code(exc) == grpc.StatusCode.UNAVAILABLE and bool(_TLS_REFUSAL.search(_describe(exc)))


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


_ENDED = object()  # a keep-alive stream ended before it answered


class _KeepAliveStream:
    """One lease keep-alive stream per client, shared by every lease refreshed through it (as
    etcd's own Go client multiplexes its leases): pyetcd opens a stream, and a thread to feed
    it, for every refresh (a millisecond of CPU, every second, for every lease), and streams
    opened per refresh on one connection serialise on its channel. A reader thread hands each
    answer to the refresh waiting for that lease. A stream lives `_LIFE_S` at most; whatever
    goes wrong ends it and fails the refreshes waiting on it, which are sent once more on a
    fresh stream, then the ordinary way (`EtcdClient.refresh_lease`). A refresh not answered
    within the client's timeout ends the stream only if it answered nothing meanwhile
    (hung); a stream that answers
    others is behind, not hung, and the refresh waits on (up to `_PATIENCE` timeouts): ending
    it would send every lease of the client to a stream of its own at once, on an etcd or a
    host already too slow (1,024 simulated nodes' refreshes then never got through)."""

    _LIFE_S = 30.0
    _PATIENCE = 3

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._requests: queue.Queue[rpc_pb2.LeaseKeepAliveRequest | None] | None = None
        self._replies: Any = None
        self._pid = 0  # the process that opened the stream (a forked child opens its own)
        self._answered = 0.0  # when the stream last answered (monotonic)
        # the open stream's lease id -> the refreshes waiting for its answer, oldest first:
        # (done, [TTL or None]); each stream has its own (an ended one fails only its own)
        self._waiting: dict[int, list[tuple[threading.Event, list[int | None]]]] = {}

    def refresh(self, lease_id: int) -> int | None:
        """The lease's TTL after the refresh (0: it is gone); None when the stream gave no
        answer in time (or could not open). A refresh whose stream ended before answering (its
        life ran out, etcd closed it) is sent once more on a fresh one: the way out, a stream
        of its own, cost a starved process seconds (1,024 simulated nodes' last survivors)."""
        for _attempt in range(2):
            ttl = self._refresh_once(lease_id)
            if ttl is not _ENDED:
                return ttl if isinstance(ttl, int) else None
        return None

    def _refresh_once(self, lease_id: int) -> int | None | object:
        """`refresh` on the current stream; `_ENDED` if that stream ended first."""
        waiter: tuple[threading.Event, list[int | None]] = (threading.Event(), [None])
        with self._lock:
            try:
                if self._requests is None or self._pid != os.getpid():
                    self._open()
            except grpc.RpcError:
                return None
            assert self._requests is not None
            waiting = self._waiting
            waiting.setdefault(lease_id, []).append(waiter)
            self._requests.put(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
        timeout = self._client.timeout
        sent = time.monotonic()
        while not waiter[0].wait(timeout):
            now = time.monotonic()
            if now - self._answered > timeout or now - sent >= self._PATIENCE * timeout:
                break  # hung (nothing answered meanwhile), or too far behind
        if waiter[0].is_set():
            return _ENDED if waiter[1][0] is None else waiter[1][0]
        with self._lock:
            if waiter[0].is_set():  # answered, or ended, just now
                return _ENDED if waiter[1][0] is None else waiter[1][0]
            waiters = waiting.get(lease_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
                hung = time.monotonic() - self._answered > timeout
                if hung and waiting is self._waiting and self._replies is not None:
                    # a stream that hangs is not used again: the next refresh opens another
                    self._replies.cancel()
                    self._requests = self._replies = None
        return None

    def _open(self) -> None:
        requests: queue.Queue[rpc_pb2.LeaseKeepAliveRequest | None] = queue.Queue()
        life = self._LIFE_S

        def feed() -> Iterable[rpc_pb2.LeaseKeepAliveRequest]:
            # gRPC's feeding thread waits here; it ends with the stream, or when idle that long
            while True:
                try:
                    item = requests.get(timeout=life)
                except queue.Empty:
                    return
                if item is None:
                    return
                yield item

        raw = self._client._client  # pyetcd: its lease stub and the client's sign-in token
        replies = raw.leasestub.LeaseKeepAlive(feed(), life, metadata=raw.metadata)
        self._requests, self._replies, self._pid = requests, replies, os.getpid()
        self._answered = time.monotonic()
        self._waiting = waiting = {}
        threading.Thread(
            target=self._read,
            args=(requests, replies, waiting),
            name="etcd-keepalive-stream",
            daemon=True,
        ).start()

    def _read(
        self,
        requests: queue.Queue[Any],
        replies: Any,
        waiting: dict[int, list[tuple[threading.Event, list[int | None]]]],
    ) -> None:
        try:
            for reply in replies:
                with self._lock:
                    self._answered = time.monotonic()
                    waiters = waiting.get(int(reply.ID))
                    if waiters:
                        done, answer = waiters.pop(0)
                        answer[0] = int(reply.TTL)
                        done.set()
        except grpc.RpcError:
            pass  # its life ran out, or etcd went: the waiting refreshes go the ordinary way
        finally:
            with self._lock:
                if self._requests is requests:
                    self._requests = self._replies = None
                for waiters in waiting.values():
                    for done, _answer in waiters:
                        done.set()
                waiting.clear()
            requests.put(None)
            replies.cancel()


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
