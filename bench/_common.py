"""Helpers shared by the benchmarks in bench/: thread pinning, progress lines, the output folder
(bench/out/, gitignored) and the one JSON object every benchmark prints as its last line.

On these 2-core machines other work runs beside a benchmark, so absolute times drift: measure the
things being compared side by side in one run (interleaved repeats, medians) with threads pinned,
and report ratios."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "bench" / "out"
if str(ROOT) not in sys.path:  # `python bench/x.py` works without installing the project
    sys.path.insert(0, str(ROOT))

T = TypeVar("T")
MIB = 1 << 20
_T0 = time.perf_counter()


def pin_threads(n: int = 1) -> None:
    """One intra-op (and inter-op) thread per process, so timings compare like with like. Call it
    before the first torch operation; the environment variables also cover libraries and child
    processes started later."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass  # already set once in this process (torch allows it only before parallel work)


def rotated(items: list[T], k: int) -> Iterator[T]:
    """`items` starting at position k (mod len): repeats of side-by-side timings rotate which
    configuration goes first, so none always runs on a cold cache or a warm clock."""
    k %= len(items)
    yield from items[k:] + items[:k]


def pick_device(choice: str, threads: int = 1):  # -> tuple[torch.device, str]
    """The device for `--device auto|cpu|cuda` (auto: CUDA when present) and a name for it in
    titles; on the CPU the threads are pinned. Exits with a clear message for `cuda` without
    CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    if choice == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA device is available here")
    device = torch.device(("cuda" if cuda else "cpu") if choice == "auto" else choice)
    if device.type == "cpu":
        pin_threads(threads)
        return device, f"CPU, {threads} thread(s)"
    return device, torch.cuda.get_device_name(device)


def out_dir() -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR


def progress(message: str) -> None:
    """A progress line with the time since start (stdout, flushed, so logs interleave sanely)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def emit(result: dict[str, Any], save_as: str | None = None) -> None:
    """Print `result` as one JSON line (the benchmark's last line of output), and keep a copy in
    bench/out/`save_as` when given."""
    line = json.dumps(_jsonable(result), separators=(",", ":"))
    if save_as:
        (out_dir() / save_as).write_text(line + "\n")
    print(line, flush=True)


def run_cli_job(
    workdir: Path,
    spec: dict[str, Any],
    job_id: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess, float]:
    """`pipetransformer run` of `spec` as job `job_id` (default: the spec's name) under
    `workdir/<job_id>`, in a fresh process as a user would, with `env` added to the environment;
    the finished process and its wall time (s)."""
    import yaml

    job = job_id or spec["name"]
    path = workdir / f"{job}.yaml"
    path.write_text(yaml.safe_dump(spec))
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "pipetransformer.orchestrator.cli", "run", str(path)]
        + ["--workdir", str(workdir / job), "--job-id", job],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
    )
    return res, time.perf_counter() - t0


def _kb_fields(path: str) -> dict[str, int]:
    """The `Name: N kB` lines of a /proc file, in bytes ({} when the process is gone)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        return {}
    return out


# what is sampled, by name: resident set (status) and proportional set (smaps_rollup: a page
# shared by k processes counts 1/k in each, so the sum over processes counts it once)
MEMORY_STATUS = {
    "rss": "VmRSS",
    "rss_anon": "RssAnon",
    "rss_file": "RssFile",
    "rss_shmem": "RssShmem",
}
MEMORY_ROLLUP = {
    "pss": "Pss",
    "pss_anon": "Pss_Anon",
    "pss_file": "Pss_File",
    "pss_shmem": "Pss_Shmem",
}


def process_memory(pid: int | str) -> dict[str, float]:
    """One process's resident memory in MiB by kind ({} when it is gone)."""
    status = _kb_fields(f"/proc/{pid}/status")
    if not status:
        return {}
    rollup = _kb_fields(f"/proc/{pid}/smaps_rollup")
    one = {k: status.get(name, 0) / MIB for k, name in MEMORY_STATUS.items()}
    one.update({k: rollup.get(name, 0) / MIB for k, name in MEMORY_ROLLUP.items()})
    one["hwm"] = status.get("VmHWM", 0) / MIB
    return one
