"""Starting the dashboard: the `streamlit run` command line and how the app reads it back.

`streamlit_command` passes the database after `--`, which streamlit hands to the script as
`sys.argv[1:]`; `db_url_from` is the app's side of that contract (with `PIPETRANSFORMER_DB` as
the fallback, which is also how tests and containers configure it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

APP_PATH = Path(__file__).resolve().parent / "app.py"
ENV_DB = "PIPETRANSFORMER_DB"


def streamlit_command(db_url: str, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """argv that serves the dashboard for `db_url` on host:port, headless, no telemetry."""
    return [
        sys.executable,
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
        "--",
        "--db",
        db_url,
    ]


def db_url_from(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """The database URL from `--db URL` in the script's own arguments, else $PIPETRANSFORMER_DB.

    Unknown arguments are ignored, and abbreviations are not expanded, so arguments meant for
    something else (a test runner's, say) are never mistaken for ours.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--db")
    args, _ = parser.parse_known_args(list(argv))
    env = os.environ if environ is None else environ
    return args.db or env.get(ENV_DB) or None


def script_args(script: Path = APP_PATH) -> list[str]:
    """`sys.argv[1:]` when `script` is the program being run (`streamlit run` sets argv[0] to
    it); otherwise none: in-process runners such as AppTest leave their own argv in place."""
    if sys.argv and Path(sys.argv[0]).resolve() == script.resolve():
        return sys.argv[1:]
    return []
