"""Child-process plumbing shared by everything that starts long-lived children (etcd, torchrun)."""

from __future__ import annotations

import shutil
import sys
import threading


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
