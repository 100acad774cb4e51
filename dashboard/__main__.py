"""`python -m pipetransformer.dashboard`: serve the dashboard (what `pipetransformer dashboard` execs).

The CLI checks that the store is readable and hands over its options; this side, which owns the
page, checks the sign-in configuration, warns before serving beyond loopback without it, and then
becomes Streamlit. So the CLI starts the dashboard without importing any of it.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.markup import escape

from pipetransformer.dashboard.auth import (
    AuthConfigError,
    bind_warning,
    load_credentials,
    oidc_configured,
)
from pipetransformer.dashboard.launch import DEFAULT_REFRESH_S, streamlit_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipetransformer.dashboard", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the store to show")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8501)
    parser.add_argument("--refresh", type=float, default=DEFAULT_REFRESH_S)
    parser.add_argument("--etcd", help="HOST:PORT of the etcd running jobs coordinate through")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = Console(highlight=False), Console(stderr=True, highlight=False)
    try:
        credentials = load_credentials()
    except AuthConfigError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    if warning := bind_warning(args.host, credentials, oidc_configured()):
        err.print(f"[yellow]warning:[/] {escape(warning)}")
    cmd = streamlit_command(
        args.db, host=args.host, port=args.port, etcd=args.etcd, refresh_s=args.refresh
    )
    who = f"actions for {credentials.source}" if credentials else "read-only (no credentials)"
    out.print(f"dashboard on http://{args.host}:{args.port}, {who} (Ctrl-C to stop)")
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # become Streamlit: signals (kill, container stop) reach it directly


if __name__ == "__main__":
    sys.exit(main())
