"""`torchx run -s kubernetes`: the Volcano Job the component produces, checked without a cluster.

Schemas alone miss every problem a cluster user met before this was built (a loopback etcd, the
checkout path as image, state in each container's own filesystem, a password in the arguments,
whole-job restarts), so the generated Job is asserted on directly, then validated against the
Kubernetes schemas (kubernetes-validate) and Volcano's vendored CRD schema.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipetransformer.core.keys import (
    ACTIVATION_CACHE_BYTES_ENV,
    ACTIVATION_CACHE_ENV,
    RDZV_SECRET_ENV,
    SPEC_ENV,
)
from pipetransformer.core.spec import load_spec, spec_from_text
from pipetransformer.orchestrator import sizing, volcano
from pipetransformer.orchestrator.appdef import app_def
from pipetransformer.orchestrator.components import (
    METRICS_PORT,
    METRICS_PORT_NAME,
    ComponentArgError,
    train,
)
from pipetransformer.orchestrator.platforms.base import TrainArgs, TrainInputs
from pipetransformer.orchestrator.pods import (
    CACHE_DIR,
    ETCD_CERT_DIR,
    ETCD_CERT_FILES,
    IMAGE_HOME,
    POD_LABELS,
    TORCHX_SHM_VOLUME,
)
from tests import rehearsal
from tests.pod_security import restricted_violations

pytest.importorskip("kubernetes", reason="the kubernetes client (test extra) is not installed")

REPO = Path(__file__).resolve().parents[1]
IMAGE = "registry.example/pipetransformer:1.0"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
QUEUE = "pipetransformer"
PRIORITY = "pipetransformer-training"


def volcano_job(app: Any) -> dict[str, Any]:
    """The Volcano Job `torchx run -s kubernetes` submits for `app`, as plain JSON-able data."""
    return rehearsal.volcano_job(app, QUEUE, "pipetransformer", PRIORITY)


def elastic_spec(tmp_path: Path) -> Path:
    spec = yaml.safe_load((REPO / "examples" / "vit-digits.yaml").read_text())
    spec["parallel"].update({"stages": 2, "replicas": 2})
    spec["runtime"] = {**spec.get("runtime", {}), "nodes": 4, "min_nodes": 2}
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(spec))
    load_spec(path)
    return path


def tasks(job: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [t for t in job["spec"]["tasks"] if t["name"].startswith(f"{role}-")]


def container(task: dict[str, Any]) -> dict[str, Any]:
    (c,) = task["template"]["spec"]["containers"]
    return c


def env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def secret_ref(c: dict[str, Any], name: str) -> dict[str, str]:
    """The Secret and key variable `name` of container `c` is read from (`secretKeyRef`)."""
    (var,) = [e for e in c.get("env", []) if e["name"] == name]
    assert "value" not in var, var
    return var["valueFrom"]["secretKeyRef"]


def test_volcano_job_finds_everything_through_services_secrets_and_volumes(
    tmp_path: Path,
) -> None:
    spec = elastic_spec(tmp_path)
    app = train(spec=str(spec), image=IMAGE, etcd="etcd:2379", nnodes=4, nproc_per_node=1)
    job = volcano_job(app)
    controllers, trainers = tasks(job, "controller"), tasks(job, "trainer")
    assert len(controllers) == 1 and len(trainers) == 4
    for task in job["spec"]["tasks"]:
        pod, c = task["template"]["spec"], container(task)
        command = c["command"]
        # the image's interpreter, the project's CLI; never the submitting machine's paths
        assert c["image"] == IMAGE and command[:4] == [
            "python",
            "-P",
            "-m",
            "pipetransformer.orchestrator.cli",
        ]
        assert not any(str(REPO) in part for part in command), command
        # no loopback address and no secret anywhere in what `ps` or the API shows
        # (torchx's own TORCHX_RANK0_HOST=localhost on the first task is unused here)
        ours = {k: v for k, v in env(c).items() if not k.startswith("TORCHX_")}
        shown = [*command, *(v or "" for v in ours.values())]
        assert not any("127.0.0.1" in s or "localhost" in s for s in shown), shown
        assert not any("postgresql" in s or "password" in s.lower() for s in command)
        assert "--db" not in command
        # the checkpoint volume at the workdir, torchx's shared memory kept
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/workdir"]]["persistentVolumeClaim"]["claimName"] == (
            "pipetransformer-workdir"
        )
        assert mounts["/dev/shm"] == TORCHX_SHM_VOLUME and TORCHX_SHM_VOLUME in volumes
        # torchx's volume, limited (merged by name: one volume of that name, every name once)
        assert volumes[TORCHX_SHM_VOLUME]["emptyDir"]["medium"] == "Memory"
        assert volumes[TORCHX_SHM_VOLUME]["emptyDir"]["sizeLimit"].endswith("Mi")
        assert len(volumes) == len(pod["volumes"]), [v["name"] for v in pod["volumes"]]
        # nothing of the image changes in a running pod; the processes write to volumes
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # no API token, the image's non-root user, time for the graceful-leave checkpoint
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] != 0
        assert pod["terminationGracePeriodSeconds"] >= 60
        # a namespace enforcing Pod Security "restricted" admits it; the volume is re-chowned
        # only where its root does not match
        assert restricted_violations(pod) == [], task["name"]
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        # a lost node's pods are evicted (and replaced) after 30 s, not Kubernetes' 300 s
        lost = {t["key"]: t for t in pod["tolerations"] if t["key"].startswith("node.")}
        assert set(lost) == {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
        assert {(t["effect"], t["tolerationSeconds"]) for t in lost.values()} == {("NoExecute", 30)}
        # a failed container fails its pod, which Volcano sees (no uncounted in-pod restarts);
        # its policies replace it alone, within a budget; nothing restarts the whole job
        assert pod["restartPolicy"] == "Never"
        assert task["maxRetry"] == 3
        assert task["policies"] and not any(
            p.get("action") == "RestartJob" for p in task["policies"]
        )
        # Guaranteed QoS: requests equal limits for CPU and memory; ephemeral storage bounded
        res = c["resources"]
        for kind in ("cpu", "memory", "ephemeral-storage"):
            assert res["requests"][kind] == res["limits"][kind], (task["name"], kind, res)
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        # etcd over TLS with the role's client certificate (k8s/README "etcd: TLS and roles")
        role = task["name"].rsplit("-", 1)[0]
        cert = next(v for v in pod["volumes"] if v["name"] == "etcd-client")
        assert cert["secret"]["secretName"] == f"etcd-client-{role}"
        assert mounts[ETCD_CERT_DIR] == "etcd-client"
        assert env(c)["PIPETRANSFORMER_ETCD_CERT"].startswith(ETCD_CERT_DIR)

    (ctl,) = controllers
    c = container(ctl)
    args = c["command"]
    assert args[args.index("--etcd") + 1] == "etcd:2379" and "--etcd-port" not in args
    assert args[args.index("--workdir") + 1] == "/workdir"
    # the store's URL from its Secret, the spec inline (the pod has none of our files)
    assert c["envFrom"] == [{"secretRef": {"name": "pipetransformer-db"}}]
    assert "PIPETRANSFORMER_DB" not in env(c)
    assert spec_from_text(env(c)[SPEC_ENV], "env") == load_spec(spec)
    assert str(spec) not in args and "controller" in args
    assert c["resources"]["requests"]["memory"] == f"{sizing.CONTROLLER_MIB}Mi"
    # its exit status decides: done completes the Volcano job, a user's stop aborts it, a
    # failure a restart cannot fix terminates it (GPUs released); anything else replaces it
    by_code = {p["exitCode"]: p["action"] for p in ctl["policies"] if "exitCode" in p}
    assert by_code == {130: "AbortJob", 2: "TerminateJob", 3: "TerminateJob"}
    assert {"event": "TaskCompleted", "action": "CompleteJob"} in ctl["policies"]
    assert {"events": ["PodFailed", "PodEvicted"], "action": "RestartTask"} in ctl["policies"]
    assert args[args.index("--restart-budget") + 1] == "3"
    assert args[args.index("--launch-id") + 1] == job["metadata"]["name"]
    # its metrics: served on the default port, named, and announced to Prometheus
    assert args[args.index("--metrics-port") + 1] == str(METRICS_PORT)
    assert c["ports"] == [{"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT}]
    meta = ctl["template"]["metadata"]
    assert meta["annotations"] == {
        "sidecar.istio.io/inject": "false",  # torchx's own, kept
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    assert POD_LABELS.items() <= meta["labels"].items()
    assert meta["labels"]["torchx.pytorch.org/role-name"] == "controller"  # torchx's, kept

    # elastic trainers: torchrun MIN:MAX, the first min_nodes tasks required, the rest optional
    for i, task in enumerate(trainers):
        c = container(task)
        args = c["command"]
        assert args[args.index("--nnodes") + 1] == "2:4"
        assert args[args.index("--etcd") + 1] == "etcd:2379"
        assert task["minAvailable"] == (1 if i < 2 else 0)
        assert env(c)[ACTIVATION_CACHE_ENV] == CACHE_DIR  # node-local, not the shared volume
        # sized from the spec (orchestrator/sizing.py): a CPU worker needs well under 1 GiB
        assert c["resources"]["requests"]["memory"] == "1024Mi"
        # a failed or evicted trainer pod is replaced, and rejoins
        assert task["policies"] == [
            {"events": ["PodFailed", "PodEvicted"], "action": "RestartTask"}
        ]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in task["template"]["spec"]["volumes"]}
        # node-local, size-limited (the kubelet evicts past it), and the files stay below it
        limit = volumes[mounts[CACHE_DIR]]["emptyDir"]["sizeLimit"]
        assert int(env(c)[ACTIVATION_CACHE_BYTES_ENV]) == int(limit.removesuffix("Mi")) << 20
        # trainers never see the store's credentials; they sign the rendezvous state
        assert c["envFrom"] == [{"secretRef": {"name": "pipetransformer-rdzv"}}]
        assert RDZV_SECRET_ENV not in env(c)  # from the Secret, never inline
        # signed in as this job's etcd user, with the password the controller reads too, from
        # the Secret made for this launch
        assert env(c)["PIPETRANSFORMER_ETCD_USER"] == f"trainer-{job['metadata']['name']}"
        ref = secret_ref(c, "PIPETRANSFORMER_ETCD_PASSWORD")
        assert ref == {"name": f"{job['metadata']['name']}-etcd-trainer", "key": "password"}
        assert secret_ref(container(ctl), "PIPETRANSFORMER_ETCD_TRAINER_PASSWORD") == ref
        # part of the job, but nothing to scrape
        meta = task["template"]["metadata"]
        assert POD_LABELS.items() <= meta["labels"].items()
        assert not any(k.startswith("prometheus.io/") for k in meta["annotations"])
        assert "--metrics-port" not in args and not c.get("ports")
    assert job["spec"]["queue"] == QUEUE and job["spec"]["priorityClassName"] == PRIORITY


def test_volcano_job_validates_against_the_schemas(tmp_path: Path) -> None:
    schemas = pytest.importorskip("tests.k8s_schemas", reason="schema helpers not present")
    app = train(
        spec=str(elastic_spec(tmp_path)),
        image=IMAGE,
        etcd="etcd:2379",
        nnodes=4,
        nproc_per_node=1,
    )
    job = volcano_job(app)
    schemas.validate_object(job)  # Volcano's CRD schema, and each pod template as a core Pod
    broken = copy.deepcopy(job)
    broken["spec"]["tasks"][0]["maxRetry"] = "three"
    with pytest.raises(Exception, match="maxRetry"):
        schemas.validate_object(broken)


def test_container_mode_refuses_what_cannot_work_in_a_cluster(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "vit-digits.yaml")
    with pytest.raises(ComponentArgError, match="etcd:2379"):
        train(spec=spec, image=IMAGE)  # an embedded etcd would live on one pod's loopback
    with pytest.raises(ComponentArgError, match="loopback"):
        train(spec=spec, image=IMAGE, etcd="127.0.0.1:2379")
    with pytest.raises(ComponentArgError, match="never from an argument"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379", db="postgresql+psycopg://u:pw@db/pt")
    with pytest.raises(ComponentArgError, match="absolute"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379", workdir="runs")
    with pytest.raises(ComponentArgError, match="device mounts"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379", mounts=["type=device", "src=/dev/fuse"])
    with pytest.raises(ComponentArgError, match=r"etcd_trainer_secret='mine' .* --etcd_client"):
        # before: accepted, and the password never read (no TLS, no auth, nobody signs in)
        train(
            spec=spec,
            image=IMAGE,
            etcd="etcd:2379",
            etcd_client_secrets="",
            etcd_trainer_secret="mine",
        )
    # extra mounts (a data set) become volumes of every pod
    app = train(
        spec=spec,
        image=IMAGE,
        etcd="etcd:2379",
        mounts=["type=volume", "src=datasets", "dst=/data", "readonly"],
    )
    for task in volcano_job(app)["spec"]["tasks"]:
        mounts = {m["mountPath"]: m for m in container(task)["volumeMounts"]}
        assert mounts["/data"]["readOnly"] is True
        names = {v["name"]: v for v in task["template"]["spec"]["volumes"]}
        assert names[mounts["/data"]["name"]]["persistentVolumeClaim"]["claimName"] == "datasets"


def test_an_etcd_without_tls_takes_no_certificates_and_no_users(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "vit-digits.yaml")
    job = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", etcd_client_secrets=""))
    for task in job["spec"]["tasks"]:
        c = container(task)
        assert not any("ETCD" in name for name in env(c)), env(c)
        assert all(v["name"] != "etcd-client" for v in task["template"]["spec"]["volumes"])
    # each launch its own trainers' password: a Secret of its own
    passwords = {
        secret_ref(
            container(
                tasks(volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379")), "trainer")[0]
            ),
            "PIPETRANSFORMER_ETCD_PASSWORD",
        )["name"]
        for _ in range(2)
    }
    assert len(passwords) == 2


def test_local_mode_is_unchanged(tmp_path: Path) -> None:
    app = train(spec=str(REPO / "examples" / "vit-digits.yaml"), etcd_port=23456)
    controller, trainer = app.roles
    assert controller.entrypoint == sys.executable and controller.image == os.getcwd()
    assert "kubernetes" not in controller.metadata and controller.max_retries == 0
    assert trainer.args[trainer.args.index("--etcd") + 1] == "127.0.0.1:23456"


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_torchx_kubernetes_dryrun_of_every_example(example: Path) -> None:
    spec = load_spec(example)
    nproc = spec.parallel.world_size // spec.runtime.nodes
    cmd = [
        sys.executable, "-m", "torchx.cli.main", "run", "-s", "kubernetes", "--dryrun",
        "--workspace", "", "-cfg", f"queue={QUEUE},validate_spec=False",
        "orchestrator/components.py:train", "--spec", str(example.relative_to(REPO)),
        "--image", IMAGE, "--etcd", "etcd:2379",
        "--nnodes", str(spec.runtime.nodes), "--nproc_per_node", str(nproc),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    request = proc.stdout[proc.stdout.index("apiVersion: batch.volcano.sh/v1alpha1") :]
    job = yaml.safe_load(request)
    assert job["kind"] == "Job" and job["spec"]["queue"] == QUEUE
    assert {t["name"].rsplit("-", 1)[0] for t in job["spec"]["tasks"]} == {"controller", "trainer"}
    gpus = {
        container(t)["resources"]["limits"].get("nvidia.com/gpu") for t in tasks(job, "trainer")
    }
    assert gpus == ({str(nproc)} if spec.runtime.device == "cuda" else {None}), gpus


def _readme_submission() -> list[str]:
    """The `torchx run -s kubernetes ...` command of the README's "Run on Kubernetes", as words."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Run on Kubernetes") :]
    start = section.index("\ntorchx run -s kubernetes") + 1  # a line of a code block
    lines = []
    for line in section[start:].splitlines():
        lines.append(line.rstrip("\\ "))
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(" ".join(lines))


def test_the_readme_s_submission_dry_runs_without_a_cluster(tmp_path: Path) -> None:
    """The README's command with `--dryrun` on a machine with no kubeconfig (before: a 60-line
    traceback, `LocationValueError: No host specified`): the Volcano Job, and a note that no
    API server validated it."""
    words = _readme_submission()
    assert words[:4] == ["torchx", "run", "-s", "kubernetes"], words
    cmd = [sys.executable, "-m", "torchx.cli.main", *words[1:4], "--dryrun", *words[4:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env |= {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "no Kubernetes configuration" in proc.stderr and "not validated" in proc.stderr
    job = yaml.safe_load(proc.stdout[proc.stdout.index("apiVersion: batch.volcano.sh/v1alpha1") :])
    assert job["kind"] == "Job" and job["spec"]["queue"] == "pipetransformer"
    # no password in what it prints (before: the trainers' etcd password, 64 hex characters,
    # as a value in both roles' env): the pods read it from the launch's Secret, which only
    # the submission makes
    assert not re.search(r"\b[0-9a-f]{64}\b", proc.stdout + proc.stderr)
    secret_vars = [
        var
        for task in job["spec"]["tasks"]
        for var in container(task)["env"]
        if "PASSWORD" in var["name"]
    ]
    assert len(secret_vars) == len(job["spec"]["tasks"]), secret_vars  # one per pod
    assert all(set(var) == {"name", "valueFrom"} for var in secret_vars), secret_vars


def test_trainer_overlay_places_trainers_on_gpu_nodes(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "vit-digits.yaml")
    overlay = REPO / "k8s" / "overlays" / "gpu" / "pod-overlay.yaml"
    app = train(spec=spec, image=IMAGE, etcd="etcd:2379", trainer_overlay=str(overlay))
    job = volcano_job(app)
    for task in tasks(job, "trainer"):
        pod = task["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            pod["tolerations"]
        )
        assert not pod.get("nodeSelector")  # the nvidia.com/gpu request places them
        # merged after the component's own overlay, which it leaves intact
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
        assert any(m["mountPath"] == "/workdir" for m in container(task)["volumeMounts"])
    (ctl,) = tasks(job, "controller")
    assert all(
        t["key"].startswith("node.kubernetes.io/") for t in ctl["template"]["spec"]["tolerations"]
    )
    # an overlay's volumes join the pod's by name: ours stay (a plain list merged after a list
    # merged by name would replace it), torchx's /dev/shm keeps its limit
    extra = tmp_path / "volumes.yaml"
    extra.write_text("spec:\n  volumes:\n    - name: scratch\n      emptyDir: {}\n")
    job = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", trainer_overlay=str(extra)))
    for task in tasks(job, "trainer"):
        volumes = {v["name"]: v for v in task["template"]["spec"]["volumes"]}
        assert {"scratch", "workdir", "tmp", "home", "dshm"} <= set(volumes), set(volumes)
        assert "sizeLimit" in volumes["dshm"]["emptyDir"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("metadata: {}\nspec: {}\n")
    with pytest.raises(ComponentArgError, match="one key, `spec`"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379", trainer_overlay=str(bad))


def test_cuda_trainers_request_one_gpu_per_worker(tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "examples" / "vit-digits.yaml").read_text())
    spec["parallel"].update({"stages": 2, "replicas": 2})
    spec["runtime"] = {**spec.get("runtime", {}), "device": "cuda", "nodes": 2}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(spec))
    overlay = REPO / "k8s" / "overlays" / "gpu" / "pod-overlay.yaml"
    app = train(
        spec=str(path),
        image=IMAGE,
        etcd="etcd:2379",
        nnodes=2,
        nproc_per_node=2,
        trainer_overlay=str(overlay),
    )
    job = volcano_job(app)
    for task in tasks(job, "trainer"):
        res = container(task)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "2", res
    (ctl,) = tasks(job, "controller")
    assert "nvidia.com/gpu" not in container(ctl)["resources"].get("limits", {})
    schemas = pytest.importorskip("tests.k8s_schemas", reason="schema helpers not present")
    schemas.validate_object(job)
    # a CPU (or auto) spec requests none unless asked; asking for fewer GPUs than workers fails
    cpu = volcano_job(train(spec=str(REPO / "examples" / "vit-digits.yaml"), image=IMAGE,
                            etcd="etcd:2379"))  # fmt: skip
    for task in tasks(cpu, "trainer"):
        assert "nvidia.com/gpu" not in container(task)["resources"].get("limits", {})
    with pytest.raises(ComponentArgError, match="gpu=1"):
        train(spec=str(path), image=IMAGE, etcd="etcd:2379", nnodes=2, nproc_per_node=2, gpu=1)
    with pytest.raises(ComponentArgError, match="gpu=-3: give a number of GPUs"):
        train(spec=str(path), image=IMAGE, etcd="etcd:2379", nnodes=2, nproc_per_node=2, gpu=-3)


def test_spec_names_that_make_pod_names_kubernetes_refuses_are_refused(tmp_path: Path) -> None:
    """torchx names pods `<name>-<id of up to 14>-<role>-<replica>-0`: at most 63 characters
    (`controller-0-0` is the longest suffix: 33 characters of name fit, 34 do not)."""
    base = yaml.safe_load((REPO / "examples" / "vit-digits.yaml").read_text())
    for name in ("a" * 33, "b" * 34):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump({**base, "name": name}))
        # nproc_per_node left out: the spec's two workers shared by the two replicas
        args = {"spec": str(spec), "image": IMAGE, "etcd": "etcd:2379", "nnodes": 2}
        if len(name) == 33:
            job = volcano_job(train(**args))
            for task in job["spec"]["tasks"]:
                assert len(f"{name}-{'x' * 14}-{task['name']}-0") <= 63
            (t0, _) = tasks(job, "trainer")
            command = container(t0)["command"]
            assert command[command.index("--nproc-per-node") + 1] == "1"
        else:
            with pytest.raises(
                ComponentArgError, match=r"\(34 characters\) is too long.*at most 33"
            ):
                train(**args)


def test_metrics_port_is_chosen_or_turned_off(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "vit-digits.yaml")
    job = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", metrics_port=9555))
    (ctl,) = tasks(job, "controller")
    c = container(ctl)
    assert c["command"][c["command"].index("--metrics-port") + 1] == "9555"
    assert c["ports"] == [{"name": METRICS_PORT_NAME, "containerPort": 9555}]
    assert ctl["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9555"
    off = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", metrics_port=0))
    (ctl,) = tasks(off, "controller")
    c = container(ctl)
    assert "--metrics-port" not in c["command"] and not c.get("ports")
    assert not any(
        k.startswith("prometheus.io/") for k in ctl["template"]["metadata"]["annotations"]
    )
    assert POD_LABELS.items() <= ctl["template"]["metadata"]["labels"].items()
    schemas = pytest.importorskip("tests.k8s_schemas", reason="schema helpers not present")
    schemas.validate_object(job)


def test_the_podmonitor_selects_the_controller_pod_and_its_port() -> None:
    """k8s/monitoring/podmonitor.yaml against the pods the component generates: its selector
    matches the controller pod of every job and no trainer pod, at the port it names."""
    monitor = yaml.safe_load((REPO / "k8s" / "monitoring" / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}  # no expressions to evaluate here
    wanted = selector["matchLabels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    spec = str(REPO / "examples" / "vit-digits.yaml")
    for app in (
        train(spec=spec, image=IMAGE, etcd="etcd:2379", nnodes=2),
        train(spec=spec, image=IMAGE, etcd="etcd:2379", metrics_port=9555, job_id="other"),
    ):
        job = volcano_job(app)
        for task in job["spec"]["tasks"]:
            selected = wanted <= task["template"]["metadata"]["labels"].items()
            assert selected == task["name"].startswith("controller-"), task["name"]
            if selected:
                ports = {p["name"]: p["containerPort"] for p in container(task)["ports"]}
                assert endpoint["port"] in ports
                meta = task["template"]["metadata"]["annotations"]
                assert endpoint["path"] == meta["prometheus.io/path"]
                assert str(ports[endpoint["port"]]) == meta["prometheus.io/port"]


def test_the_controller_may_run_the_slim_image(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "vit-digits.yaml")
    slim = "registry.example/pipetransformer:1.0-controller"
    job = volcano_job(train(spec=spec, image=IMAGE, controller_image=slim, etcd="etcd:2379"))
    (ctl,) = tasks(job, "controller")
    assert container(ctl)["image"] == slim
    assert {container(t)["image"] for t in tasks(job, "trainer")} == {IMAGE}
    # the overlay found its container (by image): the controller's pod is complete
    assert any(m["mountPath"] == "/workdir" for m in container(ctl)["volumeMounts"])
    assert container(ctl)["securityContext"]["allowPrivilegeEscalation"] is False
    with pytest.raises(ComponentArgError, match="controller_image is for container mode"):
        train(spec=spec, controller_image=slim)


# -- the trainers' etcd password, /dev/shm, the read-only root, the controller's readiness ----


def literal_inputs(spec: Path, launch_secret: str, **args: Any) -> TrainInputs:
    """What `components.gather` hands the translation, written out (tests/test_torchx.py's
    way): a known value for the secret `train` makes for a launch."""
    return TrainInputs(
        args=TrainArgs(spec=str(spec), image=IMAGE, etcd="etcd:2379", **args),
        job=load_spec(spec),
        spec_text=spec.read_text(),
        trainer_overlay=None,
        free_port=0,
        launch_secret=launch_secret,
        cwd="/checkout",
        python="/venv/bin/python",
    )


def test_the_trainers_etcd_password_is_never_a_value_in_the_job() -> None:
    """Both roles read the trainers' etcd password from a Secret (`secretKeyRef`); the Volcano
    Job, which anyone who may read it sees and `--dryrun` prints, holds no value of it. Before,
    the launch's secret was a plain value in the env of both roles."""
    spec = REPO / "examples" / "vit-digits.yaml"
    launch_secret = "5" * 64
    job = volcano_job(app_def(literal_inputs(spec, launch_secret, nnodes=2)))
    name = job["metadata"]["name"]
    assert launch_secret not in yaml.safe_dump(job)
    refs = [
        secret_ref(container(task), var)
        for task in job["spec"]["tasks"]
        for var in env(container(task))
        if "PASSWORD" in var
    ]
    assert refs == [{"name": f"{name}-etcd-trainer", "key": "password"}] * 3
    # the Job names the Secret made for its launch; `torchx run` creates it from this
    assert job["metadata"]["annotations"][volcano.LAUNCH_SECRETS_ANNOTATION] == (
        f"{name}-etcd-trainer"
    )
    (secret,) = volcano.launch_secrets(job)
    assert secret["metadata"]["name"] == f"{name}-etcd-trainer"
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == name
    assert re.fullmatch(r"[0-9a-f]{64}", secret["stringData"]["password"])
    assert volcano.launch_secrets(job)[0]["stringData"] != secret["stringData"]  # fresh each
    schemas = pytest.importorskip("tests.k8s_schemas", reason="schema helpers not present")
    schemas.validate_object(secret)
    schemas.validate_object(job)
    # a Secret of the user's: referenced as it is, none made
    mine = volcano_job(
        app_def(literal_inputs(spec, launch_secret, etcd_trainer_secret="team-etcd-trainer"))
    )
    assert {secret_ref(container(t), var)["name"] for t in mine["spec"]["tasks"]
            for var in env(container(t)) if "PASSWORD" in var} == {"team-etcd-trainer"}  # fmt: skip
    assert volcano.launch_secrets(mine) == []
    assert volcano.LAUNCH_SECRETS_ANNOTATION not in (mine["metadata"].get("annotations") or {})


class FakeKubernetes:
    """The two API groups `schedule` calls, recording every call in order."""

    def __init__(self, fail_job: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_job = fail_job
        self.secrets: dict[str, dict[str, Any]] = {}

    # CustomObjectsApi
    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict, **kw: Any
    ) -> dict[str, Any]:
        self.calls.append(("create job", body["metadata"]["name"]))
        if self.fail_job:
            raise RuntimeError("admission webhook refused the job")
        return {"metadata": {"name": body["metadata"]["name"], "uid": "uid-1"}}

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        return {"metadata": {"name": name, "uid": "uid-1"}}

    # CoreV1Api
    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("create secret", body["metadata"]["name"]))
        self.secrets[body["metadata"]["name"]] = copy.deepcopy(body)

    def patch_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("patch secret", name))
        self.secrets[name]["metadata"].update(body["metadata"])

    def delete_namespaced_secret(self, name: str, namespace: str) -> None:
        self.calls.append(("delete secret", name))
        del self.secrets[name]


def _submit(app: Any, fake: FakeKubernetes) -> str:
    """`torchx run -s kubernetes` of `app` against `fake`'s API server: dry run, then schedule."""
    from torchx.schedulers import get_scheduler_factories

    scheduler = get_scheduler_factories()["kubernetes"]("test")
    scheduler._custom_objects_api = lambda: fake
    scheduler._core_api = lambda: fake
    cfg = {"queue": QUEUE, "validate_spec": False, "namespace": "ml"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchx's note on Volcano's retries, once per role
        info = scheduler.submit_dryrun(app, cfg)
    return scheduler.schedule(info)


def test_a_submission_makes_the_launch_s_secret_and_the_job_owns_it() -> None:
    """`torchx run -s kubernetes`: the launch's Secret is created before the Job (its pods read
    it as they start), with a random password, then made the Job's (Kubernetes deletes it with
    the Job); a Job the API server refuses takes its Secret back. Before, no Secret was made."""
    spec = str(REPO / "examples" / "vit-digits.yaml")
    fake = FakeKubernetes()
    app_id = _submit(train(spec=spec, image=IMAGE, etcd="etcd:2379"), fake)
    name = app_id.split(":")[1]
    secret_name = f"{name}-etcd-trainer"
    assert fake.calls == [
        ("create secret", secret_name),
        ("create job", name),
        ("patch secret", secret_name),
    ]
    secret = fake.secrets[secret_name]
    assert re.fullmatch(r"[0-9a-f]{64}", secret["stringData"]["password"])
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": name, "uid": "uid-1"}
    ]
    refused = FakeKubernetes(fail_job=True)
    with pytest.raises(RuntimeError, match="admission webhook"):
        _submit(train(spec=spec, image=IMAGE, etcd="etcd:2379"), refused)
    assert [c[0] for c in refused.calls] == ["create secret", "create job", "delete secret"]
    assert refused.secrets == {}
    # no etcd auth, or a Secret of the user's: only the Job
    for extra in ({"etcd_client_secrets": ""}, {"etcd_trainer_secret": "team-etcd-trainer"}):
        plain = FakeKubernetes()
        _submit(train(spec=spec, image=IMAGE, etcd="etcd:2379", **extra), plain)
        assert [c[0] for c in plain.calls] == ["create job"], extra


def test_dev_shm_is_limited_and_its_limit_checked(tmp_path: Path) -> None:
    """torchx's /dev/shm is memory-backed and had no limit: now half the trainer pod's memory by
    default (the controller's 64 MiB), `--shm_mib` where given, refused past the pod's memory
    (which it counts against) or below 1."""
    spec = str(REPO / "examples" / "vit-digits.yaml")

    def shm(job: dict[str, Any], role: str) -> str:
        (task, *_) = tasks(job, role)
        (volume,) = [v for v in task["template"]["spec"]["volumes"] if v["name"] == "dshm"]
        return volume["emptyDir"]["sizeLimit"]

    job = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379"))
    memory = container(tasks(job, "trainer")[0])["resources"]["limits"]["memory"]
    assert shm(job, "trainer") == f"{int(memory.removesuffix('Mi')) // 2}Mi"
    assert shm(job, "controller") == f"{sizing.CONTROLLER_SHM_MIB}Mi"
    given = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", memMB=4096, shm_mib=3000))
    assert shm(given, "trainer") == "3000Mi"
    with pytest.raises(ComponentArgError, match=r"shm_mib=-1: give /dev/shm's size limit"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379", shm_mib=-1)
    with pytest.raises(ComponentArgError, match=r"shm_mib=5000 exceeds .* \(4096 MiB; memMB\)"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379", memMB=4096, shm_mib=5000)


def test_the_root_file_system_is_read_only_and_what_is_written_is_a_volume() -> None:
    """Every container's root file system is read-only; every place the processes write is a
    writable volume: /tmp (torchrun's logs, torch.compile's cache, multiprocessing), the
    image's HOME (~/.cache, ~/.triton), /dev/shm, the workdir, the trainers' AutoCache. Before,
    the image's files were writable and these paths were the container's own layer."""
    spec = str(REPO / "examples" / "vit-digits.yaml")
    job = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", nnodes=2))
    for task in job["spec"]["tasks"]:
        c = container(task)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, task["name"]
        volumes = {v["name"]: v for v in task["template"]["spec"]["volumes"]}
        writable = {
            m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"] if not m.get("readOnly")
        }
        written = ["/tmp", IMAGE_HOME, "/dev/shm", "/workdir"]
        written += [CACHE_DIR] if task["name"].startswith("trainer-") else []
        for path in written:
            assert path in writable, (task["name"], path)
        assert "emptyDir" in writable["/tmp"] and "emptyDir" in writable[IMAGE_HOME]
        # where the processes write by default is one of them (module defaults, the image's HOME)
        assert env(c).get("HOME") in (None, IMAGE_HOME)  # the image's ENV, not overridden
    # a user's volume cannot take one of those paths (Kubernetes refuses two at one path)
    with pytest.raises(ComponentArgError, match="dst=/tmp is where the pods mount"):
        train(spec=spec, image=IMAGE, etcd="etcd:2379",
              mounts=["type=volume", "src=scratch", "dst=/tmp"])  # fmt: skip


def test_the_controller_is_ready_once_it_serves_its_metrics() -> None:
    """A readiness probe on the controller's metrics port (`GET /metrics`, the port by name):
    the pod reads ready from the moment the controller supervises the job. No probe on the
    trainers (nothing listens there), none without metrics. Before, no probe at all."""
    spec = str(REPO / "examples" / "vit-digits.yaml")
    job = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379"))
    c = container(tasks(job, "controller")[0])
    probe = c["readinessProbe"]
    assert probe["httpGet"] == {"path": "/metrics", "port": METRICS_PORT_NAME}
    assert {p["name"] for p in c["ports"]} == {METRICS_PORT_NAME}
    assert probe["timeoutSeconds"] < probe["periodSeconds"]
    assert all("readinessProbe" not in container(t) for t in tasks(job, "trainer"))
    off = volcano_job(train(spec=spec, image=IMAGE, etcd="etcd:2379", metrics_port=0))
    assert "readinessProbe" not in container(tasks(off, "controller")[0])


def test_the_rehearsal_gives_the_pods_their_secret_variables_as_kubernetes_does(
    tmp_path: Path,
) -> None:
    """tests/rehearsal.py runs the pods' commands with the environment Kubernetes gives them:
    a `secretKeyRef` variable from the Secret the launch made (`create_launch_secrets`), the
    same value in the controller and the trainers; a Secret volume's files; a read-only root
    and /dev/shm of its limit. A missing Secret holds the pod, as the kubelet does. (Needs no
    namespaces: the pods are built, not started.)"""
    cluster = rehearsal.Cluster(tmp_path / "cluster")
    cluster.volumes.mkdir(parents=True)
    cluster.secrets["pipetransformer-db"] = {"PIPETRANSFORMER_DB": "postgresql+psycopg://x"}
    for role in ("controller", "trainer"):
        cluster.secrets[f"etcd-client-{role}"] = {f: f"{role} {f}" for f in ETCD_CERT_FILES}
    app = train(spec=str(REPO / "examples" / "vit-digits.yaml"), image=IMAGE,
                etcd="etcd:2379", nnodes=2)  # fmt: skip
    job = volcano_job(app)
    name = job["metadata"]["name"]
    with pytest.raises(AssertionError, match=f"Secret {name}-etcd-trainer .* does not exist"):
        rehearsal.role_pods(cluster, app, name)
    assert rehearsal.create_launch_secrets(cluster, job) == [f"{name}-etcd-trainer"]
    pods = rehearsal.role_pods(cluster, app, name)
    password = cluster.secrets[f"{name}-etcd-trainer"]["password"]
    assert pods["controller-0"].env["PIPETRANSFORMER_ETCD_TRAINER_PASSWORD"] == password
    for task in ("trainer-0", "trainer-1"):
        assert pods[task].env["PIPETRANSFORMER_ETCD_PASSWORD"] == password
        assert "PIPETRANSFORMER_ETCD_TRAINER_PASSWORD" not in pods[task].env
    assert "PIPETRANSFORMER_ETCD_PASSWORD" not in pods["controller-0"].env
    for task, pod in pods.items():
        assert pod.read_only_root, task
        assert pod.mounts["/dev/shm"].startswith("tmpfs:"), pod.mounts
        certs = Path(pod.mounts[ETCD_CERT_DIR])
        assert (certs / "tls.crt").read_text() == f"{task[:-2]} tls.crt"
        assert ETCD_CERT_DIR in pod.read_only
        # the rendered container's env, each `secretKeyRef` resolved, is the pod's
        rendered = rehearsal.rendered_containers(app, job)[task]
        for var in rendered["env"]:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            value = cluster.secrets[ref["name"]][ref["key"]] if ref else var["value"]
            assert pod.env[var["name"]] == value, (task, var["name"])
    trainer_shm = pods["trainer-0"].mounts["/dev/shm"]
    assert int(trainer_shm.removeprefix("tmpfs:")) == 512 << 20  # half of its 1024 MiB
