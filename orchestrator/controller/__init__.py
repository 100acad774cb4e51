"""The job controller: the single writer of the SQL store for a job.

It publishes what the workers need in etcd, answers each rendezvous round's join request with a
generation (a layout planned for the workers that joined, and the last committed checkpoint to
resume from), drains the events workers put in etcd into the store, commits checkpoints only after
verifying them on disk, applies retention, watches the workers' leases and aborts a generation
that lost one, and turns the end of the job into a job state. It holds a lease on the job's
controller key, so two controllers never drive the same job; a restarted controller picks up the
running generation from etcd and the store (`attach`).

Its life is `Controller.run`: acquire the lease, attach or publish, launch, supervise, finish,
release; callers say how the workers are launched (`Workers`), never in which order these go.

One concern a module, each a part of `Controller` over the state they share (`base.py`):

- `lifecycle.py`: `Controller`: `create` (a job recorded from its spec, resolved once), `run`
  and its steps (`acquire`, `publish`, `supervise` and its `tick`, `finish`, `release`)
- `joins.py`: join requests answered with generations, leases watched, aborts, post-mortems
  followed up, a fatal start
- `reports.py`: the workers' reports drained from etcd into the store and applied
- `freeze_requests.py`: manual freeze requests audited, their fate recorded, retired
- `checkpoints.py`: checkpoints committed once verified, retention, the resume point
- `job.py`: job ids, the holder of a job, its directory, `Submission`, `Progress`,
  `ResumePoint`, `Workers`
"""

from pipetransformer.orchestrator.controller.job import (
    ControllerError,
    HandedOver,
    Progress,
    ResumePoint,
    Submission,
    Workers,
    check_job_id,
    controller_holder,
    job_dir,
    new_job_id,
    submit,
)
from pipetransformer.orchestrator.controller.lifecycle import Controller

__all__ = [
    "Controller",
    "ControllerError",
    "HandedOver",
    "Progress",
    "ResumePoint",
    "Submission",
    "Workers",
    "check_job_id",
    "controller_holder",
    "job_dir",
    "new_job_id",
    "submit",
]
