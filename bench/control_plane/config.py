"""The benchmark's settings: `Config` (one per run, pickled to the host processes), the periods
and timeouts it mirrors from the project's own code, the job it submits (`job_spec`), and
`PhaseFailed`, how a size's phase says it failed."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipetransformer.core.spec import JobSpec
from pipetransformer.orchestrator.launch import heartbeat_s

JOB = "cps"
MONITOR_S = 0.2  # torchrun --monitor-interval in orchestrator.launch.torchrun_command
ABORT_POLL_S = 0.2  # trainer.process.AbortWatch's default
JOIN_POLL_S = 0.05  # trainer.process.join's assignment poll
AGENT_LEASE_S = 10  # `pipetransformer workers` launcher presence (orchestrator.cli.cmd_workers)
CONTROLLER_TICK_S = 0.1  # Controller.supervise's default interval
# threads per host process that run its simulated nodes' polls and reports (bench/control_plane
# /simulate.py run_periodic): enough that a call waiting on etcd delays few others
SCHEDULING_THREADS = 16
NODES_PER_HOST = 128  # simulated nodes per host process by default (`Config.hosts_for`)
DEFAULT_SIZES = (8, 16, 64, 256)


@dataclass
class Config:
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    # processes the participants are spread over (capped at N); None: `hosts_for(n)`
    hosts: int | None = None
    seconds: float = 20.0  # steady window measured
    warmup: float = 3.0  # steady seconds before the window opens
    step_hz: float = 2.0  # Metrics reports per second per reporting rank
    metrics_from: str = "replica"  # "replica" (each replica's last stage) or "loss-owner"
    lease_ttl_s: int = 5  # runtime.lease_ttl_s (the spec's default)
    join_timeout: int = 240  # torch's rendezvous join timeout (s)
    startup_timeout: float = 180.0  # spawning the host processes (torch imports)
    phase_timeout: float = 90.0  # join answer, steady start, stop
    fsync: bool = True  # etcd fsyncs its WAL (as `pipetransformer run`'s embedded etcd)
    store: str = "sqlite"  # or "postgresql" (a throwaway server from tests/fixtures_postgres)
    # rendezvous keep_alive_interval; None: the project's for N nodes (orchestrator.launch)
    heartbeat_s: int | None = None
    # a rendezvous that fails: measure the steady state anyway, ranks handed out by the benchmark
    # (no torchrun heartbeats or monitor polls then), so the controller's side is still seen
    steady_without_rendezvous: bool = True
    # after the steady window, one agent is lost (its heartbeats stop) and the others meet again
    # without it (torchrun --nnodes N-1:N, so the round can complete with one node less)
    rejoin: bool = True
    rejoin_timeout: int = 120  # the survivors' next_rendezvous() (s)

    def hosts_for(self, n: int) -> int:
        """Host processes for `n` participants: as set, else one per `NODES_PER_HOST` (at
        least 4), capped at `n`. At 1,024 in 4 processes (256 nodes' threads behind each GIL),
        a host's threads went up to 18 s unscheduled: longer than a lease, so a live node
        was taken for dead; a real node is a process of its own."""
        k = self.hosts if self.hosts is not None else max(4, -(-n // NODES_PER_HOST))
        return max(1, min(k, n))

    def heartbeat(self, n: int) -> int:
        """The keep-alive interval of a job of `n` agents: as set, or as the project runs it."""
        return self.heartbeat_s if self.heartbeat_s is not None else heartbeat_s(n)

    def min_nodes(self, n: int) -> int:
        return n - 1 if self.rejoin and n > 2 else n


def job_spec(world: int, lease_ttl_s: int) -> JobSpec:
    """A small job whose re-formed layout is 2 pipeline ranks x world/2 replicas."""
    return JobSpec.model_validate(
        {
            "name": "cps",
            "model": {"depth": 4, "dim": 32, "heads": 4},
            "training": {"epochs": 1, "global_batch_size": 16 * max(world, 2)},
            "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
            "runtime": {"lease_ttl_s": lease_ttl_s},
        }
    )


class PhaseFailed(RuntimeError):
    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"{phase}: {message}")
        self.phase = phase
