"""A rehearsal of the Kubernetes deployment on one machine (tests/rehearsal.py): etcd,
PostgreSQL, the migration Job and the torchx component's controller and trainer pods, each a
process tree in network, PID, UTS, IPC and mount namespaces of its own on one bridge, started
with the command, arguments, environment and volumes Kubernetes would give it. A small elastic
job trains to completion in PostgreSQL while one trainer pod is lost (its link cut, every
process SIGKILLed) and then recreated, as Volcano recreates a lost pod.

What tests/test_torchx_k8s.py checks on the generated YAML, this checks by running it: the pods
find etcd and PostgreSQL by their Service names, get the store's URL from the Secret, share
checkpoints through the volume, reach each other by the names they advertise, and nothing
works only because everything is on one loopback."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pipetransformer.core import keys
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.edge.manifest import verify_checkpoint
from pipetransformer.orchestrator.components import train
from pipetransformer.orchestrator.rendezvous import read_rendezvous
from pipetransformer.store import Store
from tests import rehearsal
from tests.fixtures_run import STEPS_PER_EPOCH, write_spec

pytestmark = pytest.mark.slow

JOB = "rehearsal"
# The lone survivor trains while the recreated pod starts (Python and torch, twice: 5 to 25 s
# on this shared 2-core machine) and must not finish before it joins. TINY_SPEC's model is so
# small that its steps are overhead (80 a second alone, idle: a whole job while a pod starts;
# the new pod joined at step 427 of 552 once); this one's are compute (16 a second alone, 20 on
# two pods, idle), which a busy machine slows down about as much as a pod's start. Measured:
# the new pod joined at steps 62 to 72 of 276 (load averages 15 to 40); idle, expect ~150.
MODEL = {"depth": 4, "dim": 128, "heads": 4, "mlp_ratio": 2.0}
EPOCHS = 24  # 552 steps: a trainer pod lost, one deleted, the controller evicted, a trainer
# evicted, in turn
TOTAL = EPOCHS * STEPS_PER_EPOCH
RUNTIME = {"nodes": 2, "min_nodes": 1, "lease_ttl_s": 3}
BUDGET_S = 120  # what the test should take here (printed, not asserted: the machine is shared)
QUIET_EVENTS = {"checkpoint_committed", "checkpoint_pruned", "cache_decided"}

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""
WHO = "import socket; f = socket.getfqdn(); print(socket.gethostname(), f, socket.gethostbyname(f))"
RESOLVE = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"


@pytest.fixture
def cluster(tmp_path: Path):
    if reason := rehearsal.missing():
        pytest.skip(f"the Kubernetes rehearsal cannot run here: {reason}")
    rehearsal.require_services()
    with rehearsal.Cluster(tmp_path / "cluster") as c:
        yield c


def _workers(store: Store) -> dict[int, dict[str, Any]]:
    """rank -> `worker_started` data of the newest generation's workers."""
    out: dict[int, dict[str, Any]] = {}
    for e in reversed(store.events(JOB, limit=1000)):  # oldest first: newer ones win
        if e.kind == "worker_started":
            out[e.rank] = e.data
    return out


def _running_world(store: Store) -> tuple[int, int] | None:
    """(generation number, world size) of the generation training now, if one is."""
    gens = store.generations(JOB)
    if gens and gens[-1].state == "running":
        return gens[-1].number, gens[-1].world_size
    if store.get_job(JOB).state == "completed":
        raise AssertionError(
            f"the job completed before this phase (generations {gens}): raise EPOCHS so that "
            "the lone survivor cannot finish before the recreated pod joins"
        )
    return None


def _describe_state(state: Any) -> str:
    """A rendezvous state's fields, each node with its heartbeat's age (what a round that does
    not form is waiting for: a participant not yet expired, a deadline, a wait list)."""
    if state is None:
        return "none"
    now = datetime.now(UTC)

    def node(n: Any) -> str:
        beat = state.last_heartbeats.get(n)
        age = "no heartbeat" if beat is None else f"beat {(now - beat).total_seconds():.1f}s ago"
        return f"{n.addr.split('.')[0]}:{n.pid}:{n.local_id} ({age})"

    return (
        f"round {state.round}, complete {state.complete}, closed {state.closed}, "
        f"deadline {state.deadline}\n"
        f"  participants: {[f'{node(n)} rank {r}' for n, r in state.participants.items()]}\n"
        f"  wait list: {[node(n) for n in state.wait_list]}\n"
        f"  redundancy list: {[node(n) for n in state.redundancy_list]}"
    )


def _explain(cluster: rehearsal.Cluster, etcd_ip: str, secret: str) -> str:
    """The pods' states and logs, then the job's rendezvous as etcd holds it: its keys (the
    combine lock and intents included) and its state (a hang there shows in no pod's log)."""
    lines = [cluster.explain(), "=== the rendezvous in etcd ==="]
    try:
        client = EtcdClient(f"{etcd_ip}:2379", timeout=5.0, retry_timeout=5.0)
        try:
            run_id = json.loads(client.get(keys.launch(JOB)) or "{}").get("rdzv_id")
            lines.append(f"run id {run_id!r}")
            if run_id:
                for key, value in client.get_prefix(keys.rendezvous(run_id)):
                    lines.append(f"  {key} ({len(value)} B)")
                state, alive, size = read_rendezvous(client, run_id, secret.encode())
                lines.append(f"state ({size} B): {_describe_state(state)}")
                lines.append(f"alive: {sorted(map(str, alive))}")
        finally:
            client.close()
    except Exception as exc:  # a diagnosis must not hide the failure it explains
        lines.append(f"(not read: {exc!r})")
    return "\n".join(lines)


def _app(spec: Path, job_id: str, **extra: Any) -> Any:
    """The component in container mode as the rehearsal runs it: two trainer pods of one worker
    each, etcd's Service without TLS (the rehearsal's etcd has none; TLS and auth are
    tests/test_etcd_auth.py's)."""
    return train(
        spec=str(spec),
        image="rehearsal",
        etcd="etcd:2379",
        nnodes=2,
        nproc_per_node=1,
        job_id=job_id,
        etcd_client_secrets="",
        **extra,
    )


def _steps_lost_at_end_of(store: Store, generation: int) -> int:
    """Steps the generation trained past the state the next one resumed from: its last
    recorded step minus the newest checkpoint committed by then (a graceful leave checkpoints
    the step it is at: 0). Both are taken before the next generation started: it resumes from
    a checkpoint committed by then, and its own steps (a second later on a fast machine) are
    not this generation's."""
    (nxt,) = [g for g in store.generations(JOB) if g.number > generation][:1]
    cut = nxt.started_at.timestamp()
    last = max(m.step for m in store.metrics(JOB) if m.time < cut)
    saved = max(  # pruned since (state deleted) counts: it was what the next one resumed from
        c.step
        for c in store.checkpoints(JOB, state=None)
        if c.state != "corrupt" and c.created_at.timestamp() <= cut
    )
    return last - saved


def _alive(pod: rehearsal.Pod) -> bool:
    if pod.poll() is not None:
        raise AssertionError(f"pod {pod.name} exited {pod.poll()}\n{pod.tail()}")
    return True


def _timeline(store: Store, since: float) -> str:
    """The job's events, oldest first, in seconds since `since` (unix time)."""
    return "\n".join(
        f"  {e.time - since:6.1f}s {e.kind}: {e.message[:110]}"
        for e in reversed(store.events(JOB, limit=1000))
        if e.kind not in QUIET_EVENTS
    )


def _run_in(cluster: rehearsal.Cluster, pod: rehearsal.Pod, code: str, *args: str) -> str:
    done = cluster.exec_in(pod, sys.executable, "-c", code, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _check_pods_match_torchx(
    cluster: rehearsal.Cluster, app: Any, pods: dict[str, rehearsal.PodSpec], job: dict[str, Any]
) -> None:
    """The pods run here are the containers torchx's Kubernetes scheduler would submit: same
    command, the same env entries (plus the image's and the Secrets'; a `secretKeyRef` one with
    its Secret's value), same volume mounts and root file system; the store's URL only in the
    controller's, the rendezvous secret only in the trainers', each from its Secret."""
    try:
        rendered = rehearsal.rendered_containers(app, job)
    except ImportError:
        print("(no kubernetes client: pods not compared with torchx's Volcano Job)")
        return
    assert set(rendered) == set(pods)
    for task, container in rendered.items():
        pod = pods[task]
        assert container["command"] == pod.command, task
        for var in container["env"]:
            if "valueFrom" in var:
                ref = var["valueFrom"]["secretKeyRef"]
                value = cluster.secrets[ref["name"]][ref["key"]]
            else:
                value = var["value"]
            assert pod.env[var["name"]] == value, (task, var["name"])
        assert {m["mountPath"] for m in container["volumeMounts"]} == set(pod.mounts), task
        read_only = container["securityContext"].get("readOnlyRootFilesystem", False)
        assert pod.read_only_root == read_only, task
    assert rendered["controller-0"]["envFrom"] == [{"secretRef": {"name": "pipetransformer-db"}}]
    assert "PIPETRANSFORMER_DB" in pods["controller-0"].env
    # the trainers: the rendezvous secret, never the store's credentials
    rdzv = [{"secretRef": {"name": "pipetransformer-rdzv"}}]
    assert rendered["trainer-0"]["envFrom"] == rdzv
    assert "PIPETRANSFORMER_DB" not in pods["trainer-0"].env
    assert "PIPETRANSFORMER_RDZV_SECRET" in pods["trainer-0"].env
    assert "PIPETRANSFORMER_RDZV_SECRET" not in pods["controller-0"].env


PROBE = """
import json, os, sys, tempfile
out = {}
for path in sys.argv[1:]:
    try:
        os.makedirs(path, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path)
        os.close(fd)
        os.unlink(name)
        out[path] = "written"
    except OSError as exc:
        out[path] = exc.strerror or type(exc).__name__
shm = os.statvfs("/dev/shm")
out["shm bytes"] = shm.f_blocks * shm.f_frsize
out["tempdir"] = tempfile.gettempdir()
print("PROBE " + json.dumps(out))
"""


def test_the_pods_write_only_to_their_volumes(tmp_path: Path) -> None:
    """Each of the component's pods as Kubernetes runs it (read-only root file system, its
    volumes, /dev/shm of its limit) with a probe for its command: the places the processes
    write (the temporary directory, ~/.cache under the image's HOME, the workdir, /dev/shm,
    the trainers' AutoCache) take a file; the root, /etc and the image's virtual environment
    refuse one even to root; /dev/shm is as large as its limit. Before, every path was
    writable and /dev/shm as large as the machine's."""
    if reason := rehearsal.missing():
        pytest.skip(f"the Kubernetes rehearsal cannot run here: {reason}")
    with rehearsal.Cluster(tmp_path / "cluster") as cluster:
        cluster.secrets["pipetransformer-db"] = {"PIPETRANSFORMER_DB": "sqlite:///unused"}
        app = _app(write_spec(tmp_path / "spec.yaml", model=MODEL, runtime=RUNTIME), JOB)
        dry_run = rehearsal.volcano_job(app)
        pods = rehearsal.role_pods(cluster, app, dry_run["metadata"]["name"])
        shm_limits = {  # MiB
            t["name"]: int(v["emptyDir"]["sizeLimit"].removesuffix("Mi"))
            for t in dry_run["spec"]["tasks"]
            for v in t["template"]["spec"]["volumes"]
            if v["name"] == "dshm"
        }
        home = rehearsal.IMAGE_HOME
        written = [home, f"{home}/.cache/pipetransformer", "/workdir", "/dev/shm"]
        # a checkout under /tmp is the pods' "image": the rehearsal cannot mount /tmp's emptyDir
        # over it (`Cluster.start` leaves such a mount out and logs it), so /tmp is checked
        # only where the checkout lives elsewhere
        tmp_mounted = not rehearsal.REPO.is_relative_to("/tmp")
        if tmp_mounted:
            written.insert(0, "/tmp")
        refused = ["/", "/etc", str(rehearsal.VENV_BIN)]
        for task, spec in pods.items():
            paths = written + refused + (["/cache"] if task.startswith("trainer") else [])
            probe = replace(spec, command=["python", "-c", PROBE, *paths], accounted=False)
            pod = cluster.start(probe, f"p{task[0]}{task[-1]}")
            assert pod.wait(timeout=60) == 0, pod.tail()
            line = next(x for x in pod.log.read_text().splitlines() if x.startswith("PROBE "))
            seen = json.loads(line.removeprefix("PROBE "))
            for path in paths:
                expected = "Read-only file system" if path in refused else "written"
                assert seen[path] == expected, (task, path, seen)
            if tmp_mounted:
                assert seen["tempdir"] == "/tmp"
            assert seen["shm bytes"] == shm_limits[task] << 20


def test_the_pods_train_a_job_and_ride_out_the_loss_of_a_trainer_pod(
    cluster: rehearsal.Cluster, tmp_path: Path
) -> None:
    t0, unix0 = time.monotonic(), time.time()

    def mark(what: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {what}", flush=True)

    spec = write_spec(
        tmp_path / "spec.yaml", model=MODEL, training={"epochs": EPOCHS}, runtime=RUNTIME
    )
    with rehearsal.explained(cluster):
        # -- the services of k8s/base: etcd, PostgreSQL (its init script run), the migrations
        etcd = cluster.start_etcd()
        pg, owner_url, ro_url = cluster.start_postgres()
        cluster.wait_etcd(etcd, 30)
        cluster.wait_postgres(pg, owner_url, 30)
        mark(f"etcd at {etcd.ip}, postgres at {pg.ip} (bridge {cluster.bridge})")
        upgrade = cluster.start(rehearsal.db_upgrade_pod(cluster), "dbup")
        assert upgrade.wait(timeout=90) == 0, upgrade.tail()
        mark("db upgrade Job done")

        # -- the job's pods, from the component in container mode
        app = _app(spec, JOB)
        # the Volcano Job `torchx run -s kubernetes` would submit: its name (the launch's app
        # id) names the pods, its restart and lifecycle policies decide what happens to a pod
        # that ends
        dry_run = rehearsal.volcano_job(app)
        rehearsal.create_launch_secrets(cluster, dry_run)  # as `torchx run` does (none here)
        pods = rehearsal.role_pods(cluster, app, dry_run["metadata"]["name"])
        _check_pods_match_torchx(cluster, app, pods, dry_run)
        volcano = rehearsal.VolcanoJob(cluster, dry_run, pods)
        for pod_spec in pods.values():  # `python` in a pod is the image's: this venv's
            found = shutil.which(pod_spec.command[0], path=pod_spec.env["PATH"])
            assert found == str(rehearsal.VENV_BIN / "python"), found
        controller = volcano.start("controller-0", "ctl")
        trainers = {
            pods[task].name: volcano.start(task, f"tr{i}")
            for i, task in enumerate(("trainer-0", "trainer-1"))
        }
        task_of = {pods[task].name: task for task in ("trainer-0", "trainer-1")}
        store = Store(cluster.from_root(owner_url), read_only=True)
        secret = pods["trainer-0"].env["PIPETRANSFORMER_RDZV_SECRET"]

        def explain() -> str:
            # a wait that timed out: then where the pods' processes were (they die of it)
            return f"{_explain(cluster, etcd.ip, secret)}\n{cluster.dump_stacks()}"

        try:
            checkpoint = rehearsal.wait_for(
                "a committed checkpoint",
                lambda: _alive(controller) and store.latest_checkpoint(JOB),
                120,
                explain,
            )
            mark(f"checkpoint committed at step {checkpoint.step}")
            # a pod that starts late on a loaded machine misses the first round (one node is
            # enough to start: --nnodes 1:2) and joins the next: wait for a generation of two
            rehearsal.wait_for(
                "a generation of two",
                lambda: (w := _running_world(store)) and w[1] == 2 and w,
                120,
                explain,
            )
            workers = rehearsal.wait_for(
                "the workers of both pods", lambda: (w := _workers(store)) and len(w) == 2 and w, 30
            )
            assert {w["host"] for w in workers.values()} == set(trainers), workers

            # -- each pod is its own host: what torchrun advertises (its FQDN) resolves to the
            # pod's address there and in its peer; its 127.0.0.1 has no etcd, the Service has
            victim = trainers[workers[0]["host"]]  # rank 0's pod: the workers' TCPStore host
            (survivor,) = (p for p in trainers.values() if p is not victim)
            for pod, peer in ((victim, survivor), (survivor, victim)):
                who = _run_in(cluster, pod, WHO).split()
                assert who == [pod.name, pod.spec.fqdn, pod.ip], who
                assert _run_in(cluster, peer, RESOLVE, pod.spec.fqdn) == pod.ip
            assert _run_in(cluster, survivor, CONNECT, "127.0.0.1", "2379") == (
                "ConnectionRefusedError"
            )
            assert _run_in(cluster, survivor, CONNECT, "etcd", "2379") == "connected"

            # -- lose rank 0's pod: its link cut first (no FIN, no RST), then every process
            volcano.lose(task_of[victim.name])
            mark(f"lost pod {victim.name} ({victim.ip}, rank 0)")
            shrunk = rehearsal.wait_for(
                "a generation of one",
                lambda: (w := _running_world(store)) and w[1] == 1 and w,
                90,
                explain,
            )
            mark(f"generation {shrunk[0]} trains on 1 worker")

            # -- evicted off the lost node, Volcano recreates it: the same pod, in a new
            # network namespace and address
            volcano.evict_lost(task_of[victim.name])
            replacement = volcano.pod(task_of[victim.name])
            mark(f"recreated pod {replacement.name} at {replacement.ip}")
            widened = rehearsal.wait_for(
                "the job to widen again",
                lambda: (w := _running_world(store)) and w[1] == 2 and w[0] > shrunk[0] and w,
                90,
                explain,
            )
            mark(f"generation {widened[0]} trains on 2 workers from step {store.get_job(JOB).step}")

            # -- a drain deletes the other trainer pod: SIGTERM reaches its PID 1, which
            # forwards it; its workers checkpoint the step they are at and leave, the survivor
            # re-forms from that state: no step is computed twice. Volcano recreates the pod.
            drained = task_of[survivor.name]
            volcano.delete(drained)
            # the job re-forms from the drained pod's checkpoint: on one worker, or on two at
            # once when Volcano's replacement pod is quick enough to join that very round
            left = rehearsal.wait_for(
                "a generation after the drain",
                lambda: (w := _running_world(store)) and w[0] > widened[0] and w,
                90,
                explain,
            )
            lost_steps = _steps_lost_at_end_of(store, left[0] - 1)
            mark(
                f"pod {survivor.name} drained: generation {left[0]} of {left[1]}, "
                f"{lost_steps} steps lost"
            )
            assert lost_steps == 0, _timeline(store, unix0)
            rehearsal.wait_for(
                "the drained pod back in the job",
                lambda: (w := _running_world(store)) and w[1] == 2 and w[0] >= left[0] and w,
                90,
                explain,
            )
            mark(
                f"the recreated {volcano.pod(drained).name} joined at step {store.get_job(JOB).step}"
            )

            # -- the controller pod is evicted: it hands the job over (exit 143), its
            # PodEvicted policy replaces it, and the new one takes the job over
            volcano.evict("controller-0")
            rehearsal.wait_for(
                "a new controller pod",
                lambda: (
                    volcano.pod("controller-0") is not controller and volcano.pod("controller-0")
                ),
                60,
                explain,
            )
            assert controller.poll() == 143, controller.tail()
            controller = volcano.pod("controller-0")
            mark(f"controller evicted and replaced ({controller.netns})")

            # -- the kubelet evicts a trainer pod (node pressure): it leaves gracefully, its
            # Failed pod's PodEvicted policy replaces it, and the new pod rejoins: in a round of
            # its own after one of the survivor alone, or in the very round that re-forms after
            # the leave when the replacement is quick enough to be waiting for it (as at the drain)
            before = _running_world(store)
            assert before is not None
            evicted = volcano.pod("trainer-0")
            volcano.evict("trainer-0")
            rehearsal.wait_for(
                "the evicted trainer's replacement in the job",
                lambda: (
                    (w := _running_world(store))
                    and w[1] == 2
                    and w[0] > before[0]
                    and evicted.poll() is not None
                    and volcano.pod("trainer-0") is not evicted
                    and w
                ),
                90,
                explain,
            )
            mark(f"trainer evicted, replaced and back at step {store.get_job(JOB).step}")

            code = controller.wait(timeout=150)
            mark(f"controller pod exited {code}")
            assert code == 0, controller.tail()
            for task in ("trainer-0", "trainer-1"):
                assert volcano.pod(task).wait(timeout=60) == 0, volcano.pod(task).tail()
            mark("trainer pods exited 0")
            # the controller's exit completed the Volcano job; nothing was restarted after it
            rehearsal.wait_for("the Volcano job's end", lambda: volcano.phase != "Running", 15)
            print("volcano:\n  " + "\n  ".join(volcano.history))
            assert volcano.phase == "Completed", volcano.history
            assert volcano.running() == [], volcano.history
            for role in ("controller", "trainer"):  # an eviction is a Failed pod, replaced
                assert any(
                    h.startswith(role) and h.endswith("PodEvicted -> RestartTask")
                    for h in volcano.history
                ), volcano.history

            # -- what the store says, read from the root namespace through the bridge
            job = store.get_job(JOB)
            assert job.state == "completed" and job.step == TOTAL, job.message
            steps = [m.step for m in store.metrics(JOB)]
            assert steps == list(range(1, TOTAL + 1)), "every step recorded exactly once"
            gens = store.generations(JOB)
            worlds = [g.world_size for g in gens]
            assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, worlds
            assert gens[-1].state == "completed", gens
            kinds = [e.kind for e in reversed(store.events(JOB, limit=1000))]
            assert "generation_aborted" in kinds and "worker_lost" in kinds, kinds
            assert "job_shrank" in kinds and "job_widened" in kinds and "worker_joined" in kinds
            assert kinds.count("controller_started") == 2 and "controller_exited" in kinds
            started = [e for e in store.events(JOB, limit=1000) if e.kind == "worker_started"]
            assert {e.data["host"] for e in started} == set(trainers)
            # the checkpoints are on the shared volume, where the store says they are in a pod
            volume = cluster.volume("pipetransformer-workdir")
            committed = store.checkpoints(JOB)
            assert committed and committed[0].step == TOTAL
            for c in committed:
                assert c.path.startswith("/workdir/"), c.path
                host_path = volume / Path(c.path).relative_to("/workdir")
                assert verify_checkpoint(host_path, c.checksum) == c.size_bytes
        finally:
            volcano.close()
            with contextlib.suppress(Exception):
                print("events:\n" + _timeline(store, unix0))
            store.close()
        # the dashboard's role reads what the owner's migrations created (the init's grants)
        with Store(cluster.from_root(ro_url), read_only=True) as ro:
            assert ro.get_job(JOB).state == "completed"
        # no pod's log shows a Secret's value (the store's password)
        for password in cluster.secrets["postgres-credentials"].values():
            for pod in cluster.pods:
                assert password not in pod.log.read_text(errors="replace"), pod.name

    wall = time.monotonic() - t0
    print(f"\nrehearsal wall time {wall:.1f}s (budget {BUDGET_S}s) on {socket.gethostname()}")
    for g in gens:
        reason = f" ({g.reason[:100]})" if g.reason else ""
        print(f"generation {g.number}: {g.world_size} workers, {g.state}{reason}")
    for pod in cluster.pods:
        peak = cluster.cgroups.peaks.get(pod.netns)
        if peak is not None:
            print(
                f"pod {pod.name} ({pod.netns}): CPU {cluster.cgroups.cpu.get(pod.netns, 0):.1f}s, "
                f"memory peak {peak / 2**20:.0f} MiB (container limit {pod.spec.memory_limit_mb} MB)"
            )


def test_a_stopped_job_and_a_failed_one_end_their_volcano_jobs_and_release_their_pods(
    cluster: rehearsal.Cluster, tmp_path: Path
) -> None:
    """Two jobs' ends as the generated Job's policies handle them: a user's stop (the
    controller exits 130: AbortJob: nothing restarts) and trainers that refuse to start on
    every pod (`runtime.device: cuda` on this machine without a GPU): each failed trainer pod
    is replaced (RestartTask) and refuses again, until the refusals spend the controller's
    restart budget: the job fails with the reason in the store, the controller exits 3
    (TerminateJob) before Volcano's maxRetry is spent. Either way every pod stops: GPUs
    released."""
    from pipetransformer.core import keys
    from pipetransformer.core.protocol import Control
    from pipetransformer.edge.etcd_client import EtcdClient

    with rehearsal.explained(cluster):
        etcd = cluster.start_etcd()
        pg, owner_url, _ = cluster.start_postgres()
        cluster.wait_etcd(etcd, 30)
        cluster.wait_postgres(pg, owner_url, 30)
        upgrade = cluster.start(rehearsal.db_upgrade_pod(cluster), "dbup")
        assert upgrade.wait(timeout=90) == 0, upgrade.tail()
        store = Store(cluster.from_root(owner_url), read_only=True)
        client = EtcdClient(f"{etcd.ip}:2379")
        try:

            def end_of(job_id: str, runtime: dict[str, str], status: int, phase: str) -> None:
                spec = write_spec(
                    tmp_path / f"{job_id}.yaml",
                    model=MODEL,
                    training={"epochs": EPOCHS},
                    runtime={**RUNTIME, **runtime},
                )
                app = _app(spec, job_id, gpu=1 if runtime else -1)
                dry_run = rehearsal.volcano_job(app)
                rehearsal.create_launch_secrets(cluster, dry_run)
                pods = rehearsal.role_pods(cluster, app, dry_run["metadata"]["name"])
                volcano = rehearsal.VolcanoJob(cluster, dry_run, pods)
                try:
                    controller = volcano.start("controller-0", f"{job_id[:2]}c")
                    for i in range(2):
                        volcano.start(f"trainer-{i}", f"{job_id[:2]}t{i}")
                    if job_id == "stopped":  # as the dashboard or `Ctrl-C` asks
                        rehearsal.wait_for(
                            "training",
                            lambda: store.latest_checkpoint(job_id),
                            120,
                            cluster.explain,
                        )
                        client.put(keys.control(job_id), Control.STOP)
                    assert controller.wait(timeout=150) == status, controller.tail()
                    rehearsal.wait_for(
                        f"the Volcano job {phase}",
                        lambda: volcano.phase != "Running" and not volcano.running(),
                        150,
                        cluster.explain,
                    )
                    print(f"{job_id}:\n  " + "\n  ".join(volcano.history))
                    assert volcano.phase == phase, volcano.history
                    recreated = sum("recreated" in h for h in volcano.history)
                    if job_id == "stopped":
                        assert recreated == 0, volcano.history
                        assert store.get_job(job_id).state == "interrupted"
                        assert "stopped at step" in controller.log.read_text(), controller.tail()
                    else:  # replaced within the budget, each refusing with one clear line
                        assert 1 <= recreated <= int(dry_run["spec"]["maxRetry"]), volcano.history
                        trainer = volcano.pod("trainer-0").tail(5)
                        assert "runtime.device" in trainer and "Traceback" not in trainer, trainer
                        job = store.get_job(job_id)
                        assert job.state == "failed" and "refused to run the job 3 times" in (
                            job.message or ""
                        ), job.message
                        refusals = store.events(job_id, kinds=["trainer_refused"])
                        assert len(refusals) >= 3 and "runtime.device" in refusals[0].message
                finally:
                    volcano.close()

            end_of("stopped", {}, 130, "Aborted")
            end_of("failing", {"device": "cuda"}, 3, "Terminated")
        finally:
            client.close()
            store.close()
