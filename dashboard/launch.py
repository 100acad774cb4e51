"""Starting the dashboard: the `streamlit run` command line and how the app reads it back.

`streamlit_command` passes the app's own options after `--`, which streamlit hands to the script
as `sys.argv[1:]`; `options_from` is the app's side of that contract, with environment variables
as the fallback (how tests and containers configure it): `PIPETRANSFORMER_DB` for the store and
`PIPETRANSFORMER_ETCD` for an external etcd that running jobs coordinate through.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.store import DB_ENV as ENV_DB

APP_PATH = Path(__file__).resolve().parent / "app.py"
ENV_ETCD = "PIPETRANSFORMER_ETCD"
DEFAULT_REFRESH_S = 5.0


@dataclass(frozen=True)
class Options:
    db: str | None = None
    etcd: str | None = None  # HOST:PORT; None: a job's embedded etcd, found in its workdir
    refresh_s: float = DEFAULT_REFRESH_S  # how often a running job's page re-reads the store


def streamlit_command(
    db_url: str,
    host: str = "127.0.0.1",
    port: int = 8501,
    etcd: str | None = None,
    refresh_s: float = DEFAULT_REFRESH_S,
) -> list[str]:
    """argv that serves the dashboard for `db_url` on host:port, headless, no telemetry, with
    the viewer toolbar (no Deploy button)."""
    app_args = ["--db", db_url, "--refresh", str(refresh_s)]
    if etcd:
        app_args += ["--etcd", etcd]
    return [
        sys.executable,
        "-P",  # safe path: the working directory shadows no module
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.headless",
        "true",
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "viewer",
        "--",
        *app_args,
    ]


def options_from(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Options:
    """The app's options from its own arguments, else the environment.

    Unknown arguments are ignored, and abbreviations are not expanded, so arguments meant for
    something else (a test runner's, say) are never mistaken for ours.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--db")
    parser.add_argument("--etcd")
    parser.add_argument("--refresh", type=float)
    args, _ = parser.parse_known_args(list(argv))
    env = os.environ if environ is None else environ
    refresh = args.refresh if args.refresh and args.refresh > 0 else DEFAULT_REFRESH_S
    return Options(
        db=args.db or env.get(ENV_DB) or None,
        etcd=args.etcd or env.get(ENV_ETCD) or None,
        refresh_s=refresh,
    )


def script_args(script: Path = APP_PATH) -> list[str]:
    """`sys.argv[1:]` when `script` is the program being run (`streamlit run` sets argv[0] to
    it); otherwise none: in-process runners such as AppTest leave their own argv in place."""
    if sys.argv and Path(sys.argv[0]).resolve() == script.resolve():
        return sys.argv[1:]
    return []
