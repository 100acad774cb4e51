"""Post-mortems of a generation: the rank that died is told apart from the ranks that only lost
it as a peer, whatever order the facts arrive in (core/postmortem.py)."""

from __future__ import annotations

import itertools
import signal

import pytest

from pipetransformer.core.postmortem import PostMortem, describe_status
from pipetransformer.core.protocol import is_abnormal

GONE = "Connection closed by peer [127.0.0.1]:16110"


def _pm(world: int = 2) -> PostMortem:
    return PostMortem.of(7, world, [100 + r for r in range(world)], ["h0:1", "h1:2"][:world])


def test_exit_statuses_are_described() -> None:
    assert describe_status(signum=9) == "killed by signal 9 (SIGKILL)"
    assert describe_status(exit_code=3) == "exited with code 3"
    assert describe_status(signum=200) == "killed by signal 200 (unknown signal)"
    assert is_abnormal(None, 9) and is_abnormal(1, None) and is_abnormal(-1, None)
    assert not is_abnormal(0, None) and not is_abnormal(75, None)  # done; leaving to re-form


FACTS = {
    "peer": lambda pm: pm.report(0, "peer_lost", GONE, "train"),
    "exit": lambda pm: pm.exited(1, None, signal.SIGKILL),
    "vanish": lambda pm: pm.vanished(1, "its lease lapsed"),
    "exit0": lambda pm: pm.exited(0, 75, None),  # the victim leaves to re-form: not a death
}


@pytest.mark.parametrize("order", list(itertools.permutations(FACTS)), ids="-".join)
def test_the_killed_rank_is_the_cause_in_any_order(order) -> None:
    pm = _pm()
    for name in order:
        FACTS[name](pm)
    assert [e.member.rank for e in pm.causes] == [1]
    assert [e.member.rank for e in pm.victims] == [0]
    cause = pm.causes[0]
    # the fork server's exit status is better than a lapsed lease, whichever came first
    if order.index("exit") < order.index("vanish"):
        assert (cause.kind, cause.signal) == ("died", signal.SIGKILL)
    assert pm.complete
    summary = pm.summary()
    assert summary.startswith("rank 1 (pid 101 on h1)")
    assert summary.endswith("rank 0 only lost its peer")
    assert "rank 0 (pid 100 on h0) lost its peer" in pm.victims[0].sentence()


def test_own_words_win_over_the_exit_status() -> None:
    pm = _pm()
    pm.exited(0, 1, None)  # exit code 1 before its report arrived: a death, for now
    assert pm.causes[0].kind == "died"
    assert pm.report(0, "failed", "ValueError: bad", "build")
    assert (pm.ends[0].kind, pm.ends[0].exit_code, pm.ends[0].phase) == ("failed", 1, "build")
    assert not pm.report(0, "peer_lost", GONE)  # the first own word stays
    pm.report(1, "peer_lost", GONE)
    pm.exited(1, None, signal.SIGKILL)  # the agent killed the victim afterwards: still a victim
    assert [e.kind for e in pm.victims] == ["peer_lost"]
    assert pm.summary() == (
        "rank 0 (pid 100 on h0) failed while starting: ValueError: bad; rank 1 only lost its peer"
    )


def test_nothing_known_yet_says_so() -> None:
    pm = _pm()
    pm.report(0, "peer_lost", GONE)
    assert not pm.causes and not pm.complete
    assert pm.summary() == "rank 0 only lost its peer; the failed process is not identified yet"
    pm.report(1, "aborted")  # left as told: not a cause either
    assert pm.ends[1].kind == "left" and not pm.complete
    with pytest.raises(ValueError, match="not a final report"):
        pm.report(0, "metrics")


def test_a_deterministic_failure_needs_every_rank_failing_alike_while_starting() -> None:
    pm = _pm()
    pm.report(0, "failed", "MemoryError: 8 GB", "build")
    assert pm.deterministic_failure() is None  # rank 1 has not reported yet
    pm.report(1, "failed", "MemoryError: 8 GB", "build")
    assert pm.deterministic_failure() == "MemoryError: 8 GB"
    other = _pm()
    other.report(0, "failed", "MemoryError: 8 GB", "build")
    other.report(1, "failed", "OSError: disk full", "build")
    assert other.deterministic_failure() is None  # not the same way
    later = _pm()
    later.report(0, "failed", "RuntimeError: nan", "train")
    later.report(1, "failed", "RuntimeError: nan", "train")
    assert later.deterministic_failure() is None  # after training started: restarts may help
    lost = _pm()
    lost.report(0, "failed", "MemoryError: 8 GB", "build")
    lost.report(1, "peer_lost", GONE, "build")
    assert lost.deterministic_failure() is None
    assert lost.fatal_text() is None


def test_a_failure_a_restart_repeats_is_fatal_on_its_own_at_any_phase() -> None:
    """One rank's data error mid-training (the others only lost it) is the job's end: reading
    the same file again fails the same way."""
    pm = _pm()
    pm.report(0, "peer_lost", GONE, "train")
    assert pm.deterministic_failure() is None
    pm.report(1, "failed", "DataError: cannot read image /d/7.png (row 7)", "train", repeats=True)
    assert pm.deterministic_failure() == "DataError: cannot read image /d/7.png (row 7)"
    assert pm.fatal_text() == (
        "rank 1 met an error a restart would repeat: DataError: cannot read image /d/7.png (row 7)"
    )
    pm.exited(1, 1, None)  # its exit status comes later: still its own word, still repeating
    assert pm.ends[1].repeats and pm.ends[1].exit_code == 1
    alike = _pm()
    for rank in (0, 1):
        alike.report(rank, "failed", "MemoryError: 8 GB", "build")
    assert alike.fatal_text() == "every rank failed the same way while starting: MemoryError: 8 GB"


def test_exit_reports_match_ranks_by_host_and_pid() -> None:
    pm = _pm()
    assert pm.rank_of("h1", 101) == 1 and pm.rank_of("h0", 101) is None
    assert pm.rank_of("h0", 100) == 0 and pm.rank_of("h0", 999) is None
