"""The dashboard as a user sees it: `pipetransformer dashboard` serving a real run's store, the page
rendered by headless Chromium (Streamlit builds the page client side over a websocket, so only a
browser shows what is really on it).

Needs /usr/bin/chromium (`scripts/system-deps.sh` installs it); skipped without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

from orchestrator.etcd_server import free_port
from tests.fixtures_run import REPO, RealRun

CHROMIUM = Path("/usr/bin/chromium")
HEALTH_TIMEOUT_S = 90  # streamlit's start-up imports on 2 slow, shared cores
RENDER_TIMEOUT_S = 90  # all attempts at a fully rendered page together
ATTEMPT_TIMEOUT_S = 60  # one chromium run
WINDOW = "1400,2400"
CHARTS = 5  # layout, freeze, loss, throughput, accuracy: see dashboard/app.py
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # we run as root in CI containers
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these chromium tries to reach Google's services, and is slow without a network.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--run-all-compositor-stages-before-draw",
    # Virtual time runs ahead while nothing loads; the websocket's messages do not hold it back,
    # so a run can still end before the script's output arrives: `render` retries.
    "--virtual-time-budget=30000",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} not installed (scripts/system-deps.sh installs it)",
    ),
]

VOID_TAGS = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


class Dom(HTMLParser):
    """What a test needs from a dumped DOM: counts of data-testid and classes, the text inside
    each data-testid (and h1), plotly's chart titles, and the Streamlit app element's attributes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.testids: Counter[str] = Counter()
        self.classes: Counter[str] = Counter()
        self.texts: dict[str, list[str]] = {}
        self.app: dict[str, str] = {}
        self.chart_titles: list[str] = []
        self._open: list[list[str]] = []  # per open element: the text keys it collects for

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        keys = [tag] if tag == "h1" else []
        if testid := a.get("data-testid"):
            self.testids[testid] += 1
            keys.append(testid)
            if testid == "stApp":
                self.app = a
        classes = a.get("class", "").split()
        self.classes.update(classes)
        if "gtitle" in classes:  # plotly's SVG chart title; the raw text is in an attribute
            self.chart_titles.append(a.get("data-unformatted", ""))
        for key in keys:
            self.texts.setdefault(key, []).append("")
        if tag not in VOID_TAGS:
            self._open.append(keys)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID_TAGS:
            self._open.pop()

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for keys in self._open:
            for key in keys:
                self.texts[key][-1] += data

    @classmethod
    def parse(cls, html: str) -> Dom:
        dom = cls()
        dom.feed(html)
        dom.close()
        return dom

    def text(self, key: str) -> list[str]:
        return [t.strip() for t in self.texts.get(key, [])]

    @property
    def script_done(self) -> bool:
        return self.app.get("data-test-script-state") == "notRunning"


@dataclass
class Render:
    html: str
    dom: Dom
    screenshot: Path
    attempts: int


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=5) as resp:
                if resp.read().decode().strip() == "ok":
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{base}/_stcore/health not 'ok' after {timeout}s")


def render(url: str, workdir: Path, ready: str) -> Render:
    """Dump the DOM and screenshot `url` in one chromium run (the screenshot is taken after the
    dump), again until the app's script has finished and `ready` is on the page."""
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    attempt = 0
    while True:
        attempt += 1
        profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=workdir))
        shot = workdir / f"dashboard-{attempt}.png"
        cmd = [
            str(CHROMIUM),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW}",
            f"--screenshot={shot}",
            "--dump-dom",
            url,
        ]
        browser = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            stdout, stderr = browser.communicate(timeout=ATTEMPT_TIMEOUT_S)
            html, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
        except subprocess.TimeoutExpired:
            html, err = "", f"chromium timed out after {ATTEMPT_TIMEOUT_S}s"
        finally:
            stop(browser)  # chromium's renderer and helper processes too
            shutil.rmtree(profile, ignore_errors=True)
        dom = Dom.parse(html)
        if dom.script_done and ready in html and shot.is_file():
            final = workdir / "dashboard.png"
            shot.replace(final)
            return Render(html, dom, final, attempt)
        shot.unlink(missing_ok=True)  # most likely the loading skeleton
        if time.monotonic() > deadline:
            raise AssertionError(
                f"page not rendered after {attempt} attempt(s) in {RENDER_TIMEOUT_S}s: "
                f"app state {dom.app.get('data-test-script-state')!r}, "
                f"{ready!r} {'present' if ready in html else 'absent'}\n"
                f"chromium stderr (tail):\n{err[-2000:]}\nDOM (tail):\n{html[-2000:]}"
            )
        time.sleep(1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the process group `proc` leads (started with `start_new_session`): the CLI runs
    streamlit as its child, and chromium has helper processes."""
    if proc.poll() is None or _group_alive(proc.pid):
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                break
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_dashboard_in_browser(trained_run: RealRun, tmp_path: Path) -> None:
    job_id = trained_run.job_id
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "dashboard.log"
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "dashboard",
        "--workdir",
        str(trained_run.workdir),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "COLUMNS": "200"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so `stop` reaches streamlit too
        )
    ok = False
    try:
        wait_healthy(base, proc, HEALTH_TIMEOUT_S)
        page = render(f"{base}/?job={job_id}", tmp_path, ready=job_id)
        dom = page.dom
        print(f"rendered in {page.attempts} attempt(s); screenshot {page.screenshot}")

        assert dom.testids["stException"] == 0, dom.text("stException")
        assert dom.testids["stAlertContentError"] == 0, dom.text("stAlertContentError")
        # Header: the job is the page's title, its state a metric; the sidebar lists it.
        assert job_id in dom.text("h1"), dom.text("h1")
        metrics = dict(zip(dom.text("stMetricLabel"), dom.text("stMetricValue"), strict=True))
        assert "completed" in metrics.get("State", ""), metrics
        radio = " ".join(dom.text("stRadio"))
        assert job_id in radio and "completed" in radio, radio
        # Charts: every one drawn by plotly in the browser, with traces and its title.
        assert dom.testids["stPlotlyChart"] == CHARTS, dom.testids
        assert dom.classes["js-plotly-plot"] == CHARTS, dom.classes
        assert dom.classes["main-svg"] >= CHARTS
        assert dom.classes["trace"] >= CHARTS  # bars for the layout, lines and markers elsewhere
        titles = dom.chart_titles
        assert len(titles) == CHARTS, titles
        assert any("Layout v" in t for t in titles), titles
        for expected in ("Training loss", "Throughput", "Held-out accuracy"):
            assert any(expected in t for t in titles), titles
        # Tables: checkpoints and events, at least.
        assert dom.testids["stDataFrame"] >= 2, dom.testids
        # The screenshot: a real picture, not the loading skeleton (~16 KB).
        png = page.screenshot.read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(png) > 60_000, len(png)
        ok = True
    finally:
        stop(proc)
        if not ok:
            print(f"--- dashboard output ({log}) ---\n{log.read_text(errors='replace')[-5000:]}")
