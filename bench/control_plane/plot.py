"""The PNG: the rows' figures against participants (log x) in eight panels (rendezvous and
re-rendezvous, their progress over time, etcd load, etcd per agent, controller -> store,
latency, CPU, rendezvous traffic), with red dotted lines at the sizes that had problems."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import Config


def _plot(rows: list[dict[str, Any]], path: Path, conf: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(21, 8.5))
    sizes = [r["participants"] for r in rows]

    def get(*path: str) -> Any:
        def read(r: dict[str, Any]) -> Any:
            v: Any = r
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            return v

        return read

    def line(ax: Any, key: Any, label: str, **kw: Any) -> None:
        xs, ys = [], []
        for r in rows:
            v = key(r)
            if v is not None and v > 0:
                xs.append(r["participants"])
                ys.append(v)
        if xs:
            ax.plot(xs, ys, marker="o", label=label, **kw)

    ax = axes[0][0]
    line(ax, get("rendezvous_s"), "rendezvous (all N in one round)")
    line(ax, get("ranks_assigned_s"), "+ torchrun rank assignment")
    line(ax, get("rerendezvous_s"), "re-rendezvous of N-1 after a loss")
    line(ax, get("join_answer_s"), "join request -> assignment")
    failed = [r for r in rows if r.get("rendezvous_completed") is False]
    if failed:
        ax.plot(
            [r["participants"] for r in failed],
            [r.get("rendezvous_s") or conf.join_timeout for r in failed],
            "rx",
            markersize=12,
            label=f"rendezvous failed (timed out: at the {conf.join_timeout}s join timeout)",
        )
    ax.set_ylabel("seconds")
    ax.set_title("Rendezvous")

    ax = axes[0][1]
    for r in rows:
        prog = r.get("rdzv_progress") or []
        if prog:
            drawn = ax.plot(
                [p[0] for p in prog],
                [p[1] / r["participants"] for p in prog],
                label=f"N={r['participants']}",
            )
            again = r.get("rerdzv_progress") or []
            if again:
                ax.plot(
                    [p[0] for p in again],
                    [p[1] / r["participants"] for p in again],
                    linestyle="--",
                    color=drawn[0].get_color(),
                )
    ax.set_xlabel("seconds since the participants started (dashed: since the loss)")
    ax.set_ylabel("participants in the round / N")
    ax.set_title("Rendezvous progress (etcd state, sampled)")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)

    ax = axes[0][2]
    line(ax, get("etcd_requests_per_s"), "etcd requests/s")
    line(ax, get("etcd_writes_per_s"), "etcd writes/s (raft proposals)")
    line(ax, get("reports_per_s"), "worker reports/s")
    ax.set_ylabel("per second")
    ax.set_title("etcd load (steady window)")

    ax = axes[0][3]
    line(ax, get("etcd_requests_per_agent_s"), "steady: etcd requests/s per agent + worker")
    line(ax, get("steady_backend_requests_per_agent_s"), "steady: rendezvous backend's share")
    line(ax, get("rendezvous_etcd_requests_per_agent"), "rendezvous: requests per agent")
    line(ax, get("rerendezvous_etcd_requests_per_agent"), "re-rendezvous: requests per agent")
    ax.set_ylabel("requests (per agent)")
    ax.set_title("etcd per agent (flat = scales)")

    ax = axes[1][3]
    line(ax, get("rendezvous_etcd_mb_in"), "rendezvous: MB into etcd")
    line(ax, get("rendezvous_etcd_mb_out"), "rendezvous: MB out of etcd")
    line(ax, get("rerendezvous_etcd_mb_in"), "re-rendezvous: MB into etcd", linestyle="--")
    line(ax, get("rerendezvous_etcd_mb_out"), "re-rendezvous: MB out of etcd", linestyle="--")
    ax.set_ylabel("MB")
    ax.set_title("Rendezvous traffic")

    ax = axes[1][0]
    line(ax, get("store_rows_per_s"), "store rows written/s")
    line(ax, get("store_commits_per_s"), "store commits/s")
    line(ax, get("events_drained_per_s"), "reports drained/s")
    ax.set_ylabel("per second")
    ax.set_title("Controller -> store")

    ax = axes[1][1]
    line(ax, get("drain_ms", "p50"), "drain p50")
    line(ax, get("drain_ms", "p95"), "drain p95")
    line(ax, lambda r: (get("report_age_s", "p95")(r) or 0) * 1e3, "report age p95")
    line(ax, get("client_ms", "abort_poll", "p95"), "worker etcd get p95", linestyle="--")
    line(ax, get("client_ms", "heartbeat", "p95"), "rdzv heartbeat p95", linestyle="--")
    ax.set_ylabel("milliseconds")
    ax.set_title("Latency")

    ax = axes[1][2]
    line(ax, get("cpu_cores", "etcd"), "etcd")
    line(ax, get("cpu_cores", "agents"), "simulated agents + workers")
    line(ax, get("cpu_cores", "controller_process"), "controller process")
    line(ax, get("cpu_cores", "machine_busy"), "whole machine", linestyle=":")
    ax.set_ylabel("CPU cores")
    ax.set_title("CPU (steady window)")

    for ax in [a for a in axes.flat if a is not axes[0][1]]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("participants (torchrun agents, one worker each)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        for r in rows:
            if r["failed_phase"] or r["problems"]:
                ax.axvline(r["participants"], color="red", alpha=0.3, linestyle=":")
    failed = [str(r["participants"]) for r in rows if r["failed_phase"] or r["problems"]]
    note = f"; red dotted: problems at N={', '.join(failed)}" if failed else ""
    fig.suptitle(
        "Control plane vs participants: etcd v3 rendezvous, worker leases and reports, "
        f"controller + {conf.store} store{note}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
