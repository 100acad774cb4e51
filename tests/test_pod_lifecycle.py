"""What ends a job's pods and what replaces them: the controller's exit statuses, its restart
budget kept in the store, the Volcano policies the scheduler writes, and the pods' sizes.

The Volcano Job itself is asserted in tests/test_torchx_k8s.py and rehearsed in
tests/test_k8s_rehearsal.py; here are the pure parts and the controller command's decisions
(which need no etcd: they come before it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipetransformer.core.spec import JobSpec, load_spec
from pipetransformer.orchestrator import exits, restarts, sizing, volcano
from pipetransformer.store import Store, sqlite_url
from pipetransformer.store.rows import EventRow

REPO = Path(__file__).resolve().parents[1]


def event(i: int, kind: str, data: dict | None = None, message: str = "") -> EventRow:
    return EventRow(id=i, time=1000.0 + i, kind=kind, rank=None, message=message, data=data)


def started(i: int, launch: str = "L") -> EventRow:
    return event(i, restarts.STARTED, {"launch": launch})


def exited(i: int, status: int, launch: str = "L") -> EventRow:
    return event(i, restarts.EXITED, {"launch": launch, "status": status}, f"exit {status}")


# -- the restart budget -----------------------------------------------------------------------


def test_unclean_restarts_count_crashes_kills_and_give_ups_until_a_clean_handover() -> None:
    events = [
        started(1),
        exited(2, exits.EXIT_SIGTERM),  # a drain: clean
        started(3),
        event(4, restarts.CRASHED, {"launch": "L"}, "controller crashed: OSError: disk full"),
        started(5),  # killed without a word (OOM)
        started(6),
        exited(7, exits.EXIT_ERROR),  # gave up on absent workers
        started(8),
    ]
    count, reason = restarts.unclean_restarts(events, "L")
    assert count == 3 and reason == "exit 1"
    # order does not matter (the store returns newest first)
    assert restarts.unclean_restarts(list(reversed(events)), "L") == (count, reason)
    # one more kill: the last one's reason says so
    count, reason = restarts.unclean_restarts([*events, started(9)], "L")
    assert count == 4 and "without a word" in reason
    # a handover resets the count
    assert restarts.unclean_restarts([*events, exited(9, exits.EXIT_SIGTERM)], "L")[0] == 0
    # a new launch (a user resubmitting the job) starts with a fresh budget
    assert restarts.unclean_restarts([*events, started(9, "M")], "M") == (0, "")


def job_info(state: str) -> SimpleNamespace:
    return SimpleNamespace(state=state)


def test_a_controller_restarted_after_its_launch_ended_the_job_exits_with_that_end() -> None:
    def end(i: int, state: str, outcome: str | None) -> EventRow:
        return event(i, f"job_{state}", {"outcome": outcome})

    done = [started(1), end(2, "completed", "done")]
    assert restarts.ended_status(job_info("completed"), done, "L") == exits.EXIT_COMPLETED
    failed = [started(1), end(2, "failed", "failed")]
    assert restarts.ended_status(job_info("failed"), failed, "L") == exits.EXIT_JOB_FAILED
    stopped = [started(1), end(2, "interrupted", "stopped")]
    assert restarts.ended_status(job_info("interrupted"), stopped, "L") == exits.EXIT_STOPPED
    # workers gone: a restart continues the job
    gone = [started(1), end(2, "interrupted", None)]
    assert restarts.ended_status(job_info("interrupted"), gone, "L") is None
    # a new launch (or a controller without a launch id) resumes whatever ended before
    assert restarts.ended_status(job_info("interrupted"), stopped, "M") is None
    assert restarts.ended_status(job_info("failed"), failed, "") is None
    # an end under an earlier launch, then this launch's start: it goes on
    assert restarts.ended_status(job_info("failed"), [*failed, started(3, "M")], "M") is None


def test_exit_status_of_each_job_end_and_the_termination_message(tmp_path: Path) -> None:
    assert exits.exit_status("completed", stopped=False) == 0
    assert exits.exit_status("failed", stopped=False) == exits.EXIT_JOB_FAILED
    assert exits.exit_status("interrupted", stopped=True) == exits.EXIT_STOPPED
    assert exits.exit_status("interrupted", stopped=False) == exits.EXIT_ERROR
    assert set(exits.TERMINAL) == {exits.EXIT_USAGE, exits.EXIT_JOB_FAILED, exits.EXIT_STOPPED}
    log = tmp_path / "termination-log"
    assert not exits.write_termination_log("x", str(log)) and not log.exists()  # never created
    log.write_text("old words that are longer")
    assert exits.write_termination_log("é" * 3000, str(log))
    assert len(log.read_bytes()) == exits.TERMINATION_LOG_MAX_BYTES  # Kubernetes keeps 4096


# -- the controller command's decisions, before it reaches etcd ---------------------------------


def controller(workdir: Path, job_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "pipetransformer.orchestrator.cli",
        "controller",
        "--workdir",
        str(workdir),
    ]
    cmd += ["--job-id", job_id, "--etcd", "127.0.0.1:9", "--join-timeout", "5", *args]
    env = {**os.environ, "PIPETRANSFORMER_SPEC": (REPO / "examples/vit-digits.yaml").read_text()}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_a_crash_looping_controller_fails_its_job_with_the_reason_and_a_terminal_status(
    tmp_path: Path,
) -> None:
    store = Store.open(sqlite_url(tmp_path / "store.db"))
    store.create_job("loop", load_spec(REPO / "examples/vit-digits.yaml"), str(tmp_path))
    for _ in range(3):  # three starts; the last two found the one before gone without a word
        store.add_event("loop", restarts.STARTED, "controller started", data={"launch": "L"})
    store.add_event("loop", restarts.CRASHED, "controller crashed: RuntimeError: boom")
    store.close()
    res = controller(tmp_path, "loop", "--launch-id", "L", "--restart-budget", "2")
    assert res.returncode == exits.EXIT_JOB_FAILED, res.stdout + res.stderr
    assert "restarted 3 times in a row" in res.stdout + res.stderr
    store = Store.open(sqlite_url(tmp_path / "store.db"), migrate=False)
    job = store.get_job("loop")
    assert job.state == "failed" and "RuntimeError: boom" in (job.message or "")
    assert store.events("loop", limit=1, kinds=[restarts.EXITED])[0].data["status"] == 3
    # restarted again by Volcano in the same launch: the job ended, it exits the same way
    store.close()
    res = controller(tmp_path, "loop", "--launch-id", "L", "--restart-budget", "2")
    assert res.returncode == exits.EXIT_JOB_FAILED and "already ended (failed)" in res.stdout


def test_a_bad_spec_is_a_terminal_status_for_the_controller(tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "examples/vit-digits.yaml").read_text())
    spec["training"]["epochs"] = -1
    cmd = [
        sys.executable,
        "-m",
        "pipetransformer.orchestrator.cli",
        "controller",
        "--workdir",
        str(tmp_path),
    ]
    cmd += ["--job-id", "bad", "--etcd", "127.0.0.1:9"]
    env = {**os.environ, "PIPETRANSFORMER_SPEC": yaml.safe_dump(spec)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert res.returncode == exits.EXIT_USAGE, res.stderr  # Volcano: TerminateJob
    assert "training.epochs" in res.stderr


# -- what the scheduler writes, and the pods' sizes -----------------------------------------------


def test_apply_policies_writes_declared_policies_and_leaves_other_roles_to_torchx() -> None:
    from kubernetes.client import V1ObjectMeta, V1Pod

    def task(role: str) -> dict:
        meta = V1ObjectMeta(labels={"torchx.pytorch.org/role-name": role})
        return {"name": f"{role}-0", "template": V1Pod(metadata=meta), "maxRetry": 5}

    resource = {"spec": {"tasks": [task("controller"), task("trainer"), task("sidecar")]}}
    roles = [
        SimpleNamespace(
            name="controller",
            max_retries=3,
            metadata=volcano.role_metadata(volcano.controller_policies()),
        ),
        SimpleNamespace(
            name="trainer",
            max_retries=2,
            metadata=volcano.role_metadata(volcano.trainer_policies()),
        ),
        SimpleNamespace(name="sidecar", max_retries=5, metadata={}),
    ]
    ctl, trainer, sidecar = volcano.apply_policies(resource, roles)["spec"]["tasks"]
    assert ctl["maxRetry"] == 3 and ctl["policies"] == volcano.controller_policies()
    assert trainer["maxRetry"] == 2 and trainer["policies"] == volcano.trainer_policies()
    assert "policies" not in sidecar and sidecar["maxRetry"] == 5
    # every exit status a restart cannot help has a terminal action; no exit code is 0
    codes = {p["exitCode"]: p["action"] for p in ctl["policies"] if "exitCode" in p}
    assert set(codes) == set(exits.TERMINAL)
    assert set(codes.values()) <= {volcano.ABORT_JOB, volcano.TERMINATE_JOB}


def test_torchx_finds_this_projects_kubernetes_scheduler() -> None:
    from torchx.schedulers import get_scheduler_factories

    scheduler = get_scheduler_factories()["kubernetes"]("test")
    assert type(scheduler).__name__ == "VolcanoKubernetesScheduler"


def spec_with(**runtime: object) -> JobSpec:
    spec = yaml.safe_load((REPO / "examples/vit-digits.yaml").read_text())
    spec["runtime"] = {**spec.get("runtime", {}), **runtime}
    return JobSpec.model_validate(spec)


def test_pod_sizes_follow_the_spec_and_are_guaranteed() -> None:
    cpu = spec_with()
    one, two = sizing.trainer_size(cpu, 1, 0), sizing.trainer_size(cpu, 2, 0)
    assert two.memory_mib > one.memory_mib and two.cpus == one.cpus + 1
    # measured: a CPU trainer pod of two vit-digits workers peaked at 892 MiB
    assert two.memory_mib >= 892 * 1.15
    gpu = sizing.trainer_size(spec_with(device="cuda"), 1, 1)
    # measured on an H200: 2,461 MiB for a 14 M-parameter ViT (a CUDA worker is 1.6 GiB+)
    assert gpu.memory_mib >= 2048 and gpu.cpus >= 4
    res = gpu.resources(gpus=1)
    assert res["requests"] == res["limits"] and res["limits"]["nvidia.com/gpu"] == "1"
    assert gpu.cache_mib and gpu.ephemeral_mib > gpu.cache_mib
    # a bigger model needs more host memory on a GPU (built on the host before it moves)
    big = yaml.safe_load((REPO / "examples/vit-digits.yaml").read_text())
    big["model"].update({"dim": 768, "heads": 12, "depth": 12})
    big["runtime"] = {**big.get("runtime", {}), "device": "cuda"}
    assert sizing.trainer_size(JobSpec.model_validate(big), 1, 1).memory_mib > gpu.memory_mib


def test_the_cache_files_stay_inside_the_volume_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetransformer.core.keys import ACTIVATION_CACHE_BYTES_ENV
    from pipetransformer.trainer.trainer import cache_disk_budget

    monkeypatch.delenv(ACTIVATION_CACHE_BYTES_ENV, raising=False)
    assert cache_disk_budget() is None
    monkeypatch.setenv(ACTIVATION_CACHE_BYTES_ENV, str(1 << 30))
    assert cache_disk_budget() == 1 << 29  # two boundaries' files at once
    monkeypatch.setenv(ACTIVATION_CACHE_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=ACTIVATION_CACHE_BYTES_ENV):
        cache_disk_budget()
