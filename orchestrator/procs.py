"""Child-process plumbing shared by everything that starts long-lived children (etcd, torchrun)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def detached_but_tied() -> None:
    """`preexec_fn` for a child that must ignore the terminal's Ctrl-C (its own session, so the
    parent can stop it gracefully) yet never outlive its parent: on Linux the kernel sends it
    SIGTERM when the parent dies, even by SIGKILL."""
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
