"""The Kubernetes manifests in k8s/, checked without a cluster: every overlay rendered with
`kubectl kustomize`, every object validated against its schema (tests/k8s_schemas.py: the
Kubernetes 1.30 schemas of kubernetes-validate, Volcano's and CloudNativePG's vendored CRD
schemas), then the rules schemas cannot see (no Secret values, non-root pods with requests and
no API token, no loopback addresses, documented Secrets only, etcd's quorum, the read-only
store role for the dashboard), and the PostgreSQL init script run for real.

The renders need `kubectl` (>= 1.27, kustomize v5; scripts/system-deps.sh) and skip without it;
everything else runs anywhere.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s_schemas import (
    CRD_SCHEMAS,
    SCHEMA_DIR,
    ManifestError,
    object_id,
    structural,
    validate_object,
)
from tests.pod_security import restricted_violations

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
OVERLAYS = ("dev", "gpu", "cloudnativepg")
RENDERS = ("base", *OVERLAYS)
PROJECT_IMAGE = "pipetransformer"

# Every Secret a manifest may reference, with its keys (k8s/README.md, "Secrets").
SECRETS: dict[str, set[str]] = {
    "postgres-credentials": {"password", "readonly-password"},
    "pipetransformer-db": {"PIPETRANSFORMER_DB"},
    "pipetransformer-db-readonly": {"PIPETRANSFORMER_DB"},
    "pipetransformer-dashboard-auth": {"tokens"},
    "pipetransformer-rdzv": {"PIPETRANSFORMER_RDZV_SECRET"},
    # etcd's TLS (k8s/README.md, "etcd: TLS and roles"): the members' certificate and one
    # client certificate per role, laid out as cert-manager writes them
    **{
        name: {"ca.crt", "tls.crt", "tls.key"}
        for name in (
            "etcd-member-tls",
            "etcd-client-root",
            "etcd-client-controller",
            "etcd-client-dashboard",
            "etcd-client-trainer",
        )
    },
    # cloudnativepg overlay: kubernetes.io/basic-auth Secrets the operator reads
    "postgres-owner": {"username", "password"},
    "postgres-readonly": {"username", "password"},
}
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet")
RBAC = ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
LOOPBACK = re.compile(r"(?<![\w.])(localhost|127(\.\d{1,3}){3}|::1|0:0:0:0:0:0:0:1)(?![\w])")


# -- rendering ---------------------------------------------------------------------------------


@functools.cache
def kubectl_problem() -> str | None:
    """Why the renders cannot run here, or None."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl is not installed (scripts/system-deps.sh installs it where apt has it)"
    try:
        done = subprocess.run(
            [kubectl, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`kubectl version --client` did not run: {exc}"
    if done.returncode != 0:
        return f"`kubectl version --client` failed: {done.stderr.strip()[:300]}"
    info = json.loads(done.stdout)
    kustomize = info.get("kustomizeVersion", "")
    major = re.match(r"v?(\d+)", kustomize)
    if not major or int(major.group(1)) < 5:
        client = info.get("clientVersion", {}).get("gitVersion", "?")
        return (
            f"kubectl {client} has kustomize {kustomize or '?'}; k8s/ needs kustomize v5 (>= 1.27)"
        )
    return None


def need_kubectl() -> None:
    if (reason := kubectl_problem()) is not None:
        pytest.skip(reason)


def render(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize path` as objects; a failed render fails the test with kustomize's words."""
    need_kubectl()
    done = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{done.stderr}", pytrace=False)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def _rendered(name: str) -> tuple[dict[str, Any], ...]:
    folder = K8S / "base" if name == "base" else K8S / "overlays" / name
    return tuple(render(folder))


def rendered(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_rendered(name)))


def k8s_copy(tmp_path: Path) -> Path:
    """A scratch copy of k8s/ to break or complete."""
    return Path(shutil.copytree(K8S, tmp_path / "k8s"))


# -- looking into objects ----------------------------------------------------------------------


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def absent(objects: list[dict[str, Any]], kind: str, name_prefix: str) -> bool:
    return not any(
        o["kind"] == kind and o["metadata"]["name"].startswith(name_prefix) for o in objects
    )


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_refs(obj: dict[str, Any]) -> Iterator[tuple[str, str | None, str]]:
    """(Secret name, key or None for all keys, where) for every Secret an object uses."""
    if obj["kind"] in WORKLOADS:
        pod = pod_spec(obj)
        for c in containers(pod):
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    yield ref["name"], ref["key"], f"{c['name']} env {e['name']}"
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    yield src["secretRef"]["name"], None, f"{c['name']} envFrom"
        for v in pod.get("volumes", []):
            if "secret" in v:
                items = v["secret"].get("items") or [{"key": None}]
                for item in items:
                    yield v["secret"]["secretName"], item["key"], f"volume {v['name']}"
            for src in (v.get("projected") or {}).get("sources", []):
                if "secret" in src:
                    for item in src["secret"].get("items") or [{"key": None}]:
                        yield src["secret"]["name"], item["key"], f"volume {v['name']}"
    if obj["kind"] == "Cluster":  # CloudNativePG
        spec = obj["spec"]
        initdb = spec.get("bootstrap", {}).get("initdb", {})
        if "secret" in initdb:
            yield initdb["secret"]["name"], None, "bootstrap.initdb.secret"
        if "superuserSecret" in spec:
            yield spec["superuserSecret"]["name"], None, "superuserSecret"
        for role in spec.get("managed", {}).get("roles", []):
            if "passwordSecret" in role:
                yield role["passwordSecret"]["name"], None, f"managed role {role['name']}"


def project_image(overlay: str) -> str:
    """The image the project's containers run in a render: base's placeholder, else the
    overlay's `images:` entry."""
    if overlay == "base":
        return f"{PROJECT_IMAGE}:latest"
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    (entry,) = [i for i in kustomization["images"] if i["name"] == PROJECT_IMAGE]
    return f"{entry.get('newName', PROJECT_IMAGE)}:{entry.get('newTag', 'latest')}"


# -- the rules schemas cannot see --------------------------------------------------------------


def problems(objects: list[dict[str, Any]]) -> list[str]:
    """Everything in a render that breaks the rules of k8s/README.md, one line each."""
    out: list[str] = []
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for obj in objects:
        where = object_id(obj)
        kind = obj["kind"]
        if kind == "Secret":
            out.append(f"{where}: Secret values never live in k8s/ (create them, k8s/README.md)")
        if kind in RBAC:
            out.append(f"{where}: nothing here calls the Kubernetes API; no RBAC to grant")
        if kind == "ServiceAccount" and obj.get("automountServiceAccountToken") is not False:
            out.append(f"{where}: automountServiceAccountToken must be false")
        if kind == "PersistentVolumeClaim" and obj["metadata"]["name"] == "pipetransformer-workdir":
            if obj["spec"].get("accessModes") != ["ReadWriteMany"]:
                out.append(f"{where}: the checkpoint volume must be ReadWriteMany")
        if kind == "Service":
            out.extend(_service_problems(obj, objects))
        for secret, key, via in secret_refs(obj):
            if secret not in SECRETS:
                out.append(f"{where}: {via} uses Secret {secret!r}, not a documented one")
            elif key is not None and key not in SECRETS[secret]:
                out.append(f"{where}: {via} uses key {key!r} of Secret {secret!r}")
        if kind not in WORKLOADS:
            continue
        pod = pod_spec(obj)
        if pod.get("automountServiceAccountToken") is not False:
            out.append(f"{where}: the pod must set automountServiceAccountToken: false")
        sa = pod.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in names:
            out.append(f"{where}: ServiceAccount {sa!r} is not in the render")
        pod_sc = pod.get("securityContext") or {}
        for c in containers(pod):
            out.extend(_container_problems(where, c, pod_sc))
    return out


def _container_problems(where: str, c: dict[str, Any], pod_sc: dict[str, Any]) -> list[str]:
    out = []
    at = f"{where} container {c['name']}"
    requests = (c.get("resources") or {}).get("requests") or {}
    if not {"cpu", "memory"} <= set(requests):
        out.append(f"{at}: needs resources.requests for cpu and memory")
    sc = {**pod_sc, **(c.get("securityContext") or {})}
    if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") in (0, None):
        out.append(f"{at}: must run as a non-root user (runAsNonRoot, runAsUser > 0)")
    if sc.get("allowPrivilegeEscalation") is not False:
        out.append(f"{at}: allowPrivilegeEscalation must be false")
    image = c.get("image", "")
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    if not name.endswith(PROJECT_IMAGE) and (not tag or tag == "latest"):
        out.append(f"{at}: image {image!r} must be pinned to a tag")
    texts = [*c.get("command", []), *c.get("args", [])]
    texts += [f"{e['name']}={e['value']}" for e in c.get("env", []) if "value" in e]
    for text in texts:
        if LOOPBACK.search(str(text)):
            out.append(f"{at}: {text!r} names a loopback address, which no other pod reaches")
    return out


def _service_problems(svc: dict[str, Any], objects: list[dict[str, Any]]) -> list[str]:
    where = object_id(svc)
    selector = svc["spec"].get("selector") or {}
    pods = [
        pod_spec(o) | {"_labels": o["spec"]["template"]["metadata"].get("labels", {})}
        for o in objects
        if o["kind"] in WORKLOADS
    ]
    matching = [p for p in pods if selector and selector.items() <= p["_labels"].items()]
    if not matching:
        return [f"{where}: selector {selector} matches no pod template in the render"]
    ports = {
        p.get("name") for pod in matching for c in pod["containers"] for p in c.get("ports", [])
    }
    numbers = {
        p["containerPort"]
        for pod in matching
        for c in pod["containers"]
        for p in c.get("ports", [])
    }
    out = []
    for port in svc["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if target not in (ports if isinstance(target, str) else numbers):
            out.append(f"{where}: targetPort {target!r} is no port of its pods")
    return out


# -- every render ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_validates_against_its_schema(name: str) -> None:
    objects = rendered(name)
    assert objects
    for obj in objects:
        validate_object(obj)


@pytest.mark.parametrize("name", RENDERS)
def test_renders_keep_the_rules(name: str) -> None:
    assert problems(rendered(name)) == []


@pytest.mark.parametrize("name", RENDERS)
def test_every_pod_passes_pod_security_restricted(name: str) -> None:
    for obj in rendered(name):
        if obj["kind"] in WORKLOADS:
            assert restricted_violations(pod_spec(obj)) == [], object_id(obj)


def test_the_restricted_rules_catch_what_a_namespace_would_refuse() -> None:
    pod = {
        "hostNetwork": True,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
        "containers": [
            {
                "name": "c",
                "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}, "privileged": True},
                "ports": [{"containerPort": 80, "hostPort": 80}],
            }
        ],
    }
    found = " ".join(restricted_violations(pod))
    for rule in (
        "hostNetwork",
        "hostPath",
        "privileged",
        "hostPort",
        "allowPrivilegeEscalation",
        "drop must include ALL",
        "NET_BIND_SERVICE",
    ):
        assert rule in found, rule


@pytest.mark.parametrize("name", RENDERS)
def test_project_containers_run_the_overlays_image(name: str) -> None:
    objects = rendered(name)
    images = {
        c["image"]
        for o in objects
        if o["kind"] in WORKLOADS
        for c in containers(pod_spec(o))
        if PROJECT_IMAGE in c["image"].rsplit("/", 1)[-1]
    }
    assert images == {project_image(name)}
    assert find(objects, "Job", "pipetransformer-db-upgrade")
    assert find(objects, "Deployment", "dashboard")


@pytest.mark.parametrize("name", RENDERS)
def test_etcd_is_a_three_member_cluster_with_probes_and_a_budget(name: str) -> None:
    objects = rendered(name)
    sts = find(objects, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "etcd-peers"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # members need each other to be ready
    pod = pod_spec(sts)
    (etcd,) = pod["containers"]
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", etcd["image"])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert etcd[probe]["httpGet"]["path"] in ("/livez", "/readyz", "/health"), probe
    env = env_of(etcd)
    # the initial cluster: exactly the StatefulSet's members, by their stable DNS names
    replicas = sts["spec"]["replicas"]
    expected = ",".join(
        f"etcd-{i}=https://etcd-{i}.etcd-peers.$(POD_NAMESPACE).svc:2380" for i in range(replicas)
    )
    assert env["ETCD_INITIAL_CLUSTER"]["value"] == expected
    assert env["ETCD_NAME"]["value"] == "$(POD_NAME)"
    own = "https://$(POD_NAME).etcd-peers.$(POD_NAMESPACE).svc"
    assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]["value"] == f"{own}:2380"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"]["value"] == f"{own}:2379"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert pod["enableServiceLinks"] is False  # no ETCD_* variables from Service `etcd`
    # data on a claim per member, where ETCD_DATA_DIR points
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mount = {m["name"]: m["mountPath"] for m in etcd["volumeMounts"]}[claim["metadata"]["name"]]
    assert env["ETCD_DATA_DIR"]["value"].startswith(mount + "/")
    # peers find each other before they are ready; clients use etcd:2379
    peers = find(objects, "Service", "etcd-peers")["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    assert 2380 in {p["port"] for p in peers["ports"]}
    client = find(objects, "Service", "etcd")["spec"]
    assert [p["port"] for p in client["ports"]] == [2379]
    assert client.get("publishNotReadyAddresses") is not True
    pdb = find(objects, "PodDisruptionBudget", "etcd")["spec"]
    assert pdb["minAvailable"] == 2
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


def etcd_identity(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the container, the Secret) of a workload that talks to etcd: its
    PIPETRANSFORMER_ETCD_CACERT/CERT/KEY name files of one mounted Secret's keys."""
    pod = pod_spec(obj)
    (container,) = pod["containers"]
    env = env_of(container)
    paths = {var: Path(env[f"PIPETRANSFORMER_ETCD_{var}"]["value"]) for var in TLS_FILES}
    (folder,) = {path.parent for path in paths.values()}
    mount = {m["mountPath"]: m for m in container["volumeMounts"]}[str(folder)]
    assert mount["readOnly"] is True
    secret = {v["name"]: v for v in pod["volumes"]}[mount["name"]]["secret"]
    items = {item["path"]: item["key"] for item in secret["items"]}
    assert {items[path.name] for path in paths.values()} == {"ca.crt", "tls.crt", "tls.key"}
    assert items[paths["KEY"].name] == "tls.key" and items[paths["CERT"].name] == "tls.crt"
    assert secret["defaultMode"] & 0o007 == 0  # the key: no one but the pod's user and group
    return container, secret["secretName"]


TLS_FILES = ("CACERT", "CERT", "KEY")


@pytest.mark.parametrize("name", RENDERS)
def test_etcd_serves_tls_and_takes_only_certificates_of_its_ca(name: str) -> None:
    objects = rendered(name)
    sts = find(objects, "StatefulSet", "etcd")
    pod = pod_spec(sts)
    (etcd,) = pod["containers"]
    env = {k: v.get("value") for k, v in env_of(etcd).items()}
    for listen in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS"):
        assert env[listen].startswith("https://"), listen
    assert env["ETCD_LISTEN_METRICS_URLS"].startswith("http://")  # the probes' port: no data
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert env["ETCD_PEER_CERT_ALLOWED_CN"] == "etcd-peer"  # no client certificate joins
    mount = {m["name"]: m for m in etcd["volumeMounts"]}["tls"]
    secret = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]
    assert secret["secretName"] == "etcd-member-tls" and mount["readOnly"] is True
    files = {f"{mount['mountPath']}/{item['path']}": item["key"] for item in secret["items"]}
    for var, key in (
        ("ETCD_CERT_FILE", "tls.crt"),
        ("ETCD_KEY_FILE", "tls.key"),
        ("ETCD_TRUSTED_CA_FILE", "ca.crt"),
        ("ETCD_PEER_CERT_FILE", "tls.crt"),
        ("ETCD_PEER_KEY_FILE", "tls.key"),
        ("ETCD_PEER_TRUSTED_CA_FILE", "ca.crt"),
    ):
        assert files[env[var]] == key, var
    # group-readable for the etcd user (fsGroup), nobody else
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    assert secret["defaultMode"] == 0o440


@pytest.mark.parametrize("name", RENDERS)
def test_each_etcd_client_here_shows_its_roles_certificate(name: str) -> None:
    objects = rendered(name)
    job = find(objects, "Job", "pipetransformer-etcd-auth")
    container, secret = etcd_identity(job)
    assert secret == "etcd-client-root"  # etcd's root: `setup` creates users and enables auth
    assert [*container["command"], *container["args"]] == [
        "pipetransformer",
        "etcd-auth",
        "setup",
        "--etcd",
        "etcd:2379",
    ]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    _, secret = etcd_identity(find(objects, "Deployment", "dashboard"))
    assert secret == "etcd-client-dashboard"


def test_cert_manager_example_makes_the_documented_secrets() -> None:
    """k8s/cert-manager, apart from the base (cert-manager's CRDs may not exist): a CA and,
    signed by it, each etcd Secret the manifests and the pods use, with the CN etcd takes for
    the user (orchestrator/etcd_auth.py) and the members' DNS names."""
    from pipetransformer.orchestrator import etcd_auth

    objects = render(K8S / "cert-manager")
    for name in RENDERS:
        assert not any(o["apiVersion"].startswith("cert-manager.io/") for o in rendered(name))
    certificates = {
        o["spec"]["secretName"]: o["spec"] for o in objects if o["kind"] == "Certificate"
    }
    assert certificates.pop("etcd-ca")["isCA"] is True
    assert set(certificates) == {name for name in SECRETS if name.startswith("etcd-")}
    names = {
        "etcd-member-tls": "etcd-peer",
        "etcd-client-root": etcd_auth.ROOT_USER,
        "etcd-client-controller": etcd_auth.CONTROLLER_USER,
        "etcd-client-dashboard": etcd_auth.DASHBOARD_USER,
        "etcd-client-trainer": etcd_auth.TRAINER_CERT_CN,
    }
    for secret, spec in certificates.items():
        assert spec["commonName"] == names[secret], secret
        assert spec["issuerRef"] == {"name": "etcd-ca", "kind": "Issuer"}
        assert "client auth" in spec["usages"]
    member = certificates["etcd-member-tls"]
    assert "server auth" in member["usages"]
    assert {"etcd", "*.etcd-peers.pipetransformer.svc"} <= set(member["dnsNames"])
    issuer = find(objects, "Issuer", "etcd-ca")
    assert issuer["spec"]["ca"]["secretName"] == "etcd-ca"


@pytest.mark.parametrize("name", ["base", "dev", "gpu"])
def test_postgres_statefulset_takes_credentials_only_from_secrets(name: str) -> None:
    objects = rendered(name)
    sts = find(objects, "StatefulSet", "postgres")
    pod = pod_spec(sts)
    (pg,) = pod["containers"]
    assert re.fullmatch(r"postgres:16(\.\d+)?(-\w+)?", pg["image"])
    env = env_of(pg)
    for var in ("POSTGRES_PASSWORD", "POSTGRES_READONLY_PASSWORD"):
        assert "value" not in env[var]
        assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "postgres-credentials"
    assert not [e for e in pg.get("env", []) if "PASSWORD" in e["name"] and "value" in e]
    for probe in ("livenessProbe", "readinessProbe"):
        assert pg[probe]["exec"]["command"][0] == "pg_isready"
    assert sts["spec"]["volumeClaimTemplates"]
    assert [p["port"] for p in find(objects, "Service", "postgres")["spec"]["ports"]] == [5432]
    # the init script, from its ConfigMap (name with kustomize's hash), at the image's init dir
    mounts = {m["mountPath"]: m["name"] for m in pg["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts["/docker-entrypoint-initdb.d"]]
    cm = find(objects, "ConfigMap", volume["configMap"]["name"])
    script = (K8S / "base" / "postgres-initdb" / "10-pipetransformer.sh").read_text()
    assert cm["data"] == {"10-pipetransformer.sh": script}
    assert volume["configMap"]["defaultMode"] & 0o111  # executable: run, not sourced


@pytest.mark.parametrize("name", RENDERS)
def test_migrations_and_dashboard_use_their_store_roles(name: str) -> None:
    objects = rendered(name)
    (migrate,) = pod_spec(find(objects, "Job", "pipetransformer-db-upgrade"))["containers"]
    assert [*migrate["command"], *migrate.get("args", [])] == ["pipetransformer", "db", "upgrade"]
    ref = env_of(migrate)["PIPETRANSFORMER_DB"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "pipetransformer-db", "key": "PIPETRANSFORMER_DB"}

    deployment = find(objects, "Deployment", "dashboard")
    pod = pod_spec(deployment)
    (dash,) = pod["containers"]
    assert [*dash["command"], *dash["args"]] == [
        "pipetransformer",
        "dashboard",
        "--host",
        "0.0.0.0",
        "--port",
        "8501",
        "--etcd",
        "etcd:2379",
    ]
    env = env_of(dash)
    ref = env["PIPETRANSFORMER_DB"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "pipetransformer-db-readonly", "key": "PIPETRANSFORMER_DB"}
    assert "pipetransformer-db" not in {s for s, _, _ in secret_refs(deployment)}
    token_file = Path(env["PIPETRANSFORMER_DASHBOARD_TOKEN_FILE"]["value"])
    assert token_file == Path("/etc/pipetransformer/dashboard/tokens")
    mount = {m["mountPath"]: m for m in dash["volumeMounts"]}[str(token_file.parent)]
    assert mount["readOnly"] is True
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]["secret"]
    assert volume["secretName"] == "pipetransformer-dashboard-auth"
    assert volume["items"] == [{"key": "tokens", "path": token_file.name}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert dash[probe]["httpGet"]["path"] == "/_stcore/health"
    service = find(objects, "Service", "dashboard")["spec"]
    assert [p["port"] for p in service["ports"]] == [8501]


@pytest.mark.parametrize("name", RENDERS)
def test_volcano_queue_priority_class_and_service_account(name: str) -> None:
    objects = rendered(name)
    queue = find(objects, "Queue", "pipetransformer")
    assert queue["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert {"weight", "reclaimable", "capability"} <= set(queue["spec"])
    assert "namespace" not in queue["metadata"]  # cluster-scoped
    priority = find(objects, "PriorityClass", "pipetransformer-training")
    assert priority["value"] >= 1000 and priority["description"]
    assert priority["preemptionPolicy"] in ("Never", "PreemptLowerPriority")
    assert priority.get("globalDefault") is not True
    sa = find(objects, "ServiceAccount", "pipetransformer")
    assert sa["automountServiceAccountToken"] is False
    pvc = find(objects, "PersistentVolumeClaim", "pipetransformer-workdir")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_gpu_overlay_keeps_cluster_pods_off_gpu_nodes_and_lets_the_queue_hand_out_gpus() -> None:
    objects = rendered("gpu")
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    assert len(workloads) == 5
    for obj in workloads:
        pod = pod_spec(obj)
        terms = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        expressions = [e for t in terms for e in t["preference"]["matchExpressions"]]
        assert {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]} in (
            expressions
        ), object_id(obj)
        for c in containers(pod):  # nothing cluster-side asks for a GPU
            resources = c.get("resources", {})
            assert not any("gpu" in k for part in resources.values() for k in part), c["name"]
    capability = find(objects, "Queue", "pipetransformer")["spec"]["capability"]
    assert capability["nvidia.com/gpu"] == "8" and "cpu" in capability


def test_cloudnativepg_overlay_replaces_the_statefulset_with_a_cluster() -> None:
    objects = rendered("cloudnativepg")
    assert absent(objects, "StatefulSet", "postgres")
    assert absent(objects, "Service", "postgres")  # the operator makes postgres-rw, -ro, -r
    assert absent(objects, "ConfigMap", "postgres-initdb")
    assert absent(objects, "NetworkPolicy", "postgres")
    cluster = find(objects, "Cluster", "postgres")
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    spec = cluster["spec"]
    assert spec["imageName"].startswith("ghcr.io/cloudnative-pg/postgresql:16.")
    initdb = spec["bootstrap"]["initdb"]
    assert (initdb["database"], initdb["owner"]) == ("pipetransformer", "pipetransformer")
    sql = " ".join(initdb["postInitApplicationSQL"])
    assert (
        "ALTER DEFAULT PRIVILEGES FOR ROLE pipetransformer IN SCHEMA public "
        "GRANT SELECT ON TABLES TO pipetransformer_ro" in sql
    )
    (role,) = spec["managed"]["roles"]
    assert role["name"] == "pipetransformer_ro" and role["login"] is True
    assert {name for name, _, _ in secret_refs(cluster)} == {"postgres-owner", "postgres-readonly"}
    assert spec["enableSuperuserAccess"] is False
    # everything else of the base is still there
    assert find(objects, "StatefulSet", "etcd") and find(objects, "Deployment", "dashboard")


def test_dev_secrets_come_from_git_ignored_files(tmp_path: Path) -> None:
    k8s = k8s_copy(tmp_path)
    folder = k8s / "overlays" / "dev" / "secrets"
    files = {
        "postgres-credentials.env": "password=owner-pw\nreadonly-password=ro-pw\n",
        "pipetransformer-db.env": "PIPETRANSFORMER_DB=postgresql+psycopg://pipetransformer:"
        "owner-pw@postgres:5432/pipetransformer\n",
        "pipetransformer-db-readonly.env": "PIPETRANSFORMER_DB=postgresql+psycopg://"
        "pipetransformer_ro:ro-pw@postgres:5432/pipetransformer\n",
        "tokens": "alice:sha256:" + "ab" * 32 + "\n",
        "pipetransformer-rdzv.env": "PIPETRANSFORMER_RDZV_SECRET=" + "cd" * 32 + "\n",
    }
    ignored = [
        line
        for line in (folder / ".gitignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    for name, text in files.items():
        (folder / name).write_text(text)
        assert any(fnmatch.fnmatch(name, pattern) for pattern in ignored), name
    # etcd's certificates, as k8s/README.md makes them: a folder git ignores whole
    certs = folder / "etcd-certs"
    made = subprocess.run(
        [str(REPO / "scripts" / "make-etcd-certs.sh"), str(certs)], capture_output=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    assert "etcd-certs/" in ignored
    secrets = render(folder)
    expected = ("postgres-credentials", "pipetransformer-db", "pipetransformer-db-readonly")
    expected += ("pipetransformer-dashboard-auth", "pipetransformer-rdzv")
    expected += tuple(name for name in SECRETS if name.startswith("etcd-"))
    assert {s["metadata"]["name"]: set(s["data"]) for s in secrets} == {
        name: SECRETS[name] for name in expected
    }
    for secret in secrets:
        assert secret["kind"] == "Secret"
        validate_object(secret)
    # the dev overlay itself has no Secrets: it applies without these files
    assert not [o for o in rendered("dev") if o["kind"] == "Secret"]


# -- broken manifests are refused, naming the field -------------------------------------------


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new))


def _first_error(objects: list[dict[str, Any]]) -> ManifestError:
    for obj in objects:
        try:
            validate_object(obj)
        except ManifestError as exc:
            return exc
    pytest.fail("every object validated")


def test_a_broken_overlay_fails_validation_naming_the_field(tmp_path: Path) -> None:
    k8s = k8s_copy(tmp_path)
    _edit(k8s / "base" / "etcd.yaml", "replicas: 3 #", 'replicas: "three" #')
    error = _first_error(render(k8s / "overlays" / "dev"))
    assert (error.where, error.field) == ("StatefulSet/etcd", "spec.replicas")
    assert "'three' is not of type 'integer'" in str(error)

    k8s = k8s_copy(tmp_path / "2")
    dashboard = k8s / "base" / "dashboard.yaml"
    _edit(dashboard, "  selector:\n    matchLabels:\n      app.kubernetes.io/name: dashboard\n", "")
    error = _first_error(render(k8s / "overlays" / "gpu"))
    assert error.where == "Deployment/dashboard" and "'selector' is a required property" in str(
        error
    )

    k8s = k8s_copy(tmp_path / "3")
    _edit(
        k8s / "overlays" / "gpu" / "queue-gpus.yaml",
        "  capability:",
        "  weight: heavy\n  capability:",
    )
    error = _first_error(render(k8s / "overlays" / "gpu"))
    assert (error.where, error.field) == ("Queue/pipetransformer", "spec.weight")


def test_the_rules_catch_what_schemas_let_through(tmp_path: Path) -> None:
    k8s = k8s_copy(tmp_path)
    dashboard = k8s / "base" / "dashboard.yaml"
    _edit(dashboard, '"--etcd", "etcd:2379"', '"--etcd", "127.0.0.1:2379"')
    _edit(dashboard, "secretName: pipetransformer-dashboard-auth", "secretName: my-tokens")
    _edit(
        dashboard,
        "automountServiceAccountToken: false\n      enableServiceLinks",
        "enableServiceLinks",
    )
    _edit(k8s / "base" / "db-upgrade-job.yaml", "runAsNonRoot: true", "runAsNonRoot: false")
    _edit(k8s / "base" / "workdir-pvc.yaml", "- ReadWriteMany", "- ReadWriteOnce")
    _edit(k8s / "base" / "etcd.yaml", "cpu: 100m\n", "")
    objects = render(k8s / "overlays" / "dev")
    for obj in objects:
        validate_object(obj)  # all still valid objects
    found = "\n".join(problems(objects))
    assert "'127.0.0.1:2379' names a loopback address" in found
    assert "uses Secret 'my-tokens', not a documented one" in found
    assert "Deployment/dashboard: the pod must set automountServiceAccountToken: false" in found
    assert "Job/pipetransformer-db-upgrade container db-upgrade: must run as a non-root" in found
    assert "the checkpoint volume must be ReadWriteMany" in found
    assert "StatefulSet/etcd container etcd: needs resources.requests" in found


def test_a_wrong_queue_fails_against_volcanos_schema() -> None:
    queue = {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "Queue",
        "metadata": {"name": "pipetransformer"},
        "spec": {"weight": 1, "reclaimable": True, "capability": {"cpu": "4", "memory": "8Gi"}},
    }
    validate_object(queue)
    cases = [
        ("weight", "heavy", "spec.weight", "'heavy' is not of type 'integer'"),
        ("weight", 0, "spec.weight", "less than the minimum of 1"),
        ("reclaimable", "yes", "spec.reclaimable", "'yes' is not of type 'boolean'"),
        ("capability", {"cpu": "lots"}, "spec.capability.cpu", "does not match"),
        ("weigth", 2, "spec", "'weigth' was unexpected"),
    ]
    for field, value, path, message in cases:
        broken = copy.deepcopy(queue)
        broken["spec"][field] = value
        with pytest.raises(ManifestError) as caught:
            validate_object(broken)
        assert (caught.value.where, caught.value.field) == ("Queue/pipetransformer", path)
        assert message in str(caught.value)
    nameless = copy.deepcopy(queue)
    del nameless["metadata"]["name"]
    with pytest.raises(ManifestError, match="metadata.name"):
        validate_object(nameless)


def test_a_volcano_job_is_checked_by_its_crd_and_its_pod_templates() -> None:
    pod = {"containers": [{"name": "trainer", "image": "registry.example/pipetransformer:1"}]}
    job = {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "vit-digits-abc"},
        "spec": {
            "queue": "pipetransformer",
            "schedulerName": "volcano",
            "tasks": [{"name": "trainer-0", "replicas": 1, "template": {"spec": pod}}],
        },
    }
    validate_object(job)
    broken = copy.deepcopy(job)
    broken["spec"]["tasks"][0]["maxRetry"] = "three"
    with pytest.raises(ManifestError, match=r"spec\.tasks\.0\.maxRetry"):
        validate_object(broken)
    broken = copy.deepcopy(job)
    broken["spec"]["tasks"][0]["replicas"] = 2**31  # format int32
    with pytest.raises(ManifestError, match=r"spec\.tasks\.0\.replicas"):
        validate_object(broken)
    broken = copy.deepcopy(job)  # a Pod field the CRD schema leaves open, the core schema not
    broken["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"cpu": []}
    }
    with pytest.raises(ManifestError, match=r"spec\.tasks\.0\.template\.spec\.containers\.0"):
        validate_object(broken)


def test_unknown_kinds_and_core_errors_are_named() -> None:
    with pytest.raises(ManifestError, match="no schema"):
        validate_object(
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
        )
    docs = [d for d in yaml.safe_load_all((K8S / "base" / "etcd.yaml").read_text()) if d]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    validate_object(sts)
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "2379"
    with pytest.raises(ManifestError) as caught:
        validate_object(sts)
    assert caught.value.field == "spec.template.spec.containers.0.ports.0.containerPort"


def test_structural_reading_of_crd_schemas() -> None:
    schema = structural(
        {
            "type": "object",
            "properties": {
                "port": {"x-kubernetes-int-or-string": True},
                "note": {"type": "string", "nullable": True},
                "free": {
                    "type": "object",
                    "properties": {"a": {"type": "string"}},
                    "x-kubernetes-preserve-unknown-fields": True,
                },
                "list": {"type": "array", "x-kubernetes-list-type": "set", "items": {}},
            },
        }
    )
    assert schema["additionalProperties"] is False
    assert schema["properties"]["port"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert schema["properties"]["note"]["type"] == ["string", "null"]
    assert "additionalProperties" not in schema["properties"]["free"]
    assert not [k for k in json.dumps(schema).split('"') if k.startswith("x-kubernetes-")]


# -- optional monitoring (k8s/monitoring) ----------------------------------------------------------

# spec fields of the Prometheus Operator's PodMonitor (monitoring.coreos.com/v1) this file may
# use, and of its endpoints: the few it needs, spelled as the CRD spells them
PODMONITOR_SPEC = {
    "selector",
    "podMetricsEndpoints",
    "namespaceSelector",
    "podTargetLabels",
    "jobLabel",
}
PODMONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
DURATION = re.compile(r"(\d+(ms|s|m|h))+")


def test_monitoring_renders_apart_from_the_base() -> None:
    """k8s/monitoring: a PodMonitor (its CRD may not exist: never in the base or an overlay)
    and the Grafana dashboard as a ConfigMap for Grafana's dashboard sidecar."""
    objects = render(K8S / "monitoring")
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "PodMonitor"]
    for name in RENDERS:
        assert not any(o["kind"] == "PodMonitor" for o in rendered(name)), name
    dashboard = find(objects, "ConfigMap", "pipetransformer-grafana-dashboard")
    validate_object(dashboard)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = (K8S / "monitoring" / "grafana-dashboard.json").read_text()
    assert json.loads(dashboard["data"]["grafana-dashboard.json"]) == json.loads(source)

    monitor = find(objects, "PodMonitor", "pipetransformer-controller")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= PODMONITOR_SPEC, set(monitor["spec"]) - PODMONITOR_SPEC
    assert "namespaceSelector" not in monitor["spec"]  # its own namespace: the jobs'
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels == {
        "app.kubernetes.io/part-of": "pipetransformer",
        "torchx.pytorch.org/role-name": "controller",
    }
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert set(endpoint) <= PODMONITOR_ENDPOINT, set(endpoint) - PODMONITOR_ENDPOINT
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        for field in ("interval", "scrapeTimeout"):
            assert DURATION.fullmatch(endpoint[field]), endpoint[field]
    assert not problems([dashboard])


# -- sources, without rendering ------------------------------------------------------------------


def test_source_manifests_validate_without_kustomize() -> None:
    files = sorted((K8S / "base").glob("*.yaml")) + [K8S / "overlays/cloudnativepg/cluster.yaml"]
    files.remove(K8S / "base" / "kustomization.yaml")
    count = 0
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                validate_object(doc)
                count += 1
    assert count >= 15


def test_vendored_schemas_record_their_source_and_license() -> None:
    for relative in CRD_SCHEMAS.values():
        path = SCHEMA_DIR / relative
        schema = json.loads(path.read_text())
        source = schema["x-source"]
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
        assert source["repository"].startswith("https://github.com/")
        assert source["license"] == "Apache-2.0"
        assert source["commit"] in schema["$comment"]
        readme = (path.parent / "README.md").read_text()
        assert source["commit"] in readme and source["path"] in readme, path
        assert "Apache License" in (path.parent / "LICENSE").read_text()


def test_pod_overlay_merges_into_a_trainer_pod_through_torchx() -> None:
    overlays = pytest.importorskip("torchx.specs.overlays")
    from torchx.specs import Role

    path = K8S / "overlays" / "gpu" / "pod-overlay.yaml"
    fragment = yaml.safe_load(path.read_text())
    assert set(fragment) == {"spec"}
    role = Role(name="trainer", image="img", metadata={"kubernetes": f"file://{path}"})
    overlay = overlays.get_overlay(role, "kubernetes", "V1Pod")
    assert overlay == fragment
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer-0"},
        "spec": {
            "containers": [{"name": "trainer-0", "image": "img"}],
            "tolerations": [{"key": "other", "operator": "Exists"}],
        },
    }
    overlays.apply_overlay(pod, overlay)
    validate_object(pod)
    # no node selector: the GPU request places the pod; NFD's labels exist only where it runs
    assert "nodeSelector" not in pod["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        pod["spec"]["tolerations"]
    )
    assert len(pod["spec"]["tolerations"]) == 2  # appended to what torchx generated


def test_readme_documents_the_secrets_overlays_and_steps() -> None:
    readme = (K8S / "README.md").read_text()
    for secret in SECRETS:
        assert re.search(rf"kubectl create secret generic {secret}\b", readme), secret
    for overlay in OVERLAYS:
        assert f"k8s/overlays/{overlay}" in readme
    for text in (
        "kubectl port-forward svc/dashboard 8501",
        "kustomize edit set image pipetransformer=",
        "pod-overlay.yaml",
        "postgres-rw",
        "Volcano",
        "pipetransformer-db-upgrade",
        "torchx run -s kubernetes",
        "kubectl apply -k k8s/monitoring",
        "prometheus.io/scrape",
        "grafana-dashboard.json",
        "--metrics_port",
        "## etcd: TLS and roles",
        "scripts/make-etcd-certs.sh",
        "kubectl apply -k k8s/cert-manager",
        "pipetransformer-etcd-auth",
        "pipetransformer etcd-auth setup",
    ):
        assert text in readme, text


# -- the init script, on a real server ---------------------------------------------------------


def test_postgres_init_script_makes_a_read_only_role_for_later_tables(private_postgres) -> None:
    import psycopg

    from pipetransformer.core.spec import load_spec
    from pipetransformer.store import Store

    server = private_postgres
    env = {
        **os.environ,
        "PATH": f"{server.bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PGHOST": "127.0.0.1",
        "PGPORT": str(server.port),
        "POSTGRES_USER": "postgres",
        "POSTGRES_PASSWORD": "owner pass'word",  # quoting is psql's, not the shell's
        "POSTGRES_READONLY_PASSWORD": "read-only-password",
    }
    script = K8S / "base" / "postgres-initdb" / "10-pipetransformer.sh"
    done = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    def url(user: str) -> str:
        return f"postgresql+psycopg://{user}@127.0.0.1:{server.port}/pipetransformer"

    def connect(user: str, db: str = "pipetransformer") -> psycopg.Connection:
        return psycopg.connect(
            host="127.0.0.1", port=server.port, user=user, dbname=db, autocommit=True
        )

    with connect("postgres", "postgres") as conn:
        passwords = dict(
            conn.execute(
                "SELECT rolname, rolpassword FROM pg_authid WHERE rolname IN "
                "('postgres', 'pipetransformer', 'pipetransformer_ro')"
            ).fetchall()
        )
    assert passwords["postgres"] is None  # the superuser: local socket only
    assert passwords["pipetransformer"].startswith("SCRAM-SHA-256$")
    assert passwords["pipetransformer_ro"].startswith("SCRAM-SHA-256$")

    # the migrations, as the owner (what Job pipetransformer-db-upgrade does), then a job
    with Store.open(url("pipetransformer"), retry_s=0) as owner:
        owner.create_job("k8s-job", load_spec(REPO / "examples" / "vit-digits.yaml"), "/workdir")
    # the dashboard: `pipetransformer dashboard` opens the store (a no-op upgrade), then reads
    Store.open(url("pipetransformer_ro"), retry_s=0).close()
    with Store(url("pipetransformer_ro"), read_only=True, retry_s=0) as reader:
        assert [j.id for j in reader.list_jobs()] == ["k8s-job"]
    # a table a later migration adds is readable too (ALTER DEFAULT PRIVILEGES)
    with connect("pipetransformer") as conn:
        conn.execute("CREATE TABLE added_later (x integer)")
        conn.execute("INSERT INTO added_later VALUES (1)")
    with connect("pipetransformer_ro") as conn:
        assert conn.execute("SELECT x FROM added_later").fetchall() == [(1,)]
        for statement in (
            "DELETE FROM jobs",
            "CREATE TABLE mine (x integer)",
            "SET default_transaction_read_only = off; INSERT INTO added_later VALUES (2)",
        ):
            with pytest.raises(psycopg.Error):
                conn.execute(statement)
