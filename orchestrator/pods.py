"""What the torchx component adds to the Kubernetes pods torchx generates for its roles
(`pod_overlay`, `PodVolumes`): the image's non-root user on a read-only root file system with
writable volumes where the processes write (`/tmp`, the image's HOME, a size-limited
`/dev/shm`), the checkpoint volume, a node-local AutoCache directory, the store's Secret, the
grace period a leaving trainer checkpoints in, the project's label and, on the controller, the
annotations that let Prometheus find its metrics (`metrics_annotations`) and a readiness probe
on them (`metrics_readiness_probe`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torchx.specs as specs
from torchx.specs.overlays import JOIN

CACHE_DIR = "/cache"  # a node-local emptyDir in each trainer pod
IMAGE_UID = 10001  # the non-root user of the project's image (Dockerfile)
IMAGE_HOME = "/home/pipetransformer"  # its HOME (Dockerfile)
TORCHX_SHM_VOLUME = "dshm"  # the /dev/shm volume torchx gives every pod (a test checks the name)
# The root file system is read-only: what the processes write goes to these emptyDirs. /tmp:
# torchrun's log directories, torch.compile's (inductor) cache, multiprocessing's sockets;
# HOME: ~/.cache (data and profile caches, Hugging Face), ~/.triton, CUDA's kernel cache. The
# workdir (checkpoints, the store's SQLite) and the AutoCache directory are volumes already.
SCRATCH_DIRS = {"tmp": "/tmp", "home": IMAGE_HOME}
METRICS_PORT_NAME = "metrics"  # the container port's name: k8s/monitoring/podmonitor.yaml
# on every pod of a job, beside torchx's own labels (`torchx.pytorch.org/role-name` names the
# role): k8s/monitoring/podmonitor.yaml selects the controller pods by the two
POD_LABELS = {"app.kubernetes.io/part-of": "pipetransformer"}
METRICS_PATH = "/metrics"
# where a pod finds its etcd client certificate (a Secret's ca.crt, tls.crt, tls.key)
ETCD_CERT_DIR = "/etc/pipetransformer/etcd"
ETCD_CERT_FILES = ("ca.crt", "tls.crt", "tls.key")


def etcd_client_env() -> dict[str, str]:
    """The variables that point edge.etcd_client at the certificate in `ETCD_CERT_DIR`."""
    from pipetransformer.edge.etcd_client import CACERT_ENV, CERT_ENV, KEY_ENV

    return {
        CACERT_ENV: f"{ETCD_CERT_DIR}/ca.crt",
        CERT_ENV: f"{ETCD_CERT_DIR}/tls.crt",
        KEY_ENV: f"{ETCD_CERT_DIR}/tls.key",
    }


def metrics_annotations(port: int) -> dict[str, str]:
    """The `prometheus.io/*` annotations a Prometheus with the common pod discovery
    configuration (keep pods annotated `scrape: "true"`, at `port` and `path`) scrapes by."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": METRICS_PATH,
    }


def metrics_readiness_probe(port_name: str = METRICS_PORT_NAME) -> dict[str, Any]:
    """The controller is ready once it serves its job's metrics: it does so from the moment it
    supervises the job (the job recorded, etcd reached, the trainers' etcd user made). The path
    Prometheus scrapes, so a ready pod is one that a scrape reaches; a store outage still
    answers (`pipetransformer_scrape_error 1`) within the timeout."""
    return {
        "httpGet": {"path": METRICS_PATH, "port": port_name},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }


@dataclass(frozen=True)
class PodVolumes:
    """The volumes of a job's pods: the checkpoint PVC at the workdir, and the user's mounts."""

    workdir_pvc: str
    workdir: str
    extra: list[specs.BindMount | specs.VolumeMount]  # device mounts are refused before

    def volumes(
        self, cache: bool, shm_mib: int, cache_mib: int | None = None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(pod volumes, container volume mounts), torchx's shared-memory mount included: the
        overlay replaces the container's list, so it must list everything. torchx's /dev/shm
        volume (merged by name) is limited to `shm_mib`: it is memory, counted against the
        pod's limit, and unlimited a runaway writer takes all of it. The cache's emptyDir
        is limited to `cache_mib` (the kubelet evicts a pod whose volume outgrows its limit:
        the trainer caps its files below it, `ACTIVATION_CACHE_BYTES_ENV`). The scratch
        volumes (`SCRATCH_DIRS`) are what a read-only root file system leaves writable."""
        vols: list[dict[str, Any]] = [
            {
                "name": TORCHX_SHM_VOLUME,
                "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_mib}Mi"},
            },
            {"name": "workdir", "persistentVolumeClaim": {"claimName": self.workdir_pvc}},
        ]
        mounts: list[dict[str, Any]] = [
            {"name": TORCHX_SHM_VOLUME, "mountPath": "/dev/shm"},
            {"name": "workdir", "mountPath": self.workdir},
        ]
        for name, path in SCRATCH_DIRS.items():  # on the node's disk: ephemeral storage
            vols.append({"name": name, "emptyDir": {}})
            mounts.append({"name": name, "mountPath": path})
        if cache:
            empty_dir = {"sizeLimit": f"{cache_mib}Mi"} if cache_mib else {}
            vols.append({"name": "activation-cache", "emptyDir": empty_dir})
            mounts.append({"name": "activation-cache", "mountPath": CACHE_DIR})
        for i, m in enumerate(self.extra):
            name = f"extra-{i}"
            if isinstance(m, specs.VolumeMount):
                vols.append({"name": name, "persistentVolumeClaim": {"claimName": m.src}})
            else:
                vols.append({"name": name, "hostPath": {"path": m.src_path}})
            mounts.append({"name": name, "mountPath": m.dst_path, "readOnly": m.read_only})
        return vols, mounts


# Seconds a pod stays bound to a node that stopped answering (NotReady or unreachable) before
# it is evicted: long enough for a kubelet restart or a network blip, short against the training
# time a job waits otherwise (its survivors have re-formed by then; the lost share waits).
NODE_LOSS_TOLERATION_S = 30


def pod_overlay(
    image: str,
    grace_period_s: int,
    volumes: PodVolumes,
    env_secrets: Sequence[str] = (),
    cache: bool = False,
    annotations: Mapping[str, str] | None = None,
    resources: Mapping[str, Mapping[str, str]] | None = None,
    cache_mib: int | None = None,
    etcd_cert_secret: str | None = None,
    *,
    shm_mib: int,
    readiness_probe: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What torchx's generated pod lacks: the non-root user and volume group of the image, a
    security context the Pod Security "restricted" profile admits, no API token (the pods never
    call the Kubernetes API), no restarts in place (a failed container is a Failed pod, which
    the role's Volcano policies act on: orchestrator/volcano.py), the container's last words
    kept as its termination message, `resources` (requests equal to limits: Guaranteed QoS,
    orchestrator/sizing.py), the role's etcd client certificate from the Secret
    `etcd_cert_secret` at `ETCD_CERT_DIR` (read-only, readable by the image's group), the
    grace period a leaving trainer checkpoints in, the environment from `env_secrets` (`envFrom`: each key is
    a variable's name: the controller's store URL, PIPETRANSFORMER_DB; the trainers'
    rendezvous secret, PIPETRANSFORMER_RDZV_SECRET), the checkpoint volume and a node-local
    cache; a read-only root file system with scratch volumes where the processes write and
    /dev/shm limited to `shm_mib`; `readiness_probe` (the controller's
    `metrics_readiness_probe`); the project's label (`POD_LABELS`) and `annotations` (the
    controller's `metrics_annotations`) merged into the pod's metadata.

    The container is found by its image (each role's pod has one container, named per replica)
    and merged field by field: a list given here replaces the generated one, so only
    `volumeMounts` (listed whole), `envFrom` (absent before), `readinessProbe` (absent before)
    and `securityContext` (a mapping, merged) are set on it. The pod's volumes are merged by
    name: torchx's /dev/shm volume gets its size limit, the others are added."""
    pod_volumes, container_mounts = volumes.volumes(cache, shm_mib, cache_mib)
    if etcd_cert_secret:
        pod_volumes.append(
            {
                "name": "etcd-client",
                "secret": {
                    "secretName": etcd_cert_secret,
                    "defaultMode": 0o440,
                    "items": [{"key": f, "path": f} for f in ETCD_CERT_FILES],
                },
            }
        )
        container_mounts.append(
            {"name": "etcd-client", "mountPath": ETCD_CERT_DIR, "readOnly": True}
        )
    container: dict[str, Any] = {
        "image": image,
        "volumeMounts": container_mounts,
        # `kubectl describe` and `torchx status` show the controller's outcome line
        # (orchestrator/exits.py), or a crashed container's last log lines
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Pod Security "restricted": what a namespace enforcing it requires of every container
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            # nothing of the image can be changed in a running pod; what the processes write
            # goes to the volumes mounted above (`SCRATCH_DIRS`, the workdir, the cache)
            "readOnlyRootFilesystem": True,
        },
    }
    if readiness_probe:
        container["readinessProbe"] = dict(readiness_probe)
    if resources:  # mappings merge: torchx's nvidia.com/gpu stays, cpu and memory are ours
        container["resources"] = {k: dict(v) for k, v in resources.items()}
    if env_secrets:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in env_secrets]
    metadata: dict[str, Any] = {"labels": dict(POD_LABELS)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "metadata": metadata,
        "spec": {
            "automountServiceAccountToken": False,
            # no FOO_SERVICE_HOST variables: the `etcd` Service's ETCD_* would reach the pods
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_period_s,
            # a failed container fails its pod, which Volcano sees and its policies act on
            # (an in-pod restart is invisible to Volcano: it would crash-loop uncounted)
            "restartPolicy": "Never",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": IMAGE_UID,
                "runAsGroup": IMAGE_UID,
                "fsGroup": IMAGE_UID,  # the checkpoint volume writable by the image's user
                # re-chown the volume only where its root does not match yet: not the whole
                # checkpoint tree at every pod start
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            # a lost node's pods are evicted (and Volcano's replacements scheduled) after
            # NODE_LOSS_TOLERATION_S, not the 300 s Kubernetes gives every pod by default
            "tolerations": [
                {
                    "key": f"node.kubernetes.io/{condition}",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": NODE_LOSS_TOLERATION_S,
                }
                for condition in ("not-ready", "unreachable")
            ],
            # by name: torchx's shared-memory volume gets its limit, ours are appended
            JOIN("volumes", on="name"): pod_volumes,
            JOIN("containers", on="image"): [container],
        },
    }
