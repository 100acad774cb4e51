"""A light stand-in for trainer.worker in the fork server tests (importing torch takes seconds)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

IMPORTED_BY = os.getpid()  # the fork server, when the worker was forked from it


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "echo":
        print(
            json.dumps(
                {
                    "argv": argv,
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "imported_by": IMPORTED_BY,
                    "cwd": os.getcwd(),
                    "env": os.environ.get("FORKSERVER_TEST"),
                    "agent": os.environ.get("PIPETRANSFORMER_AGENT_PID"),
                }
            ),
            flush=True,
        )
        print("to stderr", file=sys.stderr, flush=True)
        return int(argv[1])
    if mode == "wait":  # until SIGTERM, then leave as a re-forming worker does
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
        print(os.getpid(), flush=True)
        # short sleeps: a Python handler runs between bytecodes, so a signal landing just before
        # one long sleep would wait for all of it (the test sends it right after the print)
        for _ in range(600):
            time.sleep(0.1)
        return 0
    if mode == "raise":
        raise RuntimeError("boom")
    return 2


def on_worker_exit(request: dict, pid: int, exit_code: int) -> None:
    """The fork server's exit hook: appends what it was told to $FORKSERVER_EXITS."""
    path = request["env"].get("FORKSERVER_EXITS")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"pid": pid, "exit_code": exit_code, "argv": request["argv"]}))
            out.write("\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
