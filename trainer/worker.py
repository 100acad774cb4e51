"""The trainer process: one per accelerator, started by torchrun (`-m pipetransformer.trainer.worker`) or forked by
its node's fork server (which calls `main` and, when the process ends, `on_worker_exit`).

It reads its job from etcd (spec, then the assignment answering its rendezvous round's join
request), holds a lease, trains (`trainer.trainer.Trainer`), and reports through etcd; the
controller is the only writer of the SQL store. How the process leaves: done (0), asked to leave
or aborted (EXIT_REFORM, its agent restarts it into the next round), or failed (its exception,
reported first as `failed`, or as `peer_lost` when a peer's death broke a collective).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist

from pipetransformer.core.protocol import (
    EXIT_REFORM,
    Aborted,
    Failed,
    Finished,
    Left,
    PeerLost,
    Phase,
    RunOutcome,
)
from pipetransformer.edge import proctitle
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.trainer.device import Compute, worker_device
from pipetransformer.trainer.failures import is_peer_loss, own_failure
from pipetransformer.trainer.failures import report_exit as on_worker_exit  # noqa: F401 (fork-server hook)
from pipetransformer.trainer.process import (
    AbortWatch,
    LeaveRequest,
    Reporter,
    hold,
    hold_presence,
    join,
    read_spec,
)
from pipetransformer.trainer.trainer import Context, Trainer, startup_layout

log = logging.getLogger("pipetransformer.worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipetransformer.trainer.worker", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--etcd", required=True, help="etcd endpoint HOST:PORT")
    args = parser.parse_args(argv)
    # `ps` tells ranks and jobs apart (torchrun sets RANK; the generation once it is known)
    node = os.environ.get(proctitle.NODE_ENV)
    proctitle.set_title("worker", job=args.job_id, rank=os.environ.get("RANK"), node=node)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {os.environ.get('RANK', '?')}] %(message)s"
    )
    leave = LeaveRequest().install()
    etcd = EtcdClient(args.etcd)
    spec = read_spec(etcd, args.job_id)
    torch.set_num_threads(spec.runtime.threads_per_worker)
    # the device first: NCCL's communicators bind to the current device when they are created
    device = worker_device(spec)
    # the control group: every rank, for the job's whole life, gloo on CPU tensors whatever the
    # device, so that destroying or aborting a layout's NCCL groups never touches it
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assignment = join(etcd, args.job_id, rank, world)
    if assignment.fatal:  # the job failed for good: exit 0 so that the agents stop restarting
        log.error("job %s failed: %s; not starting again", args.job_id, assignment.fatal)
        dist.destroy_process_group()
        return 0
    generation = assignment.generation
    proctitle.set_title("worker", job=args.job_id, rank=rank, gen=generation, node=node)
    reporter = Reporter(etcd, args.job_id, generation, rank)
    keepalive = hold_presence(etcd, args.job_id, rank, generation, spec.runtime.lease_ttl_s)
    aborted = "the controller aborted the generation"
    watch = AbortWatch(
        etcd, args.job_id, generation, before_exit=lambda: reporter.last_word(Aborted, why=aborted)
    ).start()
    leave.before_exit = lambda: reporter.last_word(
        Left, why=f"SIGTERM; the graceful leave did not finish within {leave.grace_s:g}s"
    )
    code, phase = 0, Phase.BUILD  # build: everything before the first step
    try:
        if assignment.layout is None:
            return hold(assignment, leave)
        compute = Compute.for_spec(spec, device)
        ctx = Context(args.job_id, spec, assignment, rank, world, etcd, reporter, compute)
        trainer = Trainer(ctx, startup_layout(ctx, assignment.layout), leave)
        phase = Phase.TRAIN
        outcome = trainer.run()
        if outcome == RunOutcome.LEAVE:
            code = EXIT_REFORM
        else:
            dist.barrier()
            if rank == 0:
                kind = "stopped" if outcome == RunOutcome.STOPPED else "done"
                reporter.emit(Finished, kind=kind, outcome=outcome)
        dist.barrier()  # every final report is queued before any lease is revoked
    except Exception as exc:
        error, repeats = own_failure(exc)
        if not is_peer_loss(exc):
            reporter.emit(Failed, error=error, phase=phase, repeats=repeats)
            if repeats:  # said in full once, without the traceback a restart would repeat
                log.error("rank %d: %s (a restart would fail the same way)", rank, error)
                return 1
            raise
        # not this rank's fault: say so, and leave to re-form without a traceback
        log.warning("rank %d lost a peer (%s); leaving to re-form", rank, error)
        reporter.emit(PeerLost, error=error, phase=phase)
        code = EXIT_REFORM
    finally:
        watch.stop()
        keepalive.stop(revoke=True)
        dist.destroy_process_group()
        # the process ends with this function: the interpreter's last collection over torch's
        # objects would hold the exit (and the agent waiting for it) a second for nothing
        gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
