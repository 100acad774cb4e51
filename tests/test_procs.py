"""Signals through the trainer role's launcher: a pod's stop (SIGTERM to its PID 1) must reach
torchrun and its workers (the controller role's hand-over: tests/test_faults.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.fixtures_run import REPO, wait_for

# The child: says it is ready, then on SIGTERM writes which signal it got and exits 7 (a
# worker that leaves gracefully exits on its own terms, not by the signal).
CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    def leave(signum, frame):
        out.write_text(signal.Signals(signum).name)
        sys.exit(7)
    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    Path(sys.argv[2]).touch()
    while True:
        time.sleep(0.05)
    """
)

# The launcher, as `pipetransformer workers` runs torchrun.
LAUNCHER = textwrap.dedent(
    """
    import sys
    from pipetransformer.orchestrator.procs import call_forwarding_signals
    sys.exit(call_forwarding_signals([sys.executable, *sys.argv[1:]]))
    """
)


def _launch(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    got, ready = tmp_path / "got", tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(child), str(got), str(ready)], cwd=REPO
    )
    wait_for(ready.exists, 30, "the child to start")
    return proc, got


def test_sigterm_to_the_launcher_reaches_its_child_and_the_childs_status_is_returned(
    tmp_path: Path,
) -> None:
    proc, got = _launch(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7  # the child's own exit status, after it left
    finally:
        proc.kill()
    assert got.read_text() == "SIGTERM"


def test_sigint_is_forwarded_too(tmp_path: Path) -> None:
    proc, got = _launch(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 7
    finally:
        proc.kill()
    assert got.read_text() == "SIGINT"
