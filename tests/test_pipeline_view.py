"""The dashboard's Pipeline view: where each rank's time goes, and one traced step's schedule.
The figure builders (dashboard/pipeline_figures.py), the table rows (dashboard/views.py) and a
rank's log tail (dashboard/logs.py) over hand-built inputs, then the views themselves
in-process (AppTest) over a store holding them: the traced steps, capturing one from a running
job (its etcd), and the Workers view's log lines."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from pipetransformer.core import keys
from pipetransformer.core.protocol import StageTimes, StepTrace, TraceRequest
from pipetransformer.core.spec import parse_spec
from pipetransformer.core.stage_times import (
    PHASE_LABELS,
    PHASES,
    PhaseSeconds,
    RankTimes,
    TraceSpan,
    chrome_trace,
    per_rank,
)
from pipetransformer.core.state import Layout
from pipetransformer.dashboard import logs
from pipetransformer.dashboard.launch import ENV_ETCD
from pipetransformer.dashboard.logs import LINES, log_tail
from pipetransformer.dashboard.pipeline_figures import (
    NO_TIMINGS_TEXT,
    NO_TRACE_TEXT,
    PHASE_COLORS,
    THEORY_NAME,
    breakdown_figure,
    bubble_figure,
    bubble_over_time_figure,
    interval_readings,
    predicted_figure,
    rank_name,
    trace_figure,
    trace_lanes,
    version_spans,
)
from pipetransformer.dashboard.timeline import band_label
from pipetransformer.dashboard.views import fmt_time, measured_parts, phase_rows, worker_rows
from pipetransformer.store.rows import RecordedLayout, StageTimesRow, StepTraceRow, WorkerRow
from tests.fixtures_store import StoreRun, packed_layout, two_stage_layout
from tests.test_dashboard import TOKEN, button, chart_titles, page_text, run_app, show

T0 = 1_800_000_000.0
WHEN = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)


def two_by_two(version: int = 3, schedule: str = "gpipe") -> Layout:
    """2 stages x 2 replicas: stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3."""
    return Layout.build(
        [(0, 3), (3, 6)],
        num_blocks=6,
        replicas=2,
        microbatches=4,
        schedule=schedule,
        version=version,
    )


def secs(fwd: float, wait: float, other: float = 0.1, **rest: float) -> PhaseSeconds:
    """A step's phases: backward twice the forward, the rest as given."""
    return PhaseSeconds(forward=fwd, backward=2 * fwd, pipeline_wait=wait, other=other, **rest)


def times(rank: int, stages: tuple[int, ...], replica: int, s: PhaseSeconds, n: int = 1):
    return RankTimes(
        rank=rank,
        stages=stages,
        replica=replica,
        layout_version=3,
        wall_s=s.total(),
        seconds=s,
        intervals=n,
    )


def row(
    rank: int,
    to_step: int,
    version: int,
    stage: int,
    s: PhaseSeconds,
    *,
    from_step: int | None = None,
    replica: int = 0,
    generation: int = 1,
) -> StageTimesRow:
    return StageTimesRow(
        generation=generation,
        rank=rank,
        time=T0 + to_step,
        from_step=to_step - 10 if from_step is None else from_step,
        to_step=to_step,
        layout_version=version,
        stages=(stage,),
        replica=replica,
        wall_s=s.total(),
        seconds=s,
        clock="host",
    )


def recorded(layout: Layout, reason: str = "initial") -> RecordedLayout:
    return RecordedLayout(layout=layout, reason=reason, created_at=WHEN)


def annotations(fig) -> list[str]:  # noqa: ANN001
    return [a.text for a in fig.layout.annotations]


# ---------------------------------------------------------------- the phases of each rank


def test_breakdown_stacks_each_ranks_phases_as_shares_of_its_wall_time() -> None:
    every = PhaseSeconds(**{p: 0.1 * (i + 1) for i, p in enumerate(PHASES)})
    ranks = [
        times(0, (0,), 0, every, n=2),
        times(1, (1,), 0, secs(0.4, 0.0)),
        times(2, (0,), 1, secs(0.2, 0.3)),
        times(3, (1,), 1, secs(0.4, 0.05)),
    ]
    fig = breakdown_figure(ranks, two_by_two())
    assert [t.name for t in fig.data] == [PHASE_LABELS[p] for p in PHASES]  # phase order
    assert [t.marker.color for t in fig.data] == [PHASE_COLORS[p] for p in PHASES]
    assert all(t.orientation == "h" for t in fig.data) and fig.layout.barmode == "stack"
    names = list(fig.data[0].y)
    assert names[0] == "stage 0 · replica 0 (rank 0)" == rank_name(ranks[0])
    assert names[3] == "stage 1 · replica 1 (rank 3)"
    for i, r in enumerate(ranks):  # each bar is the whole wall time
        assert sum(t.x[i] for t in fig.data) == pytest.approx(1.0)
        forward = next(t for t in fig.data if t.name == "forward")
        assert forward.x[i] == pytest.approx(r.seconds.forward / r.wall_s)
        assert forward.customdata[i][0] == pytest.approx(r.seconds.forward)  # seconds in hover
    assert "s (%{x:.1%})" in fig.data[0].hovertemplate
    title = fig.layout.title.text
    assert "v3" in title and "2x2" in title and "gpipe" in title
    assert list(fig.layout.yaxis.categoryarray)[-1] == names[0]  # rank 0 on top


def test_a_layout_without_a_prediction_says_where_it_came_from() -> None:
    """The spec's split for the first layout; a re-plan at a freeze by its recorded reason
    (before: every unpredicted layout read "the spec's even split")."""
    ranks = [times(0, (0,), 0, secs(0.4, 0.1)), times(1, (1,), 0, secs(0.3, 0.2))]
    first = two_by_two(version=1)
    assert annotations(predicted_figure(ranks, first, None, "initial")) == [
        "not planned from measurement (the spec's split)"
    ]
    replanned = predicted_figure(ranks, two_by_two(), None, "autofreeze (decision 2: F=2)")
    assert annotations(replanned) == [
        "no AutoPipe prediction recorded for v3: autofreeze (decision 2: F=2)"
    ]
    planned = predicted_figure(ranks, two_by_two(), [0.5, 0.4], "autopipe")
    assert annotations(planned) == [] and [t.name for t in planned.data][-1] == "planned (AutoPipe)"


def test_breakdown_leaves_out_phases_nobody_spent_time_in_and_caps_overruns() -> None:
    # measured phases overrunning the wall clock (other = 0): the bar still ends at 100%
    s = PhaseSeconds(forward=0.5, backward=1.0, pipeline_wait=0.5)
    rank = RankTimes(0, (0,), 0, 1, wall_s=1.5, seconds=s, intervals=1)
    fig = breakdown_figure([rank], two_stage_layout(1))
    assert [t.name for t in fig.data] == ["forward", "backward", PHASE_LABELS["pipeline_wait"]]
    assert sum(t.x[0] for t in fig.data) == pytest.approx(1.0)


def test_empty_inputs_explain_themselves() -> None:
    layout = two_stage_layout(2)
    for fig in (
        breakdown_figure([], layout),
        bubble_figure([], layout),
        bubble_over_time_figure([], [recorded(layout)]),
    ):
        assert not fig.data
        assert any(NO_TIMINGS_TEXT in t for t in annotations(fig)), annotations(fig)
    # ranks that never ran the schedule: nothing to call a bubble
    idle = [times(0, (0,), 0, PhaseSeconds(data_wait=1.0))]
    fig = bubble_figure(idle, layout)
    assert not fig.data and any("no rank ran" in t for t in annotations(fig))


# ---------------------------------------------------------------- the bubble of each stage


def test_bubble_per_stage_is_the_mean_over_replicas_beside_the_schedules() -> None:
    ranks = [
        times(0, (0,), 0, secs(0.2, 0.1)),  # bubble 0.1 / 0.7
        times(1, (1,), 0, secs(0.4, 0.0)),
        times(2, (0,), 1, secs(0.2, 0.3)),  # bubble 0.3 / 0.9
        times(3, (1,), 1, secs(0.4, 0.12)),
    ]
    fig = bubble_figure(ranks, two_by_two())
    (bars,) = fig.data
    assert list(bars.x) == ["stage 0", "stage 1"]
    assert bars.y[0] == pytest.approx((0.1 / 0.7 + 0.3 / 0.9) / 2)
    assert bars.y[1] == pytest.approx((0 + 0.12 / 1.32) / 2)
    assert "rank 2: 33.3%" in bars.customdata[0]  # each replica in the hover
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == pytest.approx(1 / 5)  # theoretical_bubble("gpipe", 2, 4)
    assert line.line.dash == "dash" and line.name == THEORY_NAME
    assert "schedule 20%" in annotations(fig)


def test_a_zero_bubble_schedule_says_it_has_no_closed_form() -> None:
    layout = Layout.build(
        [(0, 2), (2, 4), (4, 5), (5, 6)],
        num_blocks=6,
        replicas=1,
        microbatches=4,
        schedule="zbv",
        virtual_stages=2,
        placement="v",
    )
    ranks = [
        times(0, (0, 3), 0, secs(0.2, 0.05)),
        times(1, (1, 2), 0, secs(0.2, 0.01)),
    ]
    fig = bubble_figure(ranks, layout)
    assert not fig.layout.shapes
    assert any("no closed form" in t for t in annotations(fig))
    assert list(fig.data[0].x) == ["stages 0+3", "stages 1+2"]
    assert breakdown_figure(ranks, layout).data[0].y[0] == "stages 0+3 · replica 0 (rank 0)"


# ---------------------------------------------------------------- over steps and re-layouts


def relaid_rows() -> list[StageTimesRow]:
    """v1 (2x1) over steps 1-20, v2 (2x1, 2 frozen) over 21-30, v5 (never recorded) 31-40."""
    return [
        row(0, 10, 1, 0, secs(0.2, 0.2), from_step=0),
        row(1, 10, 1, 1, secs(0.2, 0.0), from_step=0),
        row(0, 20, 1, 0, secs(0.2, 0.2)),
        row(1, 20, 1, 1, secs(0.2, 0.0)),
        row(0, 30, 2, 0, secs(0.2, 0.1)),
        row(1, 30, 2, 1, secs(0.2, 0.1)),
        row(0, 40, 5, 0, secs(0.2, 0.0)),
        row(1, 40, 5, 1, secs(0.2, 0.0)),
    ]


def test_bubble_over_time_marks_each_layout_version_and_its_theory() -> None:
    rows = relaid_rows()
    fig_layouts = [
        recorded(two_stage_layout(1)),
        recorded(two_stage_layout(2, 2), "autofreeze: blocks 0-1 converged"),
    ]
    fig = bubble_over_time_figure(rows, fig_layouts)
    measured, busy, theory = fig.data
    assert list(measured.x) == [10, 20, 30, 40]
    assert measured.y[0] == pytest.approx((0.2 / 0.8 + 0) / 2)  # mean over the ranks
    assert measured.y[3] == pytest.approx(0.0)
    assert busy.y[0] == pytest.approx((0.6 / 0.9 + 0.6 / 0.7) / 2)  # compute over wall
    # the schedule's bubble, dashed, over each recorded version's span only (v5 has none)
    assert theory.name == THEORY_NAME and theory.line.dash == "dash"
    assert list(theory.x) == [0, 20, None, 20, 30, None]
    assert list(theory.y) == pytest.approx([0.2, 0.2, None, 0.2, 0.2, None], nan_ok=True)
    # a band per version, from where it took effect (its first interval's from_step)
    bands = [(s.name, s.x0, s.x1) for s in fig.layout.shapes]
    assert bands == [("layout v1", 0, 20), ("layout v2", 20, 30), ("layout v5", 30, 40)]
    labels = annotations(fig)
    assert band_label(two_stage_layout(2, 2)) in labels and "v5" in labels
    assert fig.layout.xaxis.title.text == "step"


def test_interval_readings_take_each_ranks_newest_generation() -> None:
    rows = [
        row(0, 10, 1, 0, secs(0.2, 0.4)),
        row(0, 10, 1, 0, secs(0.2, 0.0), generation=2),  # the restarted generation
        row(1, 10, 1, 1, secs(0.2, 0.0)),
    ]
    (reading,) = interval_readings(rows)
    assert reading.ranks == 2 and reading.bubble == pytest.approx(0.0)
    assert [s.version for s in version_spans(relaid_rows())] == [1, 2, 5]
    # a version measured over one interval still has a span to draw
    (span,) = version_spans([row(0, 7, 4, 0, secs(0.1, 0.0), from_step=7)])
    assert (span.start, span.end) == (7, 8)


# ---------------------------------------------------------------- the tables


def worker(generation: int, rank: int, stages: tuple[int, ...], replica: int) -> WorkerRow:
    return WorkerRow(
        generation=generation,
        rank=rank,
        node="n1:100",
        host="n1",
        pid=100 + rank,
        stages=stages,
        replica=replica,
        log=None,
        assigned_at=T0,
        started_at=T0 + 1,
        last_report_at=T0 + 5,
        lease="held",
        state="running",
        exit_code=None,
        signal=None,
        detail=None,
    )


def test_workers_show_the_part_of_the_layout_in_force() -> None:
    """A 2x1 job re-laid out in its running processes to 1x2: the worker table recorded the
    first layout's parts; the newest measured interval says where each rank is now."""
    workers = [worker(1, 0, (0,), 0), worker(1, 1, (1,), 0), worker(2, 0, (0,), 0)]
    measured = [
        row(0, 10, 1, 0, secs(0.2, 0.1), from_step=0),
        row(1, 10, 1, 1, secs(0.2, 0.1), from_step=0),
        row(0, 20, 2, 0, secs(0.2, 0.0)),
        row(1, 20, 2, 0, secs(0.2, 0.0), replica=1),
    ]
    rows = worker_rows(workers, T0 + 10, measured)
    by_key = {(r["generation"], r["rank"]): r for r in rows}
    assert (by_key[1, 1]["stage"], by_key[1, 1]["replica"], by_key[1, 1]["layout"]) == (
        "0",
        1,
        "v2",
    )
    assert by_key[1, 0]["layout"] == "v2"
    # generation 2 has no measurement yet: the worker table's part, no version
    assert (by_key[2, 0]["stage"], by_key[2, 0]["layout"]) == ("0", "")
    # without measurements: the parts the worker table recorded
    plain = {(r["generation"], r["rank"]): r for r in worker_rows(workers, T0 + 10)}
    assert (plain[1, 1]["stage"], plain[1, 1]["replica"], plain[1, 1]["layout"]) == ("1", 0, "")

    parts = measured_parts(measured)
    assert parts == [
        {"layout": "v1", "steps": "1-10", "rank 0": "S0 · r0", "rank 1": "S1 · r0"},
        {"layout": "v2", "steps": "11-20", "rank 0": "S0 · r0", "rank 1": "S0 · r1"},
    ]
    assert measured_parts([]) == []


def test_phase_rows_give_every_phases_seconds_per_rank() -> None:
    ranks = per_rank([row(0, 10, 1, 0, secs(0.2, 0.2)), row(0, 20, 1, 0, secs(0.2, 0.1))])
    (r,) = phase_rows(ranks)
    assert r["rank"] == 0 and r["part"] == "S0 · r0" and r["intervals"] == 2
    assert [k for k in r if k.endswith("(s)")] == ["wall (s)"] + [
        f"{PHASE_LABELS[p]} (s)" for p in PHASES
    ]
    assert r["forward (s)"] == pytest.approx(0.4) and r["wall (s)"] == pytest.approx(1.7)
    assert r["bubble"] == f"{0.3 / 1.5:.1%}" and r["busy"] == f"{1.2 / 1.7:.1%}"
    assert all(v is not None and v != "None" for v in r.values())


# ---------------------------------------------------------------- the view


def report(rank: int, from_step: int, to_step: int, version: int, fwd: float, wait: float):
    s = secs(fwd, wait)
    return StageTimes(
        rank=rank,
        time=T0 + to_step,
        from_step=from_step,
        to_step=to_step,
        layout_version=version,
        stages=[rank],
        replica=0,
        wall_s=s.total(),
        seconds=s,
    )


def test_pipeline_view_reads_the_stored_timings(
    monkeypatch: pytest.MonkeyPatch, populated_store: StoreRun
) -> None:
    store, job = populated_store.store, populated_store.job_id
    at = run_app(monkeypatch, populated_store.db_url, job)
    at = show(at, "Pipeline")
    assert not at.exception, [e.value for e in at.exception]
    assert "No stage timings reported yet" in page_text(at)  # a job from before stage timing
    assert not at.get("plotly_chart")

    # v1 over steps 1-10, then v2 (2 blocks frozen) over 11-40: stage 1 is the slow one
    store.add_stage_times(
        job,
        [
            report(rank, a, b, 1 if b <= 10 else 2, 0.1 + 0.2 * rank, 0.3 * (1 - rank))
            for a, b in ((0, 5), (5, 10), (10, 20), (20, 30), (30, 40))
            for rank in (0, 1)
        ],
    )
    at = show(at.run(), "Pipeline")
    assert not at.exception, [e.value for e in at.exception]
    text = page_text(at)
    assert "slowest stage 1" in text and "under layout v2" in text
    titles = chart_titles(at)
    assert titles[0].startswith("Time per phase · layout v2")
    assert any(t.startswith("Pipeline bubble") for t in titles)
    assert "Bubble and busy share over steps" in titles
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert {d["name"] for d in specs[0]["data"]} >= {"forward", "backward"}
    (table,) = at.dataframe
    assert list(table.value["rank"]) == [0, 1] and "steps 11-40 under v2" in text

    # the older version, picked on the slider
    at.select_slider(key="pipeline_version").set_value(1)
    at = at.run()
    assert not at.exception
    assert chart_titles(at)[0].startswith("Time per phase · layout v1")

    # the Workers view: each rank's part, version by version, as measured
    at = show(at, "Workers")
    assert not at.exception, [e.value for e in at.exception]
    assert "as measured" in page_text(at)
    (parts,) = [df.value for df in at.dataframe if "steps" in df.value.columns]
    assert list(parts["layout"]) == ["v1", "v2"] and list(parts["steps"]) == ["1-10", "11-40"]
    assert list(parts["rank 1"]) == ["S1 · r0", "S1 · r0"]


def test_packed_layout_has_no_bubble_to_wait_for() -> None:
    """One pipeline rank per replica: the schedule's bubble is 0, drawn as such."""
    ranks = [times(0, (0,), 0, secs(0.2, 0.0)), times(1, (0,), 1, secs(0.3, 0.0))]
    fig = bubble_figure(ranks, packed_layout(4))
    assert fig.layout.shapes[0].y0 == 0.0
    assert fig.data[0].y[0] == 0.0


# ---------------------------------------------------------------- one traced step


def span(phase: str, start_ms: float, end_ms: float, stage=None, mb=None) -> TraceSpan:  # noqa: ANN001
    return TraceSpan(
        phase=phase, start_s=start_ms / 1e3, end_s=end_ms / 1e3, stage=stage, microbatch=mb
    )


def traced(
    rank: int,
    stages: tuple[int, ...],
    started: float,
    spans: list[TraceSpan],
    *,
    request: str = "req1",
    generation: int = 1,
    step: int = 41,
) -> StepTraceRow:
    return StepTraceRow(
        request=request,
        generation=generation,
        rank=rank,
        step=step,
        started=started,
        layout_version=2,
        stages=stages,
        replica=0,
        spans=tuple(spans),
        clock="host",
    )


def gpipe_step(started0: float = T0, skew_s: float = 0.002) -> list[StepTraceRow]:
    """Two stages, two micro-batches: rank 1 starts its step `skew_s` after rank 0."""
    return [
        traced(
            0,
            (0,),
            started0,
            [
                span("data_wait", 0, 1),
                span("forward", 1, 3, 0, 0),
                span("forward", 3, 5, 0, 1),
                span("pipeline_wait", 5, 9),  # between the schedule's spans: no stage
                span("backward", 9, 13, 0, 1),
                span("backward", 13, 17, 0, 0),
                span("optimizer", 17, 18),
            ],
        ),
        traced(
            1,
            (1,),
            started0 + skew_s,
            [
                span("pipeline_wait", 0, 1),
                span("forward", 1, 3, 1, 0),
                span("backward", 3, 7, 1, 0),
                span("forward", 7, 9, 1, 1),
                span("backward", 9, 13, 1, 1),
            ],
        ),
    ]


def bars(fig) -> list[tuple[str, str, float, float, str]]:  # noqa: ANN001
    """Every bar of a Gantt chart: (phase label, lane, start ms, duration ms, text)."""
    return [
        (t.name, y, b, x, text)
        for t in fig.data
        for y, b, x, text in zip(t.y, t.base, t.x, t.text, strict=True)
    ]


def test_trace_figure_draws_a_lane_per_rank_and_stage_and_a_bar_per_span() -> None:
    rows = gpipe_step()
    fig = trace_figure(rows)
    drawn = bars(fig)
    assert len(drawn) == sum(len(r.spans) for r in rows) == 12
    # a lane per rank and stage, rank 0 on top; the rank's waits and optimizer on its lane
    assert trace_lanes(rows) == ["rank 0 · stage 0", "rank 1 · stage 1"]
    assert list(fig.layout.yaxis.categoryarray) == ["rank 1 · stage 1", "rank 0 · stage 0"]
    assert {lane for _, lane, *_ in drawn} == {"rank 0 · stage 0", "rank 1 · stage 1"}
    # coloured and named as in the breakdown, in PHASES order
    names = [t.name for t in fig.data]
    assert names == [
        PHASE_LABELS[p] for p in PHASES if p in {s.phase for r in rows for s in r.spans}
    ]
    by_label = {PHASE_LABELS[p]: p for p in PHASES}
    assert all(t.marker.color == PHASE_COLORS[by_label[t.name]] for t in fig.data)
    assert fig.layout.barmode == "overlay" and all(t.orientation == "h" for t in fig.data)
    # milliseconds from the earliest rank's start: rank 1's spans shifted by its 2 ms skew
    starts = {(lane, text): (b, x) for _, lane, b, x, text in drawn if text}
    # (unix seconds near 1.8e9 hold a time to about 0.2 us)
    assert starts["rank 0 · stage 0", "F0"] == pytest.approx((1.0, 2.0), abs=1e-3)
    assert starts["rank 1 · stage 1", "F0"] == pytest.approx((3.0, 2.0), abs=1e-3)
    assert starts["rank 1 · stage 1", "B1"] == pytest.approx((11.0, 4.0), abs=1e-3)
    assert {text for *_, text in drawn} == {"F0", "F1", "B0", "B1", ""}
    assert fig.layout.xaxis.range[0] == 0 and fig.layout.xaxis.range[1] >= 18
    assert fig.layout.xaxis.title.text.startswith("ms from the first rank's start")
    # hover: phase, micro-batch, start and duration
    forward = next(t for t in fig.data if t.name == "forward")
    assert "forward" in forward.hovertemplate and "ms" in forward.hovertemplate
    assert forward.customdata[0][0] == " · micro-batch 0"
    assert list(forward.customdata[0][1:]) == pytest.approx([1.0, 2.0])
    title = fig.layout.title.text
    assert "Step 41 on 2 rank(s)" in title and "v2" in title and "host clock" in title


def test_trace_figure_keeps_a_step_lane_for_a_rank_of_several_stages() -> None:
    rows = [
        traced(
            0,
            (0, 3),
            T0,
            [span("forward", 0, 1, 0, 0), span("forward", 1, 2, 3, 0), span("grad_sync", 2, 3)],
        ),
        traced(1, (1, 2), T0 - 0.001, [span("forward", 0, 1, 1, 0)]),  # the earliest start
        traced(0, (0, 3), T0 + 5, [span("forward", 0, 1, 0, 0)], generation=2),
    ]
    assert trace_lanes(rows) == [
        "rank 0 · stage 0 · gen 1",
        "rank 0 · stage 3 · gen 1",
        "rank 0 · step · gen 1",
        "rank 0 · stage 0 · gen 2",
        "rank 0 · stage 3 · gen 2",
        "rank 1 · stage 1 · gen 1",
        "rank 1 · stage 2 · gen 1",
    ]
    drawn = bars(trace_figure(rows))
    assert len(drawn) == 5
    assert ("gradient sync", "rank 0 · step · gen 1") == drawn[-1][:2]
    # x = 0 at the earliest rank's start (rank 1's, 1 ms before rank 0's)
    assert min(d[2] for d in drawn) == 0.0
    first = next(d for d in drawn if d[1] == "rank 0 · stage 0 · gen 1")
    assert first[2] == pytest.approx(1.0, abs=1e-3)


def test_trace_figure_without_a_trace_says_so() -> None:
    fig = trace_figure([])
    assert not fig.data
    assert NO_TRACE_TEXT in annotations(fig)


# ---------------------------------------------------------------- a rank's log


def test_log_tail_keeps_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    tail = log_tail(str(log), lines=5)
    assert tail.reason is None and tail.truncated
    assert tail.text.splitlines() == [f"line {i}" for i in range(995, 1000)]
    whole = log_tail(str(log), lines=2000)
    assert whole.text.splitlines()[0] == "line 0" and not whole.truncated
    # undecodable bytes are replaced, not raised
    log.write_bytes(b"ok\n\xff\xfe bad\nlast")
    assert log_tail(str(log)).text.splitlines() == ["ok", "\ufffd\ufffd bad", "last"]
    log.write_bytes(b"")
    assert log_tail(str(log)).text == ""


def test_log_tail_reads_only_the_end_of_a_big_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "big.log"
    line = "x" * 99 + "\n"  # 100 bytes a line
    log.write_text(line * 100_000 + "the end\n")  # 10 MB
    read: list[int] = []

    class Counted:
        """The file as `log_tail` opens it, counting the bytes it reads."""

        def __init__(self, f) -> None:  # noqa: ANN001
            self.f = f

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(self.f, name)

        def read(self, n: int = -1) -> bytes:
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(logs, "open", lambda *a, **k: Counted(open(*a, **k)), raising=False)
    tail = log_tail(str(log), lines=10_000, max_bytes=1050)
    assert sum(read) <= 1050 + 1  # the window, and the byte before it (a whole first line?)
    # the bound cuts a line in two: that partial first line is dropped, whole lines kept
    kept = tail.text.splitlines()
    assert kept[-1] == "the end" and all(k == line.strip() for k in kept[:-1])
    assert len(kept) == 11 and tail.truncated  # 1042 bytes of lines: 10 whole, 1 cut
    assert len(tail.text.encode()) <= 1050


def test_log_tail_says_how_to_get_a_log_it_cannot_read(tmp_path: Path) -> None:
    from torchx.schedulers.kubernetes_scheduler import LABEL_ROLE_NAME, LABEL_UNIQUE_NAME

    from pipetransformer.orchestrator.components import TRAINER_ROLE

    missing = log_tail(str(tmp_path / "gone.log"))
    assert missing.text is None and "gone.log" in missing.reason
    none = log_tail(None)
    assert none.text is None and "no log file" in none.reason
    for tail in (missing, none):
        # the labels torchx puts on every pod it launches: the app, the role
        assert "kubectl logs" in tail.reason
        assert f"{LABEL_UNIQUE_NAME}=" in tail.reason
        assert f"{LABEL_ROLE_NAME}={TRAINER_ROLE}" in tail.reason
    with pytest.raises(ValueError):
        log_tail(None, lines=0)


# ---------------------------------------------------------------- the views, with traces


def trace_report(rank: int, request: str, step: int, started: float, fwd_ms: float) -> StepTrace:
    return StepTrace(
        rank=rank,
        request=request,
        step=step,
        started=started,
        layout_version=2,
        stages=[rank],
        replica=0,
        spans=[
            span("forward", 0, fwd_ms, rank, 0),
            span("backward", fwd_ms, 3 * fwd_ms, rank, 0),
            span("optimizer", 3 * fwd_ms, 3 * fwd_ms + 1),
        ],
    )


def seed_traces(store, job: str) -> list[tuple[str, int, float]]:  # noqa: ANN001
    """Two answered trace requests, in the order the ranks answered them: one at step 12, then
    the newest at step 31."""
    for request, step in (("older", 12), ("newest", 31)):
        store.add_step_traces(
            job, [trace_report(r, request, step, T0 + step + r * 0.001, 2.0 + r) for r in (0, 1)]
        )
    return store.trace_requests(job)


def download_url(data: str, file_name: str) -> str:
    """Where Streamlit serves a download button's file: named by a hash of the bytes, the MIME
    type and the file name (`MemoryMediaFileStorage`)."""
    from streamlit.runtime.memory_media_file_storage import _calculate_file_id

    return f"/mock/media/{_calculate_file_id(data.encode(), 'application/json', file_name)}.json"


def test_pipeline_view_shows_a_traced_step(
    monkeypatch: pytest.MonkeyPatch, populated_store: StoreRun
) -> None:
    store, job = populated_store.store, populated_store.job_id
    at = show(run_app(monkeypatch, populated_store.db_url, job), "Pipeline")
    assert not at.exception, [e.value for e in at.exception]
    assert "No step traced yet" in page_text(at)
    assert not at.get("download_button")

    captured = seed_traces(store, job)
    assert [c[0] for c in captured] == ["newest", "older"]
    at = show(at.run(), "Pipeline")
    assert not at.exception, [e.value for e in at.exception]
    picker = at.selectbox(key="trace_request")
    assert picker.value == "newest"  # the newest by default
    assert picker.options == [
        f"step 31 · {fmt_time(captured[0][2])}",
        f"step 12 · {fmt_time(captured[1][2])}",
    ]
    (gantt,) = [
        json.loads(c.proto.spec)
        for c in at.get("plotly_chart")
        if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("One step's schedule")
    ]
    assert "Step 31 on 2 rank(s)" in gantt["layout"]["title"]["text"]
    assert sum(len(d["y"]) for d in gantt["data"]) == 6
    assert {y for d in gantt["data"] for y in d["y"]} == {"rank 0 · stage 0", "rank 1 · stage 1"}
    # the Chrome trace of the chosen step, to download, and where to open it
    (download,) = at.get("download_button")
    assert download.proto.label == "Download as a Chrome / Perfetto trace"
    rows = store.step_traces(job, request="newest")
    assert download.proto.url == download_url(json.dumps(chrome_trace(rows)), "trace-newest.json")
    assert "ui.perfetto.dev" in page_text(at) and "chrome://tracing" in page_text(at)
    # a finished job: nothing to capture, and no sign-in asked for
    assert not [b for b in at.button if b.label == "Capture the next step"]
    assert "to capture" not in page_text(at)

    # the older trace, picked
    at.selectbox(key="trace_request").set_value("older")
    at = at.run()
    assert not at.exception
    titles = [t for t in chart_titles(at) if t.startswith("One step's schedule")]
    assert titles and "Step 12" in titles[0]
    (download,) = at.get("download_button")
    older = store.step_traces(job, request="older")
    assert download.proto.url == download_url(json.dumps(chrome_trace(older)), "trace-older.json")


# ---------------------------------------------------------------- capturing a step


@pytest.fixture
def live_job(store, db_url: str, etcd_server, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """A job the store says is running, with its layout, and the etcd it coordinates through
    (found by the dashboard through PIPETRANSFORMER_ETCD)."""
    spec = parse_spec(
        {
            "name": "live",
            "model": {"depth": 6},
            "parallel": {"stages": 2},
            "runtime": {"control_every_steps": 5},
        }
    )
    store.create_job("live-1", spec, "/tmp/nowhere")
    store.record_layout("live-1", two_stage_layout(1, 0), reason="initial")
    store.set_job_state("live-1", "running")
    monkeypatch.setenv(ENV_ETCD, etcd_server.endpoint)
    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_TOKEN", TOKEN)
    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_USER", "alice")
    return db_url


def sign_in(at: AppTest) -> AppTest:
    at.text_input(key="sign_in_user").set_value("alice")
    at.text_input(key="sign_in_token").set_value(TOKEN)
    button(at, "Sign in", sidebar=True).click()
    return at.run()


def test_a_signed_in_user_captures_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
    live_job: str,
    store,  # noqa: ANN001
    etcd,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    at = show(run_app(monkeypatch, live_job, job="live-1"), "Pipeline")
    assert not at.exception, [e.value for e in at.exception]
    # not signed in: no button, a word on how to get one
    assert not [b for b in at.button if b.label == "Capture the next step"]
    assert any("Sign in (sidebar) to capture" in c.value for c in at.caption)

    at = sign_in(at)
    at = show(at, "Pipeline")
    assert not any("Sign in (sidebar) to capture" in c.value for c in at.caption)
    button(at, "Capture the next step").click()
    at = at.run()
    assert not at.exception, [e.value for e in at.exception]
    filed = TraceRequest.model_validate_json(etcd.get(keys.trace_request("live-1")))
    assert filed.who == "alice (dashboard)" and filed.served_step is None
    (said,) = [s.value for s in at.success]
    assert f"Trace request {filed.id} filed" in said and "at most 5 step(s)" in said
    assert f"trace request {filed.id} by alice for live-1" in caplog.text  # the audit log
    assert any(f"Waiting for trace request {filed.id}" in c.value for c in at.caption)

    # a second click while it is pending shares it: no second request
    button(at, "Capture the next step").click()
    at = at.run()
    assert TraceRequest.model_validate_json(etcd.get(keys.trace_request("live-1"))).id == filed.id

    # an older trace, then the ranks answer the request: the page shows it by itself
    store.add_step_traces("live-1", [trace_report(r, "before", 3, T0, 2.0) for r in (0, 1)])
    at = at.run()
    assert at.selectbox(key="trace_request").value == "before"
    store.add_step_traces("live-1", [trace_report(r, filed.id, 8, T0 + 9, 2.0) for r in (0, 1)])
    at.selectbox(key="trace_request").set_value("before")  # the reader looks at the older one
    at = at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="trace_request").value == filed.id  # the capture, once it is in
    assert not any("Waiting for trace request" in c.value for c in at.caption)
    assert any("Step 8" in t for t in chart_titles(at))


def test_a_refused_capture_says_why(
    monkeypatch: pytest.MonkeyPatch,
    live_job: str,
    store,
    caplog: pytest.LogCaptureFixture,  # noqa: ANN001
) -> None:
    at = sign_in(show(run_app(monkeypatch, live_job, job="live-1"), "Pipeline"))
    at = show(at, "Pipeline")
    # the job's etcd cannot be found (no external one, no endpoint file in its directory)
    monkeypatch.delenv(ENV_ETCD)
    button(at, "Capture the next step").click()
    at = at.run()
    assert not at.exception
    (error,) = [e.value for e in at.error]
    assert error.startswith("Refused: job live-1 is running and has no live etcd")
    assert "refused trace request by alice for live-1" in caplog.text
    assert not at.success

    # a job that times nothing has nothing to trace: no button, and why
    quiet = parse_spec({"name": "quiet", "model": {"depth": 6}, "runtime": {"stage_timing": False}})
    store.create_job("quiet-1", quiet, "/tmp/nowhere")
    store.set_job_state("quiet-1", "running")
    at = show(sign_in(run_app(monkeypatch, live_job, job="quiet-1")), "Pipeline")
    assert not at.exception, [e.value for e in at.exception]
    assert not [b for b in at.button if b.label == "Capture the next step"]
    assert any("runtime.stage_timing: false" in c.value for c in at.caption)


# ---------------------------------------------------------------- the Workers view's log


def test_workers_view_shows_a_ranks_recent_log(
    monkeypatch: pytest.MonkeyPatch, populated_store: StoreRun, tmp_path: Path
) -> None:
    store, job = populated_store.store, populated_store.job_id
    log = tmp_path / "node-0.log"
    log.write_text("".join(f"[rank0] step {i}\n" for i in range(1, 501)))
    store.add_workers(
        job,
        1,
        [{"rank": 0, "node": "n1:10", "host": "n1"}, {"rank": 1, "node": "n2:11", "host": "pod-b"}],
    )
    store.update_workers(job, 1, [0], log=str(log))
    at = show(run_app(monkeypatch, populated_store.db_url, job), "Workers")
    assert not at.exception, [e.value for e in at.exception]
    picker = at.selectbox(key="log_rank")
    assert picker.options == ["rank 0 · n1", "rank 1 · pod-b"]
    assert not at.code  # closed: nothing read
    at.session_state["worker_log_open"] = True  # the reader opens the expander
    at = at.run()
    assert not at.exception, [e.value for e in at.exception]
    (code,) = at.code
    lines = code.value.splitlines()
    assert len(lines) == LINES and lines[-1] == "[rank0] step 500"
    assert any(str(log) in c.value for c in at.caption)

    # a rank whose output is no file here: why, and how to read its pod's log
    at.selectbox(key="log_rank").set_value(1)
    at = at.run()
    assert not at.exception and not at.code
    assert any("kubectl logs -l" in i.value for i in at.info)
    assert any(f"kubectl logs pod-b --tail {LINES}" in c.value for c in at.caption)


def test_log_tail_keeps_a_first_line_that_starts_the_window(tmp_path: Path) -> None:
    """A window that starts exactly at a line's start keeps that line whole."""
    log = tmp_path / "lines.log"
    log.write_text("a" * 9 + "\n" + "b" * 9 + "\n" + "c" * 9 + "\n")  # 3 lines of 10 bytes
    assert log_tail(str(log), max_bytes=20).text == "b" * 9 + "\n" + "c" * 9
    assert log_tail(str(log), max_bytes=15).text == "c" * 9  # "bbbb" was cut: dropped
