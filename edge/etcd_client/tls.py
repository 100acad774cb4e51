"""How a client reaches etcd: the TLS settings and identity (:class:`EtcdTls`, from the
environment by default: ``FROM_ENV``) and the endpoint (``parse_endpoint``)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import grpc

from pipetransformer.edge.etcd_client.errors import EtcdConfigError

DEFAULT_PORT = 2379

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
