"""A local rehearsal of the Kubernetes deployment: the job's pods as processes on one machine.

Each "pod" runs the command, arguments and environment Kubernetes would run, in namespaces of
its own, so what works here works because the pods reach each other as they would on a
cluster, not through the shortcuts of one machine:

- **Network.** A Linux bridge in the root namespace (`ptbr-<tag>`, 10.X.Y.1/24) and one network
  namespace per pod with a veth into it, its own address and its own `lo`: a pod's 127.0.0.1
  reaches only that pod. No default route: nothing beyond the bridge. Names resolve per pod
  through `/etc/netns/<netns>/hosts`, which `ip netns exec` bind-mounts over /etc/hosts: the
  Services `etcd` and `postgres`, etcd's peer name, the pod itself as kubelet writes it
  (`IP FQDN HOSTNAME`), and the job's pods by the names Volcano's `svc` plugin gives them
  (`<pod>.<job>` and the FQDN, through the job's headless Service), rewritten in place when a
  pod comes back at a new address. `/etc/netns/<netns>/resolv.conf` names a nameserver that
  refuses at once (see `_write_hosts`).
- **Processes, host name, IPC, mounts.** `unshare --mount --uts --ipc --pid --fork --mount-proc`:
  the pod's command is PID 1 of its own PID namespace, as in a container (killing the pod kills
  every process in it, whatever session they made), its host name is the pod's name (what
  torchrun and gloo advertise: `socket.getfqdn()`, the host name's address), and its mounts
  are its own.
- **Volumes.** Bind mounts onto the paths the pod spec names, in the pod's mount namespace: a
  PersistentVolumeClaim is one host folder per claim shared by every pod that mounts it (the
  ReadWriteMany checkpoint volume), an emptyDir a fresh folder of that pod's own, an emptyDir
  in memory a tmpfs of its `sizeLimit` (torchx's /dev/shm), a Secret a folder of its items
  (read-only where the mount says so); HOME is the image's, /home/pipetransformer, on a
  tmpfs over /home (its volume, where the pod mounts one, over that). Bind-mounting rather than
  rewriting paths in the commands keeps the pods'
  commands, environment and what they record (checkpoint paths in the store are /workdir/...)
  exactly as on a cluster. Mount points must exist: /workdir and /cache are created on the
  host when missing, as empty folders, and left there (removing one would unmount it in the
  pods of a concurrent run). A pod without a volume at the image's WORKDIR (/workdir) gets the
  image's folder there: a tmpfs holding `runs/`, as the Dockerfile makes it.
- **Root file system.** A container with `readOnlyRootFilesystem` gets `/` and the image's
  folders above remounted read-only in its mount namespace once its volumes are mounted: a
  write anywhere but a volume fails (EROFS, even as root), as in the container.
- **Environment.** Only what the container would get: the image's variables (PATH with this
  venv's bin first: `python` and `pipetransformer` resolve to it, as to the image's venv, which
  has the project installed, so the working directory is the image's /workdir, not this
  checkout), the container's `env`, its `envFrom` Secrets and the variables it reads from a
  Secret (`valueFrom.secretKeyRef`; the Secrets a launch makes: `create_launch_secrets`),
  HOSTNAME, and the Service links Kubernetes injects (`ETCD_SERVICE_HOST`, `ETCD_PORT`, ...:
  torchx's pods keep them).
- **Memory and CPU.** Each pod of the job gets cgroups of its own when the machine allows them
  (v1 or v2; nothing is limited), sampled for its peak memory (anonymous + shared, what counts
  against a container's limit once page cache is reclaimed), to compare with the limits torchx
  puts on the pods, and for its CPU time (what the rehearsal costs a shared machine).

Not rehearsed: the pods run as root (the image runs as uid 10001, but this venv's interpreter
may live where that user cannot reach it), no CPU or memory limits, no kube-proxy (a Service
name resolves to its one pod's address), no cluster DNS server, no probes, no restart policy
(the test itself recreates a lost pod, as Volcano would).

Everything a run creates is removed by `Cluster.close()`, and recorded under /run so that a run
killed before its teardown is cleaned up by the next one (`reap_stale`); the pods themselves
die with the process that started them (parent-death signal).

    with Cluster(tmp_path) as cluster:
        etcd = cluster.start_etcd()
        pg, owner_url, readonly_url = cluster.start_postgres()
        pod = cluster.start(PodSpec(...), "short-name")
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "default"
SVC_DOMAIN = f"{NAMESPACE}.svc.cluster.local"
VENV_BIN = Path(sys.executable).parent  # the "image": its python has the project installed
IMAGE_HOME = "/home/pipetransformer"  # the image's HOME (Dockerfile)
IMAGE_WORKDIR = "/workdir"  # the image's WORKDIR
ETCD_PORT = 2379
POSTGRES_PORT = 5432
DB_NAME = "pipetransformer"  # k8s/base/postgres-initdb: the owner role and its database
POSTGRES_INITDB = REPO / "k8s" / "base" / "postgres-initdb" / "10-pipetransformer.sh"
DB_UPGRADE_JOB = REPO / "k8s" / "base" / "db-upgrade-job.yaml"
STATE_DIR = Path("/run/pipetransformer-rehearsal")  # what each live run created, for reaping
LOG_TAIL_LINES = 30
TOOLS = ("ip", "unshare", "nsenter", "setpriv", "mount", "hostname", "mkdir")


def tool(name: str) -> str:
    """A tool's absolute path (pods' PATHs need not hold it)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise RuntimeError(f"`{name}` is missing (iproute2 / util-linux / coreutils)")
    return found


def image_env() -> dict[str, str]:
    """The environment every container of the image starts with (Dockerfile ENV, the base
    image's LANG), before the pod spec's own."""
    return {
        "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "VIRTUAL_ENV": str(VENV_BIN.parent),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": IMAGE_HOME,
        "LANG": "C.UTF-8",
    }


def missing() -> str | None:
    """Why this machine cannot host the rehearsal's namespaces, or None when it can (the
    services' binaries are checked by `require_services`)."""
    if not sys.platform.startswith("linux"):
        return "needs Linux (network, PID and mount namespaces)"
    if os.geteuid() != 0:
        return "needs root: it creates a bridge, network namespaces and mounts"
    for name in TOOLS:
        try:
            tool(name)
        except RuntimeError as exc:
            return str(exc)
    # every kind of namespace a pod gets, and a bridge in one: all thrown away at once
    probe = subprocess.run(
        [
            tool("unshare"),
            "--net",
            "--mount",
            "--uts",
            "--ipc",
            "--pid",
            "--fork",
            "--mount-proc",
            tool("ip"),
            "link",
            "add",
            "probe0",
            "type",
            "bridge",
        ],  # fmt: skip
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot create namespaces and bridges here: {probe.stderr.strip()}"
    return None


def require_services() -> None:
    """PostgreSQL's server binaries and etcd's: the test skips without them, or fails in CI
    (as every PostgreSQL test does, tests/fixtures_postgres.py)."""
    import pytest

    from pipetransformer.orchestrator.etcd_server import EtcdStartError, etcd_binary
    from tests.fixtures_postgres import in_ci, require_postgres

    require_postgres()
    try:
        etcd_binary()
    except EtcdStartError as exc:
        if in_ci():
            pytest.fail(f"CI must run the rehearsal: {exc}", pytrace=False)
        pytest.skip(str(exc))


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    explain: Callable[[], str] = lambda: "",
    interval: float = 0.25,
) -> Any:
    """Poll `check` until it returns something truthy (returned); on timeout raise an
    AssertionError naming `what`, with `explain()` (the pods' log tails). An AssertionError
    from `check` (a pod died) ends the wait at once; any other exception counts as "not yet"
    (a service still starting), the last one is reported."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except AssertionError:
            raise  # a pod died: no point waiting
        except Exception as exc:  # noqa: BLE001 - a service still starting raises anything
            last = exc
        if time.monotonic() >= deadline:
            error = f" (last error: {last!r})" if last else ""
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}{error}\n{explain()}"
            )
        time.sleep(interval)


# -- memory -------------------------------------------------------------------------------------


class PodCgroups:
    """A cgroup per pod beside this process's own (v1: `memory` and `cpuacct`; v2: one, with
    its memory and cpu controllers), limiting nothing: a thread samples each pod's peak
    anonymous + shared memory (what counts against a container's limit once page cache is
    reclaimed) and its CPU time, read once more before removal."""

    def __init__(self) -> None:
        self.bases = self._bases()
        self.paths: dict[str, list[Path]] = {}
        self.peaks: dict[str, int] = {}  # pod -> bytes
        self.cpu: dict[str, float] = {}  # pod -> seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _bases() -> list[Path]:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return []
        v1 = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for c in ("memory", "cpuacct"):
                if c in controllers.split(","):
                    v1[c] = Path("/sys/fs/cgroup") / c / path.lstrip("/")
        if len(v1) == 2:
            bases = [v1["memory"], v1["cpuacct"]]
        else:
            v2 = [line[3:] for line in lines if line.startswith("0::")]
            if not v2:
                return []
            base = Path("/sys/fs/cgroup") / v2[0].lstrip("/")
            try:
                enabled = (base / "cgroup.subtree_control").read_text().split()
            except OSError:
                return []
            bases = [base] if {"memory", "cpu"} <= set(enabled) else []
        return bases if all(os.access(b, os.W_OK) for b in bases) else []

    def create(self, pod: str) -> list[Path]:
        """The `cgroup.procs` files a pod's first process writes itself into (none when the
        machine gives us no cgroups). `pod`: a key unique to this pod (its network namespace:
        a recreated pod has a new one)."""
        made: list[Path] = []
        for base in self.bases:
            try:
                (base / pod).mkdir()
            except OSError:
                break
            made.append(base / pod)
        if len(made) < len(self.bases):
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            return []
        self.paths[pod] = made
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return [path / "cgroup.procs" for path in made]

    def _read(self, pod: str) -> None:
        for path in self.paths[pod]:
            with contextlib.suppress(OSError, ValueError):
                if (path / "cpuacct.usage").exists():  # v1
                    self.cpu[pod] = int((path / "cpuacct.usage").read_text()) / 1e9
                elif (path / "cpu.stat").exists():  # v2
                    usage = (path / "cpu.stat").read_text().split()
                    self.cpu[pod] = int(usage[usage.index("usage_usec") + 1]) / 1e6
                if (path / "memory.stat").exists():
                    stat = {
                        k: int(v)
                        for k, v in (
                            line.split() for line in (path / "memory.stat").read_text().splitlines()
                        )
                    }
                    if "total_rss" in stat:  # v1, hierarchical
                        now = stat["total_rss"] + stat.get("total_shmem", 0)
                    else:
                        now = stat.get("anon", 0) + stat.get("shmem", 0)
                    self.peaks[pod] = max(self.peaks.get(pod, 0), now)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            for pod in list(self.paths):
                self._read(pod)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for pod, paths in self.paths.items():
            self._read(pod)
            for path in paths:
                for _ in range(50):  # empty once its processes are reaped
                    try:
                        path.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.1)


# -- pods ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSpec:
    """One pod as Kubernetes would run it: `command` (entrypoint and arguments, resolved on the
    pod's PATH), `env` (complete: nothing of the caller's environment leaks in), `mounts` (path
    in the pod -> a host folder to bind there, or "tmpfs", or "tmpfs:BYTES" of that size), the
    mounts bound read-only (`read_only`), whether the root file system is read-only, the user
    to run as (None: root)."""

    name: str  # the pod's name, also its host name
    command: list[str]
    env: dict[str, str]
    mounts: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str | None = None
    subdomain: str | None = None  # Volcano's svc plugin: the job's headless Service
    service_links: bool = True  # Kubernetes' default (enableServiceLinks)
    memory_limit_mb: int | None = None  # the container's limit, for the report only
    accounted: bool = False  # its memory and CPU measured (the job's pods)
    read_only: frozenset[str] = frozenset()  # mount paths bound read-only
    read_only_root: bool = False  # the container's readOnlyRootFilesystem

    @property
    def fqdn(self) -> str:
        if self.subdomain:
            return f"{self.name}.{self.subdomain}.{SVC_DOMAIN}"
        return f"{self.name}.{SVC_DOMAIN}"

    def peer_names(self) -> list[str]:
        """Names other pods resolve this one by (the cluster DNS, in hosts files)."""
        names = [self.fqdn]
        if self.subdomain:
            names.append(f"{self.name}.{self.subdomain}")
        return names


@dataclass
class Pod:
    spec: PodSpec
    netns: str
    ip: str
    veth: str
    log: Path
    proc: subprocess.Popen[bytes]
    killed: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def init_pid(self) -> int | None:
        """The pod's PID 1 as the root namespace numbers it: `unshare`'s child."""
        if self.poll() is not None:
            return None
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError):
                fields = dict(
                    line.split(":\t", 1)
                    for line in status.read_text().splitlines()
                    if ":\t" in line
                )
                if fields.get("PPid", "").strip() == str(self.proc.pid):
                    return int(status.parent.name)
        return None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The pod's state and the last lines of its log."""
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = ["(no log)"]
        code = self.poll()
        state = "running" if code is None else f"exited {code}"
        if self.killed:
            state += " (killed)"
        head = f"--- pod {self.name} [{self.netns} {self.ip}] {state}, log {self.log}:"
        return "\n".join([head, *text])


def _dead(pid: str) -> bool:
    """Whether process `pid` has ended (gone, or a zombie its parent has not reaped)."""
    try:
        return Path("/proc", pid, "stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _veth_name(tag: str, index: int) -> str:
    return f"pt{tag}{index:02d}"  # at most 15 characters (IFNAMSIZ)


def _used_subnets() -> set[str]:
    out = _run("ip", "-4", "-o", "addr", "show").stdout + _run("ip", "-4", "route", "show").stdout
    return set(re.findall(r"\b(\d+\.\d+\.\d+)\.\d+", out))


def _pick_subnet() -> str:
    used = _used_subnets()
    for _ in range(200):
        prefix = f"10.{secrets.choice(range(100, 250))}.{secrets.randbelow(256)}"
        if prefix not in used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet for the rehearsal bridge")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([tool(cmd[0]), *cmd[1:]], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class Cluster:
    """The bridge, the pods' namespaces and processes, their DNS and volumes; `close()` (or the
    context manager) removes every one of them, whatever state the test left."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = secrets.token_hex(2)
        self.bridge = f"ptbr-{self.tag}"
        self.prefix = _pick_subnet()
        self.gateway = f"{self.prefix}.1"
        self.pods: list[Pod] = []
        # what k8s/README.md "Secrets" has a user create once per namespace; the rest come
        # with the services that need them (start_postgres)
        self.secrets: dict[str, dict[str, str]] = {
            "pipetransformer-rdzv": {"PIPETRANSFORMER_RDZV_SECRET": secrets.token_hex(32)}
        }
        self.secret_dirs: set[str] = set()  # Secret volumes' folders (`secret_volume`)
        self.records: dict[str, tuple[str, list[str]]] = {}  # key -> (ip, names)
        self.services: dict[str, tuple[str, int, str]] = {}  # name -> (ip, port, port name)
        self._hosts_of: dict[str, tuple[str, PodSpec]] = {}  # netns -> (ip, spec)
        self._netns: list[str] = []
        self._veths: list[str] = []
        self._next_ip = 2
        self._next_veth = 0
        self._pg_roots: list[Path] = []
        self.cgroups = PodCgroups()
        self.volumes = root / "volumes"  # PVCs: one folder per claim; emptyDirs: per pod
        self.logs = root / "logs"

    # -- lifecycle

    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        reap_stale()
        self._save_state()
        self.volumes.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._save_state()
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        _allow_bridged(self.bridge, True)

    def _save_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "bridge": self.bridge,
            "netns": self._netns,
            "veths": self._veths,
            "pg_roots": [str(p) for p in self._pg_roots],
            "cgroups": [str(p) for paths in self.cgroups.paths.values() for p in paths],
        }
        with contextlib.suppress(OSError):
            STATE_DIR.mkdir(parents=True, exist_ok=True)  # a run ending removes it when empty
            (STATE_DIR / f"{self.tag}.json").write_text(json.dumps(state))

    def close(self) -> None:
        """Kill every pod, then remove namespaces, veths, the bridge, hosts files, cgroups and
        PostgreSQL's folders. Best effort: every step runs even if one before it failed."""
        for pod in self.pods:
            self._kill_processes(pod)
        self.cgroups.close()
        _teardown(
            bridge=self.bridge,
            netns=self._netns,
            veths=self._veths,
            pg_roots=self._pg_roots,
        )
        with contextlib.suppress(OSError):
            (STATE_DIR / f"{self.tag}.json").unlink()
        _remove_if_empty()

    # -- network and DNS

    def _add_netns(self, short: str) -> tuple[str, str, str]:
        """A fresh network namespace on the bridge: (name, ip, host-side veth)."""
        netns = f"pt{self.tag}-{short}"
        ip = f"{self.prefix}.{self._next_ip}"
        self._next_ip += 1
        veth = _veth_name(self.tag, self._next_veth)
        self._next_veth += 1
        _run("ip", "netns", "add", netns)
        self._netns.append(netns)
        self._save_state()
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        self._veths.append(veth)
        self._save_state()
        _run("ip", "link", "set", f"{veth}p", "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", netns, "link", "set", f"{veth}p", "name", "eth0")
        _run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        # no default route: nothing outside the bridge is reachable, as from a locked-down pod
        return netns, ip, veth

    def add_service(self, name: str, ip: str, port: int, port_name: str) -> None:
        """A ClusterIP Service: its DNS names, and the variables it injects into pods."""
        self.services[name] = (ip, port, port_name)
        self.records[f"svc/{name}"] = (
            ip,
            [name, f"{name}.{NAMESPACE}.svc", f"{name}.{SVC_DOMAIN}"],
        )
        self._write_hosts()

    def _write_hosts(self) -> None:
        """Every pod's /etc/hosts, written in place (the pods have it bind-mounted: a new file
        would not reach them): itself first, as kubelet writes it, then the cluster's names."""
        for netns, (ip, spec) in self._hosts_of.items():
            lines = [
                "127.0.0.1\tlocalhost",
                "::1\tlocalhost ip6-localhost ip6-loopback",
                f"{ip}\t{spec.fqdn}\t{spec.name}",
                "# the cluster's DNS: Services and pods",
            ]
            lines += [f"{rip}\t{' '.join(names)}" for rip, names in self.records.values()]
            path = Path("/etc/netns") / netns / "hosts"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a+") as f:  # same inode: truncate and rewrite
                f.seek(0)
                f.truncate()
                f.write("\n".join(lines) + "\n")
            # A nameserver that refuses at once: gRPC's c-ares resolver finds the A record in
            # the hosts file but still asks DNS for AAAA, and a nameserver it cannot reach
            # would cost its full timeout (a cluster's DNS answers NXDOMAIN at once).
            resolv = path.with_name("resolv.conf")
            if not resolv.exists():
                resolv.write_text(
                    "nameserver 127.0.0.1\n"
                    f"search {NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local\n"
                    "options ndots:5\n"
                )

    def service_env(self) -> dict[str, str]:
        """What Kubernetes injects for each Service (enableServiceLinks), e.g. ETCD_PORT."""
        env: dict[str, str] = {}
        for name, (ip, port, port_name) in self.services.items():
            p = name.upper().replace("-", "_")
            env.update(
                {
                    f"{p}_SERVICE_HOST": ip,
                    f"{p}_SERVICE_PORT": str(port),
                    f"{p}_SERVICE_PORT_{port_name.upper()}": str(port),
                    f"{p}_PORT": f"tcp://{ip}:{port}",
                    f"{p}_PORT_{port}_TCP": f"tcp://{ip}:{port}",
                    f"{p}_PORT_{port}_TCP_PROTO": "tcp",
                    f"{p}_PORT_{port}_TCP_PORT": str(port),
                    f"{p}_PORT_{port}_TCP_ADDR": ip,
                }
            )
        return env

    # -- pods

    def volume(self, claim: str) -> Path:
        """The host folder of a PersistentVolumeClaim (shared by every pod mounting it)."""
        path = self.volumes / f"pvc-{claim}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def secret_volume(self, source: dict[str, Any]) -> Path:
        """A Secret volume's folder, as the kubelet projects it: one file per item (every key
        without `items`), mode `defaultMode` (0644). A missing Secret holds the pod (the
        kubelet's CreateContainerConfigError): an AssertionError here."""
        name = source["secretName"]
        assert name in self.secrets, f"Secret {name} does not exist: the pod would not start"
        data = self.secrets[name]
        path = Path(tempfile.mkdtemp(prefix=f"secret-{name}-", dir=self.volumes))
        for item in source.get("items") or [{"key": k, "path": k} for k in data]:
            file = path / item["path"]
            file.write_text(data[item["key"]])
            file.chmod(source.get("defaultMode", 0o644))
        self.secret_dirs.add(str(path))
        return path

    def empty_dir(self, pod: str, name: str) -> Path:
        """A fresh emptyDir of one pod (a recreated pod gets a new one)."""
        path = Path(tempfile.mkdtemp(prefix=f"{pod}-{name}-", dir=self.volumes))
        path.chmod(0o777)  # as Kubernetes makes an emptyDir
        return path

    def start(self, spec: PodSpec, short: str) -> Pod:
        """Start a pod in a fresh network namespace (`short` names it; a recreated pod gets a
        new one, a new address, and its name now resolves there)."""
        netns, ip, veth = self._add_netns(short)
        self._hosts_of[netns] = (ip, spec)
        self.records[f"pod/{spec.name}"] = (ip, spec.peer_names())
        self._write_hosts()
        image = (REPO, VENV_BIN, Path(os.path.realpath(sys.executable)))
        hiding = [m for m in spec.mounts if any(x.is_relative_to(m) for x in image)]
        if hiding:  # a checkout under /tmp, say: the "image" is not in a container's own files
            spec = replace(spec, mounts={m: s for m, s in spec.mounts.items() if m not in hiding})
        for path in [*spec.mounts, spec.workdir]:  # mount points, and the image's WORKDIR
            if _in_image_home(spec, path):
                continue  # made in the pod's own /home (`_pod_script`)
            if not Path(path).is_dir():
                Path(path).mkdir(parents=True)  # left in place (module doc)
        env = {**(self.service_env() if spec.service_links else {}), **spec.env}
        env["HOSTNAME"] = spec.name
        # the rehearsal's own aid, not the pod's spec: a Python process sent SIGABRT prints every
        # thread's stack into the pod's log (`dump_stacks`: where a timed-out wait hung)
        env["PYTHONFAULTHANDLER"] = "1"
        log = self.logs / f"{short}.log"
        script = self._pod_script(spec)
        cmd = [
            tool("setpriv"), "--pdeathsig", "KILL", "--",  # gone with the test, whatever happens
            tool("ip"), "netns", "exec", netns,
            tool("unshare"), "--mount", "--uts", "--ipc", "--pid", "--fork", "--mount-proc",
            "--kill-child", "--propagation", "private", "--",
            "/bin/sh", "-c", script, spec.name, *spec.command,
        ]  # fmt: skip
        procs = self.cgroups.create(netns) if spec.accounted else []
        self._save_state()
        if procs:  # join the cgroups before anything forks
            joins = "; ".join(f"echo $$ > {shlex.quote(str(p))}" for p in procs)
            cmd = ["/bin/sh", "-c", f'{joins}; exec "$@"', "join-cgroups", *cmd]
        with open(log, "ab") as out:
            out.write(
                f"--- {time.ctime()} {spec.name} in {netns} ({ip}): {spec.command}\n".encode()
            )
            if hiding:
                out.write(f"--- not mounted (they would hide the project): {hiding}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd="/",
            )
        pod = Pod(spec, netns, ip, veth, log, proc)
        self.pods.append(pod)
        return pod

    @staticmethod
    def _pod_script(spec: PodSpec) -> str:
        """What the container runtime does before the entrypoint: host name, the image's own
        folders, volumes, a read-only root, working directory, user; then the command (`"$@"`,
        found on the pod's PATH) as PID 1."""
        q = shlex.quote
        mount = tool("mount")
        lines = ["set -eu", f"{tool('hostname')} {q(spec.name)}"]
        image_dirs = []  # the image's folders, on tmpfs's of the pod's own, before any volume
        home = spec.env.get("HOME", "")
        if home.startswith("/home/"):  # the image's home
            lines.append(f"{mount} -t tmpfs -o mode=755 tmpfs /home")
            lines.append(f"{tool('mkdir')} -p {q(home)}")
            image_dirs.append("/home")
        if spec.workdir == IMAGE_WORKDIR and IMAGE_WORKDIR not in spec.mounts:
            # no volume there: the image's own folder (the Dockerfile makes /workdir/runs)
            lines.append(f"{mount} -t tmpfs -o mode=755 tmpfs {IMAGE_WORKDIR}")
            lines.append(f"{tool('mkdir')} -p {IMAGE_WORKDIR}/runs")
            image_dirs.append(IMAGE_WORKDIR)
        for path in spec.mounts:  # mount points in the image's folders (HOME's volume)
            if any(Path(path).is_relative_to(d) for d in image_dirs):
                lines.append(f"{tool('mkdir')} -p {q(path)}")
        binds = [s for s in spec.mounts.values() if not s.startswith("tmpfs")]

        def covers_a_source(path: str) -> bool:
            return any(Path(s).is_relative_to(path) for s in binds)

        # a volume over a folder that holds another's source (an emptyDir at /tmp) goes last
        for path, source in sorted(spec.mounts.items(), key=lambda m: covers_a_source(m[0])):
            if source.startswith("tmpfs"):
                size = source.partition(":")[2]  # an emptyDir's sizeLimit: the tmpfs's size
                options = "mode=1777" + (f",size={size}" if size else "")
                lines.append(f"{mount} -t tmpfs -o {options} tmpfs {q(path)}")
            else:
                lines.append(f"{mount} --bind {q(source)} {q(path)}")
            if path in spec.read_only:
                lines.append(f"{mount} -o remount,bind,ro {q(path)}")
        if spec.read_only_root:
            # after the volumes: a bind mount takes the flags of the mount its source is on,
            # and these are separate mounts that keep their own
            for path in ["/", *image_dirs]:
                lines.append(f"{mount} -o remount,bind,ro {q(path)}")
        lines.append(f"cd {q(spec.workdir)}")
        if spec.user:
            account = pwd.getpwnam(spec.user)
            lines.append(
                f"exec {tool('setpriv')} --reuid={account.pw_uid} --regid={account.pw_gid} "
                '--clear-groups -- "$@"'
            )
        else:
            lines.append('exec "$@"')
        return "\n".join(lines)

    def kill(self, pod: Pod, silent: bool = True) -> None:
        """Lose a pod as a node is lost. `silent`: its link goes down first, so no FIN or RST
        reaches its peers (a machine that died says nothing); then SIGKILL to its process group
        and its PID namespace's init, which takes every process of the pod with it."""
        if silent:
            _run("ip", "link", "set", pod.veth, "down", check=False)
        self._kill_processes(pod)
        pod.killed = True

    def _kill_processes(self, pod: Pod) -> None:
        if pod.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                pod.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.proc.wait(timeout=10)
        # anything still in the namespace (it should have died with its PID namespace)
        left = _run("ip", "netns", "pids", pod.netns, check=False).stdout.split()
        for pid in left:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def exec_in(self, pod: Pod, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command inside a running pod (`kubectl exec`): in its network, UTS, IPC and
        mount namespaces (its hosts file, its host name, its volumes), with the image's
        environment."""
        init = pod.init_pid()
        assert init is not None, f"pod {pod.name} has no running init\n{pod.tail()}"
        return subprocess.run(
            [tool("nsenter"), f"--target={init}", "--net", "--uts", "--ipc", "--mount", "--", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=image_env(),
        )

    def explain(self) -> str:
        """Every pod's state and log tail (for failure messages)."""
        return "\n".join(pod.tail() for pod in self.pods)

    def dump_stacks(self) -> str:
        """Where the running pods' Python processes are: each thread's kernel wait (`wchan`),
        then its Python stack, from SIGABRT (faulthandler prints it into the pod's log, and the
        process dies: only for a test that failed already). One process at a time, so that
        their stacks do not interleave in the log; frames of the standard library and of gRPC
        are left out."""
        lines = ["=== where the pods' Python processes were ==="]
        for pod in self.pods:
            if pod.poll() is not None:
                continue
            pids = _run("ip", "netns", "pids", pod.netns, check=False).stdout.split()
            # the newest first: the pod's init goes last, as its end takes every other with it
            for pid in sorted(pids, key=int, reverse=True):
                proc = Path("/proc", pid)
                try:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    if not Path(os.readlink(proc / "exe")).name.startswith("python"):
                        continue
                    waits = sorted(
                        (t / "wchan").read_text() or "running" for t in (proc / "task").iterdir()
                    )
                except OSError:
                    continue
                words = [a.decode(errors="replace") for a in argv if a]
                # a job's process says what it is in its title (edge/proctitle.py)
                titled = bool(words) and words[0].startswith("pipetransformer ")
                what = words[0] if titled else " ".join(words[1:4])
                counts = {w: waits.count(w) for w in dict.fromkeys(waits)}
                lines.append(f"--- {pod.log.stem} pid {pid} [{what}] threads waiting in {counts}")
                start = pod.log.stat().st_size
                try:
                    os.kill(int(pid), signal.SIGABRT)
                except ProcessLookupError:
                    continue
                deadline = time.monotonic() + 2.0
                while not _dead(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                with open(pod.log, errors="replace") as log:
                    log.seek(start)
                    dump = log.read().splitlines()
                lines.extend(
                    line
                    for line in dump
                    if line.strip()
                    and not line.startswith("Extension modules")
                    and not (
                        line.startswith("  File")
                        and ("/grpc/" in line or ("/python3" in line and "-packages" not in line))
                    )
                )
        return "\n".join(lines)

    # -- the services of k8s/base

    def start_etcd(self) -> Pod:
        """etcd as k8s/base/etcd.yaml configures it, one member (etcd-0), on the pod's address
        only: nothing listens on its loopback. Its data is on the pod's own folder."""
        from pipetransformer.orchestrator.etcd_server import etcd_binary

        name = "etcd-0"
        peer = f"http://{name}.etcd-peers.{NAMESPACE}.svc"
        data = self.empty_dir(name, "data")  # its volume, at its host path (no mount point)
        data.chmod(0o700)
        netns_ip = f"{self.prefix}.{self._next_ip}"  # the address start() gives it
        self.records["svc/etcd-peers"] = (netns_ip, [f"{name}.etcd-peers.{NAMESPACE}.svc"])
        env = {
            **image_env(),
            "ETCD_NAME": name,
            "ETCD_DATA_DIR": str(data / "data"),
            "ETCD_INITIAL_CLUSTER_STATE": "new",
            "ETCD_INITIAL_CLUSTER_TOKEN": f"pipetransformer-etcd-{NAMESPACE}",
            "ETCD_INITIAL_CLUSTER": f"{name}={peer}:2380",
            "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"{peer}:2380",
            "ETCD_ADVERTISE_CLIENT_URLS": f"{peer}:{ETCD_PORT}",
            "ETCD_LISTEN_PEER_URLS": f"http://{netns_ip}:2380",
            "ETCD_LISTEN_CLIENT_URLS": f"http://{netns_ip}:{ETCD_PORT}",
            "ETCD_AUTO_COMPACTION_MODE": "periodic",
            "ETCD_AUTO_COMPACTION_RETENTION": "1h",
            "ETCD_LOG_LEVEL": "warn",
            "ETCD_UNSAFE_NO_FSYNC": "true",  # throwaway data
        }
        spec = PodSpec(
            name=name,
            command=[str(etcd_binary())],
            env=env,
            service_links=False,  # as the manifest: etcd would read ETCD_PORT=... as a flag
        )
        pod = self.start(spec, "etcd")
        assert pod.ip == netns_ip
        self.add_service("etcd", pod.ip, ETCD_PORT, "client")
        return pod

    def wait_etcd(self, pod: Pod, timeout: float) -> None:
        from pipetransformer.edge.etcd_client import EtcdClient

        def ready() -> bool:
            if pod.poll() is not None:
                raise AssertionError(f"etcd exited\n{pod.tail()}")
            with EtcdClient(f"{pod.ip}:{ETCD_PORT}", timeout=1.0, retry_timeout=0.0) as c:
                c.status()
            return True

        wait_for("etcd to serve", ready, timeout, self.explain)

    def start_postgres(self) -> tuple[Pod, str, str]:
        """PostgreSQL as the official image starts it on an empty volume: initdb, the init
        scripts (k8s/base/postgres-initdb, run for real: roles, database, grants) against a
        server on its socket only, then the server on the pod's address, password (SCRAM)
        authentication for every remote client. Returns (pod, owner URL, read-only URL) as the
        Secrets `pipetransformer-db` and `pipetransformer-db-readonly` hold them."""
        from tests.fixtures_postgres import find_postgres_bin

        bindir = find_postgres_bin()
        assert bindir is not None
        account = _postgres_account()
        root = Path(tempfile.mkdtemp(prefix="pipetransformer-pg-", dir="/tmp"))
        self._pg_roots.append(root)
        self._save_state()
        os.chown(root, account.pw_uid, account.pw_gid)
        owner_pw, ro_pw = secrets.token_hex(12), secrets.token_hex(12)
        self.secrets["postgres-credentials"] = {"password": owner_pw, "readonly-password": ro_pw}
        data, sock = root / "data", root
        server = [
            "postgres", "-D", str(data), "-k", str(sock),
            "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
            "-c", "max_connections=50", "-c", "log_min_messages=warning",
        ]  # fmt: skip
        q = shlex.quote
        script = "\n".join(
            [
                "set -eu",
                f"initdb -D {q(str(data))} -U postgres --auth-local=trust "
                "--auth-host=scram-sha-256 -E UTF8 --locale C --no-sync >/dev/null",
                f"echo 'host all all 0.0.0.0/0 scram-sha-256' >> {q(str(data / 'pg_hba.conf'))}",
                f"{shlex.join(server)} -c listen_addresses='' &",
                "pid=$!",
                f"until pg_isready -q -h {q(str(sock))}; do sleep 0.1; done",
                f"PGHOST={q(str(sock))} sh {q(str(POSTGRES_INITDB))}",
                "kill -INT $pid; wait $pid || true",
                f"exec {shlex.join(server)} -c listen_addresses='*'",
            ]
        )
        env = {
            "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
            "LC_ALL": "C",
            "HOME": str(root),
            "POSTGRES_USER": "postgres",
            "POSTGRES_PASSWORD": owner_pw,
            "POSTGRES_READONLY_PASSWORD": ro_pw,
        }
        spec = PodSpec(
            name="postgres-0",
            command=["sh", "-c", script],
            env=env,
            user=account.pw_name,
            service_links=False,
        )
        pod = self.start(spec, "pg")
        self.add_service("postgres", pod.ip, POSTGRES_PORT, "postgres")
        owner = f"postgresql+psycopg://{DB_NAME}:{owner_pw}@postgres:{POSTGRES_PORT}/{DB_NAME}"
        ro = f"postgresql+psycopg://{DB_NAME}_ro:{ro_pw}@postgres:{POSTGRES_PORT}/{DB_NAME}"
        self.secrets["pipetransformer-db"] = {"PIPETRANSFORMER_DB": owner}
        self.secrets["pipetransformer-db-readonly"] = {"PIPETRANSFORMER_DB": ro}
        return pod, owner, ro

    def wait_postgres(self, pod: Pod, url: str, timeout: float) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        u = make_url(self.from_root(url))

        def ready() -> bool:
            if pod.poll() is not None:
                raise AssertionError(f"postgres exited\n{pod.tail()}")
            psycopg.connect(
                host=u.host,
                port=u.port,
                user=u.username,
                password=u.password,
                dbname=u.database,
                connect_timeout=2,
            ).close()
            return True

        wait_for("postgres to accept the owner role over TCP", ready, timeout, self.explain)

    def from_root(self, url: str) -> str:
        """A URL naming a Service, as the root namespace reaches it: through the bridge, at the
        Service's pod address (the root namespace has no cluster DNS)."""
        for name, (ip, port, _) in self.services.items():
            url = url.replace(f"@{name}:{port}/", f"@{ip}:{port}/")
        return url


def _in_image_home(spec: PodSpec, path: str) -> bool:
    """Whether `path` is in the image's /home, which a pod gets on a tmpfs of its own."""
    return spec.env.get("HOME", "").startswith("/home/") and Path(path).is_relative_to("/home")


def _postgres_account() -> pwd.struct_passwd:
    """PostgreSQL refuses to run as root: the Debian package's `postgres` user, else nobody."""
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("neither a 'postgres' nor a 'nobody' user exists")


def _allow_bridged(bridge: str, allow: bool) -> None:
    """Let the pods on `bridge` reach each other whatever the machine's firewall says. With
    br_netfilter loaded, bridged frames pass iptables' FORWARD chain, whose policy Docker sets
    to DROP when its daemon starts: every pod-to-pod packet would be dropped. One ACCEPT rule
    for this bridge, first in the chain; removed with the bridge."""
    if shutil.which("iptables") is None:
        return
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    if allow:
        _run("iptables", "-I", *rule, check=False)
    else:
        while _run("iptables", "-D", *rule, check=False).returncode == 0:
            pass


def _teardown(bridge: str, netns: list[str], veths: list[str], pg_roots: list[Path | str]) -> None:
    for name in netns:
        for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run("ip", "netns", "del", name, check=False)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    for veth in veths:  # a namespace's deletion removes its pair, but not at once
        _run("ip", "link", "del", veth, check=False)
    _run("ip", "link", "del", bridge, check=False)
    _allow_bridged(bridge, False)
    for root in pg_roots:
        shutil.rmtree(root, ignore_errors=True)


def _remove_if_empty() -> None:
    """/etc/netns and the state folder, once no run uses them (rmdir fails on a full one)."""
    for path in (Path("/etc/netns"), STATE_DIR):
        with contextlib.suppress(OSError):
            path.rmdir()


def reap_stale() -> None:
    """Remove what runs killed before their teardown left behind (their pid is gone)."""
    if not STATE_DIR.is_dir():
        return
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
            os.kill(int(state["pid"]), 0)
            continue  # still running: a concurrent run
        except ProcessLookupError:
            pass
        except (OSError, ValueError, KeyError):
            continue
        _teardown(state["bridge"], state["netns"], state["veths"], state["pg_roots"])
        for cgroup in state.get("cgroups", []):
            with contextlib.suppress(OSError):
                Path(cgroup).rmdir()
        with contextlib.suppress(OSError):
            path.unlink()
    _remove_if_empty()


# -- the job's pods, from the torchx component -------------------------------------------------


def secret_env(cluster: Cluster, env_from: list[dict[str, Any]]) -> dict[str, str]:
    """`envFrom` of Secrets: every key of each Secret becomes a variable."""
    env: dict[str, str] = {}
    for source in env_from:
        ref = source.get("secretRef")
        assert ref is not None, f"only secretRef sources are rehearsed: {source}"
        env.update(cluster.secrets[ref["name"]])
    return env


def create_launch_secrets(cluster: Cluster, job: dict[str, Any]) -> list[str]:
    """What `torchx run -s kubernetes` creates before the Volcano Job `job` (the dry run's):
    the Secrets made for its launch (orchestrator/volcano.py `launch_secrets`). Their names."""
    from pipetransformer.orchestrator import volcano

    made = volcano.launch_secrets(job)
    for secret in made:
        cluster.secrets[secret["metadata"]["name"]] = dict(secret["stringData"])
    return [secret["metadata"]["name"] for secret in made]


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity in binary units (`512Mi`) as bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    return int(quantity)


def role_pods(cluster: Cluster, app: Any, job: str) -> dict[str, PodSpec]:
    """The pods of a torchx AppDef in container mode, as the Kubernetes scheduler builds them
    (torchx.schedulers.kubernetes_scheduler.app_to_resource): per replica, the role with torchx's
    macros applied; the container's command (entrypoint + args) and env, with the variables the
    role reads from Secrets (this project's scheduler writes them: orchestrator/volcano.py
    `secret_env`) resolved from the cluster's Secrets; from the role's pod overlay, the
    container's `envFrom` Secrets, `volumeMounts` with the pod's volumes (merged by name with
    torchx's /dev/shm) and its root file system. Named as Volcano names them:
    `<job>-<task>-<index>`, host name the same, subdomain the job. The entrypoint stays
    `python`: the pod's PATH finds this venv's, as the image's PATH finds its venv's."""
    from torchx.specs import macros
    from torchx.specs.overlays import JOIN, get_overlay

    from pipetransformer.orchestrator import volcano

    pods: dict[str, PodSpec] = {}
    for role_idx, role in enumerate(app.roles):
        overlay = get_overlay(role, "kubernetes", "V1Pod")
        (container,) = overlay["spec"][JOIN("containers", on="image")]
        assert container["image"] == role.image, "the overlay's container is the role's"
        volumes = {"dshm": {"name": "dshm", "emptyDir": {"medium": "Memory"}}}  # torchx's
        for v in overlay["spec"].get(
            JOIN("volumes", on="name"), overlay["spec"].get("volumes", [])
        ):
            volumes[v["name"]] = {**volumes.get(v["name"], {}), **v}  # torchx's JOIN: by name
        read_only_root = bool(
            (container.get("securityContext") or {}).get("readOnlyRootFilesystem")
        )
        for replica in range(role.num_replicas):
            first = role_idx == 0 and replica == 0
            rank0_env = "TORCHX_RANK0_HOST" if first else f"VC_{app.roles[0].name}_0_HOSTS"
            values = macros.Values(
                img_root="", app_id=job, replica_id=str(replica), rank0_env=rank0_env.upper()
            )
            r = values.apply(role)
            task = f"{role.name}-{replica}"
            name = f"{job}-{task}-0"  # Volcano: <job>-<task>-<index in task>
            from_secrets: dict[str, str] = {}
            for var, ref in volcano.secret_env(role, job).items():
                assert ref["name"] in cluster.secrets, (
                    f"pod {name}: Secret {ref['name']} ({var}) does not exist: Kubernetes "
                    "would hold the container (CreateContainerConfigError)"
                )
                from_secrets[var] = cluster.secrets[ref["name"]][ref["key"]]
            env = {
                **image_env(),
                **secret_env(cluster, container.get("envFrom", [])),
                **r.env,  # a container's env wins over its envFrom
                **from_secrets,
                **({"TORCHX_RANK0_HOST": "localhost"} if first else {}),
                "TORCHX_IMAGE": r.image,
            }
            mounts: dict[str, str] = {}
            read_only: set[str] = set()
            for m in container.get("volumeMounts", []):
                volume, path = volumes[m["name"]], m["mountPath"]
                empty_dir = volume.get("emptyDir")
                if "persistentVolumeClaim" in volume:
                    mounts[path] = str(cluster.volume(volume["persistentVolumeClaim"]["claimName"]))
                elif empty_dir is not None and empty_dir.get("medium") == "Memory":
                    limit = empty_dir.get("sizeLimit")
                    mounts[path] = f"tmpfs:{_bytes(limit)}" if limit else "tmpfs"
                elif empty_dir is not None:
                    mounts[path] = str(cluster.empty_dir(name, m["name"]))
                elif "secret" in volume:
                    mounts[path] = str(cluster.secret_volume(volume["secret"]))
                else:
                    raise AssertionError(f"volume kind not rehearsed: {volume}")
                if m.get("readOnly"):
                    read_only.add(path)
            pods[task] = PodSpec(
                name=name,
                command=[r.entrypoint, *r.args],
                env=env,
                mounts=mounts,
                workdir=IMAGE_WORKDIR,
                subdomain=job,
                memory_limit_mb=int(r.resource.memMB) if r.resource.memMB else None,
                accounted=True,
                read_only=frozenset(read_only),
                read_only_root=read_only_root,
            )
    return pods


def renew_empty_dirs(cluster: Cluster, spec: PodSpec) -> PodSpec:
    """The same pod recreated: its emptyDirs are new and empty, its PVCs and Secrets the
    same."""
    shared = {str(p) for p in cluster.volumes.glob("pvc-*")} | cluster.secret_dirs
    mounts = {}
    for path, source in spec.mounts.items():
        if source.startswith("tmpfs") or source in shared:
            mounts[path] = source
        else:
            mounts[path] = str(cluster.empty_dir(spec.name, Path(path).name or "dir"))
    return replace(spec, mounts=mounts)


def volcano_job(
    app: Any,
    queue: str = "rehearsal",
    service_account: str | None = None,
    priority_class: str | None = None,
) -> dict[str, Any]:
    """The Volcano Job `torchx run -s kubernetes` submits for `app`, as plain data: the dry run
    of the `kubernetes` scheduler torchx finds (this project's plugin: the roles' lifecycle
    policies written in), without an API server (validate_spec off). Needs the kubernetes
    client."""
    import warnings

    from kubernetes.client import ApiClient
    from torchx.schedulers import get_scheduler_factories

    scheduler = get_scheduler_factories()["kubernetes"]("rehearsal")
    cfg: dict[str, Any] = {"queue": queue, "validate_spec": False}
    if service_account:
        cfg["service_account"] = service_account
    if priority_class:
        cfg["priority_class"] = priority_class
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchx's note on Volcano's retries, once per role
        info = scheduler.submit_dryrun(app, cfg)
    return ApiClient().sanitize_for_serialization(info.request.resource)


def rendered_containers(app: Any, job: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """task name -> the container torchx's Kubernetes scheduler would submit (Volcano Job),
    as plain data; to check role_pods against (needs the kubernetes client)."""
    out = {}
    for task in (job or volcano_job(app))["spec"]["tasks"]:
        (container,) = task["template"]["spec"]["containers"]
        out[task["name"]] = container
    return out


def db_upgrade_pod(cluster: Cluster) -> PodSpec:
    """The migration Job's pod from k8s/base/db-upgrade-job.yaml: its command and arguments
    (found on the pod's PATH, the image's `pipetransformer`), its env with `secretKeyRef`s
    resolved from the cluster's Secrets, its emptyDir volumes, its root file system."""
    manifest = yaml.safe_load(DB_UPGRADE_JOB.read_text())
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {**image_env(), **secret_env(cluster, container.get("envFrom", []))}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = cluster.secrets[ref["name"]][ref["key"]]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    name = manifest["metadata"]["name"] + "-" + secrets.token_hex(3)
    mounts = {}
    for m in container.get("volumeMounts", []):
        assert "emptyDir" in volumes[m["name"]], f"volume kind not rehearsed: {m}"
        mounts[m["mountPath"]] = str(cluster.empty_dir(name, m["name"]))
    return PodSpec(
        name=name,
        command=[*container.get("command", []), *container.get("args", [])],
        env=env,
        mounts=mounts,
        workdir=IMAGE_WORKDIR,
        service_links=pod.get("enableServiceLinks", True),
        read_only_root=bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem")),
    )


@contextlib.contextmanager
def explained(cluster: Cluster) -> Iterator[None]:
    """On any failure, print every pod's log tail before the error propagates."""
    try:
        yield
    except BaseException:
        print("\n=== pods at the failure ===\n" + cluster.explain(), flush=True)
        raise


# -- Volcano's job controller, as the generated Job states it ------------------------------------


@dataclass
class TaskState:
    spec: PodSpec
    pod: Pod
    short: str
    handled: bool = False  # its end was acted on
    evicted: bool = False
    restarts: int = 0


class VolcanoJob:
    """The part of Volcano's job controller (and of the kubelet) the pods' fate depends on,
    read from the dry-run's Volcano Job (`volcano_job`), not from a copy here:

    - a container that exits under `restartPolicy: OnFailure` restarts in its pod, unseen by
      Volcano; under `Never` its pod is Succeeded (exit 0) or Failed;
    - a pod's end raises an event: TaskCompleted (exit 0), PodEvicted (evicted: `evict`) or
      PodFailed; the task's policies are matched, exit codes first, then events; RestartTask
      replaces the pod (new namespace and address, new emptyDirs) and counts against the job's
      `maxRetry` (past it the job is Failed), CompleteJob / AbortJob / TerminateJob stop every
      other pod (SIGTERM, then SIGKILL after its grace period) and end the job; no policy:
      the pod stays as it ended;
    - a deleted pod (`delete`: SIGTERM to its PID 1, SIGKILL after the pod's
      `terminationGracePeriodSeconds`) is recreated while the job runs: Volcano keeps a task's
      replicas.

    `reconcile` acts on what happened since its last call (a background thread calls it)."""

    END_PHASES = {"CompleteJob": "Completed", "AbortJob": "Aborted", "TerminateJob": "Terminated"}

    def __init__(self, cluster: Cluster, job: dict[str, Any], pods: dict[str, PodSpec]) -> None:
        self.cluster, self.job = cluster, job
        self.specs = pods
        self.tasks: dict[str, TaskState] = {}
        self.phase = "Running"
        self.retries = 0
        self.history: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def task_spec(self, task: str) -> dict[str, Any]:
        (found,) = (t for t in self.job["spec"]["tasks"] if t["name"] == task)
        return found

    def grace_s(self, task: str) -> float:
        return float(self.task_spec(task)["template"]["spec"]["terminationGracePeriodSeconds"])

    def start(self, task: str, short: str) -> Pod:
        with self._lock:
            pod = self.cluster.start(self.specs[task], short)
            self.tasks[task] = TaskState(self.specs[task], pod, short)
            if not self._thread.is_alive():
                self._thread.start()
            return pod

    def pod(self, task: str) -> Pod:
        return self.tasks[task].pod

    def _terminate(self, pod: Pod, grace_s: float) -> None:
        """SIGTERM to the pod's PID 1, SIGKILL to all of it after `grace_s`."""
        init = pod.init_pid()
        if init is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.proc.wait(timeout=grace_s)
        self.cluster._kill_processes(pod)

    def delete(self, task: str) -> None:
        """`kubectl delete pod`, a drain: graceful; Volcano recreates it (the job runs)."""
        with self._lock:
            state = self.tasks[task]
            state.handled = True  # deleted, not failed: no policy applies
        self._terminate(state.pod, self.grace_s(task))
        with self._lock:
            self.history.append(f"{task}: deleted (exit {state.pod.poll()})")
            if self.phase == "Running":
                self._recreate(task)

    def lose(self, task: str) -> None:
        """The pod's node is lost: its link cut, every process killed (`Cluster.kill`); the
        pod object stays until the node-loss toleration evicts it (`evict_lost`)."""
        with self._lock:
            self.tasks[task].handled = True
        self.cluster.kill(self.tasks[task].pod, silent=True)
        self.history.append(f"{task}: node lost")

    def evict_lost(self, task: str) -> None:
        """The lost node's pod is evicted and deleted; Volcano recreates it elsewhere."""
        with self._lock:
            self._recreate(task)

    def evict(self, task: str) -> None:
        """The kubelet evicts the pod (node pressure): graceful; the pod is Failed, reason
        Evicted, and the task's PodEvicted policy decides."""
        with self._lock:
            self.tasks[task].evicted = True
        self._terminate(self.tasks[task].pod, self.grace_s(task))

    def _recreate(self, task: str) -> None:
        old = self.tasks[task]
        spec = renew_empty_dirs(self.cluster, old.spec)
        short = f"{old.short}r{old.restarts + 1}"
        pod = self.cluster.start(spec, short)
        self.tasks[task] = TaskState(spec, pod, old.short, restarts=old.restarts + 1)
        self.history.append(f"{task}: recreated as {pod.netns} ({pod.ip})")

    def _policy(self, task: str, code: int, event: str) -> str | None:
        policies = self.task_spec(task).get("policies") or self.job["spec"].get("policies") or []
        for p in policies:  # Volcano matches exit codes before events
            if "exitCode" in p and event == "PodFailed" and p["exitCode"] == code:
                return p["action"]
        for p in policies:
            if event == p.get("event") or event in p.get("events", []):
                return p["action"]
        return None

    def reconcile(self) -> None:
        with self._lock:
            for task, state in list(self.tasks.items()):
                code = state.pod.poll()
                if code is None or state.handled:
                    continue
                state.handled = True
                template = self.task_spec(task)["template"]["spec"]
                if code != 0 and template.get("restartPolicy") == "OnFailure":
                    # the kubelet restarts the container in place: Volcano sees nothing
                    self.history.append(f"{task}: exit {code}, restarted in its pod")
                    self._recreate(task)
                    continue
                event = "TaskCompleted" if code == 0 else "PodFailed"
                if state.evicted:
                    event = "PodEvicted"
                action = self._policy(task, code, event) if self.phase == "Running" else None
                self.history.append(f"{task}: exit {code} -> {event} -> {action}")
                if action == "RestartTask":
                    self.retries += 1
                    if self.retries > int(self.job["spec"].get("maxRetry") or 3):
                        self._end("Failed")
                    else:
                        self._recreate(task)
                elif action in self.END_PHASES:
                    self._end(self.END_PHASES[action])

    def _end(self, phase: str) -> None:
        self.phase = phase
        self.history.append(f"job {phase}")
        for task, state in self.tasks.items():
            if state.pod.poll() is None:
                state.handled = True
                threading.Thread(
                    target=self._terminate, args=(state.pod, self.grace_s(task)), daemon=True
                ).start()

    def running(self) -> list[str]:
        return [t for t, s in self.tasks.items() if s.pod.poll() is None]

    def _loop(self) -> None:
        while not self._stop.wait(0.3):
            self.reconcile()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
