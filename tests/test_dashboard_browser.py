"""The dashboard as a person uses it: `pipetransformer dashboard` serving real jobs' stores, driven
in headless Chromium through Playwright (Streamlit builds the page client side over a websocket,
so only a browser shows what is really on it, and only clicks show what it does).

- a finished job: every view draws without errors, the page is readable at 800 px;
- a running job: its step advances on screen without a click; without credentials the freeze
  override is disabled and nothing is filed; a wrong token is refused and logged; a signed-in
  user's request shows as pending, then applied, and the layout history gains the new version;
  when the job stops, the page stops polling;
- a job whose ranks reported their stage timings: the Pipeline view draws where the time goes;
- a job whose ranks traced a step: the Pipeline view draws its schedule as a Gantt chart and
  downloads it as a Chrome trace; the Workers view shows a rank's recent log lines;
- two jobs, one with long hosts, log paths and messages: the Workers and Events tables fit the
  page; the Runs view lists both with their held-out accuracy and opens the one ticked.

Screenshots go to build/screenshots/dashboard/ (or $DASHBOARD_SCREENSHOTS). Needs
/usr/bin/chromium (`scripts/system-deps.sh` installs it) and the `playwright` package (a test
dependency; it drives the system chromium, no browser download); skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipetransformer.core.protocol import StageTimes, StepTrace
from pipetransformer.core.stage_times import PhaseSeconds, TraceSpan
from pipetransformer.orchestrator.etcd_server import free_port
from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import REPO, RealRun, start_cli, store_probe, wait_for, write_spec
from tests.fixtures_store import POPULATED_JOB_ID, populate

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(os.environ.get("DASHBOARD_SCREENSHOTS", REPO / "build" / "screenshots" / "dashboard"))
HEALTH_TIMEOUT_S = 90  # streamlit's start-up imports on 2 slow, shared cores
UI_TIMEOUT_MS = 60_000  # one page action or expectation
# the running job's page re-reads the store this often (at 1 s, one run of the page took longer
# than that on a loaded machine: runs followed each other and the page never settled)
REFRESH_S = 3.0
TOKEN = "browser-test-token-1234"

playwright = pytest.importorskip("playwright.sync_api", reason="playwright not installed")
expect = playwright.expect

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} not installed (scripts/system-deps.sh installs it)",
    ),
]


# --------------------------------------------------------------------------- serving and browsing


def wait_healthy(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=5) as resp:
                if resp.read().decode().strip() == "ok":
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{base}/_stcore/health not 'ok' after {HEALTH_TIMEOUT_S}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the process group `proc` leads (the CLI execs streamlit; it may have children)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


@contextmanager
def dashboards(workdir: Path, logs: Path, *envs: dict[str, str]) -> Iterator[list[str]]:
    """One `pipetransformer dashboard` per environment, started together; yields base URLs."""
    procs: list[tuple[subprocess.Popen[bytes], Path, str]] = []
    try:
        for i, extra in enumerate(envs):
            port, log = free_port(), logs / f"dashboard-{i}.log"
            env = {k: v for k, v in os.environ.items() if "DASHBOARD_TOKEN" not in k}
            cmd = [
                sys.executable, "-m", "pipetransformer.orchestrator.cli", "dashboard",
                "--workdir", str(workdir), "--port", str(port), "--host", "127.0.0.1",
                "--refresh", str(REFRESH_S),
            ]  # fmt: skip
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env={**env, "COLUMNS": "200", **extra},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            procs.append((proc, log, f"http://127.0.0.1:{port}"))
        for proc, log, base in procs:
            wait_healthy(base, proc, log)
        yield [base for _, _, base in procs]
    finally:
        for proc, log, _ in procs:
            stop(proc)
            print(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def open_page(browser, url: str, width: int = 1400):  # noqa: ANN001, ANN201
    page = browser.new_page(viewport={"width": width, "height": 1600})
    page.set_default_timeout(UI_TIMEOUT_MS)
    expect.set_options(timeout=UI_TIMEOUT_MS)
    page.goto(url)
    settle(page)
    return page


SETTLED = """() => document.querySelector('[data-testid="stApp"]')?.dataset.testScriptState
    === 'notRunning' && !document.querySelector('[data-stale="true"]')"""


def settle(page) -> None:  # noqa: ANN001
    """Wait until the app's script has run and no element of an earlier run is left on the page
    (Streamlit keeps them, marked stale, until the new run replaces them)."""
    page.wait_for_function(SETTLED)
    page.locator('[data-testid="stMetricValue"]').first.wait_for()


def metric(page, label: str):  # noqa: ANN001, ANN201
    box = page.locator('[data-testid="stMetric"]').filter(
        has=page.locator('[data-testid="stMetricLabel"]', has_text=re.compile(f"^{label}$"))
    )
    return box.locator('[data-testid="stMetricValue"]')


def choose_view(page, view: str, shows) -> None:  # noqa: ANN001
    """Pick a view, wait for what it `shows` (a locator: proof the new run has drawn), then for
    the run to finish."""
    page.get_by_role("radiogroup", name="View").get_by_text(view, exact=True).click()
    shows.first.wait_for()
    settle(page)


def shot(page, name: str) -> Path:  # noqa: ANN001
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes().startswith(b"\x89PNG")
    return path


def assert_no_errors(page) -> None:  # noqa: ANN001
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]'
    ).all_inner_texts()


def chart_titles(page) -> list[str]:  # noqa: ANN001
    # Streamlit's plotly theme wraps titles in <b>; the words are what matter
    raw = [t.get_attribute("data-unformatted") or "" for t in page.locator(".gtitle").all()]
    return [re.sub(r"<[^>]+>", "", t) for t in raw]


# --------------------------------------------------------------------------- a finished job


def test_finished_job_every_view_and_800px(trained_run: RealRun, tmp_path: Path, browser) -> None:
    job = trained_run.job_id
    with dashboards(trained_run.workdir, tmp_path, {}) as (base,):
        page = open_page(browser, f"{base}/?job={job}")
        expect(page.get_by_role("heading", name=job)).to_be_visible()
        expect(metric(page, "State")).to_contain_text("completed")
        assert page.get_by_text("Live: updates every").count() == 0  # finished: not polled
        assert page.locator('[data-testid="stAppDeployButton"]').count() == 0  # viewer toolbar
        # Training: four charts drawn by plotly in the browser, each with traces
        expect(page.locator(".js-plotly-plot")).to_have_count(4)
        titles = chart_titles(page)
        assert {"Training loss", "Throughput", "Held-out accuracy", "Learning rate"} <= set(titles)
        assert page.locator(".js-plotly-plot .trace").count() >= 4
        assert_no_errors(page)
        shot(page, "finished-training")
        for view, expected in (
            ("Layout", "Layout v"),
            ("Freezing", "Gradient norm per block"),
            ("Compare", "Training loss"),
        ):
            choose_view(page, view, page.locator(f'.gtitle[data-unformatted*="{expected}"]'))
            assert_no_errors(page)
            shot(page, f"finished-{view.lower()}")
        for view, expected in (("Workers", "Generation 1"), ("Spec", "name: tiny")):
            choose_view(page, view, page.get_by_text(expected))
            assert_no_errors(page)
            shot(page, f"finished-{view.lower()}")
        page.close()

        # 800 px: every metric value whole (not cut to "comp…"), chart titles inside their charts
        page = open_page(browser, f"{base}/?job={job}", width=800)
        # waited for, not counted at once: on a loaded machine the page had drawn 5 of them
        expect(page.locator(".js-plotly-plot")).to_have_count(4)
        values = page.locator('[data-testid="stMetricValue"]')
        expect(values).to_have_count(7)
        for value in values.all():
            clipped = value.evaluate(
                "e => [...e.querySelectorAll('*')].concat([e])"
                ".some(n => n.scrollWidth > n.clientWidth + 1)"
            )
            assert not clipped and "…" not in value.inner_text(), value.inner_text()
        for chart in page.locator(".js-plotly-plot").all():
            box, title = chart.bounding_box(), chart.locator(".gtitle").bounding_box()
            assert box and title and title["x"] + title["width"] <= box["x"] + box["width"] + 1
        shot(page, "finished-800px")
        page.close()


# --------------------------------------------------------------------------- a running job


def test_running_job_live_and_freeze_override(tmp_path: Path, browser) -> None:
    # far longer than the test on any machine (it is stopped at the end: a slow CI machine once
    # finished 40 epochs before the form was reached); decision points every 10 steps
    spec = write_spec(
        tmp_path / "spec.yaml",
        model={"depth": 4},
        training={"epochs": 2000},
        freeze={"every": 10},
    )
    workdir, run_log = tmp_path / "runs", tmp_path / "run.log"
    job = "live"
    proc = start_cli("run", str(spec), "--workdir", str(workdir), "--job-id", job, log=run_log)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{TOKEN}\n")
    try:
        db = workdir / "store.db"
        wait_for(store_probe(db, job, lambda s, j: s.get_job(j).step >= 2), 120, "steps", run_log)
        with dashboards(
            workdir, tmp_path, {}, {"PIPETRANSFORMER_DASHBOARD_TOKEN_FILE": str(tokens)}
        ) as (open_base, auth_base):
            url = f"?job={job}"
            # -- no credentials: live, but no action possible
            page = open_page(browser, f"{open_base}/{url}")
            expect(page.get_by_text("Live: updates every")).to_be_visible()
            first = int(metric(page, "Step").inner_text())
            expect(metric(page, "Step")).not_to_have_text(str(first))  # no click, no reload
            assert int(metric(page, "Step").inner_text()) > first
            # a new held-out result reaches the sidebar's job list too, not the header alone
            # (before: the list kept the accuracy the page was opened with)
            held_out = metric(page, "Accuracy")
            expect(held_out).not_to_have_text("—", timeout=60_000)
            jobs = page.locator('[data-testid="stSidebar"] [data-testid="stRadio"]').first
            wait_for(
                lambda: held_out.inner_text() in jobs.inner_text(),
                30,
                "the header's accuracy in the sidebar's job list",
            )
            choose_view(page, "Freezing", page.get_by_role("button", name="File freeze request"))
            expect(page.get_by_role("button", name="File freeze request")).to_be_disabled()
            expect(page.get_by_text("Actions are disabled")).to_be_visible()
            shot(page, "running-no-credentials")
            page.close()

            # -- a wrong token is refused, and the refusal logged
            page = open_page(browser, f"{auth_base}/{url}")
            sidebar = page.locator('[data-testid="stSidebar"]')
            sidebar.get_by_label("User").fill("alice")
            sidebar.get_by_label("Token").fill("wrong-token-123")
            sidebar.get_by_role("button", name="Sign in").click()
            expect(sidebar.get_by_text("Sign-in refused")).to_be_visible()
            wait_for(
                lambda: (
                    "refused sign-in: user 'alice'" in (tmp_path / "dashboard-1.log").read_text()
                ),
                10,
                "the refusal in the dashboard's log",
            )
            # -- signed in: file a request, see it pending, then applied
            sidebar.get_by_label("User").fill("alice")
            sidebar.get_by_label("Token").fill(TOKEN)
            sidebar.get_by_role("button", name="Sign in").click()
            expect(sidebar.get_by_text("Signed in as alice")).to_be_visible()
            choose_view(page, "Freezing", page.get_by_role("button", name="File freeze request"))
            page.get_by_role("spinbutton", name="New freeze boundary").fill("2")
            page.get_by_role("textbox", name="Reason").fill("browser test")
            page.get_by_role("button", name="File freeze request").click()
            expect(page.get_by_text(re.compile(r"Request \w+ filed"))).to_be_visible()
            table = page.locator('[data-testid="stTable"]')
            expect(table).to_contain_text("alice (dashboard)")
            shot(page, "running-request-filed")
            expect(table).to_contain_text("applied")  # by the page's own refresh
            shot(page, "running-request-applied")
            choose_view(page, "Layout", page.locator('.gtitle[data-unformatted*="Layout history"]'))
            expect(page.locator(".gtitle").first).to_have_attribute(
                "data-unformatted", re.compile("2/4 frozen")
            )  # the current layout's title
            assert "Layout history" in chart_titles(page)
            shot(page, "running-layout-history")

            # -- the job stops: the page says so by itself and stops polling
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130, run_log.read_text()[-3000:]  # SIGINT
            expect(metric(page, "State")).to_contain_text("interrupted")
            expect(page.get_by_text("Live: updates every")).to_have_count(0)
            page.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    try:
        requested = store.events(job, limit=50, kinds=["freeze_requested"])
        applied = store.events(job, limit=50, kinds=["freeze_applied"])
    finally:
        store.close()
    # one request, by the signed-in user, audited and applied (the refused attempts filed none)
    assert [e.data["request"]["who"] for e in requested] == ["alice (dashboard)"]
    assert [e.data["boundary"] for e in applied] == [2]


# --------------------------------------------------------------------------- the Pipeline view


def test_pipeline_view_draws_where_the_time_goes(tmp_path: Path, browser) -> None:
    """A finished job re-laid out once (v1, then v2 with 2 blocks frozen) whose ranks reported
    their phases (`Store.add_stage_times`): the view draws the three charts, names the phases,
    and says which stage is the slowest."""
    workdir = tmp_path / "runs"
    workdir.mkdir()
    store = Store.open(sqlite_url(workdir / "store.db"))
    try:
        populate(store)

        def report(rank: int, a: int, b: int) -> StageTimes:
            fwd, wait = 0.1 + 0.2 * rank, 0.3 * (1 - rank)  # stage 1 computes, stage 0 waits
            s = PhaseSeconds(forward=fwd, backward=2 * fwd, pipeline_wait=wait, other=0.05)
            return StageTimes(
                rank=rank,
                time=1_700_000_000.0 + b,
                from_step=a,
                to_step=b,
                layout_version=1 if b <= 10 else 2,
                stages=[rank],
                replica=0,
                wall_s=s.total(),
                seconds=s,
            )

        intervals = ((0, 5), (5, 10), (10, 20), (20, 30), (30, 40))
        store.add_stage_times(
            POPULATED_JOB_ID, [report(r, a, b) for a, b in intervals for r in (0, 1)]
        )
    finally:
        store.close()
    with dashboards(workdir, tmp_path, {}) as (base,):
        page = open_page(browser, f"{base}/?job={POPULATED_JOB_ID}")
        choose_view(page, "Pipeline", page.locator('.gtitle[data-unformatted*="Time per phase"]'))
        expect(page.locator(".js-plotly-plot")).to_have_count(4)  # no traced step: no Gantt
        titles = chart_titles(page)
        assert any(t.startswith("Time per phase · layout v2") for t in titles), titles
        assert any(t.startswith("Pipeline bubble") for t in titles), titles
        assert "Bubble and busy share over steps" in titles
        assert any(t.startswith("Stage compute per step") for t in titles), titles
        # the phases by name, in the breakdown's legend
        legend = page.locator(".js-plotly-plot .legendtext")
        for name in ("forward", "backward", "waiting for a neighbour stage"):
            expect(legend.filter(has_text=re.compile(f"^{name}$")).first).to_be_visible()
        assert page.locator(".js-plotly-plot .trace").count() >= 5
        expect(page.get_by_text(re.compile(r"slowest stage 1 .* under layout v2"))).to_be_visible()
        assert_no_errors(page)
        shot(page, "pipeline")
        page.close()


def test_pipeline_view_draws_a_traced_step(tmp_path: Path, browser) -> None:
    """A finished job whose two ranks answered a trace request (`Store.add_step_traces`): the
    Pipeline view draws the step as a Gantt chart, a lane per rank and stage, and the download
    button gives its Chrome trace; the Workers view shows a rank's recent log lines."""
    workdir = tmp_path / "runs"
    workdir.mkdir()
    log = tmp_path / "node-0.log"
    log.write_text("".join(f"[rank0] step {i} loss 0.{i:03d}\n" for i in range(1, 301)))
    store = Store.open(sqlite_url(workdir / "store.db"))
    try:
        populate(store)

        def traced(rank: int) -> StepTrace:
            ms = 1e-3
            spans = [TraceSpan(phase="data_wait", start_s=0, end_s=1 * ms)]
            t = 1 * ms if rank == 0 else 3 * ms  # rank 1 waits for rank 0's first forward
            for mb in range(4):
                spans.append(
                    TraceSpan(
                        phase="forward", start_s=t, end_s=t + 2 * ms, stage=rank, microbatch=mb
                    )
                )
                t += 2 * ms
            for mb in reversed(range(4)):
                spans.append(
                    TraceSpan(
                        phase="backward", start_s=t, end_s=t + 4 * ms, stage=rank, microbatch=mb
                    )
                )
                t += 4 * ms
            spans.append(TraceSpan(phase="optimizer", start_s=t, end_s=t + 1 * ms))
            return StepTrace(
                rank=rank,
                request="a1b2c3d4e5f6",
                step=37,
                started=1_700_000_100.0 + rank * 0.0005,
                layout_version=2,
                stages=[rank],
                replica=0,
                spans=spans,
            )

        store.add_step_traces(POPULATED_JOB_ID, [traced(0), traced(1)])
        store.add_workers(POPULATED_JOB_ID, 1, [{"rank": 0, "node": "n1:10", "host": "n1"}])
        store.update_workers(POPULATED_JOB_ID, 1, [0], log=str(log))
    finally:
        store.close()
    with dashboards(workdir, tmp_path, {}) as (base,):
        page = open_page(browser, f"{base}/?job={POPULATED_JOB_ID}")
        choose_view(
            page, "Pipeline", page.locator('.gtitle[data-unformatted*="One step\'s schedule"]')
        )
        gantt = page.locator(".js-plotly-plot").filter(
            has=page.locator('.gtitle[data-unformatted*="One step\'s schedule"]')
        )
        expect(gantt).to_have_count(1)
        title = gantt.locator(".gtitle").get_attribute("data-unformatted") or ""
        assert "Step 37 on 2 rank(s)" in title, title
        # a lane per rank and stage, a bar per span (10 a rank), micro-batches named on the bars
        ticks = gantt.locator(".ytick text").all_text_contents()  # SVG: no inner text
        assert set(ticks) == {"rank 0 · stage 0", "rank 1 · stage 1"}, ticks
        expect(gantt.locator(".bars .point")).to_have_count(20)
        expect(
            gantt.locator(".bars .point text").filter(has_text=re.compile("^F0$"))
        ).to_have_count(2)
        legend = gantt.locator(".legendtext")
        for name in ("forward", "backward", "waiting for data", "optimizer"):
            expect(legend.filter(has_text=re.compile(f"^{name}$"))).to_have_count(1)
        expect(page.get_by_text("ui.perfetto.dev")).to_be_visible()
        # the picker names the traced step by its step and time
        picker = page.get_by_role("combobox", name="Traced step (newest first)")
        expect(picker).to_be_visible()
        expect(picker).to_have_value(re.compile(r"^step 37 · 2023-11-14 22:1\d:\d\d UTC$"))
        # finished: nothing to capture
        assert page.get_by_role("button", name="Capture the next step").count() == 0
        assert_no_errors(page)
        shot(page, "pipeline-trace")

        download = page.get_by_role("button", name="Download as a Chrome / Perfetto trace")
        expect(download).to_be_visible()
        with page.expect_download() as got:
            download.click()
        assert got.value.suggested_filename == "trace-a1b2c3d4e5f6.json"
        trace = json.loads(Path(got.value.path()).read_text())
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert len(events) == 20 and {e["pid"] for e in events} == {0, 1}

        # the Workers view: rank 0's recent log lines, read once the reader opens them
        choose_view(page, "Workers", page.get_by_text("Recent log lines"))
        page.get_by_text("Its last 200 lines").click()
        expect(page.get_by_text("[rank0] step 300 loss 0.300")).to_be_visible()
        assert page.get_by_text("[rank0] step 100 loss", exact=False).count() == 0  # 101-300
        assert_no_errors(page)
        shot(page, "workers-log")
        page.close()


# --------------------------------------------------------------------------- several jobs, wide tables

SECOND_JOB = "vit-digits-second"
LONG_HOST = "trainer-pod-1-of-a-job-with-a-rather-long-name.trainers.cluster.local"
LONG_LOG = "/srv/runs/jobs/vit-digits-3f2a1c/workers-vit-digits-3f2a1c-ff8bcf-node-0.log"
LONG_MESSAGE = (
    "generation 1 aborted: rank 1 (pid 4242 on node-a) was killed by SIGKILL while training "
    "step 37; generation 2 resumes from the checkpoint at step 30 with the same layout"
)
GRID_OVERFLOW = (
    "e => { const s = e.querySelector('.dvn-scroller'); return s.scrollWidth - s.clientWidth }"
)


def grid_text(table) -> str:  # noqa: ANN001
    """What a table's grid holds in the page (Streamlit draws its cells on a canvas; the grid
    keeps the rows and columns in view in a table for screen readers)."""
    cells = table.locator('table[role="grid"] th, table[role="grid"] td')
    return " | ".join(cells.all_text_contents())


def assert_fits(page, table, last: str) -> None:  # noqa: ANN001
    """Every column of `table` in view: its right-most column, `last`, among those the grid
    drew, the grid not scrolling sideways, and the table inside the window."""
    # waited for: the grid lists its columns once it has drawn them (only those in view)
    expect(table.locator('table[role="grid"] th').last).to_have_text(last)
    assert table.evaluate(GRID_OVERFLOW) <= 1, (last, table.evaluate(GRID_OVERFLOW))
    box = table.bounding_box()
    assert box and box["x"] + box["width"] <= page.viewport_size["width"], box


def test_runs_table_opens_a_job_and_wide_tables_fit(tmp_path: Path, browser) -> None:
    """Two finished jobs in one store, one with long host names, log paths and event messages.
    At 1400 px the Workers and Events tables show their right-most column without scrolling
    (before: the Workers table was twice as wide as the page, its log column cut off); the Runs
    view lists both jobs with their newest held-out accuracy (before: no such view), and
    ticking one opens it."""
    workdir = tmp_path / "runs"
    workdir.mkdir()
    store = Store.open(sqlite_url(workdir / "store.db"))
    try:
        populate(store)
        populate(store, SECOND_JOB)
        store.add_evaluation(SECOND_JOB, 4, 50, accuracy=0.75, loss=0.5, time=1_700_000_050.0)
        job = POPULATED_JOB_ID
        store.add_event(job, "generation_aborted", LONG_MESSAGE, data={"generation": 1})
        store.add_workers(
            job, 1, [{"rank": r, "node": f"n{r}:10", "host": LONG_HOST} for r in (0, 1)]
        )
        store.update_workers(job, 1, [0, 1], log=LONG_LOG, detail="ended with the job: completed")
    finally:
        store.close()
    with dashboards(workdir, tmp_path, {}) as (base,):
        page = open_page(browser, f"{base}/?job={POPULATED_JOB_ID}")
        tables = page.locator('[data-testid="stDataFrame"]')
        choose_view(page, "Workers", page.get_by_text("Generation 1"))
        assert_fits(page, tables.first, "log")
        shot(page, "wide-workers")
        choose_view(page, "Events", page.get_by_text("Checkpoints"))
        expect(tables).to_have_count(2)
        assert_fits(page, tables.nth(0), "message")
        assert_fits(page, tables.nth(1), "created")
        shot(page, "wide-events")

        choose_view(page, "Runs", page.get_by_text("2 job(s) in this store"))
        expect(tables).to_have_count(1)
        runs = tables.first
        assert_fits(page, runs, "recoveries")
        text = grid_text(runs)
        assert SECOND_JOB in text and POPULATED_JOB_ID in text, text
        # each job's newest held-out accuracy (the grid holds the values the cells format)
        assert re.search(r"0\.75\b|75%", text) and re.search(r"0\.9\b|90%", text), text
        assert_no_errors(page)
        shot(page, "runs")
        # tick the newest job's row (row 0; its box is at the grid's left, under the header)
        box = runs.bounding_box()
        assert box
        page.mouse.click(box["x"] + 16, box["y"] + 35 + 17)
        expect(page.get_by_role("heading", name=SECOND_JOB)).to_be_visible()
        settle(page)
        expect(metric(page, "Accuracy")).to_have_text("75.0%")
        expect(page.locator(".js-plotly-plot")).to_have_count(4)  # its Training view
        assert page.url.endswith(f"job={SECOND_JOB}"), page.url
        assert_no_errors(page)
        page.close()
    assert "Session State API" not in (tmp_path / "dashboard-0.log").read_text()
