"""Who may act from the dashboard: credentials from the environment or a file, checked in
constant time. Pure (no Streamlit): the page asks `Credentials.check` and records the name it
returns in the audit trail.

Reading a job stays open to whoever can reach the page (bind to loopback, or put it behind your
ingress); filing a freeze request needs a signed-in user. Credentials come from:

- `PIPETRANSFORMER_DASHBOARD_TOKEN`: one token, for the user named by
  `PIPETRANSFORMER_DASHBOARD_USER` (default `operator`);
- `PIPETRANSFORMER_DASHBOARD_TOKEN_FILE`: a file (a mounted Kubernetes Secret, say) with one
  `user:secret` per line (`#` starts a comment). A secret written `sha256:<64 hex digits>` is the
  SHA-256 of the token, so the file need not hold tokens in plain text. A file holding a single
  line without a colon is one token for the default user.
- Streamlit's own OIDC login (`st.login`, configured under `[auth]` in `.streamlit/secrets.toml`),
  handled by the page, not here.

Tokens never go into the job spec or the store.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_TOKEN = "PIPETRANSFORMER_DASHBOARD_TOKEN"
ENV_TOKEN_FILE = "PIPETRANSFORMER_DASHBOARD_TOKEN_FILE"
ENV_USER = "PIPETRANSFORMER_DASHBOARD_USER"
DEFAULT_USER = "operator"
MIN_TOKEN_CHARS = 8
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")

HOW_TO_ENABLE = (
    f"Actions are disabled: no credentials are configured. Set `{ENV_TOKEN}` (one token) or "
    f"`{ENV_TOKEN_FILE}` (a file of `user:token` lines) where the dashboard starts, or configure "
    "Streamlit's OIDC login under `[auth]` in `.streamlit/secrets.toml`."
)


class AuthConfigError(ValueError):
    """Credentials are configured but unusable; the message names the variable or file line."""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Credentials:
    """Users and the SHA-256 of each one's token; `source` says where they came from."""

    users: tuple[tuple[str, bytes], ...]
    source: str

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.users]

    def check(self, user: str, token: str) -> str | None:
        """The authenticated name, or None. Every entry is compared, each with
        `hmac.compare_digest`, so the time taken says nothing about which part was wrong."""
        presented, name_bytes = digest(token), user.strip().encode()
        found: str | None = None
        for name, expected in self.users:
            same_name = hmac.compare_digest(name.encode(), name_bytes)
            same_token = hmac.compare_digest(expected, presented)
            if same_name & same_token:
                found = name
        return found


def _check_user(name: str, where: str) -> str:
    if not _USER.fullmatch(name):
        raise AuthConfigError(
            f"{where}: user name {name!r} must be 1-64 letters, digits or ._@+- "
            "(it goes into the audit trail)"
        )
    return name


def _secret(secret: str, where: str) -> bytes:
    if m := _HASHED.fullmatch(secret):
        return bytes.fromhex(m.group(1))
    if len(secret) < MIN_TOKEN_CHARS:
        raise AuthConfigError(
            f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters; use a long random "
            "one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`"
        )
    return digest(secret)


def parse_token_file(text: str, path: str, default_user: str = DEFAULT_USER) -> Credentials:
    """Credentials from the text of a token file (format in the module docstring)."""
    lines = [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not lines:
        raise AuthConfigError(f"{ENV_TOKEN_FILE}={path}: the file holds no token")
    if len(lines) == 1 and ":" not in lines[0][1]:
        number, token = lines[0]
        return Credentials(((default_user, _secret(token, f"{path}:{number}")),), f"file {path}")
    users: dict[str, bytes] = {}
    for number, line in lines:
        where = f"{path}:{number}"
        name, sep, secret = line.partition(":")
        if not sep or not secret:
            raise AuthConfigError(f"{where}: expected `user:token` or `user:sha256:<hex>`")
        name = _check_user(name.strip(), where)
        if name in users:
            raise AuthConfigError(f"{where}: user {name!r} is listed twice")
        users[name] = _secret(secret.strip(), where)
    return Credentials(tuple(users.items()), f"file {path}")


def load_credentials(environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The configured credentials, or None when none are (actions stay disabled). Raises
    AuthConfigError when they are configured but unusable, naming the variable or file line."""
    env = os.environ if environ is None else environ
    default_user = _check_user(env.get(ENV_USER, DEFAULT_USER), ENV_USER)
    token, path = env.get(ENV_TOKEN), env.get(ENV_TOKEN_FILE)
    if token and path:
        raise AuthConfigError(f"set one of {ENV_TOKEN} and {ENV_TOKEN_FILE}, not both")
    if token:
        return Credentials(((default_user, _secret(token, ENV_TOKEN)),), f"environment {ENV_TOKEN}")
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise AuthConfigError(f"{ENV_TOKEN_FILE}={path}: cannot read it ({exc})") from None
        return parse_token_file(text, path, default_user)
    return None


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the page on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def bind_warning(host: str, credentials: Credentials | None, oidc: bool) -> str | None:
    """The warning to print when the page is served beyond this machine with no way to sign in
    (reading stays open there; actions stay disabled until credentials are configured)."""
    if is_loopback(host) or credentials is not None or oidc:
        return None
    return (
        f"the dashboard listens on {host}, beyond this machine, with no credentials configured: "
        "anyone who reaches it can read every job (actions stay disabled). "
        f"Set {ENV_TOKEN} or {ENV_TOKEN_FILE}, configure OIDC login, or bind to 127.0.0.1."
    )


def secrets_files(cwd: Path | None = None) -> list[Path]:
    """Where Streamlit looks for `secrets.toml` (project first, then the user's)."""
    return [
        (cwd or Path.cwd()) / ".streamlit" / "secrets.toml",
        Path.home() / ".streamlit" / "secrets.toml",
    ]


def oidc_configured(paths: list[Path] | None = None) -> bool:
    """Whether Streamlit's OIDC login is configured (an `[auth]` table in a secrets.toml)."""
    import tomllib

    for path in paths if paths is not None else secrets_files():
        try:
            if "auth" in tomllib.loads(path.read_text()):
                return True
        except (OSError, tomllib.TOMLDecodeError):
            continue
    return False
