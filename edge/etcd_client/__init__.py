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

The package, module by module: :mod:`.errors` (the exceptions, and how a gRPC failure is
classified: transient, a refused password, a refused TLS handshake), :mod:`.tls` (the TLS settings
and identity, :class:`EtcdTls`, and endpoint parsing), :mod:`.leases` (:class:`Lease`,
:class:`KeepAlive`, and the one keep-alive stream a client's leases share), :mod:`.client`
(:class:`EtcdClient`: the retry policy, sign-in, and the key/value, transaction, lease and Auth
calls).
"""

from __future__ import annotations

from pipetransformer.edge.etcd_client.client import EtcdClient, EtcdStatus
from pipetransformer.edge.etcd_client.errors import (
    EtcdAuthFailed,
    EtcdConfigError,
    EtcdError,
    EtcdPermissionDenied,
    EtcdTlsRefused,
    EtcdUnavailable,
    LeaseExpired,
)
from pipetransformer.edge.etcd_client.leases import KeepAlive, Lease
from pipetransformer.edge.etcd_client.tls import (
    CACERT_ENV,
    CERT_ENV,
    FROM_ENV,
    KEY_ENV,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USER_ENV,
    EtcdTls,
    parse_endpoint,
)

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
