"""The Streamlit dashboard, rendered in-process with AppTest against a store on disk."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard.launch import APP_PATH, ENV_DB, db_url_from, script_args, streamlit_command
from orchestrator.store import Store, sqlite_url

TIMEOUT_S = 30  # first run imports plotly/pandas; generous for 2 slow cores


def run_app(monkeypatch: pytest.MonkeyPatch, db_url: str | None, job: str | None = None) -> AppTest:
    # AppTest runs the script in this process with pytest's argv, so the URL goes by env var.
    if db_url is None:
        monkeypatch.delenv(ENV_DB, raising=False)
    else:
        monkeypatch.setenv(ENV_DB, db_url)
    at = AppTest.from_file(str(APP_PATH), default_timeout=TIMEOUT_S)
    if job is not None:
        at.query_params["job"] = job
    return at.run()


def page_text(at: AppTest) -> str:
    parts = [
        e.value
        for kind in ("title", "markdown", "caption", "info", "error", "warning")
        for e in at.get(kind)
    ]
    parts += [f"{m.label}: {m.value}" for m in at.metric]
    parts += [str(o) for r in at.sidebar.radio for o in r.options]
    return "\n".join(str(p) for p in parts)


def test_job_page_renders(monkeypatch: pytest.MonkeyPatch, finished_run) -> None:
    at = run_app(monkeypatch, finished_run.db_url)
    assert not at.exception, [e.value for e in at.exception]
    assert [t.value for t in at.main.title] == [finished_run.job_id]
    metrics = {m.label: m.value for m in at.metric}
    job = finished_run.store.get_job(finished_run.job_id)
    assert job.state in metrics["State"]
    assert metrics["Step"] == str(job.step)
    # Sidebar lists the job with its state.
    (radio,) = at.sidebar.radio
    assert radio.value == finished_run.job_id
    assert any(finished_run.job_id in o and job.state in o for o in radio.options)

    charts = at.get("plotly_chart")
    specs = [json.loads(c.proto.spec) for c in charts]
    titles = [s["layout"]["title"]["text"] for s in specs]
    assert len(charts) == 5, titles
    assert titles[0].startswith("Layout v")
    assert {"Training loss", "Throughput", "Held-out accuracy"} <= set(titles)
    assert all(s["data"] for s in specs)  # every chart has data behind it

    subheaders = [s.value for s in at.subheader]
    assert {"Pipeline layout", "Checkpoints", "Recent events"} <= set(subheaders)
    assert len(at.dataframe) >= 2  # checkpoints and events tables
    assert not at.error


def test_job_selected_by_query_param(monkeypatch: pytest.MonkeyPatch, finished_run) -> None:
    store = Store.open(finished_run.db_url)
    try:
        spec = store.get_job(finished_run.job_id).spec
        init = {"checkpoint": "/w/jobs/pre/checkpoints/step-00000040", "checksum": "ab12"}
        tuned = spec.model_copy(update={"init": spec.init.model_copy(update=init)})
        store.create_job("newer-job-000001", tuned, "/w")
    finally:
        store.close()
    # Default: newest job, which has nothing recorded yet; the page still renders.
    at = run_app(monkeypatch, finished_run.db_url)
    assert not at.exception
    assert [t.value for t in at.main.title] == ["newer-job-000001"]
    text = page_text(at)
    assert "No layout recorded yet." in text
    assert "fine-tuned from `/w/jobs/pre/checkpoints/step-00000040`" in text

    at = run_app(monkeypatch, finished_run.db_url, job=finished_run.job_id)
    assert not at.exception
    assert [t.value for t in at.main.title] == [finished_run.job_id]
    assert "fine-tuned from" not in page_text(at)

    at = run_app(monkeypatch, finished_run.db_url, job="no-such-job")
    assert not at.exception
    assert any("no-such-job" in w.value for w in at.sidebar.warning)
    assert [t.value for t in at.main.title] == ["newer-job-000001"]


def test_missing_database_is_reported_not_created(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "nowhere" / "store.db"
    at = run_app(monkeypatch, sqlite_url(path))
    assert not at.exception
    assert any("Database not found" in e.value and str(path) in e.value for e in at.error)
    assert not path.exists() and not path.parent.exists()
    assert not at.get("plotly_chart")


def test_empty_store_says_no_jobs(monkeypatch: pytest.MonkeyPatch, store: Store, db_url) -> None:
    at = run_app(monkeypatch, db_url)
    assert not at.exception
    assert any("No jobs" in i.value for i in at.info)
    assert not at.sidebar.radio


def test_database_without_schema(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    at = run_app(monkeypatch, sqlite_url(path))
    assert not at.exception
    assert any("no pipetransformer schema" in e.value for e in at.error)
    assert path.stat().st_size == 0  # nothing was written


def test_no_database_given(monkeypatch: pytest.MonkeyPatch) -> None:
    at = run_app(monkeypatch, None)
    assert not at.exception
    assert any(ENV_DB in i.value for i in at.info)


# --------------------------------------------------------------------------- launch helpers


def test_streamlit_command() -> None:
    cmd = streamlit_command("sqlite:////tmp/x.db", host="0.0.0.0", port=8600)
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(APP_PATH)]
    assert Path(cmd[4]).is_file()
    opts = cmd[5 : cmd.index("--")]
    assert dict(zip(opts[::2], opts[1::2], strict=True)) == {
        "--server.headless": "true",
        "--server.address": "0.0.0.0",
        "--server.port": "8600",
        "--browser.gatherUsageStats": "false",
    }
    assert cmd[cmd.index("--") + 1 :] == ["--db", "sqlite:////tmp/x.db"]
    # What the app reads back from the arguments after `--`.
    assert db_url_from(cmd[cmd.index("--") + 1 :], environ={}) == "sqlite:////tmp/x.db"


def test_db_url_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert db_url_from(["--db", "sqlite://"], {ENV_DB: "postgresql://h/db"}) == "sqlite://"
    assert db_url_from([], {ENV_DB: "postgresql://h/db"}) == "postgresql://h/db"
    assert db_url_from(["-q", "--durations=5", "--d", "x"], {}) is None
    monkeypatch.setattr(sys, "argv", [str(APP_PATH), "--db", "sqlite://"])
    assert script_args() == ["--db", "sqlite://"]
    monkeypatch.setattr(sys, "argv", ["pytest", "--db", "sqlite://"])
    assert script_args() == []
