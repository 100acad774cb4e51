"""Child-process plumbing shared by everything that starts long-lived children (etcd, torchrun)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
from types import FrameType


def tied_to_parent(cmd: list[str]) -> list[str]:
    """`cmd` prefixed with `setpriv --pdeathsig TERM --`, so the child gets SIGTERM when this
    process dies, even by SIGKILL: no orphaned etcd or workers. Start it with
    `start_new_session=True` too, so a terminal Ctrl-C reaches only us and we stop it gracefully.

    Not a `preexec_fn`: that makes CPython fork (not vfork) and run Python in the child, and with
    a gRPC call in flight on another thread the child then sometimes aborts before exec. The
    kernel ties the signal to the forking *thread*, so it is armed from the main thread only."""
    if not sys.platform.startswith("linux"):
        return cmd
    if threading.current_thread() is not threading.main_thread():
        return cmd
    setpriv = shutil.which("setpriv")  # util-linux
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


# What a pod's stop (drain, eviction, delete, Volcano reclaim) and a terminal send.
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def call_forwarding_signals(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` (tied to this process) to its end and return its exit status, passing SIGTERM
    and SIGINT on to it.

    In a container this process is PID 1, and PID 1 ignores every signal it has no handler for:
    without one, a pod's stop never reaches torchrun and its workers (who leave gracefully on
    SIGTERM: finish the step, checkpoint with everyone) and they are SIGKILLed at the end of
    the grace period, losing the steps since the last checkpoint. Main thread only."""
    proc = subprocess.Popen(tied_to_parent(cmd), env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        return proc.wait()  # resumed after each handler (PEP 475)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
