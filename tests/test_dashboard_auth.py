"""Who may act from the dashboard: credentials from the environment or a file, constant-time
checks, clear errors for unusable configuration, and the warning for an open bind address."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipetransformer.dashboard.auth import (
    DEFAULT_USER,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    ENV_USER,
    AuthConfigError,
    bind_warning,
    is_loopback,
    load_credentials,
    oidc_configured,
    parse_token_file,
)

TOKEN = "correct-horse-battery"


def test_no_configuration_means_no_actions() -> None:
    assert load_credentials({}) is None


def test_token_from_the_environment() -> None:
    creds = load_credentials({ENV_TOKEN: TOKEN})
    assert creds is not None and creds.names == [DEFAULT_USER]
    assert ENV_TOKEN in creds.source
    assert creds.check(DEFAULT_USER, TOKEN) == DEFAULT_USER
    assert creds.check(f"  {DEFAULT_USER} ", TOKEN) == DEFAULT_USER  # typed with spaces
    assert creds.check(DEFAULT_USER, TOKEN + "x") is None
    assert creds.check("someone", TOKEN) is None
    assert creds.check(DEFAULT_USER, "") is None
    named = load_credentials({ENV_TOKEN: TOKEN, ENV_USER: "alice"})
    assert named is not None and named.check("alice", TOKEN) == "alice"


def test_token_file_with_users_and_hashed_secrets(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"bobs-long-token").hexdigest()
    path = tmp_path / "tokens"
    path.write_text(f"# who may act\nalice:{TOKEN}\n\nbob:sha256:{hashed}\n")
    creds = load_credentials({ENV_TOKEN_FILE: str(path)})
    assert creds is not None and creds.names == ["alice", "bob"]
    assert creds.check("alice", TOKEN) == "alice"
    assert creds.check("bob", "bobs-long-token") == "bob"
    assert creds.check("bob", f"sha256:{hashed}") is None  # the digest itself is not the token
    assert creds.check("alice", "bobs-long-token") is None  # another user's token
    # a mounted Secret holding just the token
    single = tmp_path / "token"
    single.write_text(TOKEN + "\n")
    one = load_credentials({ENV_TOKEN_FILE: str(single)})
    assert one is not None and one.check(DEFAULT_USER, TOKEN) == DEFAULT_USER


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("", "holds no token"),
        ("alice:short\n", "shorter than 8"),
        ("alice\nbob:long-enough-token\n", "tokens:1: expected `user:token`"),
        ("al ice:long-enough-token\n", "user name 'al ice'"),
        ("a:long-enough-token\na:another-long-token\n", "listed twice"),
    ],
)
def test_unusable_token_files_name_the_line(tmp_path: Path, text: str, phrase: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(AuthConfigError, match=phrase):
        parse_token_file(text, str(path))


def test_unusable_environment() -> None:
    with pytest.raises(AuthConfigError, match="not both"):
        load_credentials({ENV_TOKEN: TOKEN, ENV_TOKEN_FILE: "/x"})
    with pytest.raises(AuthConfigError, match="cannot read"):
        load_credentials({ENV_TOKEN_FILE: "/nonexistent/tokens"})
    with pytest.raises(AuthConfigError, match=ENV_TOKEN):
        load_credentials({ENV_TOKEN: "short"})
    with pytest.raises(AuthConfigError, match=ENV_USER):
        load_credentials({ENV_TOKEN: TOKEN, ENV_USER: "bad name"})


def test_bind_warning_only_for_open_addresses_without_auth() -> None:
    creds = load_credentials({ENV_TOKEN: TOKEN})
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("dashboard.example.com")
    assert bind_warning("127.0.0.1", None, oidc=False) is None
    assert bind_warning("0.0.0.0", creds, oidc=False) is None
    assert bind_warning("0.0.0.0", None, oidc=True) is None
    warning = bind_warning("0.0.0.0", None, oidc=False)
    assert warning is not None and ENV_TOKEN in warning and "127.0.0.1" in warning


def test_oidc_detected_from_secrets_toml(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.toml"
    assert not oidc_configured([secrets])  # missing file
    secrets.write_text('[connections.x]\nurl = "y"\n')
    assert not oidc_configured([secrets])
    secrets.write_text('[auth]\nredirect_uri = "http://localhost:8501/oauth2callback"\n')
    assert oidc_configured([tmp_path / "other.toml", secrets])
    secrets.write_text("[auth\n")  # unreadable TOML: not configured, never a crash
    assert not oidc_configured([secrets])
