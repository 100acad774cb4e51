"""Who may write the job's keys: etcd's users and roles for each of our roles, as code.

etcd with auth enabled checks every request against the roles of the user making it: the user
named by the client certificate's CN (etcd started with ``--client-cert-auth``), or a user and
password (a token; it wins over the certificate). A role is a list of key ranges, each readable
or read-writable. These are the identities, derived from the keyspace of ``core/keys.py``:

``root``
    etcd's administrator, which etcd requires before it enables auth. Certificate CN ``root``,
    used by ``pipetransformer etcd-auth setup`` only; its password is random and thrown away.
``pipetransformer-controller`` (role ``root``)
    every job's controller: it writes its job's keys (spec, layout, assignment, launch, abort,
    control, its lease), retires requests, drains and deletes the trainers' reports and ends
    rendezvous, and it **creates its job's trainer user** when it starts. etcd lets only the
    ``root`` role manage users and roles, so the controller has it: it is the one role that
    runs nothing but this project's code (no model code, no web server) and decides everything
    about a job anyway.
``pipetransformer-dashboard`` (role of the same name)
    reads ``/pipetransformer/jobs/`` and writes only ``/pipetransformer/requests/``: freeze and
    trace requests, which the controller audits and the ranks validate. People's
    ``pipetransformer freeze``/``trace`` use the same certificate.
``trainer-<job>`` (role of the same name, one per job), password only
    a job's trainer pods (``pipetransformer workers``, torchrun's agents and the rendezvous,
    the fork server, the workers): they read their job's keys and requests and write only what
    trainers write (`TRAINER_WRITES`: events, workers, exits, alerts, refusals, agents, the join
    request, the trace request they mark served) and their launch's rendezvous
    (``/pipetransformer/rdzv/<run>/``, granted per run). Their certificate (CN
    ``pipetransformer-trainer``, no user of that name: it grants nothing) only gets them through
    ``--client-cert-auth``.

Why per-job users for the trainers, and why the requests moved. etcd permissions are key ranges,
and "the workers/ key of every job" is no range. The dashboard's case had a cheap answer: the
requests people file now live under a prefix of their own, ``/pipetransformer/requests/<job>/``
(``core/keys.py`` builds them as before; no caller changed), so one static role covers them for
every job. The trainers' cannot: a trainer of one job must not write another's reports or
rendezvous, and trainers of all jobs hold the same pod Secrets, so no shared certificate can
tell them apart. What does tell them apart is their pod specification: a random password per
launch, in a Secret of that launch's own (``<Volcano Job>-etcd-trainer``, made at submission
and owned by the Volcano Job: orchestrator/volcano.py; never a value in the Job), which the
launch's pods alone reference: the trainers (``PIPETRANSFORMER_ETCD_USER``
``=trainer-<job>``, ``PIPETRANSFORMER_ETCD_PASSWORD``) and the controller
(``PIPETRANSFORMER_ETCD_TRAINER_PASSWORD``), which creates the user and its role before it
publishes the launch (`admit_trainers_from_env`); until then the trainers' clients wait for the
user as they wait for an outage. (Deriving it from the rendezvous secret would not do: that
Secret is usually one per namespace; so would one password Secret for every job.) A finished
job's user can still write that job's keys only; ``etcdctl user delete trainer-<job> &&
etcdctl role delete trainer-<job>`` removes it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from pyetcd.etcdrpc import auth_pb2, rpc_pb2
from pyetcd.utils import prefix_range_end

from pipetransformer.core import keys
from pipetransformer.edge.etcd_client import EtcdClient, EtcdError, EtcdPermissionDenied
from pipetransformer.orchestrator.errors import UsageError

__all__ = [
    "CONTROLLER_USER",
    "DASHBOARD_ROLE",
    "DASHBOARD_USER",
    "ROOT_USER",
    "TRAINER_CERT_CN",
    "TRAINER_PASSWORD_ENV",
    "TRAINER_WRITES",
    "Permission",
    "add_arguments",
    "admit_trainers",
    "admit_trainers_from_env",
    "cmd_etcd_auth",
    "dashboard_permissions",
    "ensure_role",
    "ensure_user",
    "plan_lines",
    "setup",
    "trainer_permissions",
    "trainer_user",
]

ROOT_USER = ROOT_ROLE = "root"  # etcd's own names: auth cannot be enabled without them
CONTROLLER_USER = "pipetransformer-controller"
DASHBOARD_USER = DASHBOARD_ROLE = "pipetransformer-dashboard"
# The trainer pods' certificate: no user has this name, so it passes the TLS handshake and
# grants nothing; their identity is their job's user (scripts/make-etcd-certs.sh makes it).
TRAINER_CERT_CN = "pipetransformer-trainer"
# The controller pod's copy of the password its job's trainers authenticate with.
TRAINER_PASSWORD_ENV = "PIPETRANSFORMER_ETCD_TRAINER_PASSWORD"

# The keys of a job its trainer processes write: trainer/process.py (events, worker presence,
# join), trainer/failures.py (exits), orchestrator/rendezvous/ (alerts), orchestrator/roles.py
# (agents, refusals), trainer/trainer.py (the trace request, marked served). Everything else of
# the job they only read. tests/test_etcd_auth.py checks every key of core/keys.py is placed.
TRAINER_WRITES: tuple[Callable[[str], str], ...] = (
    keys.events,
    keys.workers,
    keys.exits,
    keys.alerts,
    keys.refusals,
    keys.agents,
    keys.join,
    keys.trace_request,
)


def trainer_user(job_id: str) -> str:
    """The etcd user (and role) of a job's trainers."""
    return f"trainer-{job_id}"


@dataclass(frozen=True, order=True)
class Permission:
    """One key range of a role: ``[key, range_end)``, or the key alone when range_end is ""."""

    key: str
    range_end: str = ""
    write: bool = False

    @classmethod
    def prefix(cls, prefix: str, write: bool = False) -> Permission:
        return cls(prefix, prefix_range_end(prefix.encode()).decode(), write)

    def covers(self, key: str) -> bool:
        if not self.range_end:
            return key == self.key
        return self.key <= key < self.range_end

    def to_proto(self) -> auth_pb2.Permission:
        kind = auth_pb2.Permission.READWRITE if self.write else auth_pb2.Permission.READ
        return auth_pb2.Permission(
            permType=kind, key=self.key.encode(), range_end=self.range_end.encode()
        )

    @classmethod
    def from_proto(cls, perm: auth_pb2.Permission) -> Permission:
        write = perm.permType in (auth_pb2.Permission.WRITE, auth_pb2.Permission.READWRITE)
        return cls(perm.key.decode(), perm.range_end.decode(), write)

    def __str__(self) -> str:
        where = f"{self.key}*" if self.range_end else self.key
        return f"{'readwrite' if self.write else 'read'} {where}"


def _key_permission(key: str, write: bool) -> Permission:
    # a key builder that ends in "/" names a prefix (a queue, a set of leases)
    return Permission.prefix(key, write) if key.endswith("/") else Permission(key, "", write)


def dashboard_permissions() -> tuple[Permission, ...]:
    """Read every job's keys; write the requests of any job and nothing else."""
    return (Permission.prefix(keys.JOBS), Permission.prefix(keys.REQUESTS, write=True))


def trainer_permissions(job_id: str, run_ids: Iterable[str] = ()) -> tuple[Permission, ...]:
    """A job's trainers: read the job's keys and requests, write `TRAINER_WRITES` and the
    rendezvous of each of `run_ids` (the launches' rdzv ids)."""
    reads = (Permission.prefix(keys.job(job_id) + "/"), Permission.prefix(keys.requests(job_id)))
    writes = tuple(_key_permission(build(job_id), write=True) for build in TRAINER_WRITES)
    runs = tuple(
        Permission.prefix(keys.rendezvous(run_id) + "/", write=True)
        for run_id in sorted(set(run_ids))
    )
    return reads + writes + runs


# -- applying them ---------------------------------------------------------------------------


def _status(exc: EtcdError) -> tuple[grpc.StatusCode | None, str]:
    cause = exc.__cause__
    if isinstance(cause, grpc.RpcError) and hasattr(cause, "code"):
        return cause.code(), cause.details() or ""
    return None, str(exc)


def _missing(exc: EtcdError) -> bool:
    code, details = _status(exc)
    return code == grpc.StatusCode.FAILED_PRECONDITION and "not found" in details


def _exists(exc: EtcdError) -> bool:
    code, details = _status(exc)
    return code == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in details


def _role_permissions(admin: EtcdClient, role: str) -> set[Permission] | None:
    try:
        reply = admin.auth_rpc("RoleGet", rpc_pb2.AuthRoleGetRequest(role=role))
    except EtcdError as exc:
        if _missing(exc):
            return None
        raise
    return {Permission.from_proto(p) for p in reply.perm}


def ensure_role(admin: EtcdClient, role: str, permissions: Iterable[Permission]) -> list[str]:
    """Create `role` if missing and grant what it lacks of `permissions` (nothing it has is
    taken away: a trainer role keeps every run it was given). What was done, one line each."""
    done = []
    have = _role_permissions(admin, role)
    if have is None:
        try:
            admin.auth_rpc("RoleAdd", rpc_pb2.AuthRoleAddRequest(name=role))
            done.append(f"role {role}: created")
        except EtcdError as exc:  # made meanwhile by another controller: fine
            if not _exists(exc):
                raise
        have = set()
    for perm in sorted(set(permissions) - have):
        admin.auth_rpc(
            "RoleGrantPermission",
            rpc_pb2.AuthRoleGrantPermissionRequest(name=role, perm=perm.to_proto()),
        )
        done.append(f"role {role}: {perm}")
    return done


def _password_works(admin: EtcdClient, user: str, password: str) -> bool:
    request = rpc_pb2.AuthenticateRequest(name=user, password=password)
    try:
        admin.auth_rpc("Authenticate", request)
    except EtcdError as exc:
        code, _ = _status(exc)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return False  # a wrong password; or auth not enabled yet: cannot tell, so set it
        raise
    return True


def ensure_user(
    admin: EtcdClient, user: str, roles: Sequence[str], password: str | None = None
) -> list[str]:
    """Create `user` if missing, with `password` (None: a random one nobody keeps: the user
    signs in with a certificate), set `password` on an existing user whose password differs,
    and grant the `roles` it lacks. What was done, one line each."""
    done = []
    try:
        reply = admin.auth_rpc("UserGet", rpc_pb2.AuthUserGetRequest(name=user))
        has = set(reply.roles)
    except EtcdError as exc:
        if not _missing(exc):
            raise
        secret = password if password is not None else secrets.token_urlsafe(32)
        try:
            admin.auth_rpc("UserAdd", rpc_pb2.AuthUserAddRequest(name=user, password=secret))
            done.append(f"user {user}: created")
        except EtcdError as exc2:
            if not _exists(exc2):
                raise
        has = set()
    else:
        if password is not None and not _password_works(admin, user, password):
            admin.auth_rpc(
                "UserChangePassword",
                rpc_pb2.AuthUserChangePasswordRequest(name=user, password=password),
            )
            done.append(f"user {user}: password set")
    for role in roles:
        if role not in has:
            admin.auth_rpc("UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role))
            done.append(f"user {user}: granted role {role}")
    return done


def setup(admin: EtcdClient) -> list[str]:
    """The static users and roles, then auth enabled; idempotent. `admin` is root (the
    certificate with CN root) or, on an etcd without auth yet, anyone. What was done, one line
    each."""
    try:
        done = ensure_role(admin, DASHBOARD_ROLE, dashboard_permissions())
        done += ensure_user(admin, ROOT_USER, [ROOT_ROLE])
        done += ensure_user(admin, CONTROLLER_USER, [ROOT_ROLE])
        done += ensure_user(admin, DASHBOARD_USER, [DASHBOARD_ROLE])
        admin.auth_rpc("AuthEnable", rpc_pb2.AuthEnableRequest())  # a no-op when enabled
        # what only root may do: proves the identity that ran this can run it again
        admin.auth_rpc("UserGet", rpc_pb2.AuthUserGetRequest(name=ROOT_USER))
    except EtcdPermissionDenied:
        raise UsageError(
            f"etcd auth is enabled, and {admin.identity} is not root there: run setup with "
            f"the certificate whose CN is {ROOT_USER} (Secret etcd-client-root)"
        ) from None
    return done + ["auth: enabled"]


def admit_trainers(
    admin: EtcdClient, job_id: str, password: str, run_ids: Iterable[str]
) -> list[str]:
    """Job `job_id`'s trainer user and role (`trainer_permissions`), with `password` and the
    rendezvous of `run_ids`; idempotent. What was done, one line each."""
    if not password:
        raise UsageError(f"${TRAINER_PASSWORD_ENV} is empty: give the trainers' etcd password")
    user = trainer_user(job_id)
    done = ensure_role(admin, user, trainer_permissions(job_id, run_ids))
    return done + ensure_user(admin, user, [user], password=password)


def admit_trainers_from_env(
    admin: EtcdClient, job_id: str, rdzv_id: str, environ: Mapping[str, str] | None = None
) -> list[str]:
    """For `pipetransformer controller`: with `$PIPETRANSFORMER_ETCD_TRAINER_PASSWORD` set
    (an etcd with TLS and auth), the job's trainer user, allowed the rendezvous `rdzv_id` and
    the one its published launch names (a controller taking a launch over); else nothing.
    A controller whose identity may not manage users is a UsageError saying what it needs."""
    password = (os.environ if environ is None else environ).get(TRAINER_PASSWORD_ENV)
    if password is None:
        return []
    runs = {rdzv_id}
    if raw := admin.get(keys.launch(job_id)):
        try:
            runs.add(str(json.loads(raw)["rdzv_id"]))
        except (ValueError, KeyError, TypeError):
            pass  # not ours to judge here: the controller reads the launch itself
    try:
        return admit_trainers(admin, job_id, password, runs)
    except EtcdPermissionDenied as exc:
        raise UsageError(
            f"cannot create job {job_id}'s trainer user in etcd: {exc}. The controller needs "
            f"the etcd role {ROOT_ROLE} (certificate CN {CONTROLLER_USER}, Secret "
            "etcd-client-controller, after `pipetransformer etcd-auth setup`)"
        ) from None


# -- `pipetransformer etcd-auth` ----------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["setup", "plan"],
        help="setup: create the users and roles, enable auth (idempotent; run it with the "
        "certificate whose CN is root); plan: print them, contact nothing",
    )
    p.add_argument(
        "--etcd", help="HOST:PORT of etcd (setup); TLS settings from $PIPETRANSFORMER_ETCD_*"
    )


def plan_lines() -> list[str]:
    """The identities and their permissions, as `setup` and the controllers make them."""
    job, run = "<job>", "<job>-<run>"
    trainer = trainer_permissions(job, [run])
    return [
        f"user {ROOT_USER}: role {ROOT_ROLE} (certificate CN {ROOT_USER}; etcd-auth setup)",
        f"user {CONTROLLER_USER}: role {ROOT_ROLE} (creates each job's trainer user)",
        f"user {DASHBOARD_USER}: role {DASHBOARD_ROLE}: "
        + ", ".join(map(str, dashboard_permissions())),
        f"user {trainer_user(job)} (password; made by the job's controller): role "
        f"{trainer_user(job)}: " + ", ".join(map(str, trainer)),
    ]


def cmd_etcd_auth(args: argparse.Namespace) -> int:
    if args.action == "plan":
        print("\n".join(plan_lines()))
        return 0
    if not args.etcd:
        raise UsageError("--etcd HOST:PORT: setup needs the etcd to set up")
    try:
        with EtcdClient(args.etcd, retry_timeout=30) as admin:
            admin.wait_ready(30)
            done = setup(admin)
    except (EtcdError, ValueError) as exc:
        raise UsageError(f"--etcd {args.etcd}: {exc}") from None
    print("\n".join(done))
    return 0
