"""A job's figures for Prometheus and TensorBoard (orchestrator/monitoring.py): the exporter
served over real HTTP from a real SQLite store and parsed as Prometheus parses it, a store that
fails mid-scrape, the port given back; event files read back with TensorBoard's own reader; and
the Grafana dashboard in k8s/monitoring/ querying only what the exporter serves."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipetransformer.core.protocol import Evaluated, LayoutPlanned, Metrics, StageTimes
from pipetransformer.core.stage_times import PHASES, PhaseSeconds
from pipetransformer.orchestrator.monitoring import (
    INSTALL_HINT,
    METRICS,
    JobMetrics,
    TensorBoardMissing,
    TensorBoardWriter,
)
from pipetransformer.store import Store, sqlite_url
from tests.fixtures_store import POPULATED_JOB_ID, T0, StoreRun, packed_layout, two_stage_layout

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "k8s" / "monitoring" / "grafana-dashboard.json"
JOB = POPULATED_JOB_ID

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """GET /metrics as Prometheus does, parsed by prometheus_client's own parser:
    (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):  # a counter's creation time, not a figure
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"job_id": JOB, **labels}.items())))
    assert key in samples, f"{key} not served; served: {sorted({n for n, _ in samples})}"
    return samples[key]


def names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}


def per_label(samples: Samples, name: str, label: str) -> dict[str, dict[str, str]]:
    """label value -> the labels of each sample of `name`."""
    return {dict(ls)[label]: dict(ls) for n, ls in samples if n == name}


def stage_report(rank: int, to_step: int, fwd: float, wait: float, stage: int) -> StageTimes:
    seconds = PhaseSeconds(
        forward=fwd, backward=2 * fwd, pipeline_wait=wait, optimizer=0.05, data_wait=0.02
    )
    return StageTimes(
        rank=rank,
        generation=2,
        time=T0 + 100 + to_step,
        from_step=to_step - 2,
        to_step=to_step,
        layout_version=2,
        stages=[stage],
        replica=0,
        wall_s=seconds.total() + 0.03,  # what no phase measured: `other`
        seconds=seconds.model_copy(update={"other": 0.03}),
    )


def seed_running_job(run: StoreRun) -> None:
    """The populated job (tests/fixtures_store.py) resumed as a second generation of two
    workers, one of them lost, with a newer step carrying MFU and peak memory, and each rank's
    stage times over two intervals."""
    store = run.store
    store.set_job_state(JOB, "running")
    gen = store.start_generation(JOB, world_size=2)
    store.add_workers(JOB, gen, [{"rank": 0, "node": "a:1"}, {"rank": 1, "node": "b:1"}])
    store.update_workers(JOB, gen, [0], state="running", lease="held")
    store.update_workers(JOB, gen, [1], state="lost", lease="lapsed")
    store.add_metrics(
        JOB,
        [
            Metrics(
                rank=0,
                generation=gen,
                step=41,
                epoch=4,
                samples_consumed=2624,
                loss=0.25,
                lr=1e-3,
                samples_per_s=1234.5,
                frozen=2,
                time=T0 + 141,
                mfu=0.31,
                peak_memory_mib=[100.0, 200.0],
            )
        ],
    )
    if not hasattr(store, "add_stage_times"):
        pytest.skip("the store has no stage times yet (store/stage_times.py)")
    store.add_stage_times(
        JOB,
        [
            stage_report(0, 42, 0.10, 0.20, stage=0),
            stage_report(1, 42, 0.20, 0.00, stage=1),
            stage_report(0, 44, 0.10, 0.10, stage=0),
            stage_report(1, 44, 0.20, 0.01, stage=1),
        ],
    )


@pytest.fixture
def exporter(populated_store: StoreRun) -> Iterator[tuple[JobMetrics, int]]:
    seed_running_job(populated_store)
    metrics = JobMetrics(populated_store.store, JOB)
    port = metrics.start(0)
    try:
        yield metrics, port
    finally:
        metrics.stop()


def test_exporter_serves_the_jobs_figures_over_http(exporter: tuple[JobMetrics, int]) -> None:
    metrics, port = exporter
    assert port > 0 and metrics.port == port
    samples = scrape(port)
    assert value(samples, "pipetransformer_scrape_error") == 0
    assert value(samples, "pipetransformer_job_state", state="running") == 1
    assert value(samples, "pipetransformer_job_state", state="completed") == 0
    # the newest step's figures
    assert value(samples, "pipetransformer_samples_per_second") == 1234.5
    assert value(samples, "pipetransformer_loss") == 0.25
    assert value(samples, "pipetransformer_mfu_ratio") == pytest.approx(0.31)
    assert value(samples, "pipetransformer_last_step_timestamp_seconds") == T0 + 141
    assert value(samples, "pipetransformer_peak_memory_bytes", rank="1") == 200 * 2**20
    assert value(samples, "pipetransformer_accuracy_ratio") == pytest.approx(0.9)
    # the layout in force: v2, 2 of 6 blocks frozen, 2 x 1 with 4 micro-batches (GPipe)
    assert value(samples, "pipetransformer_layout_version") == 2
    assert value(samples, "pipetransformer_freeze_boundary_blocks") == 2
    assert value(samples, "pipetransformer_model_blocks") == 6
    assert value(samples, "pipetransformer_layout_pipeline_ranks") == 2
    assert value(samples, "pipetransformer_theoretical_bubble_ratio") == pytest.approx(1 / 5)
    # checkpoint, generations, workers
    assert value(samples, "pipetransformer_checkpoint_step") == 40
    assert value(samples, "pipetransformer_checkpoint_age_seconds") > 0
    assert value(samples, "pipetransformer_recoveries_total") == 1
    assert value(samples, "pipetransformer_generation") == 2
    assert value(samples, "pipetransformer_workers_alive") == 1
    assert value(samples, "pipetransformer_workers", state="lost") == 1
    assert value(samples, "pipetransformer_workers", state="done") == 0

    # per rank: the phases of its newest intervals add up to its wall time
    ranks = per_label(samples, "pipetransformer_stage_bubble_ratio", "rank")
    assert ranks == {
        "0": {"job_id": JOB, "rank": "0", "stage": "0", "replica": "0"},
        "1": {"job_id": JOB, "rank": "1", "stage": "1", "replica": "0"},
    }
    for rank, labels in ranks.items():
        fractions = {
            p: value(samples, "pipetransformer_stage_phase_ratio", **labels, phase=p)
            for p in PHASES
        }
        assert sum(fractions.values()) == pytest.approx(1.0), (rank, fractions)
        busy = value(samples, "pipetransformer_stage_busy_ratio", **labels)
        assert busy == pytest.approx(fractions["forward"] + fractions["backward"])
    # rank 0 waited 0.3 s beside 0.6 s of compute over the two intervals
    bubble = value(samples, "pipetransformer_stage_bubble_ratio", rank="0", stage="0", replica="0")
    assert bubble == pytest.approx(0.3 / 0.9)
    wall = value(samples, "pipetransformer_stage_wall_seconds", rank="0", stage="0", replica="0")
    assert wall == pytest.approx(2 * 0.07 + 0.6 + 0.3 + 2 * 0.03)
    assert value(samples, "pipetransformer_stage_layout_version") == 2
    assert value(samples, "pipetransformer_stage_measured_step") == 44

    # every name served is declared with its help, and a fully seeded job serves them all
    assert names(samples) == set(METRICS)
    assert all(n.startswith("pipetransformer_") for n in METRICS)
    assert all(dict(labels).get("job_id") == JOB for _, labels in samples)


def test_each_scrape_reads_the_store_afresh(exporter: tuple[JobMetrics, int]) -> None:
    metrics, port = exporter
    store = metrics.collector.store
    assert isinstance(store, Store)
    store.record_layout(JOB, packed_layout(3, freeze_boundary=5), reason="autofreeze")
    gen = store.start_generation(JOB, world_size=2)
    samples = scrape(port)
    assert value(samples, "pipetransformer_layout_version") == 3
    assert value(samples, "pipetransformer_freeze_boundary_blocks") == 5
    assert value(samples, "pipetransformer_layout_replicas") == 2
    # one pipeline rank: no bubble to expect
    assert value(samples, "pipetransformer_theoretical_bubble_ratio") == 0
    assert value(samples, "pipetransformer_recoveries_total") == gen - 1 == 2
    # the new generation's ranks are not recorded yet: none of them is alive
    assert value(samples, "pipetransformer_generation") == 3
    assert value(samples, "pipetransformer_workers_alive") == 0
    assert value(samples, "pipetransformer_workers", state="lost") == 0


class FlakyStore:
    """A store whose named reads raise until `broken` is emptied."""

    def __init__(self, store: Store, broken: set[str]) -> None:
        self._store, self.broken = store, broken

    def __getattr__(self, name: str) -> Any:
        read = getattr(self._store, name)
        if name not in self.broken:
            return read

        def fail(*args: object, **kwargs: object) -> None:
            raise ConnectionError(f"{name}: the database went away")

        return fail


def test_a_store_error_during_a_scrape_is_served_as_the_error_gauge(
    populated_store: StoreRun, caplog: pytest.LogCaptureFixture
) -> None:
    seed_running_job(populated_store)
    flaky = FlakyStore(populated_store.store, {"status", "stage_times"})
    with JobMetrics(flaky, JOB) as metrics, caplog.at_level(logging.WARNING):
        port = metrics.start(0)
        for _ in range(3):
            samples = scrape(port)
            assert value(samples, "pipetransformer_scrape_error") == 1
            # what the failed reads give is missing; the others are served
            assert "pipetransformer_step" not in names(samples)
            assert "pipetransformer_stage_phase_ratio" not in names(samples)
            assert value(samples, "pipetransformer_checkpoint_step") == 40
            assert value(samples, "pipetransformer_recoveries_total") == 1
        # logged, once per distinct error and minute, not at every scrape
        warned = [r.getMessage() for r in caplog.records if r.name == "pipetransformer.monitoring"]
        assert len(warned) == 2, warned
        assert "the database went away" in warned[0] and "scrape_error" in warned[0]
        flaky.broken.clear()  # the store is back: so are the figures
        samples = scrape(port)
        assert value(samples, "pipetransformer_scrape_error") == 0
        assert value(samples, "pipetransformer_step") == 40
    assert metrics.port is None


def test_a_missing_store_answers_every_scrape_with_the_error_gauge(tmp_path: Path) -> None:
    # a read-only exporter of its own over a database that is not there (no retries here)
    metrics = JobMetrics.open(sqlite_url(tmp_path / "absent" / "store.db"), "nope", retry_s=0)
    port = metrics.start(0)
    try:
        for _ in range(2):
            samples = scrape(port)
            assert samples == {("pipetransformer_scrape_error", (("job_id", "nope"),)): 1.0}
    finally:
        metrics.stop()
    assert not (tmp_path / "absent").exists()  # read-only: nothing was created


def test_stop_gives_the_port_back(populated_store: StoreRun) -> None:
    metrics = JobMetrics(populated_store.store, JOB)
    port = metrics.start(0, host="127.0.0.1")
    with pytest.raises(RuntimeError, match="served already"):
        metrics.start(0)
    assert value(scrape(port), "pipetransformer_step") == 40
    metrics.stop()
    metrics.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as s:  # no one listens there any more: a server may bind it at once
        # (SO_REUSEADDR, as servers set it, passes over the scrapes' TIME_WAIT connections and
        # still fails on a port something listens on)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    # and the same exporter can serve again, on the very port
    again = metrics.start(port)
    try:
        assert again == port and value(scrape(port), "pipetransformer_step") == 40
    finally:
        metrics.stop()
    with pytest.raises(ValueError, match="port"):
        metrics.start(70000)


def test_render_needs_no_server(populated_store: StoreRun) -> None:
    text = JobMetrics(populated_store.store, JOB).render().decode()
    assert f'pipetransformer_step{{job_id="{JOB}"}} 40.0' in text
    assert "# HELP pipetransformer_checkpoint_age_seconds" in text


# -- TensorBoard ----------------------------------------------------------------------------------


def reports() -> list[object]:
    """One drain's reports, not in step order (as a drain's keys come across ranks)."""
    steps = [
        Metrics(
            rank=0,
            step=s,
            epoch=0,
            samples_consumed=32 * s,
            loss=None if s == 2 else 2.0 / s,  # step 2 diverged: no loss point
            lr=1e-3,
            samples_per_s=100.0 * s,
            frozen=0 if s < 3 else 1,
            time=T0 + s,
            mfu=None,
        )
        for s in (3, 1, 2, 4)
    ]
    return [
        LayoutPlanned(rank=0, layout=two_stage_layout(1, 0), reason="initial", time=T0),
        *steps,
        StageTimes(
            rank=1,
            time=T0 + 4.5,
            from_step=2,
            to_step=4,
            layout_version=2,
            stages=[1],
            replica=0,
            wall_s=2.0,
            seconds=PhaseSeconds(forward=0.5, backward=1.0, pipeline_wait=0.5),
        ),
        StageTimes(
            rank=1,
            time=T0 + 2.5,
            from_step=0,
            to_step=2,
            layout_version=1,
            stages=[1],
            replica=0,
            wall_s=1.0,
            seconds=PhaseSeconds(forward=0.25, backward=0.5, data_wait=0.25),
        ),
        Evaluated(rank=0, epoch=0, step=4, accuracy=0.75, loss=0.5, time=T0 + 4.2),
        LayoutPlanned(rank=0, layout=two_stage_layout(2, 2), reason="autofreeze", time=T0 + 2.7),
        "not a report",  # anything else in a drain is ignored
    ]


def read_back(logdir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def points(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def test_tensorboard_event_files_hold_the_reports(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    logdir = tmp_path / "tb"
    with TensorBoardWriter(logdir) as tb:
        written = tb.write(reports())
        assert written > 0
        assert tb.write(reports()) == 0  # the same drain replayed adds nothing
        # a later drain with a step written before and a new one: only the new one lands
        later = [
            Metrics(rank=0, step=4, epoch=0, samples_consumed=0, loss=9.0, lr=1e-3,
                    samples_per_s=9.0, frozen=1, time=T0 + 9),
            Metrics(rank=0, step=5, epoch=0, samples_consumed=0, loss=0.3, lr=1e-3,
                    samples_per_s=500.0, frozen=1, time=T0 + 5),
        ]  # fmt: skip
        assert tb.write(later) == 4  # loss, samples/s, lr, frozen of step 5
    acc = read_back(logdir)
    tags = set(acc.Tags()["scalars"])
    assert points(acc, "train/samples_per_s") == [(s, 100.0 * s) for s in (1, 2, 3, 4, 5)]
    assert points(acc, "train/loss") == [(1, 2.0), (3, 2 / 3), (4, 0.5), (5, 0.3)]
    assert points(acc, "train/frozen_blocks") == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert "train/mfu" not in tags  # unknown on every step
    assert [e.wall_time for e in acc.Scalars("train/lr")][:2] == [T0 + 1, T0 + 2]
    assert points(acc, "eval/accuracy") == [(4, 0.75)]
    assert "eval/f1" not in tags
    # rank 1's phase fractions at each interval's end; the measured bubble
    assert points(acc, "stage_times/rank1/backward") == [(2, 0.5), (4, 0.5)]
    assert points(acc, "stage_times/rank1/data_wait") == [(2, 0.25), (4, 0.0)]
    assert points(acc, "stage_times/rank1/bubble") == [(2, 0.0), (4, 0.25)]
    # layouts: the version and boundary at the last step before each was planned
    assert points(acc, "layout/version") == [(0, 1), (2, 2)]
    assert points(acc, "layout/freeze_boundary") == [(0, 0), (2, 2)]
    texts = {
        e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("layout/text_summary")
    }
    assert sorted(texts) == [1, 2] and "autofreeze" in texts[2] and "F=2" in texts[2]


def test_tensorboard_purge_step_hides_what_a_new_writer_writes_again(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    logdir = tmp_path / "tb"
    with TensorBoardWriter(logdir) as tb:
        tb.write(reports())
    time.sleep(1.1)  # event file names carry the second they were made in
    # a controller that took over, its job resumed from step 2: steps 3 and 4 are trained again
    with TensorBoardWriter(logdir, purge_step=3) as tb:
        tb.write(
            [
                Metrics(
                    rank=0,
                    step=s,
                    epoch=0,
                    samples_consumed=0,
                    loss=1.0,
                    lr=1e-3,
                    samples_per_s=7.0,
                    frozen=0,
                    time=T0 + 10 + s,
                )
                for s in (3, 4)
            ]  # fmt: skip
        )
    assert points(read_back(logdir), "train/samples_per_s") == [
        (1, 100.0),
        (2, 200.0),
        (3, 7.0),
        (4, 7.0),
    ]


def test_tensorboard_missing_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(TensorBoardMissing, match=re.escape(INSTALL_HINT)):
        TensorBoardWriter(tmp_path / "tb")
    assert INSTALL_HINT == "pip install 'pipetransformer[tensorboard]'"
    assert not (tmp_path / "tb").exists()


# -- the Grafana dashboard --------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"]
    used = {m for e in dashboard_exprs() for m in re.findall(r"\bpipetransformer_\w+", e)}
    assert used and used <= set(METRICS), sorted(used - set(METRICS))
    # every exported label a query filters or a legend names exists on that metric
    for p in board["panels"]:
        for t in p.get("targets", []):
            for metric, selector in re.findall(r"(pipetransformer_\w+)\{([^}]*)\}", t["expr"]):
                labels = {"job_id", *METRICS[metric][1]}
                assert set(re.findall(r"(\w+)\s*=~?", selector)) <= labels, t["expr"]
    titles = {p["title"] for p in board["panels"]}
    for wanted in (
        "Samples/s",
        "Loss",
        "Held-out accuracy",
        "Freeze boundary and layout version",
        "Rank $rank: where the time goes",
        "Pipeline bubble",
        "Workers alive",
        "Recoveries",
        "Checkpoint age",
    ):
        assert wanted in titles, wanted
    # the per-rank phases: one panel per rank, stacked
    (phases,) = [p for p in board["panels"] if p.get("repeat") == "rank"]
    assert phases["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    # panels refer to the data source variable, so the file imports into any Grafana
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "job_id", "rank"} <= variables
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
