"""The etcd keyspace. One place builds every key so the controller and workers agree.

/pipetransformer/jobs/<job>/spec             JobSpec JSON (controller writes)
/pipetransformer/jobs/<job>/layout           current Layout JSON (controller writes)
/pipetransformer/jobs/<job>/assignment       Assignment: generation, layout, checkpoint dir, start state
/pipetransformer/jobs/<job>/launch           {"rdzv_id"}: the rendezvous the job's torchrun agents meet at
/pipetransformer/jobs/<job>/join             JoinRequest of a new rendezvous round (its rank 0 writes)
/pipetransformer/jobs/<job>/abort            generation number the controller aborted (workers watch)
/pipetransformer/jobs/<job>/controller       {"host", "pid"} of the live controller, on its lease
/pipetransformer/jobs/<job>/control          "run" | "stop", read by rank 0 at control points
/pipetransformer/jobs/<job>/events/<g>-<r>-<n> WorkerEvent JSON queue (workers put, controller drains)
/pipetransformer/jobs/<job>/workers/<rank>   {"generation", "pid", "host"}, on the worker's lease
/pipetransformer/jobs/<job>/agents/<host>-<pid> a `workers` launcher (torchx trainer role), on its lease
/pipetransformer/jobs/<job>/exits/<host>-<pid> WorkerExit JSON: how a worker process ended (its fork
                                             server reports; the controller drains)
/pipetransformer/jobs/<job>/alerts/<host>-<pid> RendezvousRefused JSON: a torchrun agent refused a
                                             rendezvous state that did not verify (controller drains)
/pipetransformer/requests/<job>/freeze_override  pending manual freeze request {"id", "layers", ...}
/pipetransformer/requests/<job>/trace_request    pending TraceRequest (rank 0 marks it served)
/pipetransformer/rdzv/<run_id>               torchrun rendezvous state (etcd3 backend)

The requests people file (the CLI, the dashboard) live under their own prefix, apart from the
job's keys: etcd grants permissions by key range, and this is what lets one etcd role write the
requests of every job and nothing else (orchestrator/etcd_auth.py).

What each key holds is typed in `core.protocol`. The one name outside etcd both sides
agree on, the environment variable a fork server sets, is here too (the fork-server client
imports this module and nothing heavier).
"""

from __future__ import annotations

ROOT = "/pipetransformer"
# The three subtrees, each a prefix an etcd role is granted (orchestrator/etcd_auth.py)
JOBS = f"{ROOT}/jobs/"
REQUESTS = f"{ROOT}/requests/"
RDZV = f"{ROOT}/rdzv/"

# Set by a node's fork server in every worker it forks: the pid of the worker's torchrun agent,
# which names the worker's node ("host:agent-pid"; host names alone repeat on one machine).
AGENT_PID_ENV = "PIPETRANSFORMER_AGENT_PID"
# A controller pod's job spec as YAML text (the submitting machine's files are not in the pod):
# set by the torchx component in container mode, read by `pipetransformer controller` without SPEC.
SPEC_ENV = "PIPETRANSFORMER_SPEC"
# Where AutoCache keeps its memory-mapped files: a node-local directory (an emptyDir on
# Kubernetes). Files shared across nodes over a network file system are not coherent, so on a
# cluster it must not be the shared checkpoint volume, which is the default (one machine).
ACTIVATION_CACHE_ENV = "PIPETRANSFORMER_ACTIVATION_CACHE"
# bytes the AutoCache files of one node may take (a pod's cache volume has a size limit, past
# which the kubelet evicts the pod); unset: no cap
ACTIVATION_CACHE_BYTES_ENV = "PIPETRANSFORMER_ACTIVATION_CACHE_BYTES"
# The job's rendezvous secret, which keys the HMAC over the torchrun rendezvous state (a pickle):
# its value (from a Kubernetes Secret), or a file holding it (a local run makes one per job).
RDZV_SECRET_ENV = "PIPETRANSFORMER_RDZV_SECRET"
RDZV_SECRET_FILE_ENV = "PIPETRANSFORMER_RDZV_SECRET_FILE"


def job(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def spec(job_id: str) -> str:
    return f"{job(job_id)}/spec"


def layout(job_id: str) -> str:
    return f"{job(job_id)}/layout"


def assignment(job_id: str) -> str:
    return f"{job(job_id)}/assignment"


def launch(job_id: str) -> str:
    return f"{job(job_id)}/launch"


def join(job_id: str) -> str:
    return f"{job(job_id)}/join"


def abort(job_id: str) -> str:
    return f"{job(job_id)}/abort"


def controller(job_id: str) -> str:
    return f"{job(job_id)}/controller"


def control(job_id: str) -> str:
    return f"{job(job_id)}/control"


def requests(job_id: str) -> str:
    """The requests people file for a job (a prefix: the dashboard's role may write them)."""
    return f"{REQUESTS}{job_id}/"


def freeze_override(job_id: str) -> str:
    return f"{requests(job_id)}freeze_override"


def trace_request(job_id: str) -> str:
    """A `TraceRequest`: capture one step's schedule on every rank (read at control points)."""
    return f"{requests(job_id)}trace_request"


def events(job_id: str) -> str:
    return f"{job(job_id)}/events/"


def event(job_id: str, generation: int, rank: int, seq: int) -> str:
    # zero-padded so a sorted prefix read returns each rank's events in order
    return f"{events(job_id)}{generation:05d}-{rank:05d}-{seq:09d}"


def workers(job_id: str) -> str:
    return f"{job(job_id)}/workers/"


def worker(job_id: str, rank: int) -> str:
    return f"{workers(job_id)}{rank:05d}"


def exits(job_id: str) -> str:
    return f"{job(job_id)}/exits/"


def exit_report(job_id: str, host: str, pid: int) -> str:
    return f"{exits(job_id)}{host}-{pid}"


def alerts(job_id: str) -> str:
    return f"{job(job_id)}/alerts/"


def alert(job_id: str, host: str, pid: int) -> str:
    return f"{alerts(job_id)}{host}-{pid}"


def refusals(job_id: str) -> str:
    """Trainer pods that cannot run the job where they landed (`protocol.TrainerRefused`)."""
    return f"{job(job_id)}/refusals/"


def refusal(job_id: str, host: str, pid: int) -> str:
    return f"{refusals(job_id)}{host}-{pid}"


def agents(job_id: str) -> str:
    return f"{job(job_id)}/agents/"


def rendezvous(run_id: str) -> str:
    return f"{RDZV}{run_id}"
