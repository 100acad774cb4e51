"""The Streamlit dashboard, rendered in-process with AppTest against a store on disk."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from pipetransformer.dashboard.launch import (
    APP_PATH,
    DEFAULT_REFRESH_S,
    ENV_DB,
    ENV_ETCD,
    Options,
    options_from,
    script_args,
    streamlit_command,
)
from pipetransformer.store import Store, sqlite_url
from tests.fixtures_store import StoreRun

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


def chart_titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def show(at: AppTest, view: str) -> AppTest:
    at.radio(key="view").set_value(view)
    return at.run()


def test_job_page_renders(monkeypatch: pytest.MonkeyPatch, finished_run) -> None:
    at = run_app(monkeypatch, finished_run.db_url)
    assert not at.exception, [e.value for e in at.exception]
    assert [t.value for t in at.main.title] == [finished_run.job_id]
    metrics = {m.label: m.value for m in at.metric}
    job = finished_run.store.get_job(finished_run.job_id)
    assert job.state in metrics["State"]
    assert metrics["Step"] == str(job.step)
    assert metrics["Frozen"] == f"{job.freeze_boundary}/{job.spec.model.depth}"
    assert metrics["Layout"].startswith("v")
    assert all(m.value and "None" not in m.value for m in at.metric)
    # where the model and the data came from (the rows: the workers' DataOpened report)
    assert "on built-in digits, 1,438 train / 359 held-out rows" in page_text(at)
    # Sidebar lists the job with its state; a finished job is not polled.
    (radio,) = [r for r in at.sidebar.radio if r.key == "job"]
    assert radio.value == finished_run.job_id
    assert any(finished_run.job_id in o and job.state in o for o in radio.options)
    assert "Live:" not in page_text(at)

    # Training: every curve on the step axis, each with data behind it.
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    titles = chart_titles(at)
    assert set(titles) == {"Training loss", "Throughput", "Held-out accuracy", "Learning rate"}
    assert all(s["data"] for s in specs)
    assert all(s["layout"]["xaxis"]["title"]["text"] == "step" for s in specs)
    # the same charts against wall time
    at.radio(key="xaxis").set_value("time")
    at = at.run()
    assert not at.exception
    assert {
        json.loads(c.proto.spec)["layout"]["xaxis"]["title"]["text"] for c in at.get("plotly_chart")
    } == {"time (UTC)"}
    assert not at.error


def test_every_view_renders(monkeypatch: pytest.MonkeyPatch, finished_run) -> None:
    at = run_app(monkeypatch, finished_run.db_url)
    job = finished_run.store.get_job(finished_run.job_id)

    at = show(at, "Layout")
    assert not at.exception, [e.value for e in at.exception]
    assert chart_titles(at)[0].startswith("Layout v")

    at = show(at, "Freezing")
    assert not at.exception, [e.value for e in at.exception]
    assert {"Frozen blocks", "Gradient norm per block"} <= set(chart_titles(at))
    # the override form is there, and disabled: no credentials, and the job is not running
    (submit,) = [b for b in at.button if b.label == "File freeze request"]
    assert submit.disabled
    assert any("Actions are disabled" in i.value for i in at.sidebar.info)

    at = show(at, "Workers")
    assert not at.exception, [e.value for e in at.exception]
    text = page_text(at)
    assert "Generation 1" in text
    workers = finished_run.store.workers(finished_run.job_id)
    assert workers, "a real run records its workers"
    frames = [df.value for df in at.dataframe]
    assert frames and sum(len(f) for f in frames) == len(workers)
    assert {"host", "pid", "stage", "replica", "lease", "last report", "exit", "log"} <= set(
        frames[0].columns
    )

    at = show(at, "Events")
    assert not at.exception, [e.value for e in at.exception]
    events = at.dataframe[0].value
    assert "None" not in set(events["from"]) and "controller" in set(events["from"])
    assert len(at.dataframe) == 2  # events and checkpoints

    at = show(at, "Spec")
    assert not at.exception
    (code,) = at.code
    assert code.language == "yaml" and f"name: {job.name}" in code.value

    at = show(at, "Compare")
    assert not at.exception, [e.value for e in at.exception]
    assert {"Training loss", "Throughput (samples/s)", "Held-out accuracy"} <= set(chart_titles(at))


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
    assert "Layout: —" in text and "Samples/s: —" in text
    assert "fine-tuned from `/w/jobs/pre/checkpoints/step-00000040`" in text
    assert "Live: updates every" in text  # a pending job is watched until it ends
    assert "No layout recorded yet." in page_text(show(at, "Layout"))
    assert not at.exception

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
    (said,) = [i.value for i in at.info if "No jobs" in i.value]
    assert "pipetransformer run examples/vit-digits-elastic.yaml" in said  # how to start one
    assert not at.sidebar.radio


def test_the_dashboard_opens_before_the_first_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pipetransformer dashboard` in a directory where nothing ran yet (before: refused, "no
    store ... run a job first"): the local store is made, empty, and the page opens on it."""
    from pipetransformer.orchestrator import cli

    handed: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        handed.append(argv)
        raise SystemExit(0)  # instead of becoming Streamlit

    monkeypatch.setattr(cli.os, "execv", execv)
    monkeypatch.delenv("PIPETRANSFORMER_DB", raising=False)
    workdir = tmp_path / "fresh" / "runs"
    with pytest.raises(SystemExit):
        cli.main(["dashboard", "--workdir", str(workdir)])
    assert "error" not in capsys.readouterr().err
    url = handed[-1][handed[-1].index("--db") + 1]
    assert url == sqlite_url(workdir / "store.db")
    with Store.open(url, migrate=False) as opened:
        assert opened.list_jobs() == []
    at = run_app(monkeypatch, url)
    assert not at.exception and any("No jobs" in i.value for i in at.info)


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
    cmd = streamlit_command(
        "sqlite:////tmp/x.db", host="0.0.0.0", port=8600, etcd="10.0.0.5:2379", refresh_s=2
    )
    assert cmd[:6] == [sys.executable, "-P", "-m", "streamlit", "run", str(APP_PATH)]
    assert Path(cmd[5]).is_file()
    opts = cmd[6 : cmd.index("--")]
    assert dict(zip(opts[::2], opts[1::2], strict=True)) == {
        "--server.headless": "true",
        "--server.address": "0.0.0.0",
        "--server.port": "8600",
        "--browser.gatherUsageStats": "false",
        "--client.toolbarMode": "viewer",  # no Deploy button
    }
    # What the app reads back from the arguments after `--`.
    app_args = cmd[cmd.index("--") + 1 :]
    assert options_from(app_args, environ={}) == Options(
        db="sqlite:////tmp/x.db", etcd="10.0.0.5:2379", refresh_s=2.0
    )
    plain = streamlit_command("sqlite://")
    assert "--etcd" not in plain
    assert options_from(plain[plain.index("--") + 1 :], environ={}).refresh_s == DEFAULT_REFRESH_S


def test_db_url_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert options_from(["--db", "sqlite://"], {ENV_DB: "postgresql://h/db"}).db == "sqlite://"
    assert options_from([], {ENV_DB: "postgresql://h/db"}).db == "postgresql://h/db"
    assert options_from(["-q", "--durations=5", "--d", "x"], {}).db is None
    assert options_from([], {ENV_ETCD: "h:2379"}).etcd == "h:2379"
    assert options_from(["--refresh", "0"], {}).refresh_s == DEFAULT_REFRESH_S  # never a busy loop
    monkeypatch.setattr(sys, "argv", [str(APP_PATH), "--db", "sqlite://"])
    assert script_args() == ["--db", "sqlite://"]
    monkeypatch.setattr(sys, "argv", ["pytest", "--db", "sqlite://"])
    assert script_args() == []


# --------------------------------------------------------------------------- actions

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def running_job(store: Store, db_url: str, etcd, etcd_server, monkeypatch: pytest.MonkeyPatch):
    """A job the store says is running, with its layout, and the etcd it coordinates through
    (found by the dashboard through PIPETRANSFORMER_ETCD)."""
    from pipetransformer.core.spec import parse_spec
    from tests.fixtures_store import two_stage_layout

    spec = parse_spec({"name": "live", "model": {"depth": 6}, "parallel": {"stages": 2}})
    store.create_job("live-1", spec, "/tmp/nowhere")
    store.record_layout("live-1", two_stage_layout(1, 0), reason="initial")
    store.set_job_state("live-1", "running")
    monkeypatch.setenv(ENV_ETCD, etcd_server.endpoint)
    return db_url


def button(at: AppTest, label: str, sidebar: bool = False):
    (found,) = [b for b in (at.sidebar.button if sidebar else at.button) if b.label == label]
    return found


def file_request(at: AppTest, layers: int, reason: str) -> AppTest:
    at.number_input(key="override_layers").set_value(layers)
    at.text_input(key="override_reason").set_value(reason)
    button(at, "File freeze request").click()
    return at.run()


def test_freeze_override_needs_a_signed_in_user(
    monkeypatch: pytest.MonkeyPatch, running_job: str, etcd, caplog: pytest.LogCaptureFixture
) -> None:
    from pipetransformer.core import keys
    from pipetransformer.core.protocol import FreezeRequest

    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_TOKEN", TOKEN)
    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_USER", "alice")
    at = show(run_app(monkeypatch, running_job, job="live-1"), "Freezing")
    assert not at.exception, [e.value for e in at.exception]
    assert "Live: updates every" in page_text(at)
    assert button(at, "File freeze request").disabled
    assert any("Sign in" in c.value for c in at.caption)

    # a wrong token is refused, and the refusal is logged with the name that was tried
    at.text_input(key="sign_in_user").set_value("alice")
    at.text_input(key="sign_in_token").set_value("not-the-token")
    button(at, "Sign in", sidebar=True).click()
    at = at.run()
    assert any("Sign-in refused" in e.value for e in at.sidebar.error)
    assert "refused sign-in: user 'alice'" in caplog.text
    assert button(at, "File freeze request").disabled

    at.text_input(key="sign_in_user").set_value("alice")
    at.text_input(key="sign_in_token").set_value(TOKEN)
    button(at, "Sign in", sidebar=True).click()
    at = at.run()
    assert any("Signed in as **alice**" in c.value for c in at.sidebar.caption)
    assert not button(at, "File freeze request").disabled

    # the CLI's rules, before anything is filed
    at = file_request(at, 6, "too far")
    assert any("Refused: layers=6 exceeds 5" in e.value for e in at.error), at.error
    at = file_request(at, 2, "   ")
    assert any("Refused: reason" in e.value for e in at.error), at.error
    assert etcd.get(keys.freeze_override("live-1")) is None

    at = file_request(at, 2, "blocks 0-1 plateaued")
    assert any("filed" in s.value for s in at.success), at.error
    filed = FreezeRequest.model_validate_json(etcd.get(keys.freeze_override("live-1")))
    assert (filed.layers, filed.who, filed.reason) == (
        2,
        "alice (dashboard)",
        "blocks 0-1 plateaued",
    )
    # listed as pending (the controller has not audited it yet)
    requests = at.table[0].value
    assert list(requests["request"]) == [filed.id] and list(requests["status"]) == ["pending"]
    # one pending request at a time
    at = file_request(at, 3, "again")
    assert any("already has a pending freeze request" in e.value for e in at.error)


def test_the_freeze_form_offers_only_what_the_rules_allow(
    monkeypatch: pytest.MonkeyPatch, store: Store, db_url: str
) -> None:
    """A completed job frozen as far as it may be (5 of 6 blocks, the last one kept trainable):
    the form's default is the boundary in force, not 6, which the rules refuse (before: 6)."""
    from pipetransformer.core.spec import parse_spec
    from pipetransformer.core.state import Layout, StageLayout

    spec = parse_spec({"name": "done", "model": {"depth": 6}, "parallel": {"stages": 2}})
    store.create_job("done-1", spec, "/tmp/nowhere")
    packed = Layout(
        version=2,
        num_blocks=6,
        freeze_boundary=5,
        stages=[StageLayout(index=0, start=5, end=6, ranks=[0, 1])],
        replicas=2,
        microbatches=4,
    )
    store.record_layout("done-1", packed, reason="autofreeze")
    store.set_job_state("done-1", "completed")
    at = show(run_app(monkeypatch, db_url, job="done-1"), "Freezing")
    assert not at.exception, [e.value for e in at.exception]
    assert at.number_input(key="override_layers").value == 5
    assert button(at, "File freeze request").disabled


def test_without_credentials_nothing_can_be_filed(
    monkeypatch: pytest.MonkeyPatch, running_job: str, etcd, caplog: pytest.LogCaptureFixture
) -> None:
    from pipetransformer.core import keys

    monkeypatch.delenv("PIPETRANSFORMER_DASHBOARD_TOKEN", raising=False)
    monkeypatch.delenv("PIPETRANSFORMER_DASHBOARD_TOKEN_FILE", raising=False)
    at = show(run_app(monkeypatch, running_job, job="live-1"), "Freezing")
    assert not at.exception
    assert any("Actions are disabled" in i.value for i in at.sidebar.info)
    assert not [b for b in at.sidebar.button if b.label == "Sign in"]
    assert button(at, "File freeze request").disabled
    assert etcd.get(keys.freeze_override("live-1")) is None


def test_a_form_left_open_after_sign_out_files_nothing(
    monkeypatch: pytest.MonkeyPatch, running_job: str, etcd
) -> None:
    from pipetransformer.core import keys

    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_TOKEN", TOKEN)
    at = show(run_app(monkeypatch, running_job, job="live-1"), "Freezing")
    at.text_input(key="sign_in_token").set_value(TOKEN)
    button(at, "Sign in", sidebar=True).click()
    at = at.run()
    assert not button(at, "File freeze request").disabled
    at.session_state["actor"] = None  # signed out elsewhere; this page still shows the form
    at = file_request(at, 2, "stale")
    # the page is drawn for who is signed in now: the form is disabled again, the submit void
    assert not at.success and button(at, "File freeze request").disabled
    assert any("Sign in" in c.value for c in at.caption)
    assert etcd.get(keys.freeze_override("live-1")) is None


# --------------------------------------------------------------------------- the CLI's checks


def test_cli_warns_before_serving_beyond_loopback_without_credentials(
    monkeypatch: pytest.MonkeyPatch,
    finished_run,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    import pipetransformer.dashboard.__main__ as dashboard_main
    from pipetransformer.orchestrator import cli

    served: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        served.append(argv)
        raise SystemExit(0)  # instead of becoming the next program

    def serve(argv: list[str]) -> int:
        """`pipetransformer dashboard ARGS`, then the `python -m pipetransformer.dashboard` it becomes, in
        this process: the CLI hands over without importing the dashboard."""
        try:
            return cli.main(argv)
        except SystemExit:
            handed = served[-1]
            assert handed[1:4] == ["-P", "-m", "pipetransformer.dashboard"], handed
            return dashboard_main.main(handed[4:])

    monkeypatch.setattr(cli.os, "execv", execv)
    monkeypatch.setattr(dashboard_main.os, "execv", execv)
    for var in ("PIPETRANSFORMER_DASHBOARD_TOKEN", "PIPETRANSFORMER_DASHBOARD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # no .streamlit/secrets.toml here (OIDC would count as auth)
    monkeypatch.setenv("HOME", str(tmp_path))
    args = ["dashboard", "--db", finished_run.db_url]
    with pytest.raises(SystemExit):
        serve([*args, "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert "warning" in err and "0.0.0.0" in err and "PIPETRANSFORMER_DASHBOARD_TOKEN" in err
    assert served[-1][served[-1].index("--server.address") + 1] == "0.0.0.0"

    with pytest.raises(SystemExit):
        serve([*args, "--host", "127.0.0.1"])
    assert "warning" not in capsys.readouterr().err

    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_TOKEN", TOKEN)
    with pytest.raises(SystemExit):
        serve([*args, "--host", "0.0.0.0"])
    assert "warning" not in capsys.readouterr().err

    # credentials configured but unusable: refused before anything is served
    monkeypatch.delenv("PIPETRANSFORMER_DASHBOARD_TOKEN")
    monkeypatch.setenv("PIPETRANSFORMER_DASHBOARD_TOKEN_FILE", "/nonexistent/tokens")
    served.clear()
    assert serve([*args]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not [argv for argv in served if "streamlit" in argv], "Streamlit never started"


# --------------------------------------------------------------------------- several jobs


def two_jobs(run: StoreRun) -> str:
    """A second finished job beside `run`'s (newer, so listed first): its last evaluation,
    at 75 %, is below its best, 90 %; `run`'s job lost a generation once. Returns its id."""
    from tests.fixtures_store import populate

    second = "vit-digits-second"
    populate(run.store, second)
    run.store.add_evaluation(second, 4, 50, accuracy=0.75, loss=0.5, time=1_700_000_050.0)
    run.store.add_event(
        run.job_id,
        "generation_aborted",
        "generation 1 aborted: rank 1 was killed by SIGKILL",
        data={"generation": 1, "reason": "rank 1 killed by SIGKILL"},
    )
    return second


def test_runs_view_lists_every_job_and_opens_the_ticked_one(
    monkeypatch: pytest.MonkeyPatch, populated_store: StoreRun
) -> None:
    """Before: no view listed the store's jobs with their results; the sidebar's list gave
    only each job's state and newest accuracy."""
    second, first = two_jobs(populated_store), populated_store.job_id
    at = show(run_app(monkeypatch, populated_store.db_url, job=second), "Runs")
    assert not at.exception, [e.value for e in at.exception]
    (table,) = at.dataframe
    runs = table.value.set_index("job")
    assert list(runs.index) == [second, first]  # newest first
    assert list(runs["final"]) == [0.75, 0.9] and list(runs["best"]) == [0.9, 0.9]
    assert list(runs["recoveries"]) == [0, 1]
    assert list(runs["steps"]) == [40, 40] and list(runs["frozen"]) == ["2/6", "2/6"]
    assert set(runs["dataset"]) == {"digits"} and set(runs["model"]) == {"vit 6×64"}
    assert "final ppl" not in runs  # no language model here
    assert "2 job(s) in this store" in page_text(at)

    # ticking a row opens that job on its first view, the URL and the sidebar following
    at.session_state["runs"] = {"selection": {"rows": [1], "columns": [], "cells": []}}
    at = at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [t.value for t in at.main.title] == [first]
    assert at.radio(key="view").value == "Training" and at.radio(key="job").value == first
    assert at.query_params["job"] == first and not at.warning
    assert "Training loss" in chart_titles(at)


def test_compare_view_sums_up_each_job_and_smooths_its_curves(
    monkeypatch: pytest.MonkeyPatch, populated_store: StoreRun
) -> None:
    """Before: Compare had curves only, smoothed by a slider in the sidebar with no raw curve
    beneath; no numbers side by side."""
    second = two_jobs(populated_store)
    at = show(run_app(monkeypatch, populated_store.db_url, job=populated_store.job_id), "Compare")
    at.multiselect(key="compare").set_value([second])
    at = at.run()
    assert not at.exception, [e.value for e in at.exception]
    (table,) = at.dataframe
    summary = table.value.set_index("job")
    assert list(summary.index) == [populated_store.job_id, second]  # the page's job first
    assert list(summary["final"]) == [0.9, 0.75] and list(summary["best"]) == [0.9, 0.9]
    assert list(summary["speed-up"]) == [1.0, 1.0]  # the same steps at the same speed
    assert summary["samples/s"].iloc[0] > 900 and list(summary["steps"]) == [40, 40]
    # the smoothing slider is above the curves it smooths (the sidebar's is left out here)
    assert [s.key for s in at.main.slider] == ["smoothing"] and not at.sidebar.slider
    loss = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    assert [(t["name"], t.get("showlegend", True)) for t in loss] == [
        (f"{populated_store.job_id} (raw)", False),
        (populated_store.job_id, True),
        (f"{second} (raw)", False),
        (second, True),
    ]
    at.slider(key="smoothing").set_value(0.0)
    at = at.run()
    loss = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    assert [t["name"] for t in loss] == [populated_store.job_id, second]  # raw values only
    # one setting: back on Training, the sidebar's slider has the value set here
    at = show(at, "Training")
    assert not at.exception and at.sidebar.slider(key="smoothing").value == 0.0
    assert [t["name"] for t in json.loads(at.get("plotly_chart")[0].proto.spec)["data"]][0] == (
        "loss"
    )
