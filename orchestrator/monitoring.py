"""A job's figures where a cluster already looks (issue 28): Prometheus and TensorBoard.

`JobMetrics` serves one job's figures as Prometheus metrics over HTTP (`prometheus_client`, on a
registry of its own). Nothing is kept between scrapes: each scrape reads the store afresh
(`JobCollector`), so a value is never stale and the exporter costs nothing between scrapes. A
store that fails a read during a scrape does not take the server down: the scrape answers
`pipetransformer_scrape_error 1` with whatever the other reads gave, and the failure is logged
(once per distinct error and minute).

`TensorBoardWriter` writes the typed reports the controller has just stored (`core.protocol`
`Metrics`, `Evaluated`, `StageTimes`, `LayoutPlanned`) as TensorBoard event files under a
directory; a replayed drain adds nothing.

Every metric is named `pipetransformer_*`, carries the label `job_id` (not `job`: Prometheus
sets `job` on every target itself and renames a scraped `job` label to `exported_job`), and is
listed in `METRICS` with its help text; `k8s/monitoring/grafana-dashboard.json` queries only
those names (tests/test_monitoring.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipetransformer.core.protocol import Evaluated, LayoutPlanned, Metrics, StageTimes
from pipetransformer.core.stage_times import measured_bubble, per_rank, theoretical_bubble
from pipetransformer.store import JOB_STATES, WORKER_STATES, Store

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from pipetransformer.store import (
        CheckpointInfo,
        GenerationRow,
        JobStatus,
        StageTimesRow,
        WorkerRow,
    )

log = logging.getLogger("pipetransformer.monitoring")

PREFIX = "pipetransformer_"
# a worker of the newest generation counts as alive while in one of these states
# (store.tables.WORKER_STATES: the others say how it ended)
ALIVE_STATES = ("assigned", "running")
# stage-time intervals summed per rank at each scrape (the newest that many `to_step`s)
STAGE_INTERVALS = 4
# a read the store keeps retrying longer than this makes a scrape outlive Prometheus's
# default timeout (10 s): `JobMetrics.open` gives its own store this bound
SCRAPE_RETRY_S = 2.0
# the same store error is logged at most once in this many seconds
ERROR_LOG_EVERY_S = 60.0

# Every metric the exporter may serve: the name a query uses -> (type, extra labels besides
# job_id, help). Counters carry their `_total` here, as PromQL sees them.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "pipetransformer_scrape_error": (
        "gauge",
        (),
        "1 when a store read failed during this scrape (the figures it would have given are "
        "missing), else 0",
    ),
    "pipetransformer_job_state": (
        "gauge",
        ("state",),
        "1 for the job's state in the store (pending, running, completed, failed, interrupted)",
    ),
    "pipetransformer_step": ("gauge", (), "the newest optimizer step the store recorded"),
    "pipetransformer_epoch": ("gauge", (), "the epoch of the newest recorded progress"),
    "pipetransformer_epochs": ("gauge", (), "epochs the job's spec trains for"),
    "pipetransformer_epoch_position_samples": (
        "gauge",
        (),
        "training samples of the current epoch trained so far (the position within the epoch: "
        "0 at each epoch's start, the training set's size at its end; not a running total)",
    ),
    "pipetransformer_loss": (
        "gauge",
        (),
        "training loss of the newest step (absent if not finite)",
    ),
    "pipetransformer_samples_per_second": (
        "gauge",
        (),
        "training throughput of the newest step, samples per second",
    ),
    "pipetransformer_learning_rate": ("gauge", (), "learning rate of the newest step"),
    "pipetransformer_mfu_ratio": (
        "gauge",
        (),
        "model FLOPs utilisation of the newest step, a fraction of the devices' dense peak",
    ),
    "pipetransformer_last_step_timestamp_seconds": (
        "gauge",
        (),
        "unix time at which the newest recorded step ended (the worker's clock)",
    ),
    "pipetransformer_accuracy_ratio": (
        "gauge",
        (),
        "held-out accuracy of the newest evaluation, 0..1 (question answering: exact match)",
    ),
    "pipetransformer_peak_memory_bytes": (
        "gauge",
        ("rank",),
        "peak GPU memory allocated per rank, as the newest control point reported it",
    ),
    "pipetransformer_freeze_boundary_blocks": (
        "gauge",
        (),
        "blocks frozen by the current layout (the freeze boundary F)",
    ),
    "pipetransformer_model_blocks": ("gauge", (), "transformer blocks of the model"),
    "pipetransformer_layout_version": ("gauge", (), "version of the layout in force"),
    "pipetransformer_layout_pipeline_ranks": (
        "gauge",
        (),
        "ranks in one pipeline of the layout in force",
    ),
    "pipetransformer_layout_replicas": ("gauge", (), "data-parallel replicas of the layout"),
    "pipetransformer_layout_microbatches": ("gauge", (), "micro-batches per step of the layout"),
    "pipetransformer_checkpoint_step": ("gauge", (), "step of the newest committed checkpoint"),
    "pipetransformer_checkpoint_age_seconds": (
        "gauge",
        (),
        "seconds since the newest committed checkpoint was committed",
    ),
    "pipetransformer_generation": ("gauge", (), "number of the newest generation (1 = first)"),
    "pipetransformer_recoveries_total": (
        "counter",
        (),
        "generations after the first: restarts after a failure, re-formed worlds and resumes",
    ),
    "pipetransformer_world_size": ("gauge", (), "workers the newest generation was formed with"),
    "pipetransformer_workers": (
        "gauge",
        ("state",),
        "workers of the newest generation by state (store.tables.WORKER_STATES)",
    ),
    "pipetransformer_workers_alive": (
        "gauge",
        (),
        "workers of the newest generation assigned or running",
    ),
    "pipetransformer_stage_phase_ratio": (
        "gauge",
        ("rank", "stage", "replica", "phase"),
        "fraction of a rank's wall time spent in each phase over its newest measured "
        "intervals (core/stage_times.py PHASES; the phases of a rank sum to 1)",
    ),
    "pipetransformer_stage_busy_ratio": (
        "gauge",
        ("rank", "stage", "replica"),
        "fraction of a rank's wall time spent in forward and backward computation",
    ),
    "pipetransformer_stage_bubble_ratio": (
        "gauge",
        ("rank", "stage", "replica"),
        "measured pipeline bubble of a rank: waiting for a neighbour stage over the time "
        "inside the schedule",
    ),
    "pipetransformer_stage_wall_seconds": (
        "gauge",
        ("rank", "stage", "replica"),
        "wall time the phase fractions of a rank were measured over",
    ),
    "pipetransformer_stage_layout_version": (
        "gauge",
        (),
        "layout version the stage readings were measured under",
    ),
    "pipetransformer_stage_measured_step": (
        "gauge",
        (),
        "the newest step the stage readings reach",
    ),
    "pipetransformer_theoretical_bubble_ratio": (
        "gauge",
        (),
        "the bubble the current layout's schedule implies with equal stages (absent for the "
        "zero-bubble schedules)",
    ),
}


def _family(name: str) -> Metric:
    """An empty metric family for `name` (a key of `METRICS`), labelled `job_id` + its own."""
    kind, labels, doc = METRICS[name]
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), doc, labels=["job_id", *labels])
    return GaugeMetricFamily(name, doc, labels=["job_id", *labels])


class StoreReads(Protocol):
    """The store reads a scrape makes (`store.Store` has them)."""

    def status(self, job_id: str) -> JobStatus: ...
    def latest_checkpoint(self, job_id: str) -> CheckpointInfo | None: ...
    def generations(self, job_id: str) -> list[GenerationRow]: ...
    def workers(self, job_id: str) -> list[WorkerRow]: ...
    def stage_times(
        self, job_id: str, since_step: int | None = None, last_intervals: int | None = None
    ) -> list[StageTimesRow]: ...


def stage_label(stages: Sequence[int]) -> str:
    """A rank's stages as one label value: "1", or "0+2" for a rank with virtual stages."""
    return "+".join(str(s) for s in stages)


class JobCollector(Collector):
    """A `prometheus_client` collector over one job's store rows, read at each `collect`.

    Each group of figures comes from its own read; a read that raises leaves its group out and
    sets `pipetransformer_scrape_error` to 1 (logged), the rest is served as usual."""

    def __init__(
        self,
        store: StoreReads,
        job_id: str,
        stage_intervals: int = STAGE_INTERVALS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if stage_intervals < 1:
            raise ValueError(f"stage_intervals must be >= 1, got {stage_intervals}")
        self.store = store
        self.job_id = job_id
        self.stage_intervals = stage_intervals
        self._clock = clock
        self._logged: dict[str, float] = {}  # error text -> when it was last logged
        self._lock = threading.Lock()  # scrapes may run in parallel (one thread per request)

    def describe(self) -> list[Metric]:
        # no names declared up front: registering never runs a scrape's reads
        return []

    def collect(self) -> Iterator[Metric]:
        failed = False
        groups = (
            ("status", self._status),
            ("latest_checkpoint", self._checkpoint),
            ("generations and workers", self._generations),
            ("stage_times", self._stages),
        )
        for what, group in groups:
            try:
                families = list(group())  # whole, or not at all
            except Exception as exc:  # a scrape answers whatever the store does
                failed = True
                self._log_error(what, exc)
                continue
            yield from families
        error = _family("pipetransformer_scrape_error")
        error.add_metric([self.job_id], 1.0 if failed else 0.0)
        yield error

    # -- groups: each reads what it needs and yields complete families --------------------------

    def _status(self) -> Iterator[Metric]:
        st = self.store.status(self.job_id)
        job = [self.job_id]
        state = _family("pipetransformer_job_state")
        for s in JOB_STATES:
            state.add_metric([self.job_id, s], 1.0 if s == st.state else 0.0)
        yield state
        yield from _gauges(
            job,
            {
                "pipetransformer_step": st.step,
                "pipetransformer_epoch": st.epoch,
                "pipetransformer_epochs": st.epochs,
                "pipetransformer_epoch_position_samples": st.samples_consumed,
                "pipetransformer_accuracy_ratio": st.accuracy,
                "pipetransformer_freeze_boundary_blocks": st.freeze_boundary,
                # the newest recorded layout's (the boundary is that layout's too); the job
                # row's is the one its newest progress report trained under
                "pipetransformer_layout_version": (
                    st.layout.version if st.layout is not None else st.layout_version
                ),
            },
        )
        last = st.last_metrics
        if last is not None:
            yield from _gauges(
                job,
                {
                    "pipetransformer_loss": last.loss,
                    "pipetransformer_samples_per_second": last.samples_per_s,
                    "pipetransformer_learning_rate": last.lr,
                    "pipetransformer_mfu_ratio": last.mfu,
                    "pipetransformer_last_step_timestamp_seconds": last.time,
                },
            )
        if st.peak_memory_mib:
            peak = _family("pipetransformer_peak_memory_bytes")
            for rank, mib in enumerate(st.peak_memory_mib):
                if _finite(mib):
                    peak.add_metric([self.job_id, str(rank)], mib * 2**20)
            yield peak
        if st.layout is not None:
            lay = st.layout
            yield from _gauges(
                job,
                {
                    "pipetransformer_model_blocks": lay.num_blocks,
                    "pipetransformer_layout_pipeline_ranks": lay.pipeline_ranks,
                    "pipetransformer_layout_replicas": lay.replicas,
                    "pipetransformer_layout_microbatches": lay.microbatches,
                    "pipetransformer_theoretical_bubble_ratio": theoretical_bubble(
                        lay.schedule, lay.pipeline_ranks, lay.microbatches, lay.virtual_stages
                    ),
                },
            )

    def _checkpoint(self) -> Iterator[Metric]:
        ckpt = self.store.latest_checkpoint(self.job_id)
        if ckpt is None:
            return
        age = max(0.0, self._clock() - ckpt.created_at.timestamp())
        yield from _gauges(
            [self.job_id],
            {
                "pipetransformer_checkpoint_step": ckpt.step,
                "pipetransformer_checkpoint_age_seconds": age,
            },
        )

    def _generations(self) -> Iterator[Metric]:
        gens = self.store.generations(self.job_id)
        recoveries = _family("pipetransformer_recoveries_total")
        recoveries.add_metric([self.job_id], float(max(0, len(gens) - 1)))
        yield recoveries
        if not gens:
            return
        newest = gens[-1]
        # the newest generation's ranks (none yet while its join request is being answered)
        states = [w.state for w in self.store.workers(self.job_id) if w.generation == newest.number]
        by_state = _family("pipetransformer_workers")
        for s in WORKER_STATES:
            by_state.add_metric([self.job_id, s], float(states.count(s)))
        yield by_state
        yield from _gauges(
            [self.job_id],
            {
                "pipetransformer_generation": newest.number,
                "pipetransformer_world_size": newest.world_size,
                "pipetransformer_workers_alive": sum(states.count(s) for s in ALIVE_STATES),
            },
        )

    def _stages(self) -> Iterator[Metric]:
        rows = self.store.stage_times(self.job_id, last_intervals=self.stage_intervals)
        ranks = per_rank(rows)
        if not ranks:
            return
        phases = _family("pipetransformer_stage_phase_ratio")
        busy = _family("pipetransformer_stage_busy_ratio")
        bubble = _family("pipetransformer_stage_bubble_ratio")
        wall = _family("pipetransformer_stage_wall_seconds")
        for r in ranks:
            labels = [self.job_id, str(r.rank), stage_label(r.stages), str(r.replica)]
            wall.add_metric(labels, r.wall_s)
            for phase, fraction in r.seconds.fractions(r.wall_s).items():
                phases.add_metric([*labels, phase], fraction)
            if r.wall_s > 0:
                busy.add_metric(labels, r.busy_fraction)
            if (b := r.bubble) is not None:
                bubble.add_metric(labels, b)
        yield from (phases, busy, bubble, wall)
        yield from _gauges(
            [self.job_id],
            {
                "pipetransformer_stage_layout_version": ranks[0].layout_version,
                "pipetransformer_stage_measured_step": max(r.to_step for r in rows),
            },
        )

    def _log_error(self, what: str, exc: Exception) -> None:
        text = f"{what}: {type(exc).__name__}: {exc}"
        now = self._clock()
        with self._lock:
            last = self._logged.get(text)
            if last is not None and now - last < ERROR_LOG_EVERY_S:
                return
            self._logged[text] = now
            if len(self._logged) > 100:  # a store whose errors all differ: keep the newest
                for key in sorted(self._logged, key=self._logged.__getitem__)[:50]:
                    del self._logged[key]
        log.warning(
            "metrics for job %s: a store read failed during a scrape (%s); served "
            "pipetransformer_scrape_error 1",
            self.job_id,
            text,
        )


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _gauges(labels: list[str], values: dict[str, float | int | None]) -> Iterator[Metric]:
    """One family per name with one sample each; names whose value is unknown are left out."""
    for name, value in values.items():
        if value is None or not _finite(float(value)):
            continue
        family = _family(name)
        family.add_metric(labels, float(value))
        yield family


@dataclass
class _Serving:
    httpd: WSGIServer
    thread: threading.Thread


class JobMetrics:
    """One job's Prometheus metrics, served at `/metrics` (any path, in fact) over HTTP.

        metrics = JobMetrics(store, job_id)       # or JobMetrics.open(url, job_id)
        port = metrics.start(9400, "0.0.0.0")     # a daemon thread; 0 = any free port
        ...
        metrics.stop()

    `store` is any object with the reads of `StoreReads` (a `store.Store`); it is read from the
    server's threads, one transaction per read. Prefer a store of the exporter's own
    (`JobMetrics.open`): read-only, with a short retry bound so that a store outage answers the
    scrape with `pipetransformer_scrape_error 1` before Prometheus gives up on it, and with no
    share in the controller's store's `recoveries`."""

    def __init__(
        self,
        store: StoreReads,
        job_id: str,
        stage_intervals: int = STAGE_INTERVALS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.job_id = job_id
        self.collector = JobCollector(store, job_id, stage_intervals, clock)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._serving: _Serving | None = None
        self._owned: Store | None = None  # closed by stop() when `open` made it

    @classmethod
    def open(
        cls,
        url: str,
        job_id: str,
        retry_s: float = SCRAPE_RETRY_S,
        stage_intervals: int = STAGE_INTERVALS,
    ) -> Self:
        """An exporter over a read-only store of its own at `url` (closed by `stop`)."""
        store = Store(url, read_only=True, retry_s=retry_s)
        metrics = cls(store, job_id, stage_intervals)
        metrics._owned = store
        return metrics

    @property
    def port(self) -> int | None:
        """The port being served, None when not serving."""
        return None if self._serving is None else int(self._serving.httpd.server_port)

    def render(self) -> bytes:
        """One scrape's text, without HTTP (what `/metrics` answers)."""
        return generate_latest(self.registry)

    def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve on `host`:`port` from a daemon thread; returns the bound port (`port` 0: a free
        one). `host` "0.0.0.0" (or "::") serves every interface, as a pod must for Prometheus
        to reach it at the pod's address. Raises OSError when the port cannot be bound and
        RuntimeError when already serving."""
        if self._serving is not None:
            raise RuntimeError(
                f"metrics for job {self.job_id} are served already (port {self.port})"
            )
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be 0..65535, got {port}")
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        thread.name = f"metrics-{self.job_id}"
        self._serving = _Serving(httpd, thread)
        bound = int(httpd.server_port)
        log.info("metrics for job %s on http://%s:%d/metrics", self.job_id, host, bound)
        return bound

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and free the port (and close the store `open` made). Idempotent."""
        serving, self._serving = self._serving, None
        if serving is not None:
            serving.httpd.shutdown()  # ends serve_forever, after the request in progress
            serving.httpd.server_close()
            serving.thread.join(timeout_s)
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- TensorBoard ----------------------------------------------------------------------------------

INSTALL_HINT = "pip install 'pipetransformer[tensorboard]'"


class TensorBoardMissing(ImportError):
    """The `tensorboard` package (the `tensorboard` extra) is not installed."""


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise TensorBoardMissing(
            f"writing TensorBoard event files needs the tensorboard package: {INSTALL_HINT} ({exc})"
        ) from exc
    return SummaryWriter


class TensorBoardWriter:
    """A job's reports as TensorBoard event files under `logdir`
    (`tensorboard --logdir LOGDIR`).

    `write(events)` takes the typed reports of one drain (anything else is ignored):

    - `Metrics` at its step: `train/loss`, `train/samples_per_s`, `train/lr`, `train/mfu`,
      `train/frozen_blocks`, `memory/peak_mib/rank<r>`
    - `Evaluated` at its step: `eval/accuracy`, `eval/loss`, `eval/f1`
    - `StageTimes` at its `to_step`: `stage_times/rank<r>/<phase>` (the fraction of the
      interval's wall time) and `stage_times/rank<r>/bubble` (measured)
    - `LayoutPlanned`: `layout/version`, `layout/freeze_boundary`, `layout/pipeline_ranks`,
      `layout/replicas` at the last step that ended before it was planned (a layout report
      carries no step; the newest step written before, when its drain has none), and the text
      `layout` (its `describe()` and reason) at step = its version

    Values that are unknown (None, not finite) are left out; each point keeps the report's own
    time as its wall time.

    Replays: a point whose step is not above the last step written for its tag (layouts: whose
    version is not above the last written) is skipped, so a drain replayed after a crash
    between the store writes and the etcd deletes adds nothing, and a step trained again after
    a recovery keeps its first value, as the store does. The last steps live in this object's
    memory only: a new writer over the same directory (a controller that took over) starts
    from nothing, and its first points may repeat steps the old one wrote. Pass `purge_step`
    (the first step the new writer may write, e.g. the resumed checkpoint's step + 1) to have
    TensorBoard hide the old files' points from that step on.

    Needs the `tensorboard` package (`pipetransformer[tensorboard]`); the constructor raises
    `TensorBoardMissing` naming the install command without it. `torch.utils.tensorboard` is
    imported only then (it imports torch: about a second)."""

    def __init__(
        self, logdir: str | Path, purge_step: int | None = None, flush_secs: float = 30.0
    ) -> None:
        writer = _summary_writer()
        self.logdir = Path(logdir)
        self._writer = writer(
            log_dir=str(self.logdir), purge_step=purge_step, flush_secs=flush_secs
        )
        self._last: dict[str, int] = {}  # tag -> the last step written
        self._step = 0  # the newest training step written (layouts go there, at the latest)
        self._closed = False

    def write(self, events: Iterable[object]) -> int:
        """Write the points of `events` not written before; returns how many were written."""
        if self._closed:
            raise RuntimeError(f"the TensorBoard writer for {self.logdir} is closed")
        reports = list(events)
        # a drain's keys are not in step order across ranks, and skipping is per tag by step:
        # the reports that carry a step go in step order, the layouts after them
        stepped = sorted((e for e in reports if _step_of(e) is not None), key=_step_of)
        layouts = sorted(
            (e for e in reports if isinstance(e, LayoutPlanned)), key=lambda e: e.layout.version
        )
        before = self._step
        written = 0
        for e in stepped:
            if isinstance(e, Metrics):
                points = {
                    "train/loss": e.loss,
                    "train/samples_per_s": e.samples_per_s,
                    "train/lr": e.lr,
                    "train/mfu": e.mfu,
                    "train/frozen_blocks": e.frozen,
                }
                for rank, mib in enumerate(e.peak_memory_mib or ()):
                    points[f"memory/peak_mib/rank{rank}"] = mib
                written += self._scalars(points, e.step, e.time)
                self._step = max(self._step, e.step)
            elif isinstance(e, Evaluated):
                points = {"eval/accuracy": e.accuracy, "eval/loss": e.loss, "eval/f1": e.f1}
                written += self._scalars(points, e.step, e.time)
            elif isinstance(e, StageTimes):
                prefix = f"stage_times/rank{e.rank}"
                points = {
                    f"{prefix}/{p}": share for p, share in e.seconds.fractions(e.wall_s).items()
                }
                points[f"{prefix}/bubble"] = measured_bubble(e.seconds)
                written += self._scalars(points, e.to_step, e.time)
        steps = [(e.time, e.step) for e in stepped if isinstance(e, Metrics)]
        for e in layouts:
            # the last step that ended before the layout was planned: the old layout's last
            at = max((s for t, s in steps if t <= e.time), default=before)
            written += self._layout(e, max(at, before))
        return written

    def _layout(self, e: LayoutPlanned, step: int) -> int:
        layout = e.layout
        if layout.version <= self._last.get("layout", 0):
            return 0
        self._last["layout"] = layout.version
        text = f"{layout.describe()}  \n{e.reason}"
        self._writer.add_text("layout", text, global_step=layout.version, walltime=e.time)
        points = {
            "layout/version": layout.version,
            "layout/freeze_boundary": layout.freeze_boundary,
            "layout/pipeline_ranks": layout.pipeline_ranks,
            "layout/replicas": layout.replicas,
        }
        for tag, value in points.items():  # keyed by the version above, not by step
            self._writer.add_scalar(tag, value, global_step=step, walltime=e.time)
        return 1 + len(points)

    def _scalars(self, points: dict[str, float | None], step: int, walltime: float) -> int:
        n = 0
        for tag, value in points.items():
            if value is None or not math.isfinite(value):
                continue
            if step <= self._last.get(tag, -1):
                continue  # written before: a replayed drain, or a step trained again
            self._last[tag] = step
            self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)
            n += 1
        return n

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file. Idempotent."""
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_of(e: object) -> int | None:
    """The training step a report belongs to, None for those without one."""
    if isinstance(e, Metrics | Evaluated):
        return e.step
    if isinstance(e, StageTimes):
        return e.to_step
    return None
