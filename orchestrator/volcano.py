"""What Volcano does when a pod of the job ends: lifecycle policies per role, and torchx's
Kubernetes scheduler taught to write them.

torchx's Kubernetes scheduler gives a role's Volcano tasks the policies of its `RetryPolicy`:
REPLICA gives none, so a Failed or Evicted pod is never replaced (Volcano recreates deleted pods
only); APPLICATION restarts the whole job on any pod's failure, which throws away what elastic
training keeps. A pipetransformer job wants neither. Its pods run with `restartPolicy: Never`
(a failed container is a Failed pod that Volcano sees, not a restart inside the pod that nobody
counts), and each role declares its own policies (`role_policies`, carried in the role's
metadata under `VOLCANO_METADATA`):

- **controller**: its exit status says whether a restart can help (orchestrator/exits.py).
  Completed (0) completes the Volcano job; stopped by a user (130) aborts it, and a failure a
  restart cannot fix (2, 3) terminates it: every pod is stopped and its GPUs released, and
  `torchx status` reads CANCELLED or FAILED. Any other failure (a crash, an OOM kill, a
  handover on SIGTERM) or an eviction restarts the controller's task: the new controller takes
  the job over from the store and etcd while the trainers train on.
- **trainer**: a failed or evicted trainer pod is replaced (RestartTask) and its new pod rejoins
  the job through the rendezvous; the survivors re-form without it meanwhile.

Restarts are bounded: the Volcano job's `maxRetry` (the roles' `max_retries`) counts the
restarts Volcano makes and fails the job past it, and the controller keeps its own count of
unclean restarts in the store (`cli.cmd_controller`), so a crash loop ends with its reason
recorded even where Volcano counts differently.

Secrets as environment. A role's `env` holds plain values only, which the Volcano Job shows to
anyone who reads it (and `--dryrun` prints). A role declares the variables its pods read from a
Secret instead (`secret_env_metadata`, under `SECRET_ENV_METADATA`: the trainers' etcd password
and the controller's copy of it, orchestrator/etcd_auth.py), and the scheduler writes them as
`valueFrom.secretKeyRef` (`apply_secret_env`). A Secret whose name holds torchx's `${app_id}`
belongs to one launch: the Job names it (annotation `LAUNCH_SECRETS_ANNOTATION`), and `schedule`
creates it with a random value per key before the Job (`launch_secrets`), then makes the Job
its owner, so that Kubernetes deletes it with the Job. No value exists before submission:
`--dryrun` has none to show.

`VolcanoKubernetesScheduler` is torchx's scheduler plus three things: it writes each task's
declared policies and `maxRetry` and its Secret variables, creates the launch's Secrets, and
`describe` adds the controller pod's termination message (the job's last words) to
`torchx status`. It is registered as torchx's `kubernetes` scheduler
(torchx_plugins/schedulers/pipetransformer_kubernetes.py: a plugin wins a name clash), so
`torchx run -s kubernetes` writes the policies; a role without declared policies gets exactly
what torchx's own scheduler gives it.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torchx.specs import macros

from pipetransformer.orchestrator.exits import EXIT_JOB_FAILED, EXIT_STOPPED, EXIT_USAGE
from pipetransformer.orchestrator.pods import POD_LABELS

VOLCANO_METADATA = "pipetransformer/volcano"  # a role's metadata key: {"policies": [...]}
# a role's metadata key: {VARIABLE: {"name": SECRET, "key": KEY}} (module docstring)
SECRET_ENV_METADATA = "pipetransformer/secret-env"
# on the Volcano Job: the Secrets made for this launch, comma-separated (module docstring)
LAUNCH_SECRETS_ANNOTATION = "pipetransformer/launch-secrets"
LAUNCH_SECRET_BYTES = 32  # each value: 64 hex characters
JOB_API_VERSION = "batch.volcano.sh/v1alpha1"

# Volcano's events and actions (batch.volcano.sh/v1alpha1 LifecyclePolicy; bus/v1alpha1)
POD_FAILED, POD_EVICTED, TASK_COMPLETED = "PodFailed", "PodEvicted", "TaskCompleted"
RESTART_TASK, COMPLETE_JOB = "RestartTask", "CompleteJob"
ABORT_JOB, TERMINATE_JOB = "AbortJob", "TerminateJob"

Policy = Mapping[str, Any]


def controller_policies() -> list[dict[str, Any]]:
    """The controller task's policies: its exit status decides (see the module docstring).
    Volcano matches a failed pod's exit code before its event."""
    return [
        {"event": TASK_COMPLETED, "action": COMPLETE_JOB},
        {"exitCode": EXIT_STOPPED, "action": ABORT_JOB},
        {"exitCode": EXIT_USAGE, "action": TERMINATE_JOB},
        {"exitCode": EXIT_JOB_FAILED, "action": TERMINATE_JOB},
        {"events": [POD_FAILED, POD_EVICTED], "action": RESTART_TASK},
    ]


def trainer_policies() -> list[dict[str, Any]]:
    """A trainer task's policies: a failed or evicted pod is replaced; it rejoins the job."""
    return [{"events": [POD_FAILED, POD_EVICTED], "action": RESTART_TASK}]


def role_metadata(policies: Sequence[Policy]) -> dict[str, Any]:
    return {VOLCANO_METADATA: {"policies": [dict(p) for p in policies]}}


def _task_role(task: Mapping[str, Any]) -> str:
    labels = task["template"].metadata.labels or {}
    return labels.get("torchx.pytorch.org/role-name", "")


def apply_policies(resource: dict[str, Any], roles: Sequence[Any]) -> dict[str, Any]:
    """Write each role's declared policies (and its `max_retries` as `maxRetry`) into its tasks
    of the Volcano job `resource` (what torchx's `app_to_resource` made); roles that declare
    none keep torchx's. Returns `resource`, changed in place."""
    declared = {
        r.name: r.metadata[VOLCANO_METADATA]["policies"]
        for r in roles
        if VOLCANO_METADATA in (r.metadata or {})
    }
    retries = {r.name: r.max_retries for r in roles}
    for task in resource["spec"]["tasks"]:
        role = _task_role(task)
        if role in declared:
            task["policies"] = [dict(p) for p in declared[role]]
            task["maxRetry"] = retries[role]
    return resource


def secret_env_metadata(env: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """A role's metadata declaring `env`: variable -> (Secret name, key). A name holding
    torchx's `${app_id}` (`macros.app_id`) is a Secret made for each launch."""
    return {SECRET_ENV_METADATA: {var: {"name": n, "key": k} for var, (n, k) in env.items()}}


def secret_env(role: Any, app_id: str) -> dict[str, dict[str, str]]:
    """The variables `role` reads from Secrets, {variable: {"name": Secret, "key": key}}, as
    launch `app_id` (the Volcano Job's name) has them: `${app_id}` filled in."""
    declared = (role.metadata or {}).get(SECRET_ENV_METADATA, {})
    return {
        var: {"name": ref["name"].replace(macros.app_id, app_id), "key": ref["key"]}
        for var, ref in declared.items()
    }


def apply_secret_env(resource: dict[str, Any], roles: Sequence[Any]) -> dict[str, Any]:
    """Write each role's Secret variables (`secret_env`) into its tasks' containers of the
    Volcano job `resource` (what torchx's `app_to_resource` made: a variable of the same name
    is replaced), and name the Secrets made for this launch on the Job
    (`LAUNCH_SECRETS_ANNOTATION`). Returns `resource`, changed in place."""
    from kubernetes.client import V1EnvVar, V1EnvVarSource, V1SecretKeySelector

    app_id = resource["metadata"]["name"]
    by_name = {r.name: r for r in roles}
    per_launch: set[str] = set()
    for task in resource["spec"]["tasks"]:
        role = by_name.get(_task_role(task))
        if role is None:
            continue
        env = secret_env(role, app_id)
        declared = role.metadata[SECRET_ENV_METADATA] if env else {}
        per_launch |= {
            env[var]["name"] for var, ref in declared.items() if macros.app_id in ref["name"]
        }
        for container in task["template"].spec.containers:
            kept = [e for e in container.env or [] if e.name not in env]
            container.env = kept + [
                V1EnvVar(
                    name=var,
                    value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(**ref)),
                )
                for var, ref in env.items()
            ]
    if per_launch:
        annotations = resource["metadata"].setdefault("annotations", {})
        annotations[LAUNCH_SECRETS_ANNOTATION] = ",".join(sorted(per_launch))
    return resource


def launch_secrets(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Secrets the Volcano Job `job` (plain data) names as made for its launch
    (`LAUNCH_SECRETS_ANNOTATION`), each with a fresh random value under every key its
    containers read; labelled with the job's name, and immutable (nothing rotates them: a new
    launch makes new ones)."""
    meta = job.get("metadata") or {}
    names = [
        n
        for n in (meta.get("annotations") or {}).get(LAUNCH_SECRETS_ANNOTATION, "").split(",")
        if n
    ]
    keys: dict[str, set[str]] = {n: set() for n in names}
    for task in job["spec"]["tasks"]:
        for container in task["template"]["spec"]["containers"]:
            for var in container.get("env") or []:
                ref = (var.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["name"] in keys:
                    keys[ref["name"]].add(ref["key"])
    labels = {**POD_LABELS, "app.kubernetes.io/instance": meta["name"]}
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": dict(labels)},
            "type": "Opaque",
            "immutable": True,
            "stringData": {k: secrets.token_hex(LAUNCH_SECRET_BYTES) for k in sorted(keys[name])},
        }
        for name in names
    ]


def owner_reference(job_name: str, uid: str) -> dict[str, str]:
    """What makes a Secret the Volcano Job's: Kubernetes' garbage collector deletes it with
    the Job."""
    return {"apiVersion": JOB_API_VERSION, "kind": "Job", "name": job_name, "uid": uid}


def termination_messages(pod: Any) -> list[str]:
    """The termination messages of a pod's terminated containers (a `V1Pod`), current or last."""
    found: list[str] = []
    for status in (pod.status and pod.status.container_statuses) or []:
        for state in (status.state, status.last_state):
            terminated = state and state.terminated
            if terminated and terminated.message:
                found.append(terminated.message.strip())
                break
    return found


def kubernetes_configured() -> bool:
    """Whether the `kubernetes` client finds a cluster to talk to: in a pod's service account,
    or in a kubeconfig (`KUBECONFIG`, ~/.kube/config)."""
    from kubernetes import client, config

    for load in (config.load_incluster_config, config.load_kube_config):
        try:
            load(client_configuration=client.Configuration())
            return True
        except (config.ConfigException, OSError):
            continue
    return False


def _validates(cfg: Any) -> bool:
    """torchx's `validate_spec` option (typed options, or a plain mapping of them)."""
    if dataclasses.is_dataclass(cfg):
        return bool(cfg.validate_spec)
    return bool(cfg.get("validate_spec", True))


def _without_validation(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, validate_spec=False)
    return {**cfg, "validate_spec": False}


def _namespace(cfg: Any) -> str:
    """torchx's `namespace` option (typed options, or a plain mapping of them)."""
    value = cfg.namespace if dataclasses.is_dataclass(cfg) else cfg.get("namespace")
    return value or "default"


def _scheduler_class() -> type:
    # torchx's Kubernetes scheduler imports the `kubernetes` client: only when it is asked for
    from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler

    class VolcanoKubernetesScheduler(KubernetesScheduler):
        """torchx's Kubernetes scheduler, writing the lifecycle policies a role declares and
        reporting the controller's last words in `describe` (see orchestrator/volcano.py)."""

        def _submit_dryrun(self, app: Any, cfg: Any) -> Any:
            if _validates(cfg) and self._client is None and not kubernetes_configured():
                # no cluster to ask: the Job is built and shown (`--dryrun` needs no cluster),
                # not validated by an API server (torchx would fail on the missing host)
                print(
                    "note: no Kubernetes configuration (no kubeconfig, not in a pod): the "
                    "Volcano Job is not validated by an API server",
                    file=sys.stderr,
                )
                cfg = _without_validation(cfg)
            info = super()._submit_dryrun(app, cfg)
            apply_policies(info.request.resource, app.roles)
            apply_secret_env(info.request.resource, app.roles)
            return info

        def schedule(self, dryrun_info: Any) -> Any:
            """The launch's Secrets first (its pods read them as they start), then the Job,
            then the Job made their owner. A Job that could not be created takes its Secrets
            back with it."""
            from kubernetes.client import ApiClient

            job = ApiClient().sanitize_for_serialization(dryrun_info.request.resource)
            made = launch_secrets(job)
            if not made:
                return super().schedule(dryrun_info)
            namespace = _namespace(dryrun_info.cfg)
            core = self._core_api()
            created: list[str] = []
            try:
                for secret in made:
                    core.create_namespaced_secret(namespace, secret)
                    created.append(secret["metadata"]["name"])
                app_id = super().schedule(dryrun_info)
            except BaseException:
                for name in created:
                    try:
                        core.delete_namespaced_secret(name, namespace)
                    except Exception:  # noqa: BLE001 (the submission's own error matters)
                        print(f"note: Secret {name} was left behind", file=sys.stderr)
                raise
            self._own(namespace, job["metadata"]["name"], created)
            return app_id

        def _core_api(self) -> Any:
            from kubernetes import client

            return client.CoreV1Api(self._api_client())

        def _own(self, namespace: str, job_name: str, names: list[str]) -> None:
            """Make the Volcano Job `job_name` the owner of the Secrets `names`; a failure is
            a note (the job runs; its Secrets would outlive it)."""
            try:
                job = self._custom_objects_api().get_namespaced_custom_object(
                    "batch.volcano.sh", "v1alpha1", namespace, "jobs", job_name
                )
                owner = owner_reference(job_name, job["metadata"]["uid"])
                core = self._core_api()
                for name in names:
                    core.patch_namespaced_secret(
                        name, namespace, {"metadata": {"ownerReferences": [owner]}}
                    )
            except Exception as exc:  # noqa: BLE001 (the job is submitted; say what is left)
                print(
                    f"note: Secret(s) {', '.join(names)} not owned by Volcano Job {job_name} "
                    f"({exc}): delete them once the job is gone (kubectl -n {namespace} "
                    f"delete secret {' '.join(names)})",
                    file=sys.stderr,
                )

        def describe(self, app_id: str) -> Any:
            resp = super().describe(app_id)
            if resp is None or resp.msg:
                return resp
            try:
                resp.msg = "; ".join(self._controller_messages(app_id))
            except Exception:  # noqa: BLE001 (the message is extra: status still answers)
                pass
            return resp

        def _controller_messages(self, app_id: str) -> list[str]:
            from kubernetes import client

            namespace, name = app_id.split(":")
            pods = client.CoreV1Api(self._api_client()).list_namespaced_pod(
                namespace,
                label_selector=f"app.kubernetes.io/instance={name},"
                "torchx.pytorch.org/role-name=controller",
            )
            return [m for pod in pods.items for m in termination_messages(pod)]

    return VolcanoKubernetesScheduler


def create_scheduler(
    session_name: str, client: Any = None, docker_client: Any = None, **_: Any
) -> Any:
    """torchx's scheduler factory (the arguments of torchx's own Kubernetes factory; the CLI's
    other keywords, such as context_name, are ignored as torchx's factory ignores them): the
    Kubernetes scheduler with the roles' policies."""
    return _scheduler_class()(session_name=session_name, client=client, docker_client=docker_client)
