"""A per-node fork server for trainer workers: torch is imported once, not once per generation.

A re-formed generation's workers are new processes (torchrun restarts them), and importing torch,
DCP and the pipelining package costs about 4.5 s of a recovery on this machine. Each node's
launcher therefore starts one server that imports `trainer.worker` and waits; the command torchrun
runs is this module's thin client (stdlib and setproctitle only, tens of milliseconds), which hands
its argv, environment, working directory and stdio to the server and gets a forked worker in return.

The client stands in for the worker towards torchrun: it forwards the signals torchrun sends
(SIGTERM stops a worker group gracefully) and exits as the worker did (the same code, or the same
signal). The server, the one process that sees a worker killed outright, also hands each exit
status to the target's `on_worker_exit` hook (trainer.worker reports abnormal ones to the
controller, which tells the rank that died from the ranks that only lost it as a peer). If the
client dies (SIGKILL from torchrun), the server kills its worker; if the server dies, its
workers die with it (parent-death signal). Without a server (none given, none
reachable, or not Linux) the client simply execs `python -m pipetransformer.trainer.worker`.

Multiprocessing's own forkserver does not fit: torchrun starts workers as commands, not as
Python callables of a `multiprocessing` context.

The server and each client title their processes with the job and node (and the client with its
rank), `pipetransformer forkserver job=J node=N`, `pipetransformer worker-client job=J rank=R
node=N` (edge/proctitle.py); each worker titles itself.

    start(env, job_id=J)                                # per node, by its launcher
    python -m pipetransformer.orchestrator.forkserver --server NAME pipetransformer.trainer.worker ARGS...   # per worker
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import random
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import NoReturn

from pipetransformer.core.keys import AGENT_PID_ENV
from pipetransformer.edge import proctitle
from pipetransformer.orchestrator.procs import tied_to_parent

TARGET = "pipetransformer.trainer.worker"  # imported by the server, its main(argv) run by each forked worker
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1
_WAKE = object()  # the selector key of the server's own wake-up pipe
STOP_GRACE_S = 30.0  # after a SIGTERM, how long workers may take to leave before being killed


def available() -> bool:
    """Fork servers need Linux: abstract sockets, peer credentials and pidfds."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


def start(
    env: dict[str, str],
    log: Path | None = None,
    new_session: bool = False,
    target: str = TARGET,
    job_id: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start a node's server for `target` (a module with `main(argv) -> int`), tied to this
    process and logging to `log` (else to our stdout); returns it and its name for
    `client_args`. Its socket is bound and listening before this returns (we bind it and hand
    it over), so no worker started afterwards misses it. Its process title names `job_id` and
    the node `env` names (`proctitle.NODE_ENV`)."""
    name = f"pipetransformer-forkserver-{uuid.uuid4().hex[:12]}"
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listener.bind(_address(name))
        listener.listen(64)  # clients arriving while the server imports torch wait here
        fd = str(listener.fileno())
        cmd = [
            sys.executable,
            "-P",
            "-m",
            "pipetransformer.orchestrator.forkserver",
            "--serve-fd",
            fd,
            target,
            *([job_id] if job_id else []),
        ]
        out = stack.enter_context(open(log, "ab")) if log else None  # noqa: SIM115
        proc = subprocess.Popen(
            tied_to_parent(cmd),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env=env,
            pass_fds=[listener.fileno()],
            start_new_session=new_session,
        )
    return proc, name


def client_args(name: str | None, target: str = TARGET) -> list[str]:
    """What torchrun runs per worker (after `python`): `-m target`, through server `name` if
    one is given."""
    if name is None:
        return ["-m", target]
    return ["-m", "pipetransformer.orchestrator.forkserver", "--server", name, target]


def _address(name: str) -> str:
    return "\0" + name  # Linux abstract namespace: nothing on disk to clean up


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    packet = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [packet], fds)
    else:
        sock.sendall(packet)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), 8)
        fds.extend(got)
        if not chunk:
            raise EOFError("peer closed the connection")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    fds: list[int] = []
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
    return json.loads(_recv_exact(sock, size, fds)), fds


# -- client (torchrun's entrypoint) ----------------------------------------------------------------


def _exec_directly(target: str, argv: list[str]) -> NoReturn:
    os.environ[AGENT_PID_ENV] = str(os.getppid())
    os.execv(sys.executable, [sys.executable, "-P", "-m", target, *argv])


def _option(argv: list[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in `argv`, else None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def client(name: str, target: str, argv: list[str]) -> int:
    """Run `target`'s main(argv) forked from the server `name`, and exit as it did."""
    env = dict(os.environ)
    env[AGENT_PID_ENV] = str(os.getppid())
    worker: int | None = None
    pending: list[int] = []  # signals that came before the worker existed

    def forward(signum: int, frame: object) -> None:
        if worker is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    # A Python handler runs between bytecodes: a signal that lands just before a blocking recv
    # would wait for the recv to return, which here waits for the worker the signal is meant
    # for. The C-level handler also writes to this pipe, so every wait wakes up for it.
    wakeup_r, wakeup_w = os.pipe()
    for fd in (wakeup_r, wakeup_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
    # one client per rank lives as long as its worker: say whose (torchrun sets RANK)
    proctitle.set_title(
        "worker-client",
        job=_option(argv, "--job-id"),
        rank=os.environ.get("RANK"),
        node=os.environ.get(proctitle.NODE_ENV),
    )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_address(name))
        request = {"target": target, "argv": argv, "env": env, "cwd": os.getcwd()}
        _send(sock, request, [0, 1, 2])
        _wait_readable(sock, wakeup_r)  # while the server is still importing torch
        reply, _ = _recv(sock)
        worker = int(reply["pid"])
    except (OSError, EOFError, ValueError, KeyError):
        sock.close()
        if pending:  # told to stop before anything ran: do so
            signal.signal(pending[0], signal.SIG_DFL)
            os.kill(os.getpid(), pending[0])
        _exec_directly(target, argv)  # no usable server: a plain worker process
    for signum in pending:
        forward(signum, None)
    try:
        _wait_readable(sock, wakeup_r)
        status = _recv(sock)[0]["status"]
    except (OSError, EOFError, ValueError, KeyError):
        return 1  # the server died, and its workers with it
    if os.WIFSIGNALED(status):  # die the same way, so torchrun reports the signal
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


def _wait_readable(sock: socket.socket, wakeup: int) -> None:
    """Until `sock` has data (or is closed), running signal handlers as signals arrive."""
    while True:
        try:
            ready, _, _ = select.select([sock, wakeup], [], [])
        except InterruptedError:
            continue
        if wakeup in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wakeup, 512)  # the handlers run at the next bytecode boundary
        if sock in ready:
            return


# -- server ----------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, pid: int, conn: socket.socket, request: dict):
        self.pid, self.conn, self.request = pid, conn, request
        self.pidfd = os.pidfd_open(pid)
        self.client_gone = False


def serve(listener: socket.socket, target: str = TARGET) -> dict:
    """Import `target`, then fork a worker per client on `listener` until killed. Returns only
    in a forked child: the request it is to run, its process already set up as the client's.

    Single-threaded on purpose (one selector over the listener, the clients' connections and
    the workers' pidfds): forking a process that runs other threads is unsafe.

    SIGTERM (the node's launcher going away, e.g. a pod being stopped) does not cut its workers
    short: torchrun stops them gracefully through their clients at the same time, so the server
    takes no new clients and exits once they are gone (after STOP_GRACE_S it kills them)."""
    stopping: list[float] = []
    server_pid = os.getpid()
    # a signal wakes the select below at once (retried after a signal, it would sleep on)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(time.monotonic()))
    importlib.import_module(target)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    sel.register(wake_r, selectors.EVENT_READ, _WAKE)
    workers: dict[int, _Worker] = {}  # by pidfd
    while True:
        if stopping:
            if listener.fileno() >= 0:
                sel.unregister(listener)
                listener.close()
            if not workers:
                # the interpreter's last collection over the target's objects (torch's) takes
                # a second; nothing they hold needs it
                gc.freeze()
                sys.exit(0)
            if time.monotonic() - stopping[0] > STOP_GRACE_S:
                for w in workers.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGKILL)
        for key, _ in sel.select(timeout=0.5):
            if key.data is _WAKE:
                os.read(wake_r, 64)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                request = _accept(conn, target)
                if request is None:
                    continue
                message, fds = request
                sys.stdout.flush()
                sys.stderr.flush()
                # the worker starts only once its client has been told its pid: a client whose
                # server dies before that runs the target itself, which must then be the only
                # run of it (a worker that had started would have been a second one)
                go_r, go_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(go_w)
                    sel.close()
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    listener.close()
                    for w in workers.values():
                        w.conn.close()
                        os.close(w.pidfd)
                    conn.close()
                    _become_client(message, fds, server_pid, go_r)
                    return message
                os.close(go_r)
                for fd in fds:
                    os.close(fd)
                worker = _Worker(pid, conn, message)
                workers[worker.pidfd] = worker
                sel.register(worker.pidfd, selectors.EVENT_READ, worker)
                sel.register(conn, selectors.EVENT_READ, worker)
                try:
                    _send(conn, {"pid": pid})
                    os.write(go_w, b"1")
                except OSError:
                    os.kill(pid, signal.SIGKILL)  # the client is gone already
                finally:
                    os.close(go_w)
            elif isinstance(key.fileobj, int):  # a worker exited: tell its client how
                worker = key.data
                _, status = os.waitpid(worker.pid, 0)
                sel.unregister(worker.pidfd)
                os.close(worker.pidfd)
                del workers[worker.pidfd]
                if not worker.client_gone:
                    sel.unregister(worker.conn)
                    with contextlib.suppress(OSError):
                        _send(worker.conn, {"status": status})
                    _report_exit(target, worker.request, worker.pid, status)
                worker.conn.close()
            else:  # a client only ever hangs up (killed, e.g. by torchrun): kill its worker
                worker = key.data
                try:
                    data = worker.conn.recv(1)
                except OSError:
                    data = b""
                if not data:
                    worker.client_gone = True
                    sel.unregister(worker.conn)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(worker.pid, signal.SIGKILL)


def _report_exit(target: str, request: dict, pid: int, status: int) -> None:
    """Tell the target's `on_worker_exit(request, pid, exit_code)` hook, if it has one, how a
    worker ended (exit_code < 0: killed by that signal): the server is the only process that
    sees a worker killed outright. The hook runs in a grandchild (it may do I/O and take a
    while; the server must not block or run other threads), which the server does not wait for."""
    hook = getattr(sys.modules.get(target), "on_worker_exit", None)
    if hook is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked processes
        try:
            if os.fork() == 0:
                try:
                    hook(request, pid, os.waitstatus_to_exitcode(status))
                except BaseException as exc:  # a report must never take anything down
                    print(f"forkserver: exit report for {pid} failed: {exc}", file=sys.stderr)
                finally:
                    os._exit(0)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def _accept(conn: socket.socket, target: str) -> tuple[dict, list[int]] | None:
    """A request for `target` from a process of our own user (an abstract socket can be reached
    from the whole network namespace), or None after refusing it (that client runs without us)."""
    fds: list[int] = []
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise PermissionError(f"client uid {uid} is not ours")
        conn.settimeout(10)
        message, fds = _recv(conn)
        conn.settimeout(None)
        if len(fds) != 3 or not isinstance(message.get("argv"), list):
            raise ValueError("malformed request")
        if message.get("target") != target:
            raise ValueError(f"this server runs {target}, not {message.get('target')}")
        return message, fds
    except (OSError, EOFError, ValueError) as exc:
        print(f"forkserver: refused a client: {exc}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            _send(conn, {"error": str(exc)})
        conn.close()
        return None


def _become_client(message: dict, fds: list[int], server_pid: int, go: int) -> None:
    """In the forked child: die with the server, wait until the server has told the client
    this worker's pid (a byte on `go`; nothing: the server died first), and take over the
    client's stdio, environment and working directory."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server_pid:  # the server died between fork and prctl
        os._exit(1)
    told = os.read(go, 1)
    os.close(go)
    if not told:
        os._exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target_fd, fd in enumerate(fds):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    random.seed()  # not the server's state, which every fork would share


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-fd"] and len(argv) in (3, 4):  # --serve-fd FD TARGET [JOB_ID]
        target = argv[2]
        # titled before the target's import, which takes seconds (torch)
        job_id = argv[3] if len(argv) == 4 else None
        proctitle.set_title("forkserver", job=job_id, node=os.environ.get(proctitle.NODE_ENV))
        request = serve(socket.socket(fileno=int(argv[1])), target)
        # a forked worker, no longer the server (the target may title itself in more detail);
        # the environment is its client's now
        proctitle.set_title(
            "worker",
            job=job_id,
            rank=os.environ.get("RANK"),
            node=os.environ.get(proctitle.NODE_ENV),
        )
        sys.argv = [target, *request["argv"]]
        return importlib.import_module(target).main(request["argv"])
    if argv[:1] == ["--server"] and len(argv) >= 3:
        if not available():
            _exec_directly(argv[2], argv[3:])
        return client(argv[1], argv[2], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
