"""Judging a size: the problems in what the host processes counted (`_client_problems`: etcd
errors, failed rendezvous heartbeats and lease refreshes, expired leases, aborts, nodes waiting,
new rounds), what degraded while it still ran (`_judge`), and the run's verdict, the first size
that broke (`_breaks_first`). The problems only a phase sees (Started reports not drained, nodes
dropped from the round, the controller's errors, an aborted generation) are recorded where
`measure.measure_size` sees them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config import Config

STALE_REPORT_S = 1.0  # a report older than this when stored counts as the controller lagging


def _client_problems(row: dict[str, Any], stats: dict[int, dict[str, Any]]) -> None:
    """The problems in the host processes' counts (`stats`: one summary per host)."""
    errors: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    samples: list[str] = []
    for s in stats.values():
        errors.update(s["errors"])
        warnings.update(s["warnings"])
        samples.extend(s["error_samples"] + s["warning_samples"])
    problems = row["problems"]

    def problem(kind: str, count: int, detail: str) -> None:
        if count:
            problems.append({"kind": kind, "count": int(count), "detail": detail})

    problem(
        "etcd_client_errors",
        sum(errors.values()),
        f"{dict(errors)}; e.g. {samples[0] if samples else ''}",
    )
    problem(
        "rdzv_heartbeat_failed",
        warnings["rdzv_heartbeat_failed"],
        "torchrun rendezvous heartbeats that did not get through (a node missing 3 in a row is "
        "dropped from the round)",
    )
    problem(
        "lease_refresh_failed", warnings["lease_refresh_failed"], "lease keep-alives that failed"
    )
    problem(
        "presence_lease_expired",
        sum(s["presence_expired"] for s in stats.values()),
        "workers' presence leases expired (the controller reads that as a dead worker)",
    )
    problem(
        "agent_lease_expired",
        sum(s["agent_lease_expired"] for s in stats.values()),
        "launchers' presence leases expired",
    )
    problem(
        "abort_seen",
        sum(s["aborted"] for s in stats.values()),
        "workers saw the controller abort their generation",
    )
    waiting = max((s["max_waiting"] for s in stats.values()), default=0)
    problem(
        "rdzv_nodes_waiting",
        waiting,
        "num_nodes_waiting() > 0: torchrun would restart the worker group",
    )
    rounds = sorted({r for s in stats.values() for r in s["rounds"]})
    if len(rounds) > 1:
        problem("rdzv_new_round", len(rounds) - 1, f"rounds seen while steady: {rounds}")


def _round_problem(parts: list[dict[str, Any]], n: int, joined_max: int) -> str | None:
    """Why a rendezvous phase's participants did not all meet in one round of `n`, or None."""
    failed = [p for p in parts if "error" in p]
    if failed:
        # the ones whose rendezvous itself failed say more than the others, which then wait
        # for them in torchrun's rank assignment
        stuck = [p for p in failed if "t_rdzv" not in p]
        first = (stuck or failed)[0]
        also = f" ({len(stuck)} of them in next_rendezvous())" if stuck else ""
        return (
            f"{len(failed)}/{n} participants failed{also}: {first['error']} (at most "
            f"{joined_max}/{n} nodes were ever in the round)"
        )
    ranks = sorted(p.get("rank", -1) for p in parts)
    rounds = {p.get("round") for p in parts}
    worlds = Counter(p.get("world") for p in parts if "world" in p)
    if ranks != list(range(n)) or len(rounds) != 1 or set(worlds) != {n}:
        seen = ", ".join(f"{c} saw {w}" for w, c in sorted(worlds.items()))
        apart = [p["view_apart"] for p in parts if p.get("view_apart")]
        why = f"; a node apart: {apart[0]}" if apart else ""
        return (
            f"inconsistent result: world sizes ({seen}), rounds {sorted(rounds)}, "
            f"ranks {'0..' + str(n - 1) if ranks == list(range(n)) else ranks}{why}"
        )
    return None


def _judge(row: dict[str, Any], conf: Config) -> None:
    """What degraded (the size still ran): late polls, stale reports, a saturated controller."""
    slow = {op: r for op, r in row.get("achieved", {}).items() if r < 0.9}
    if slow:
        row["degraded"].append(
            {"kind": "calls_late", "detail": f"calls made / due below 0.9: {slow}"}
        )
    age = (row.get("report_age_s") or {}).get("p95")
    if age is not None and age > STALE_REPORT_S:
        row["degraded"].append(
            {"kind": "reports_stale", "detail": f"report age p95 {age}s > {STALE_REPORT_S}s"}
        )
    busy = row.get("controller_busy")
    if busy is not None and busy > 0.8:
        row["degraded"].append(
            {"kind": "controller_saturated", "detail": f"controller ticking {busy:.0%} of the time"}
        )


def _breaks_first(rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    broke = next((r for r in rows if r["failed_phase"] or r["problems"]), None)
    slow = next((r for r in rows if r["degraded"]), None)
    first: dict[str, Any] | None = None
    parts = []
    if broke is not None:
        what = ([f"failed in {broke['failed_phase']}"] if broke["failed_phase"] else []) + [
            p["kind"] for p in broke["problems"]
        ]
        first = {"participants": broke["participants"], "what": what, "error": broke["error"]}
        detail = broke["error"] or "; ".join(p["detail"] for p in broke["problems"])
        parts.append(
            f"First failure at N={broke['participants']}: {', '.join(what)} "
            f"({detail.splitlines()[0][:240]})."
        )
    else:
        parts.append(f"Nothing failed up to N={max(r['participants'] for r in rows)}.")
    if slow is not None and (broke is None or slow["participants"] <= broke["participants"]):
        kinds = ", ".join(d["detail"] for d in slow["degraded"])
        parts.append(f"First degradation at N={slow['participants']}: {kinds}.")
        if first is None:
            first = {
                "participants": slow["participants"],
                "what": [d["kind"] for d in slow["degraded"]],
                "error": None,
            }
    busy = [r for r in rows if (r.get("cpu_cores") or {}).get("machine_busy")]
    if busy:
        r = max(busy, key=lambda r: r["participants"])
        c = r["cpu_cores"]
        parts.append(
            f"At N={r['participants']} the machine was {c['machine_busy']:.1f}/{c['machine_cores']}"
            f" cores busy (etcd {c['etcd']}, simulated agents {c.get('agents')}, controller "
            f"process {c['controller_process']})."
        )
    return first, " ".join(parts)
