"""Child-process plumbing shared by everything that starts long-lived children (etcd, torchrun)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _session_and_parent_death_signal() -> None:
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def detached_but_tied() -> Callable[[], None]:
    """A `preexec_fn` for a child that must ignore the terminal's Ctrl-C (its own session, so the
    parent can stop it gracefully) yet not outlive its parent: on Linux the kernel sends it
    SIGTERM when the parent dies, even by SIGKILL.

    The kernel ties that signal to the *thread* that forked, so it is only armed when spawning
    from the main thread; a child started from a short-lived thread just gets its own session."""
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return _session_and_parent_death_signal
    return os.setsid
