"""The per-node fork server: workers forked with their client's argv, stdio, environment and
working directory; exit codes, signals and deaths pass through both ways; no server, no problem."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetransformer.orchestrator import forkserver

pytestmark = pytest.mark.skipif(not forkserver.available(), reason="fork servers need Linux")

REPO = Path(__file__).resolve().parents[1]
TARGET = "tests.forkserver_target"


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)


@pytest.fixture
def server(tmp_path: Path):
    proc, name = forkserver.start(_env(), tmp_path / "server.log", target=TARGET)
    yield proc, name
    proc.kill()
    proc.wait()


def _client(name: str | None, *args: str, cwd: Path | None = None, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *forkserver.client_args(name, TARGET), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd or REPO,
        env=_env(**env),
    )


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_workers_are_forked_with_the_clients_argv_stdio_env_and_cwd(server, tmp_path):
    proc, name = server
    clients = [
        _client(name, "echo", str(code), "--flag", cwd=tmp_path, FORKSERVER_TEST=f"c{code}")
        for code in (0, 3)
    ]
    seen = []
    for code, client in zip((0, 3), clients, strict=True):
        out, err = client.communicate(timeout=30)
        assert client.returncode == code, err
        report = json.loads(out)
        assert report["argv"] == ["echo", str(code), "--flag"]
        assert report["imported_by"] == proc.pid  # imported once, by the server
        assert report["ppid"] == proc.pid and report["pid"] != client.pid
        assert report["cwd"] == str(tmp_path)
        assert report["env"] == f"c{code}"
        assert report["agent"] == str(os.getpid())  # the client's parent: its torchrun agent
        assert "to stderr" in err
        seen.append(report["pid"])
    assert len(set(seen)) == 2


def test_an_uncaught_exception_exits_1_with_its_traceback(server):
    client = _client(server[1], "raise")
    _, err = client.communicate(timeout=30)
    assert client.returncode == 1
    assert "RuntimeError: boom" in err


def test_sigterm_to_the_client_reaches_the_worker(server):
    client = _client(server[1], "wait")
    worker = int(client.stdout.readline())
    client.send_signal(signal.SIGTERM)  # torchrun stopping a worker group
    assert client.wait(timeout=10) == 75
    assert _gone(worker)


def test_the_exit_hook_hears_how_every_worker_ended(server, tmp_path):
    exits = tmp_path / "exits.jsonl"
    done = _client(server[1], "echo", "3", FORKSERVER_EXITS=str(exits))
    killed = _client(server[1], "wait", FORKSERVER_EXITS=str(exits))
    killed_pid = int(killed.stdout.readline())
    os.kill(killed_pid, signal.SIGKILL)
    assert killed.wait(timeout=10) == -signal.SIGKILL
    done_pid = json.loads(done.communicate(timeout=30)[0])["pid"]
    # a client that goes away (torchrun killing it) has its worker killed: not a death to report
    stopped = _client(server[1], "wait", FORKSERVER_EXITS=str(exits))
    stopped_pid = int(stopped.stdout.readline())
    stopped.kill()
    assert _gone(stopped_pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # reports come from a throwaway process, soon after
        seen = (
            [json.loads(line) for line in exits.read_text().splitlines()] if exits.exists() else []
        )
        if len(seen) >= 2:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    seen = sorted(
        (r["pid"], r["exit_code"], r["argv"][0])
        for r in map(json.loads, exits.read_text().splitlines())
    )
    assert seen == sorted([(done_pid, 3, "echo"), (killed_pid, -signal.SIGKILL, "wait")])


def test_a_killed_worker_kills_its_client_with_the_same_signal(server):
    client = _client(server[1], "wait")
    worker = int(client.stdout.readline())
    os.kill(worker, signal.SIGKILL)
    assert client.wait(timeout=10) == -signal.SIGKILL


def test_a_killed_client_takes_its_worker_along(server):
    client = _client(server[1], "wait")
    worker = int(client.stdout.readline())
    client.kill()  # torchrun's SIGKILL after its grace period
    client.wait(timeout=10)
    assert _gone(worker)


def test_a_dead_server_takes_its_workers_and_fails_their_clients(server):
    proc, name = server
    client = _client(name, "wait")
    worker = int(client.stdout.readline())
    proc.kill()
    assert _gone(worker)
    # the client wakes on the closed socket at once (it once ran the target itself instead,
    # when the kill came before the server's reply: see the test below)
    assert client.wait(timeout=10) == 1


# The server's own code, except that it dies after forking a worker and before telling the
# client the worker's pid (a second later: long enough for a worker that did not wait to run).
_DIES_BEFORE_NAMING_THE_WORKER = """
import os, signal, sys, time
from pipetransformer.orchestrator import forkserver
send = forkserver._send
def dying(sock, message, fds=None):
    if "pid" in message:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    send(sock, message, fds)
forkserver._send = dying
sys.exit(forkserver.main(sys.argv[1:]))
"""


def test_a_server_dying_before_it_names_the_worker_leaves_one_run_of_the_target(tmp_path):
    """The client of a server that dies before its reply runs the target itself, so the worker
    forked for it must never have run: one run, not two (the race a loaded machine hit)."""
    name = f"pipetransformer-forkserver-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind("\0" + name)
        listener.listen(4)
        fd = str(listener.fileno())
        proc = subprocess.Popen(
            [sys.executable, "-c", _DIES_BEFORE_NAMING_THE_WORKER, "--serve-fd", fd, TARGET],
            env=_env(),
            cwd=REPO,
            pass_fds=[listener.fileno()],
        )
    try:
        client = _client(name, "echo", "0")
        out, err = client.communicate(timeout=60)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert client.returncode == 0, err
        runs = [json.loads(line) for line in out.splitlines()]
        assert [r["pid"] for r in runs] == [client.pid], runs  # exec'd in place, and only there
    finally:
        proc.kill()
        proc.wait()


def test_without_a_server_the_client_runs_the_target_itself(tmp_path):
    client = _client("no-such-forkserver", "echo", "4")
    out, err = client.communicate(timeout=30)
    assert client.returncode == 4, err
    report = json.loads(out)
    assert report["pid"] == report["imported_by"] == client.pid  # exec'd in place
    assert report["agent"] == str(os.getpid())


def test_a_server_refuses_another_target_and_the_client_runs_it_itself(tmp_path):
    proc, name = forkserver.start(_env(), tmp_path / "server.log", target="json")
    try:
        client = _client(name, "echo", "0")
        out, err = client.communicate(timeout=30)
        assert client.returncode == 0, err
        assert json.loads(out)["pid"] == client.pid
        assert "refused a client" in (tmp_path / "server.log").read_text()
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_server_lets_its_workers_leave_first(server):
    """SIGTERM to the server (its node is going away) while torchrun stops the workers too: the
    workers leave gracefully, new clients run on their own, and then the server exits."""
    proc, name = server
    client = _client(name, "wait")
    worker = int(client.stdout.readline())
    proc.terminate()
    time.sleep(1.0)
    assert proc.poll() is None and not _gone(worker, within=0)
    late = _client(name, "echo", "0")
    out, err = late.communicate(timeout=30)
    assert late.returncode == 0, err
    assert json.loads(out)["pid"] == late.pid  # the server takes no new clients
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=10) == 75
    assert proc.wait(timeout=10) == 0
