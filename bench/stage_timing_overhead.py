"""What measuring where each rank's time goes costs (`runtime.stage_timing`, issue 28; the goal
is below 1 % of a step).

Two measurements, side by side in one run:
- the clock itself: the cost of one timed phase (`StageClock.measure`: two reads of the host's
  clock, or two CUDA event records on a GPU) and of taking an interval, times the phases a step
  times (two per micro-batch and stage, about six around them), over the step time of the job
  below: the overhead it implies;
- real jobs, `pipetransformer run` of the same spec with stage timing on and off, interleaved
  round by round (the machine's drift hits both alike): the median step time of each, and their
  ratio. On a noisy 2-core machine this ratio is only good to a few per cent; the first figure
  is the one the goal is judged on.

    .venv/bin/python bench/stage_timing_overhead.py [--rounds 3] [--epochs 4]
    .venv/bin/python bench/stage_timing_overhead.py --gpu    # bench/job_mfu.py's ViT-B/16 job

One JSON line (also bench/out/stage_timing_overhead.json).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from _common import ROOT, emit, environment, progress, rotated, run_cli_job

from pipetransformer.core.stage_times import PhaseSeconds
from pipetransformer.store import Store, sqlite_url
from pipetransformer.trainer.stage_clock import StageClock


def clock_costs(device: torch.device, n: int = 20_000) -> dict[str, float]:
    """Seconds per timed phase and per interval taken, on `device`."""
    clock = StageClock(device)
    for _ in range(100):  # warm up (CUDA: the first events allocate)
        with clock.measure("forward"):
            pass
    clock.take()
    t0 = time.perf_counter()
    for _ in range(n):
        with clock.measure("forward"):
            pass
    per_phase = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    clock.take()  # resolves n events on a GPU
    per_take = time.perf_counter() - t0
    return {"per_phase_s": per_phase, "per_take_s": per_take}


def cpu_spec(epochs: int) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "examples" / "vit-digits.yaml").read_text())
    spec["training"]["epochs"] = epochs
    spec["checkpoint"] = {"every_epochs": epochs, "keep": 1}
    return spec


def gpu_spec(epochs: int) -> dict[str, Any]:
    import job_mfu

    spec = job_mfu.job_spec("timing", "bf16-weights", 256, epochs, False)
    spec["model"] = {**spec["model"], "num_classes": 10}
    spec["data"]["synthetic_samples"] = 256 * 32
    return spec


def step_time(workdir: Path, spec: dict[str, Any], job: str) -> dict[str, Any]:
    """A job's median step time (from its metrics rows, past the first epoch's compilation and
    warm-up) and how many stage-timing rows it stored."""
    res, wall = run_cli_job(workdir, spec, job_id=job)
    if res.returncode != 0:
        raise RuntimeError(f"job {job} failed:\n{(res.stdout + res.stderr)[-3000:]}")
    store = Store.open(sqlite_url(workdir / job / "store.db"), migrate=False)
    try:
        metrics = store.metrics(job)
        rows = store.stage_times(job)
    finally:
        store.close()
    # where the time went over the whole job (stage timing on), as fractions of the wall time
    total = functools.reduce(PhaseSeconds.plus, (r.seconds for r in rows), PhaseSeconds())
    shares = total.fractions(sum(r.wall_s for r in rows))
    phases = {p: round(share, 4) for p, share in shares.items()} or None
    skip = len(metrics) // spec["training"]["epochs"]  # the first epoch
    gaps = [b.time - a.time for a, b in zip(metrics[skip:], metrics[skip + 1 :], strict=False)]
    return {
        "wall_s": wall,
        "step_s": statistics.median(gaps),
        "stage_time_rows": len(rows),
        "clock": rows[0].clock if rows else None,
        "phase_fractions": phases,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="the one-GPU ViT-B/16 job")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.gpu else "cpu")
    costs = clock_costs(device)
    progress(f"clock: {costs}")
    spec = gpu_spec(args.epochs) if args.gpu else cpu_spec(args.epochs)
    par = spec["parallel"]
    # phases a step times on its busiest rank: forward and backward per micro-batch and stage,
    # the schedule, data or frozen prefix, gradient sync (twice), optimizer (up to three)
    per_step = 2 * par["microbatches"] * par.get("virtual_stages", 1) + 7
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in rotated(["on", "off"], r):
                spec["runtime"] = {**spec.get("runtime", {}), "stage_timing": mode == "on"}
                job = f"timing-{mode}-{r}"
                runs[mode].append(step_time(Path(tmp), {**spec, "name": job}, job))
                progress(f"round {r} stage_timing {mode}: {runs[mode][-1]}")
    step_on = statistics.median(x["step_s"] for x in runs["on"])
    step_off = statistics.median(x["step_s"] for x in runs["off"])
    every = spec.get("runtime", {}).get("control_every_steps", 10)
    implied = per_step * costs["per_phase_s"] + costs["per_take_s"] * per_step / 20_000 / every
    emit(
        {
            "benchmark": "stage_timing_overhead",
            "device": device.type,
            "clock": costs,
            "timed_phases_per_step": per_step,
            "implied_overhead": implied / step_off,
            "step_s": {"on": step_on, "off": step_off},
            "measured_ratio_on_over_off": step_on / step_off,
            "runs": runs,
            "goal": "implied_overhead < 0.01",
            "environment": environment(),
        },
        save_as="stage_timing_overhead.json",
    )


if __name__ == "__main__":
    main()
