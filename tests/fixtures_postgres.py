"""A real PostgreSQL server for tests, started and stopped by the fixtures themselves.

The server comes from the Debian package `postgresql` (`scripts/system-deps.sh` installs it;
binaries under /usr/lib/postgresql/<version>/bin, newest version wins, or the folder named by
$PIPETRANSFORMER_PG_BIN). No system cluster or service is used: each `PostgresServer` runs
`initdb` into its own temporary folder and starts `postgres` directly.

- **User.** PostgreSQL refuses to run as root, and CI runs as root. Then `initdb` and `postgres`
  run as the unprivileged `postgres` user the Debian package creates (`nobody` when there is
  none), by `subprocess.Popen(user=..., group=..., extra_groups=[])`: no runuser/sudo needed.
  Its folder is a fresh `/tmp/pipetransformer-pg-*` (mode 0700) handed to that user, because
  pytest's own tmp folders are root-only. As any other user, everything runs as that user.
- **Network.** TCP on 127.0.0.1 only, on a free port picked at start (another port is tried if
  it was taken meanwhile); the unix socket lives in the server's folder, never
  /var/run/postgresql. Authentication is `trust` for the superuser `postgres` (loopback only).
- **Speed.** fsync, synchronous_commit and full_page_writes are off (nothing here must survive
  a power cut): initdb takes about a second, start-up a fraction of one, CREATE DATABASE tens
  of milliseconds, so every test gets a fresh database.
- **Missing server.** Without the binaries (or without psycopg) the tests that need it skip
  with the reason, unless $CI is set: then they fail, so CI can never skip them silently.
"""

from __future__ import annotations

import itertools
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import psycopg

PG_BIN_ENV = "PIPETRANSFORMER_PG_BIN"
PG_ROOT = Path("/usr/lib/postgresql")
SUPERUSER = "postgres"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
_INSTALL_HINT = "install the Debian package: sudo bash scripts/system-deps.sh"


def _version_key(bindir: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", bindir.parent.name)) or (0,)


def find_postgres_bin() -> Path | None:
    """The folder holding initdb and postgres, or None when PostgreSQL is not installed."""
    override = os.environ.get(PG_BIN_ENV)
    if override:
        candidates = [Path(override)]
    else:
        candidates = sorted(PG_ROOT.glob("*/bin"), key=_version_key, reverse=True)
        on_path = shutil.which("initdb")
        if on_path:
            candidates.append(Path(on_path).resolve().parent)
    for bindir in candidates:
        if all(os.access(bindir / exe, os.X_OK) for exe in ("initdb", "postgres")):
            return bindir
    return None


def missing_postgres() -> str | None:
    """Why a PostgreSQL test cannot run here, or None when it can."""
    if find_postgres_bin() is None:
        where = os.environ.get(PG_BIN_ENV) or f"{PG_ROOT}/*/bin or PATH"
        return (
            f"PostgreSQL server binaries (initdb, postgres) not found in {where}; {_INSTALL_HINT}"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg (3) is not installed: .venv/bin/pip install -e '.[test]'"
    return None


def in_ci() -> bool:
    """$CI set to anything but an explicit no (CI services set CI=true; .ci/run does too)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_postgres() -> Path:
    """The binaries folder; skips the calling test when PostgreSQL is missing, fails it in CI."""
    reason = missing_postgres()
    if reason is not None:
        if in_ci():
            pytest.fail(f"CI must run the PostgreSQL tests: {reason}", pytrace=False)
        pytest.skip(reason)
    bindir = find_postgres_bin()
    assert bindir is not None
    return bindir


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> pwd.struct_passwd | None:
    """The account to run PostgreSQL as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in (SUPERUSER, "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root, and neither a 'postgres' nor a 'nobody' user exists")


class PostgresServer:
    """One throwaway PostgreSQL cluster: `initdb` on construction, then `start()`/`stop()`
    as often as a test likes (same port and data each time), `cleanup()` at the end."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.account = _run_as()
        # /tmp, not pytest's tmp_path: the unprivileged account must reach the folder.
        self.root = Path(tempfile.mkdtemp(prefix="pipetransformer-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.log_path = self.root / "postgres.log"
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._names = itertools.count(1)
        try:
            self.socket_dir.mkdir()
            if self.account is not None:
                for p in (self.root, self.socket_dir):
                    os.chown(p, self.account.pw_uid, self.account.pw_gid)
            self._run(
                [
                    str(bindir / "initdb"),
                    "--pgdata",
                    str(self.data),
                    "--username",
                    SUPERUSER,
                    "--auth",
                    "trust",
                    "--encoding",
                    "UTF8",
                    "--locale",
                    "C",
                    "--no-sync",
                ],
                timeout=120,
            )
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    # ---- processes

    def _popen_kwargs(self) -> dict[str, object]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            "HOME": str(self.root),
        }
        kwargs: dict[str, object] = {"env": env, "cwd": self.root}
        if self.account is not None:
            kwargs.update(user=self.account.pw_uid, group=self.account.pw_gid, extra_groups=[])
        return kwargs

    def _run(self, cmd: list[str], timeout: float) -> None:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, **self._popen_kwargs()
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (on the port it had before, if it ran before) and wait until it
        accepts connections."""
        if self.running:
            return
        ports = [self.port] if self.port is not None else [_free_port() for _ in range(3)]
        errors = []
        for port in ports:
            try:
                self._start_on(port)
                self.port = port
                return
            except RuntimeError as exc:
                errors.append(str(exc))
        raise RuntimeError("PostgreSQL did not start:\n" + "\n".join(errors))

    def _start_on(self, port: int) -> None:
        cmd = [
            str(self.bindir / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(port),
            "-h",
            "127.0.0.1",
            "-k",
            str(self.socket_dir),
            # Throwaway data: durability costs time and buys nothing here.
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=50",
            "-c",
            "log_min_messages=warning",
        ]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                **self._popen_kwargs(),  # type: ignore[arg-type]
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(
                    f"postgres on port {port} exited at start; log:\n{self._log_tail()}"
                )
            try:
                self._connect(port, "postgres").close()
                return
            except Exception as exc:  # not accepting connections yet
                last = exc
                time.sleep(0.05)
        self.stop(mode="immediate")
        raise RuntimeError(
            f"postgres on port {port} not ready after {START_TIMEOUT_S:.0f}s ({last}); "
            f"log:\n{self._log_tail()}"
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server like `pg_ctl stop -m <mode>`: "fast" (SIGINT: roll back open
        transactions, disconnect clients, shut down cleanly) or "immediate" (SIGQUIT)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal({"fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode])
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)

    def cleanup(self) -> None:
        self.stop(mode="immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ---- databases

    def _connect(self, port: int | None = None, dbname: str = "postgres") -> psycopg.Connection:
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=port or self.port,
            user=SUPERUSER,
            dbname=dbname,
            connect_timeout=2,
            autocommit=True,  # CREATE/DROP DATABASE cannot run inside a transaction
        )

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL of `database` on this server (psycopg 3)."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """CREATE DATABASE (a fresh, empty one) and return its SQLAlchemy URL."""
        name = name or f"test_{next(self._names)}"
        with self._connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE, disconnecting whoever is still connected (PostgreSQL 13+)."""
        with self._connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def remove_stale_servers() -> None:
    """Delete the folders of servers whose test run was killed before its cleanup (no live
    postmaster); a folder with a live server may belong to a concurrent run and stays."""
    for root in Path("/tmp").glob("pipetransformer-pg-*"):
        try:
            pid = int((root / "data" / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
            continue  # still running
        except (OSError, ValueError, IndexError):
            pass
        if time.time() - root.stat().st_mtime > 60:  # not one being set up right now
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole session (see the module docstring)."""
    bindir = require_postgres()
    remove_stale_servers()
    server = PostgresServer(bindir)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def postgres_db_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty database on the session server; dropped after the test."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url.rsplit("/", 1)[1])


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A running PostgreSQL server of the test's own, one it may stop and restart without
    disturbing the session server; removed after the test."""
    server = PostgresServer(require_postgres())
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
