"""How long each dashboard view takes to render on a long job (issue 49): a store holding one
finished job of `--steps` optimizer steps (10,000 by default) as a controller writes one (a step
row each with per-block gradient norms, an evaluation every `--eval-every` steps, three layout
versions, a recovery, stage timings every `--timing-every` steps on two ranks, events), and the
Streamlit page run in this process (`streamlit.testing.v1.AppTest`, the script the server runs)
once per view, timed. Goal: every view under 2 s on an idle machine.

    .venv/bin/python bench/dashboard_render.py                 # ~1 minute
    .venv/bin/python bench/dashboard_render.py --steps 2000 --repeats 1

One JSON line: seconds per view (median of `--repeats` timed runs after one untimed run, which
fills Streamlit's caches as a reader's first visit does), the largest, and the goal."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import OUT_DIR, emit, progress

from pipetransformer.core.protocol import Metrics, StageTimes
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.stage_times import PhaseSeconds
from pipetransformer.core.state import Layout, StageLayout, TrainingState
from pipetransformer.store import Store, sqlite_url

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
JOB = "long-job"
T0 = 1_760_000_000.0
DEPTH = 8
GOAL_S = 2.0


def _layout(version: int, boundary: int, replicas: int) -> Layout:
    blocks = DEPTH - boundary
    stages = 2 // replicas
    cut = boundary + blocks // stages
    ranges = [(boundary, cut), (cut, DEPTH)] if stages == 2 else [(boundary, DEPTH)]
    return Layout(
        version=version,
        num_blocks=DEPTH,
        freeze_boundary=boundary,
        stages=[
            StageLayout(index=i, start=a, end=b, ranks=[i + stages * r for r in range(replicas)])
            for i, (a, b) in enumerate(ranges)
        ],
        replicas=replicas,
        microbatches=4,
    )


def populate(store: Store, steps: int, eval_every: int, timing_every: int) -> None:
    """One finished job of `steps` steps, through the Store API as the controller writes it."""
    spec = JobSpec.model_validate(
        {
            "name": "long-job",
            "model": {"depth": DEPTH},
            "training": {"epochs": max(1, steps // eval_every), "global_batch_size": 64},
            "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
            "freeze": {"policy": "gradient"},
        }
    )
    store.create_job(JOB, spec, workdir="/tmp/runs")
    store.set_job_state(JOB, "running")
    first = store.start_generation(JOB, world_size=2)
    store.record_layout(JOB, _layout(1, 0, 1), reason="initial")
    switch = (steps // 3, 2 * steps // 3)  # re-layouts; a recovery half way
    rows, timings = [], []
    for step in range(1, steps + 1):
        frozen = 0 if step <= switch[0] else (4 if step <= switch[1] else 6)
        rows.append(
            Metrics(
                rank=0,
                step=step,
                epoch=(step - 1) // eval_every,
                samples_consumed=0,
                loss=2.3 * math.exp(-step / (steps / 5)) + 0.1 + 0.05 * math.sin(step),
                samples_per_s=900.0 + (300.0 if frozen else 0.0) + 20 * math.sin(step / 7),
                lr=3e-3,
                time=T0 + step * 0.5,
                frozen=frozen,
                grad_norms=[1.0 / (1 + b + step / 1000) for b in range(DEPTH)],
            )
        )
        if step % timing_every == 0:
            version = 1 if step <= switch[0] else (2 if step <= switch[1] else 3)
            for rank in range(2):
                timings.append(
                    StageTimes(
                        rank=rank,
                        generation=first,
                        from_step=step - timing_every,
                        to_step=step,
                        layout_version=version,
                        stages=[rank if version == 1 else 0],
                        replica=0 if version == 1 else rank,
                        wall_s=timing_every * 0.5,
                        seconds=PhaseSeconds(
                            forward=timing_every * 0.15,
                            backward=timing_every * 0.25,
                            pipeline_wait=timing_every * 0.05,
                            optimizer=timing_every * 0.05,
                        ),
                    )
                )
        if step == switch[0]:
            store.record_layout(JOB, _layout(2, 4, 1), reason="autofreeze (decision 3: F=4)")
        if step == switch[1]:
            store.record_layout(JOB, _layout(3, 6, 2), reason="autofreeze (decision 6: F=6)")
    store.add_metrics(JOB, rows)
    store.add_stage_times(JOB, timings)
    for step in range(eval_every, steps + 1, eval_every):
        acc = 0.5 + 0.45 * (1 - math.exp(-step / (steps / 4)))
        store.add_evaluation(JOB, step // eval_every - 1, step, acc, 1 - acc, T0 + step * 0.5)
    middle = steps // 2
    store.add_event(JOB, "generation_aborted", "generation 1 aborted: rank 1 killed",
                    data={"generation": first, "reason": "rank 1 killed by signal 9 (SIGKILL)"})  # fmt: skip
    store.end_generation(JOB, first, "aborted", reason="rank 1 killed by signal 9 (SIGKILL)")
    second = store.start_generation(JOB, world_size=2)
    store.add_event(JOB, "generation_started", f"generation {second} with 2 workers",
                    data={"generation": second, "start": {"step": middle - 10}})  # fmt: skip
    store.update_progress(
        JOB,
        TrainingState(epoch=steps // eval_every - 1, step=steps, lr=3e-3, layout_version=3),
    )
    store.end_generation(JOB, second, "completed")
    store.set_job_state(JOB, "completed", f"completed at step {steps}")


def render_times(url: str, views: list[str], repeats: int) -> dict[str, float]:
    """Seconds to run the page on each view: the median of `repeats` runs after one untimed."""
    from streamlit.testing.v1 import AppTest

    from pipetransformer.dashboard.launch import ENV_DB

    os.environ[ENV_DB] = url
    out: dict[str, float] = {}
    for view in views:
        at = AppTest.from_file(str(APP), default_timeout=300)
        at.query_params["job"] = JOB
        at.run()
        at.radio(key="view").set_value(view)
        at.run()  # untimed: a reader's first visit to the view fills the caches
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            at.run()
            times.append(time.perf_counter() - start)
        if at.exception:
            raise RuntimeError(f"{view}: {[e.value for e in at.exception]}")
        out[view] = statistics.median(times)
        progress(f"{view}: {out[view]:.2f} s")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--timing-every", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--views", default="", help="comma-separated (default: every view)")
    args = parser.parse_args(argv)
    from pipetransformer.dashboard.job_view import VIEWS

    views = [v for v in args.views.split(",") if v] or list(VIEWS)
    folder = OUT_DIR / "dashboard-render"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"store-{args.steps}.db"
    path.unlink(missing_ok=True)
    progress(f"writing a job of {args.steps:,} steps to {path}")
    with Store.open(sqlite_url(path)) as store:
        populate(store, args.steps, args.eval_every, args.timing_every)
    seconds = render_times(sqlite_url(path), views, args.repeats)
    largest = max(seconds, key=seconds.__getitem__)
    result: dict[str, Any] = {
        "benchmark": "dashboard_render",
        "steps": args.steps,
        "repeats": args.repeats,
        "seconds_per_view": {v: round(s, 3) for v, s in seconds.items()},
        "largest_view": largest,
        "largest_s": round(seconds[largest], 3),
        "goal_s": GOAL_S,
        "met": seconds[largest] <= GOAL_S,
    }
    emit(result, save_as="dashboard_render.json")


if __name__ == "__main__":
    sys.exit(main())
