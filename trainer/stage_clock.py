"""Where this rank's time goes, phase by phase (`core.stage_times.PHASES`), over each reporting
interval: cheap enough to stay on in every job (`runtime.stage_timing`, on by default;
`bench/stage_timing_overhead.py` measures what it costs).

On a GPU the phases that queue device work (forward, backward, the schedule, gradient sync,
optimizer, frozen prefix) are timed with CUDA events on the current stream, never by
synchronising the host: the events are read once per interval, when `take` waits for the last
one. Waiting for data, checkpoints and evaluation block the host and are timed on its clock, as
everything is on the CPU.

The pipeline schedule (`torch.distributed.pipelining`) interleaves computation and waiting for
neighbour stages inside one `step` call: each stage's `forward_one_chunk`,
`backward_one_chunk` and `backward_weight_one_chunk` are timed (wrapped on the stage object),
and what the schedule spent beyond them is `pipeline_wait` (receives, sends, the loss).
A replica sum that DDP overlaps with the last micro-batch's backward (GPipe, 1F1B, interleaved)
counts as backward; the split-backward schedules sum after the schedule, in `grad_sync`.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pipetransformer.core.stage_times import (
    MAX_TRACE_SPANS,
    PHASES,
    PhaseSeconds,
    TraceSpan,
    with_waits,
)

# what the clock times besides the reported phases: the schedule as a whole (split at `take`)
_SCHEDULE = "schedule"
_STAGE_METHODS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward",
}


class StageClock:
    """Seconds per phase since the interval began (`restart`), taken with `take`; and, on
    request, one step's spans (`begin_trace` .. `end_trace`)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self._host: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []  # (phase, start, end) CUDA events
        self._started = time.perf_counter()
        self._in_schedule = False
        # a traced step: (phase, stage, microbatch, start, end), host seconds or CUDA events
        self._trace: list[tuple[str, int | None, int | None, Any, Any, bool]] | None = None
        self._trace_host0 = 0.0
        self._trace_unix0 = 0.0
        self._trace_origin: Any = None

    @property
    def clock(self) -> str:
        return "cuda" if self.cuda else "host"

    def restart(self) -> None:
        """Begin a new interval, dropping what was measured since the last one (a re-layout's
        pause is reported on its own, with the layout)."""
        self._host.clear()
        self._events.clear()
        self._started = time.perf_counter()

    @contextmanager
    def measure(
        self,
        phase: str,
        on_device: bool = True,
        stage: int | None = None,
        microbatch: int | None = None,
    ) -> Iterator[None]:
        """Time the block as `phase`: with CUDA events where it queues device work
        (`on_device`) on a GPU, else on the host's clock. `stage` and `microbatch` name what a
        traced step's span worked on."""
        if not self.enabled:
            yield
            return
        device = self.cuda and on_device
        if device:
            start: Any = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        try:
            yield
        finally:
            if device:
                end: Any = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((phase, start, end))
            else:
                end = time.perf_counter()
                self._host[phase] += end - start
            if self._trace is not None:
                self._trace.append((phase, stage, microbatch, start, end, device))

    @contextmanager
    def schedule(self) -> Iterator[None]:
        """The context the pipeline schedule's training `step` runs in (split at `take` into the
        stages' computation and the wait). The stages' chunks count only in here: evaluation
        runs them too, as evaluation."""
        with self.measure(_SCHEDULE):
            self._in_schedule = True
            try:
                yield
            finally:
                self._in_schedule = False

    def wrap_stages(self, stages: Sequence[Any]) -> None:
        """Time each `PipelineStage`'s per-micro-batch forward and backward (the methods the
        schedules call, whose first argument is the micro-batch), on the stage objects
        themselves: a layout's stages are built once and dropped at the next re-layout, whose
        stages are wrapped again."""
        if not self.enabled:
            return
        for stage in stages:
            for name, phase in _STAGE_METHODS.items():
                method = getattr(stage, name, None)
                if method is not None and not getattr(method, "_stage_clock", False):
                    index = getattr(stage, "stage_index", None)
                    setattr(stage, name, self._timed(method, phase, index))

    def _timed(
        self, method: Callable[..., Any], phase: str, stage: int | None
    ) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._in_schedule:
                return method(*args, **kwargs)
            chunk = args[0] if args and isinstance(args[0], int) else None
            with self.measure(phase, stage=stage, microbatch=chunk):
                return method(*args, **kwargs)

        timed._stage_clock = True  # type: ignore[attr-defined]
        return timed

    def take(self) -> tuple[PhaseSeconds, float]:
        """The interval's seconds per phase and its wall time, and a new interval begins. On a
        GPU this waits for the interval's last event (the queued work before it)."""
        seconds = defaultdict(float, self._host)
        if self._events:
            self._events[-1][2].synchronize()
            for phase, start, end in self._events:
                seconds[phase] += start.elapsed_time(end) / 1e3
        wall = time.perf_counter() - self._started
        inside = seconds.pop(_SCHEDULE, 0.0)
        seconds["pipeline_wait"] += max(0.0, inside - seconds["forward"] - seconds["backward"])
        measured = sum(seconds[p] for p in PHASES if p != "other")
        seconds["other"] = max(0.0, wall - measured)
        self.restart()
        return PhaseSeconds(**{p: seconds[p] for p in PHASES}), wall

    # -- one traced step ---------------------------------------------------------------------

    def begin_trace(self) -> None:
        """Record every span from here to `end_trace` (one step), besides the totals."""
        if not self.enabled:
            return
        self._trace = []
        self._trace_host0, self._trace_unix0 = time.perf_counter(), time.time()
        if self.cuda:
            self._trace_origin = torch.cuda.Event(enable_timing=True)
            self._trace_origin.record()

    def end_trace(self) -> tuple[float, list[TraceSpan]]:
        """The traced spans (seconds from the trace's start; the schedule's idle gaps between
        the stages' forward and backward as `pipeline_wait`) and the start in unix seconds.
        On a GPU this waits for the step's queued work."""
        recorded, self._trace = self._trace or [], None
        if self.cuda and recorded:
            torch.cuda.synchronize()

        def offset(mark: Any, device: bool) -> float:
            if device:
                return max(0.0, self._trace_origin.elapsed_time(mark) / 1e3)
            return max(0.0, mark - self._trace_host0)

        spans, schedule = [], None
        for phase, stage, microbatch, start, end, device in recorded:
            a, b = offset(start, device), offset(end, device)
            if phase == _SCHEDULE:
                schedule = (a, max(a, b))
                continue
            spans.append(
                TraceSpan(
                    phase=phase, start_s=a, end_s=max(a, b), stage=stage, microbatch=microbatch
                )
            )
        return self._trace_unix0, with_waits(spans, schedule)[:MAX_TRACE_SPANS]
