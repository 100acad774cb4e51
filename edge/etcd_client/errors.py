"""The etcd client's errors, and how a failed gRPC call is classified (transient: retried;
a refused password or TLS handshake: configuration, not an outage)."""

from __future__ import annotations

import re

import grpc
from pyetcd import exceptions as etcd_exc

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


# gRPC's words for a handshake that failed on a certificate (ours refused, theirs not trusted or
# not for this name) or on a server that does not speak TLS: configuration, not an outage.
_TLS_REFUSAL = re.compile(
    r"CERTIFICATE|UNKNOWN_CA|WRONG_VERSION_NUMBER|Hostname Verification|not in peer certificate",
    re.I,
)


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
