"""The dashboard as a person uses it: `pipetransformer dashboard` serving real jobs' stores, driven
in headless Chromium through Playwright (Streamlit builds the page client side over a websocket,
so only a browser shows what is really on it, and only clicks show what it does).

- a finished job: every view draws without errors, the page is readable at 800 px;
- a running job: its step advances on screen without a click; without credentials the freeze
  override is disabled and nothing is filed; a wrong token is refused and logged; a signed-in
  user's request shows as pending, then applied, and the layout history gains the new version;
  when the job stops, the page stops polling.

Screenshots go to build/screenshots/dashboard/ (or $DASHBOARD_SCREENSHOTS). Needs
/usr/bin/chromium (`scripts/system-deps.sh` installs it) and the `playwright` package (a test
dependency; it drives the system chromium, no browser download); skipped without them.
"""

from __future__ import annotations

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

from orchestrator.etcd_server import free_port
from store import Store, sqlite_url
from tests.fixtures_run import REPO, RealRun, start_cli, store_probe, wait_for, write_spec

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(os.environ.get("DASHBOARD_SCREENSHOTS", REPO / "build" / "screenshots" / "dashboard"))
HEALTH_TIMEOUT_S = 90  # streamlit's start-up imports on 2 slow, shared cores
UI_TIMEOUT_MS = 60_000  # one page action or expectation
REFRESH_S = 1.0  # the running job's page re-reads the store this often
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
                sys.executable, "-m", "orchestrator.cli", "dashboard",
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
        page.locator(".js-plotly-plot").first.wait_for()
        values = page.locator('[data-testid="stMetricValue"]')
        assert values.count() == 7
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
