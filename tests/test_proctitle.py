"""Process titles (edge/proctitle.py): every long-lived process of a job names its role, its job
and its rank in /proc/PID/cmdline (what `ps` and `pgrep -f` read), so that jobs can be told apart
and `pkill -f 'job=<id>( |$)'` reaches one job only (docs/operations.md, "Processes")."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipetransformer.edge import proctitle
from pipetransformer.orchestrator import forkserver
from tests.fixtures_run import REPO, start_cli, wait_for, write_spec

linux_only = pytest.mark.skipif(not forkserver.available(), reason="titles are read from /proc")


def cmdline(pid: int) -> str:
    """A process's command line as `ps` and `pgrep -f` show it ('' once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(w.decode(errors="replace") for w in raw.split(b"\0") if w)


def descendants(root: int) -> list[int]:
    """`root`'s live descendants, from /proc/PID/stat's parent pids."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found.extend(kids)
        todo.extend(kids)
    return found


def test_a_title_is_the_role_then_its_fields_in_order_each_one_word() -> None:
    assert proctitle.title("worker", job="j-1", rank=3, gen=2, node=None) == (
        "pipetransformer worker job=j-1 rank=3 gen=2"
    )
    assert proctitle.title("forkserver", job=None, node="") == "pipetransformer forkserver"
    assert proctitle.title("launcher", node="a b") == "pipetransformer launcher node=a_b"


@linux_only
def test_a_fork_server_its_clients_and_their_workers_name_job_node_and_rank(
    tmp_path: Path,
) -> None:
    """Before: the server and every worker it forked showed `... forkserver --serve-fd N
    <target>`, the clients `... --server NAME <target> ARGS`: no job, node or rank."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **{proctitle.NODE_ENV: "3"})
    server, name = forkserver.start(
        env, tmp_path / "server.log", target="tests.forkserver_target", job_id="tj-1"
    )
    client = subprocess.Popen(
        [
            sys.executable,
            *forkserver.client_args(name, "tests.forkserver_target"),
            *("wait", "--job-id", "tj-1"),
        ],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env=dict(env, RANK="2"),  # as torchrun sets it
    )
    try:
        assert client.stdout is not None
        worker = int(client.stdout.readline())  # forked and running
        assert cmdline(server.pid) == "pipetransformer forkserver job=tj-1 node=3"
        assert cmdline(client.pid) == "pipetransformer worker-client job=tj-1 rank=2 node=3"
        assert cmdline(worker) == "pipetransformer worker job=tj-1 rank=2 node=3"
    finally:
        client.send_signal(signal.SIGTERM)
        client.wait(timeout=30)
        server.kill()
        server.wait()


LOADER = textwrap.dedent(
    """
    from pathlib import Path
    import torch
    from pipetransformer.core.sampler import ElasticSampler
    from pipetransformer.edge import proctitle
    from pipetransformer.trainer.sources.dataset import EpochBatches, elastic_loader

    class Titles(torch.utils.data.Dataset):  # what each read's process is called
        def __len__(self):
            return 4
        def __getitem__(self, key):
            return Path("/proc/self/cmdline").read_bytes().split(b"\\0")[0].decode()

    proctitle.set_title("worker", job="tj-2", rank=1, gen=5, node=0)
    batches = EpochBatches(ElasticSampler(4, global_batch=2, seed=0), 0, 0, 1, 0, 1)
    loader = elastic_loader(Titles(), batches, num_workers=1, collate_fn=lambda rows: rows)
    print(next(iter(loader))[0])
    """
)


@linux_only
def test_a_workers_loader_processes_say_whose_they_are() -> None:
    """Before: a loader showed its worker's command line, the same as every other process the
    fork server forked."""
    out = subprocess.run(
        [sys.executable, "-c", LOADER], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "pipetransformer loader job=tj-2 rank=1 gen=5 node=0 id=0"


@linux_only
@pytest.mark.slow
def test_a_running_jobs_processes_carry_role_job_and_rank(tmp_path: Path) -> None:
    """A real `pipetransformer run`: the controller, the node's fork server and each rank's
    worker (and its fork-server client) say so, with the job, node, rank and generation; the
    pattern docs/operations.md gives finds this job's processes and not another job's whose id
    it begins. Before: the workers read `... forkserver --serve-fd N pipetransformer.trainer.worker`,
    the controller `... pipetransformer.orchestrator.cli run ...`."""
    job = "titles"
    spec = write_spec(tmp_path / "spec.yaml", training={"epochs": 50})
    log = tmp_path / "run.log"
    proc = start_cli(
        "run", str(spec), "--workdir", str(tmp_path / "runs"), "--job-id", job, log=log
    )
    # a process of another job whose id begins with this one's
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import setproctitle, time; "
            f"setproctitle.setproctitle('pipetransformer worker job={job}-2 rank=0'); "
            "time.sleep(120)",
        ]
    )
    try:
        worker_re = re.compile(rf"pipetransformer worker job={job} rank=(\d) gen=(\d+) node=0")

        def titles() -> dict[int, str] | None:
            seen = {pid: cmdline(pid) for pid in descendants(proc.pid)}
            if sum(bool(worker_re.fullmatch(t)) for t in seen.values()) < 2:
                return None  # until both ranks have joined their generation
            return seen

        seen = wait_for(titles, 150, "both workers titled with their generation", log)
        assert cmdline(proc.pid) == f"pipetransformer controller job={job}"
        by_title = sorted(seen.values())
        assert f"pipetransformer forkserver job={job} node=0" in by_title
        workers = [m.groups() for t in by_title if (m := worker_re.fullmatch(t))]
        assert sorted(rank for rank, _ in workers) == ["0", "1"]
        assert len({gen for _, gen in workers}) == 1  # one generation
        for rank in ("0", "1"):
            assert f"pipetransformer worker-client job={job} rank={rank} node=0" in by_title
        assert not [t for t in by_title if "--serve-fd" in t]  # the anonymous workers

        wait_for(lambda: cmdline(other.pid).startswith("pipetransformer "), 30, "the other title")
        if shutil.which("pgrep"):  # procps
            found = subprocess.run(
                ["pgrep", "-f", f"job={job}( |$)"], capture_output=True, text=True, check=True
            )
            matched = {int(p) for p in found.stdout.split()}
            ours = {pid for pid, t in seen.items() if t.startswith("pipetransformer ")}
            assert ours | {proc.pid} <= matched and other.pid not in matched
    finally:
        other.kill()
        others = descendants(proc.pid)
        proc.kill()  # its agents, fork server and etcd die with it (parent-death signal)
        proc.wait()
        for pid in others:  # and whatever had not yet
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        other.wait()
