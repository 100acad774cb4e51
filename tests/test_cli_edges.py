"""The CLI's edges, tried as a new user would: each mistake is one line on stderr naming the
argument and what to do, exit status 2, and nothing created or stored (no workdir, no store
file, no job, no freeze request)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from pipetransformer.core import keys
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.edge.overrides import endpoint_file
from pipetransformer.orchestrator.cli import main
from pipetransformer.store import Store, sqlite_url, url_problem
from tests.fixtures_run import cli, start_cli, store_probe, wait_for, write_spec


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI in this process; it must refuse with status 2 in one line on stderr."""
    assert main(list(argv)) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert "Traceback" not in out.err + out.out
    return lines[0]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, read, released: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path / "spec.yaml")


def test_workdir_naming_a_file(capsys, tmp_path: Path, spec: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    for argv in (["run", str(spec)], ["status"], ["resume", "j"], ["db", "upgrade"]):
        line = _refused(capsys, *argv, "--workdir", str(afile))
        assert f"--workdir {afile} is a file" in line and "directory" in line
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("foo://x", "scheme 'foo' is not supported"),
        ("mysql://u@h/db", "scheme 'mysql' is not supported"),
        ("not a url", "is not a database URL"),
        ("postgresql+psycopg2://u@h/db", "driver 'postgresql+psycopg2' is not installed"),
        ("sqlite+pysqlcipher:///x.db", "driver 'sqlite+pysqlcipher' is not supported"),
    ],
)
def test_db_url_the_store_cannot_use(capsys, tmp_path: Path, spec: Path, url: str, says: str):
    workdir = tmp_path / "runs"
    for argv in (["run", str(spec)], ["status"], ["dashboard"], ["db", "current"]):
        line = _refused(capsys, *argv, "--db", url, "--workdir", str(workdir))
        assert line.startswith("error: --db") and says in line, line
        assert "sqlite:///PATH or postgresql://" in line or "psycopg" in line
    assert not workdir.exists()


def test_db_url_from_the_environment_is_named_as_such(capsys, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PIPETRANSFORMER_DB", "foo://x")
    line = _refused(capsys, "status", "--workdir", str(tmp_path / "runs"))
    assert line.startswith("error: $PIPETRANSFORMER_DB foo://x: scheme 'foo'"), line


def test_sqlite_file_in_a_missing_directory(capsys, tmp_path: Path, spec: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    url = sqlite_url(missing / "store.db")
    line = _refused(capsys, "run", str(spec), "--db", url, "--workdir", str(tmp_path / "runs"))
    assert f"names a SQLite file in {missing}, which does not exist; create it first" in line
    assert not missing.parent.parent.exists() and not (tmp_path / "runs").exists()


def test_url_problem_accepts_what_the_store_supports(tmp_path: Path) -> None:
    assert url_problem(sqlite_url(tmp_path / "store.db")) is None
    assert url_problem("sqlite://") is None  # in memory
    assert url_problem("postgresql://u:p@db.example:5432/pipetransformer") is None
    assert url_problem("postgresql+psycopg://u@h/db") is None
    assert url_problem("postgresql://u@h") is None  # libpq's default database: the user's
    assert url_problem(sqlite_url(tmp_path / "s.db").replace("sqlite", "sqlite+pysqlite")) is None
    (tmp_path / "f").write_text("")
    assert "which is not a directory" in url_problem(sqlite_url(tmp_path / "f" / "store.db"))
    assert "which is not a file" in url_problem(sqlite_url(tmp_path))


def test_postgres_that_refuses_connections_is_named_at_once(capsys, tmp_path: Path, spec: Path):
    """Before: a traceback after the store's 30 s of retries (StoreUnavailable). Now one
    attempt: the server, how to check it, the password masked, nothing created."""
    port = _closed_port()
    url = f"postgresql://alice:s3cret@127.0.0.1:{port}/jobs"
    workdir = tmp_path / "runs"
    for argv in (["run", str(spec)], ["status"], ["db", "current"], ["dashboard"]):
        line = _refused(capsys, *argv, "--db", url, "--workdir", str(workdir))
        assert f"could not connect to the PostgreSQL server at 127.0.0.1:{port}" in line
        assert f"pg_isready -h 127.0.0.1 -p {port}" in line and "s3cret" not in line
    assert not workdir.exists()


def test_empty_job_id_is_refused_not_replaced(capsys, tmp_path: Path, spec: Path) -> None:
    workdir = tmp_path / "runs"
    line = _refused(capsys, "run", str(spec), "--job-id", "", "--workdir", str(workdir))
    assert "--job-id '' must be 1-63 lowercase letters" in line
    assert not workdir.exists()


@pytest.mark.slow
def test_a_running_job_is_not_resumed_and_a_request_for_nothing_is_not_filed(
    tmp_path: Path,
) -> None:
    """`resume` of a job a live `run` controls says so at once, and where (before: 31 s, then a
    traceback from a second embedded etcd on the same data); `freeze --layers 0` (and a request
    at the boundary in force) files nothing."""
    spec = write_spec(tmp_path / "spec.yaml", training={"epochs": 500})
    workdir, log = tmp_path / "runs", tmp_path / "run.log"
    job = "live-edges"
    proc = start_cli("run", str(spec), "--workdir", str(workdir), "--job-id", job, log=log)
    try:
        db = workdir / "store.db"
        wait_for(store_probe(db, job, lambda s, j: s.get_job(j).step >= 1), 120, "a step", log)
        res = cli("resume", job, "--workdir", str(workdir), timeout=60)
        assert res.returncode == 2, res.stdout + res.stderr
        endpoint = endpoint_file(workdir, job).read_text().strip()
        said = " ".join(res.stderr.split())
        assert f"job {job} is running: its controller (pid {proc.pid} on" in said, said
        assert f"etcd at {endpoint}" in said and "Traceback" not in said

        res = cli("freeze", job, "--layers", "0", "--workdir", str(workdir), timeout=60)
        said = " ".join(res.stderr.split())
        assert res.returncode == 2 and "layers=0 freezes nothing" in said, said
        assert "ask for 1..1" in said  # depth 2, keep_trainable 1
        with EtcdClient(endpoint) as etcd:
            assert etcd.get(keys.freeze_override(job)) is None
            assert etcd.get(keys.controller(job)) is not None  # the run still controls it
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    # the job is interrupted now: a freeze or a trace says so first, whatever etcd is named
    for command in (["freeze", job, "--layers", "1"], ["trace", job], ["freeze", job, "--layers", "1", "--etcd", "127.0.0.1:9"]):  # fmt: skip
        res = cli(*command, "--workdir", str(workdir), timeout=60)
        said = " ".join(res.stderr.split())
        assert res.returncode == 2 and f"job {job} is interrupted: a " in said, said
        assert f"pipetransformer resume {job}` first" in said and "etcd" not in said
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    try:
        kinds = [e.kind for e in store.events(job)]
        assert "freeze_requested" not in kinds
        assert len(store.generations(job)) == 1  # the refused resume started nothing
    finally:
        store.close()


@pytest.mark.parametrize("port", ["-5", "70000", "nine"])
def test_metrics_port_that_is_not_a_port(capsys, tmp_path: Path, spec: Path, port: str) -> None:
    """Refused by the argument parser, before anything is created (exit 2, one line)."""
    for argv in (["run", str(spec)], ["resume", "j"], ["controller", str(spec)]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--metrics-port", port, "--workdir", str(tmp_path / "runs")])
        assert exc.value.code == 2
        assert f"'{port}' is not a port: give 0..65535" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_busy_metrics_port_is_refused_before_the_job_is_recorded(
    capsys, tmp_path: Path, spec: Path
) -> None:
    """A port another process serves: one line naming it, and no job left `pending` in the
    store (before: recorded first, then exit 2, pending forever in `status --all`)."""
    workdir = tmp_path / "runs"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        line = _refused(capsys, "run", str(spec), "--metrics-port", port, "--workdir", str(workdir))
    assert f"--metrics-port {port}: cannot serve it" in line
    store = workdir / "store.db"
    if store.exists():
        with Store.open(sqlite_url(store), migrate=False) as opened:
            assert opened.list_jobs() == []


@pytest.mark.parametrize("budget", ["-1", "three"])
def test_a_restart_budget_that_is_no_count_is_refused(
    budget: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the argument parser, before anything is created (exit 2, one line)."""
    with pytest.raises(SystemExit) as exc:
        main(["controller", "--restart-budget", budget, "--workdir", str(tmp_path / "runs")])
    assert exc.value.code == 2
    assert f"'{budget}' is not a count: give 0 or more" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
