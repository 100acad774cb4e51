"""What a trainer pod holds in host memory: one real job, its processes sampled by role.

A Kubernetes trainer pod runs torchrun's agent, the fork server that starts the workers, the
workers themselves (a CUDA context, the model, pinned buffers, NCCL), torch.compile's worker
pool and a memory-backed /dev/shm; the controller pod runs `pipetransformer controller`. The
pods' memory requests have to cover the peak of all of it, or the kubelet OOM-kills a trainer
mid-run. This runs `pipetransformer run` of one spec and samples, every 0.2 s, every process
of the job by role (PSS: shared pages are split between the processes sharing them, so the
roles add up to what the processes cost together) and /dev/shm's use, and prints the peaks
beside the admission estimate's (orchestrator/admission.py) per-worker prediction.

    .venv/bin/python bench/trainer_memory.py                    # examples/vit-digits.yaml (CPU)
    .venv/bin/python bench/trainer_memory.py --spec examples/vit-gpu.yaml
    .venv/bin/python bench/trainer_memory.py --vit-b16          # ViT-B/16, 2 epochs, on a GPU

One JSON line (also bench/out/trainer_memory.json). The figures size the torchx component's
trainer pods (orchestrator/components.py, `trainer_memory_mb`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from _common import ROOT, emit, environment, progress

MIB = 1024 * 1024


def role_of(cmdline: list[str], parent_role: str | None) -> str:
    """The pod role a process of the job belongs to, from its command line (and its parent's:
    the fork server's children are the workers). The job's own processes name their role in
    their title (`pipetransformer forkserver job=...`, edge/proctitle.py); until they have set
    it, their command line tells."""
    text = " ".join(cmdline)
    titled = text.split()[1:2] if text.startswith("pipetransformer ") else []
    if cmdline and os.path.basename(cmdline[0]) == "etcd":
        return "etcd"
    if "compile_worker" in text or "_inductor" in text:
        return "compile_workers"
    if parent_role in ("forkserver", "worker"):
        return "worker"  # forked by the fork server (or a worker's loader)
    if "torch.distributed.run" in text or "torchrun" in text:
        return "agent"
    forkserver = "pipetransformer.orchestrator.forkserver" in text
    if titled == ["forkserver"] or (forkserver and "--serve-fd" in text):
        return "forkserver"
    if parent_role == "agent":
        # the agent's children: thin clients that have the fork server fork the real worker,
        # or (without a fork server) the workers themselves
        return "worker_stub" if titled == ["worker-client"] or forkserver else "worker"
    return "controller"


def _read(pid: int) -> tuple[list[str], int, int, int] | None:
    """(command line, parent pid, PSS bytes, RSS bytes) of a live process, or None."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        pss = rss = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
            elif line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
        return [c.decode(errors="replace") for c in cmd if c], ppid, pss, rss
    except (OSError, ValueError, IndexError):
        return None


def sample_tree(root: int) -> dict[str, dict[str, int]]:
    """PSS, RSS and process count per role, over `root` and all its descendants."""
    procs: dict[int, tuple[list[str], int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _read(int(entry))) is not None:
            procs[int(entry)] = info
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    roles: dict[str, dict[str, int]] = {}
    stack: list[tuple[int, str | None]] = [(root, None)]
    while stack:
        pid, parent_role = stack.pop()
        if pid not in procs:
            continue
        cmd, _, pss, rss = procs[pid]
        role = role_of(cmd, parent_role)
        agg = roles.setdefault(role, {"pss": 0, "rss": 0, "processes": 0})
        agg["pss"] += pss
        agg["rss"] += rss
        agg["processes"] += 1
        stack.extend((c, role) for c in children.get(pid, []))
    return roles


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class Sampler(threading.Thread):
    """Peaks per role (and of the trainer pod's roles together) while the job runs."""

    TRAINER_ROLES = ("agent", "forkserver", "worker", "worker_stub", "compile_workers")

    def __init__(self, root: int, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.every_s = root, every_s
        self.peak: dict[str, dict[str, int]] = {}
        self.trainer_peak_pss = 0
        self.shm_base = shm_used()
        self.shm_peak = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            roles = sample_tree(self.root)
            self.samples += 1
            for role, agg in roles.items():
                peak = self.peak.setdefault(role, {"pss": 0, "rss": 0, "processes": 0})
                for k, v in agg.items():
                    peak[k] = max(peak[k], v)
            trainer = sum(roles.get(r, {}).get("pss", 0) for r in self.TRAINER_ROLES)
            self.trainer_peak_pss = max(self.trainer_peak_pss, trainer)
            self.shm_peak = max(self.shm_peak, shm_used() - self.shm_base)
            self.done.wait(self.every_s)


def vit_b16_spec(epochs: int, batch: int) -> dict[str, Any]:
    """bench/job_mfu.py's ViT-B/16 (bf16-weights, compiled) on one GPU, no freezing."""
    sys.path.insert(0, str(ROOT / "bench"))
    import job_mfu

    spec = job_mfu.job_spec("trainer-memory-vit-b16", "bf16-weights", batch, epochs, False)
    spec["data"]["synthetic_samples"] = batch * 16
    return spec


def measure(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from pipetransformer.core.spec import JobSpec
    from pipetransformer.orchestrator import admission

    job = JobSpec.model_validate(spec)
    path = workdir / f"{job.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    est = admission.estimate(job)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetransformer.orchestrator.cli", "run", str(path)]
        + ["--workdir", str(workdir / job.name)],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sampler = Sampler(proc.pid)
    sampler.start()
    out, _ = proc.communicate()
    sampler.done.set()
    sampler.join()
    wall = time.perf_counter() - t0
    peaks = {
        role: {"pss_mib": round(p["pss"] / MIB), "rss_mib": round(p["rss"] / MIB), **p}
        for role, p in sampler.peak.items()
    }
    for p in peaks.values():
        del p["pss"], p["rss"]
    workers = job.parallel.world_size
    return {
        "job": job.name,
        "returncode": proc.returncode,
        "tail": out[-1500:] if proc.returncode else None,
        "wall_s": round(wall, 1),
        "device": job.runtime.device,
        "workers": workers,
        "model_params": admission.model_params(job.model),
        "estimate_worker_peak_mib": round(est.worker_peak_bytes / MIB),
        "peaks_by_role": peaks,
        "trainer_pod_peak_pss_mib": round(sampler.trainer_peak_pss / MIB),
        "trainer_pod_peak_pss_per_worker_mib": round(sampler.trainer_peak_pss / MIB / workers),
        "shm_peak_mib": round(sampler.shm_peak / MIB, 1),
        "samples": sampler.samples,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "examples/vit-digits.yaml"))
    ap.add_argument("--vit-b16", action="store_true", help="ViT-B/16 on one GPU instead")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args(argv)
    if args.vit_b16:
        spec = vit_b16_spec(args.epochs, args.batch)
    else:
        spec = yaml.safe_load(Path(args.spec).read_text())
        spec.setdefault("training", {})["epochs"] = args.epochs
    progress(f"[trainer_memory] running {spec['name']} ({args.epochs} epochs)")
    with tempfile.TemporaryDirectory(prefix="trainer-memory-") as tmp:
        result = measure(spec, Path(tmp))
    emit({"bench": "trainer_memory", "environment": environment(), **result}, "trainer_memory")


if __name__ == "__main__":
    main()
