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

`VolcanoKubernetesScheduler` is torchx's scheduler plus two things: it writes each task's
declared policies and `maxRetry`, and `describe` adds the controller pod's termination message
(the job's last words) to `torchx status`. It is registered as torchx's `kubernetes` scheduler
(torchx_plugins/schedulers/pipetransformer_kubernetes.py: a plugin wins a name clash), so
`torchx run -s kubernetes` writes the policies; a role without declared policies gets exactly
what torchx's own scheduler gives it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pipetransformer.orchestrator.exits import EXIT_JOB_FAILED, EXIT_STOPPED, EXIT_USAGE

VOLCANO_METADATA = "pipetransformer/volcano"  # a role's metadata key: {"policies": [...]}

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
            return info

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
