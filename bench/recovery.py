"""Recovery: inject faults into a running 2-node x 1-process job and measure how it recovers.

The job runs as separate processes, as on a cluster: an etcd server, the controller role and two
torchrun agents (`pipetransformer workers --nnodes 1:2`, one worker each). Faults, cycled in a
seeded random order, each injected once the job is steady (two workers, training):

    worker_kill      SIGKILL one worker (its agent restarts it; both re-rendezvous)
    worker_term      SIGTERM one worker (graceful: finish the step, checkpoint, leave)
    node_loss        SIGKILL one agent and its worker; the survivor carries on alone, then a
                     new agent joins and the job widens again
    controller_kill  SIGKILL the controller, restart it a second later
    etcd_restart     stop etcd, start it again on the same data directory a second later

Per fault: `recovery_s` = fault to the first training step completed after it (for a worker
fault: the re-formed generation's first step; for a control-plane fault: the first step recorded
after the service is back), and `lost_steps` = steps trained before the fault that were not in
a committed checkpoint (they are trained again). The last line is one JSON object with
`injected`, `recovered`, `recovery_s_p50`, `recovery_s_p95`, `lost_steps_max` and per-fault rows.

    .venv/bin/python bench/recovery.py [--faults 10] [--seed 0] [--checkpoint-every 10]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _common import ROOT, emit, environment, progress

from pipetransformer.core import keys  # noqa: E402
from pipetransformer.edge.etcd_client import EtcdClient  # noqa: E402
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd  # noqa: E402
from pipetransformer.store import EventRow, Store, sqlite_url  # noqa: E402

KINDS = ("worker_kill", "worker_term", "node_loss", "controller_kill", "etcd_restart")
JOB = "recovery"


def _cli(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipetransformer.orchestrator.cli", *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
            start_new_session=True,  # a fault kills one role's whole process group, no more
        )


class Job:
    def __init__(self, tmp: Path, etcd: EmbeddedEtcd, spec: Path) -> None:
        self.tmp, self.etcd, self.spec = tmp, etcd, spec
        self.workdir = tmp / "runs"
        self.db = sqlite_url(self.workdir / "store.db")
        self.controller: subprocess.Popen | None = None
        self.agents: list[subprocess.Popen] = []
        self._n = 0

    def start_controller(self) -> None:
        self._n += 1
        self.controller = _cli(
            "controller", str(self.spec), "--job-id", JOB, "--workdir", str(self.workdir),
            "--etcd", self.etcd.endpoint, "--join-timeout", "120",
            log=self.tmp / f"controller-{self._n}.log",
        )  # fmt: skip

    def start_agent(self) -> None:
        self.agents.append(
            _cli(
                "workers",
                "--job-id",
                JOB,
                "--etcd",
                self.etcd.endpoint,
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "1",
                log=self.tmp / f"agent-{len(self.agents)}.log",
            )  # fmt: skip
        )

    def store(self) -> Store | None:
        if not (self.workdir / "store.db").exists():
            return None
        try:
            store = Store.open(self.db, migrate=False)
            if store.revision() is None or not store.list_jobs():
                store.close()
                return None
            return store
        except Exception:
            return None

    def read(self, fn, default=None):
        store = self.store()
        if store is None:
            return default
        try:
            return fn(store)
        finally:
            store.close()

    def events(self, kind: str) -> list[EventRow]:
        return self.read(
            lambda s: [e for e in reversed(s.events(JOB, limit=5000)) if e.kind == kind], []
        )

    def steady(self) -> dict | None:
        """The running generation's world and workers once it is training with 2 workers."""

        def check(s: Store) -> dict | None:
            gens = s.generations(JOB)
            if not gens or gens[-1].state != "running" or gens[-1].world_size != 2:
                return None
            resumed = [
                e
                for e in reversed(s.events(JOB, limit=5000))
                if e.kind == "generation_resumed" and e.data["generation"] == gens[-1].number
            ]
            if not resumed:
                return None
            started = [e for e in reversed(s.events(JOB, limit=5000)) if e.kind == "worker_started"]
            workers = {e.rank: e.data for e in started[-2:]}
            return {"generation": gens[-1].number, "workers": workers}

        return self.read(check)

    def state(self) -> dict:
        def read(s: Store) -> dict:
            metrics = s.metrics(JOB)
            ckpt = s.latest_checkpoint(JOB)
            return {
                "step": metrics[-1].step if metrics else 0,
                "committed": ckpt.step if ckpt else 0,
            }

        return self.read(read, {"step": 0, "committed": 0})


def _wait(pred, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def _first_step_after(job: Job, t: float, generation_after: int | None) -> float | None:
    """Time of the first completed step after `t`: the first step of a generation newer than
    `generation_after`, or (None) the first metrics row timed after `t`."""
    if generation_after is not None:
        for e in job.events("generation_resumed"):
            if e.data["generation"] > generation_after and e.data["time"] > t:
                return e.data["time"]
        return None
    rows = job.read(lambda s: [m.time for m in s.metrics(JOB) if m.time > t], [])
    return min(rows) if rows else None


def inject(job: Job, kind: str, rng: random.Random) -> dict:
    steady = _wait(job.steady, 180, "a steady job of two workers")
    time.sleep(rng.uniform(0.5, 2.0))  # a random step
    before = job.state()
    rank = rng.choice([0, 1])
    worker = steady["workers"][rank]
    gen = steady["generation"]
    t = time.time()
    if kind == "worker_kill":
        os.kill(worker["pid"], signal.SIGKILL)
    elif kind == "worker_term":
        os.kill(worker["pid"], signal.SIGTERM)
    elif kind == "node_loss":
        agent = int(worker["node"].rsplit(":", 1)[1])  # the torchrun agent ...
        os.killpg(os.getpgid(agent), signal.SIGKILL)  # ... with the `workers` launcher around it
        os.kill(worker["pid"], signal.SIGKILL)  # and its worker (torchrun gives it its session)
    elif kind == "controller_kill":
        os.killpg(job.controller.pid, signal.SIGKILL)
        job.controller.wait()
        time.sleep(1.0)
        job.start_controller()
    elif kind == "etcd_restart":
        job.etcd.stop()
        time.sleep(1.0)
        job.etcd.start()
    reforms = kind in ("worker_kill", "worker_term", "node_loss")
    try:
        first = _wait(
            lambda: _first_step_after(job, t, gen if reforms else None), 120, f"{kind} recovery"
        )
    except TimeoutError as exc:
        return {"kind": kind, "recovered": False, "error": str(exc)}
    row: dict[str, Any] = {"kind": kind, "recovered": True, "recovery_s": first - t}
    if reforms:
        starts = [e.data["start"]["step"] for e in job.events("generation_started") if e.time > t]
        trained = job.read(
            lambda s: max([m.step for m in s.metrics(JOB) if m.time <= t], default=0), 0
        )
        row["lost_steps"] = max(0, trained - starts[0]) if starts else None
        row["resumed_from"] = starts[0] if starts else None
    else:
        row["lost_steps"] = 0
    row["step_at_fault"] = before["step"]
    if kind == "node_loss":  # the node comes back: a new agent joins and the job widens
        t_join = time.time()
        job.start_agent()
        _wait(job.steady, 180, "the job to widen again")
        row["rejoin_s"] = time.time() - t_join
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    plan = [args.kinds[i % len(args.kinds)] for i in range(args.faults)]
    rng.shuffle(plan)
    spec = yaml.safe_load((ROOT / "examples" / "vit-digits.yaml").read_text())
    spec["name"] = "recovery"
    spec["training"]["epochs"] = 1000  # stopped once the faults are done
    spec["checkpoint"] = {"every_epochs": 1000, "every_steps": args.checkpoint_every, "keep": 3}
    spec["runtime"] = {"nodes": 2, "lease_ttl_s": 3, "max_restarts": 100}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec_path = tmp / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        with EmbeddedEtcd(tmp / "etcd") as etcd:
            job = Job(tmp, etcd, spec_path)
            job.start_controller()
            job.start_agent()
            job.start_agent()
            try:
                for i, kind in enumerate(plan, start=1):
                    row = inject(job, kind, rng)
                    rows.append(row)
                    took = f"{row['recovery_s']:.2f}s" if row["recovered"] else "NOT RECOVERED"
                    progress(
                        f"fault {i}/{len(plan)} {kind}: recovered in {took}, "
                        f"lost {row.get('lost_steps')} step(s)"
                    )
                    if not row["recovered"]:
                        break
            finally:
                with EtcdClient(etcd.endpoint) as client:
                    client.put(keys.control(JOB), "stop")
                try:
                    job.controller.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
                for p in [job.controller, *job.agents]:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            events = job.read(lambda s: [e.kind for e in reversed(s.events(JOB, limit=5000))])
    ok = [r for r in rows if r["recovered"]]
    rec = sorted(r["recovery_s"] for r in ok)
    lost = [r["lost_steps"] for r in ok if r.get("lost_steps") is not None]

    def pct(q: float) -> float | None:
        return rec[min(len(rec) - 1, int(q * len(rec)))] if rec else None

    by_kind = {
        k: statistics.median([r["recovery_s"] for r in ok if r["kind"] == k])
        for k in {r["kind"] for r in ok}
    }
    emit(
        {
            "benchmark": "recovery",
            "injected": len(rows),
            "recovered": len(ok),
            "recovery_s_p50": statistics.median(rec) if rec else None,
            "recovery_s_p95": pct(0.95),
            "lost_steps_max": max(lost) if lost else None,
            "checkpoint_every_steps": args.checkpoint_every,
            "recovery_s_median_by_kind": by_kind,
            "goals": {
                "recovered": "all",
                "recovery_s_p50": 5.0,
                "lost_steps_max": args.checkpoint_every,
            },
            "faults": rows,
            "event_counts": {k: events.count(k) for k in sorted(set(events or []))},
            "environment": environment(),
        },
        save_as="recovery.json",
    )


if __name__ == "__main__":
    main()
