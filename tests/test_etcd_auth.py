"""Who may write the job's keys, against a real etcd started with TLS, client certificates and
auth (orchestrator/etcd_auth.py, edge/etcd_client/tls.py's EtcdTls): each role does its job, each
write outside its permissions is refused naming the identity and the key, a client without a
certificate or with a wrong one is refused at the handshake, and a misconfigured client is told
which variable and path are wrong before it sends anything."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from pipetransformer.core import keys
from pipetransformer.core.spec import JobSpec, load_spec
from pipetransformer.edge.etcd_client import (
    CACERT_ENV,
    CERT_ENV,
    KEY_ENV,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USER_ENV,
    EtcdAuthFailed,
    EtcdClient,
    EtcdConfigError,
    EtcdPermissionDenied,
    EtcdTls,
    EtcdTlsRefused,
    EtcdUnavailable,
)
from pipetransformer.edge.overrides import file_freeze_request, file_trace_request
from pipetransformer.orchestrator import cli, etcd_auth
from pipetransformer.orchestrator.errors import UsageError
from pipetransformer.orchestrator.etcd_server import etcd_binary, free_port
from pipetransformer.orchestrator.procs import tied_to_parent
from pipetransformer.orchestrator.rendezvous import (
    create_backend,
    state_key,
    store_prefix,
    verify_state,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "make-etcd-certs.sh"
ROLES = {
    "root": "etcd-client-root",
    "controller": "etcd-client-controller",
    "dashboard": "etcd-client-dashboard",
    "trainer": "etcd-client-trainer",
}
TLS_ENV = (CACERT_ENV, CERT_ENV, KEY_ENV, USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV)


def make_certs(out: Path) -> Path:
    done = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return out


@dataclass
class AuthEtcd:
    """An etcd serving TLS only, demanding client certificates, auth enabled by `setup`."""

    endpoint: str
    certs: Path

    def tls(self, role: str, user: str | None = None, password: str | None = None) -> EtcdTls:
        folder = self.certs / ROLES[role]
        return EtcdTls(
            ca_cert=str(self.certs / "ca.crt"),
            cert=str(folder / "tls.crt"),
            key=str(folder / "tls.key"),
            user=user,
            password=password,
        )

    def client(
        self,
        role: str,
        user: str | None = None,
        password: str | None = None,
        retry_timeout: float = 5.0,
    ) -> EtcdClient:
        return EtcdClient(
            self.endpoint, retry_timeout=retry_timeout, tls=self.tls(role, user, password)
        )

    def env(self, role: str, user: str | None = None, password: str | None = None) -> dict:
        folder = self.certs / ROLES[role]
        env = {
            CACERT_ENV: str(self.certs / "ca.crt"),
            CERT_ENV: str(folder / "tls.crt"),
            KEY_ENV: str(folder / "tls.key"),
        }
        if user:
            env |= {USER_ENV: user, PASSWORD_ENV: password or ""}
        return env


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


IPV6 = _ipv6_loopback()  # an address the members' certificate does not name: [::1]


def _etcd_command(data: Path, certs: Path, port: int, peer: int) -> list[str]:
    # the flags k8s/base/etcd.yaml sets as ETCD_* variables, on one member
    member = certs / "etcd-member-tls"
    listen = f"https://127.0.0.1:{port}" + (f",https://[::1]:{port}" if IPV6 else "")
    tls = [f"--cert-file={member / 'tls.crt'}", f"--key-file={member / 'tls.key'}"]
    peer_tls = [f"--peer-cert-file={member / 'tls.crt'}", f"--peer-key-file={member / 'tls.key'}"]
    return [
        str(etcd_binary()),
        "--name=auth",
        f"--data-dir={data}",
        f"--listen-client-urls={listen}",
        f"--advertise-client-urls=https://127.0.0.1:{port}",
        f"--listen-peer-urls=https://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=https://127.0.0.1:{peer}",
        f"--initial-cluster=auth=https://127.0.0.1:{peer}",
        *tls,
        f"--trusted-ca-file={certs / 'ca.crt'}",
        "--client-cert-auth=true",
        *peer_tls,
        f"--peer-trusted-ca-file={certs / 'ca.crt'}",
        "--peer-client-cert-auth=true",
        "--peer-cert-allowed-cn=etcd-peer",
        "--logger=zap",
        "--log-level=warn",
        "--log-outputs=stderr",
        "--unsafe-no-fsync=true",
    ]


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthEtcd]:
    base = tmp_path_factory.mktemp("etcd-auth")
    certs = make_certs(base / "certs")
    port, peer = free_port(), free_port()
    log = open(base / "etcd.log", "wb")  # closed at teardown
    proc = subprocess.Popen(
        tied_to_parent(_etcd_command(base / "data", certs, port, peer)),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = AuthEtcd(f"127.0.0.1:{port}", certs)
    try:
        with server.client("root") as root:
            try:
                root.wait_ready(30)
            except EtcdUnavailable:
                pytest.fail((base / "etcd.log").read_text()[-3000:])
            etcd_auth.setup(root)
        yield server
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def new_job() -> str:
    return f"j{uuid.uuid4().hex[:8]}"


def admitted(server: AuthEtcd, job: str, runs: tuple[str, ...] = ()) -> str:
    """`job`'s trainer user, as its controller makes it; its password."""
    password = uuid.uuid4().hex
    with server.client("controller") as controller:
        etcd_auth.admit_trainers(controller, job, password, runs)
    return password


# -- the script and the names ----------------------------------------------------------------


def test_the_script_issues_each_role_its_cn(auth_etcd: AuthEtcd) -> None:
    expected = {
        "etcd-member-tls": "etcd-peer",
        "etcd-client-root": etcd_auth.ROOT_USER,
        "etcd-client-controller": etcd_auth.CONTROLLER_USER,
        "etcd-client-dashboard": etcd_auth.DASHBOARD_USER,
        "etcd-client-trainer": etcd_auth.TRAINER_CERT_CN,
    }
    for secret, cn in expected.items():
        folder = auth_etcd.certs / secret
        assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        subject = subprocess.run(
            ["openssl", "x509", "-in", str(folder / "tls.crt"), "-noout", "-subject"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert subject.strip().endswith(f"CN = {cn}"), (secret, subject)
        assert (folder / "tls.key").stat().st_mode & 0o077 == 0  # the key: its owner's only
    bad = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_every_job_key_is_placed_and_no_role_reaches_another_jobs_keys() -> None:
    """Each key builder of core/keys.py taking a job id lands in exactly one class: what the
    trainers write, what people's requests are, what only the controller writes; and a job's
    ranges never cover a job whose id extends it ("j" and "j-2")."""
    trainer = etcd_auth.trainer_permissions("j", ["j-run"])
    dashboard = etcd_auth.dashboard_permissions()

    def allowed(perms: tuple[etcd_auth.Permission, ...], key: str, write: bool) -> bool:
        return any(p.covers(key) and (p.write or not write) for p in perms)

    writes = set(etcd_auth.TRAINER_WRITES)
    builders = [
        fn
        for name, fn in vars(keys).items()
        if inspect.isfunction(fn)
        and list(inspect.signature(fn).parameters)[:1] == ["job_id"]
        and fn is not keys.job  # the prefix of the others, no key itself
    ]
    assert len(builders) >= 15
    for build in builders:
        extra = list(inspect.signature(build).parameters)[1:]
        args = {"generation": 1, "rank": 2, "seq": 3, "host": "h", "pid": 4}
        key = build("j", *(args[a] for a in extra))
        request = key.startswith(keys.REQUESTS)
        assert allowed(trainer, key, write=False), key  # trainers read all of their job
        trainer_writes = build in writes or any(w("j") in key for w in writes if w("j")[-1] == "/")
        assert allowed(trainer, key, write=True) == trainer_writes, key
        assert allowed(dashboard, key, write=True) == request, key
        assert allowed(dashboard, key, write=False), key
        other = build("j-2", *(args[a] for a in extra))
        assert not allowed(trainer, other, write=False), other
    assert allowed(trainer, keys.rendezvous("j-run") + "/state", write=True)
    assert not allowed(trainer, keys.rendezvous("j-run-2") + "/state", write=False)


def test_plan_prints_every_identity(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["etcd-auth", "plan"]) == 0
    out = capsys.readouterr().out
    for user in ("root", etcd_auth.CONTROLLER_USER, etcd_auth.DASHBOARD_USER, "trainer-<job>"):
        assert f"user {user}" in out
    assert "readwrite /pipetransformer/requests/*" in out


# -- each role does its job --------------------------------------------------------------------


def test_controller_publishes_and_its_trainers_write_what_trainers_write(
    auth_etcd: AuthEtcd,
) -> None:
    job, run, old_run = new_job(), f"{new_job()}-r1", f"{new_job()}-r0"
    password = uuid.uuid4().hex
    with auth_etcd.client("controller") as controller:
        controller.put(keys.spec(job), "{}")
        controller.put(keys.launch(job), json.dumps({"rdzv_id": old_run}))  # taken over
        env = {etcd_auth.TRAINER_PASSWORD_ENV: password}
        done = etcd_auth.admit_trainers_from_env(controller, job, run, environ=env)
        assert f"user trainer-{job}: created" in done
        # idempotent: a restarted controller changes nothing
        assert etcd_auth.admit_trainers_from_env(controller, job, run, environ=env) == []
        assert etcd_auth.admit_trainers_from_env(controller, job, run, environ={}) == []
    user = etcd_auth.trainer_user(job)
    with auth_etcd.client("trainer", user, password) as trainer:
        assert trainer.get(keys.spec(job)) == "{}"
        lease = trainer.lease(5)
        trainer.put(keys.worker(job, 0), "{}", lease=lease)
        trainer.put(keys.event(job, 1, 0, 1), "{}")
        trainer.put(keys.exit_report(job, "h", 1), "{}")
        trainer.put(keys.alert(job, "h", 1), "{}")
        trainer.put(keys.refusal(job, "h", 1), "{}")
        trainer.put(keys.join(job), "{}")
        trainer.put(f"{keys.agents(job)}h-1", "", lease=lease)
        for rdzv in (run, old_run):
            trainer.put(keys.rendezvous(rdzv) + "/state", "x")
        assert trainer.compare_and_swap(keys.trace_request(job), None, "{}")
        assert trainer.lease_remaining(lease.id) > 0
        lease.revoke()  # its keys go with it: write permission on them
        assert trainer.get(keys.worker(job, 0)) is None


def test_dashboard_files_requests_and_reads_jobs(auth_etcd: AuthEtcd) -> None:
    @dataclass
    class Facts:
        id: str
        state: str
        workdir: str
        spec: JobSpec
        freeze_boundary: int

    job = Facts(new_job(), "running", "/nowhere", load_spec(REPO / "examples/vit-digits.yaml"), 0)
    with auth_etcd.client("dashboard") as dashboard:
        request = file_freeze_request(dashboard, job, 2, "converged", who="alice (dashboard)")
        assert json.loads(dashboard.get(keys.freeze_override(job.id)))["id"] == request.id
        trace = file_trace_request(dashboard, job, who="alice (dashboard)")
        assert json.loads(dashboard.get(keys.trace_request(job.id)))["id"] == trace.id
        assert dashboard.get(keys.layout(job.id)) is None  # reading a job's keys is allowed


# -- and nothing else ------------------------------------------------------------------------


def test_dashboard_cannot_abort_or_publish(auth_etcd: AuthEtcd) -> None:
    job = new_job()
    with auth_etcd.client("dashboard") as dashboard:
        for key in (keys.abort(job), keys.layout(job), keys.rendezvous(job) + "/state"):
            with pytest.raises(EtcdPermissionDenied) as refused:
                dashboard.put(key, "1")
            message = str(refused.value)
            assert f"put {key}" in message and "CN 'pipetransformer-dashboard'" in message
            assert "permission denied" in message
        with pytest.raises(EtcdPermissionDenied):
            dashboard.delete_prefix(keys.job(job) + "/")
        with pytest.raises(EtcdPermissionDenied):  # nor make itself a user
            etcd_auth.admit_trainers(dashboard, job, "pw", [])


def test_trainer_cannot_write_another_jobs_keys_or_the_controllers(auth_etcd: AuthEtcd) -> None:
    job, other = new_job(), new_job()
    password = admitted(auth_etcd, job, (f"{job}-r",))
    admitted(auth_etcd, other, (f"{other}-r",))
    with auth_etcd.client("trainer", etcd_auth.trainer_user(job), password) as trainer:
        trainer.put(keys.worker(job, 0), "{}")
        for key in (
            keys.worker(other, 0),
            keys.event(other, 1, 0, 1),
            keys.rendezvous(f"{other}-r") + "/state",
            keys.abort(job),
            keys.layout(job),
            keys.freeze_override(job),
        ):
            with pytest.raises(EtcdPermissionDenied, match=f"user 'trainer-{job}'"):
                trainer.put(key, "1")
        with pytest.raises(EtcdPermissionDenied):
            trainer.get(keys.spec(other))  # not even reading another job
    # the trainers' certificate alone is nobody
    with auth_etcd.client("trainer") as anonymous:
        with pytest.raises(EtcdPermissionDenied, match="pipetransformer-trainer"):
            anonymous.get(keys.spec(job))


def test_clients_without_a_trusted_certificate_are_refused_at_the_handshake(
    auth_etcd: AuthEtcd, tmp_path: Path
) -> None:
    ca = str(auth_etcd.certs / "ca.crt")
    started = time.monotonic()
    with EtcdClient(auth_etcd.endpoint, retry_timeout=10, tls=EtcdTls(ca_cert=ca)) as bare:
        with pytest.raises(EtcdTlsRefused, match="TLS handshake with etcd at") as refused:
            bare.get("/x")
    assert "no client certificate given" in str(refused.value)
    assert time.monotonic() - started < 5  # not retried: waiting cannot help

    stranger = make_certs(tmp_path / "other-ca")  # a certificate from a CA etcd does not trust
    foreign = stranger / "etcd-client-root"
    tls = EtcdTls(ca_cert=ca, cert=str(foreign / "tls.crt"), key=str(foreign / "tls.key"))
    with EtcdClient(auth_etcd.endpoint, retry_timeout=10, tls=tls) as client:
        with pytest.raises(EtcdTlsRefused):
            client.get("/x")
    # nor do we trust a server whose certificate another CA signed
    tls = EtcdTls(ca_cert=str(stranger / "ca.crt"))
    with EtcdClient(auth_etcd.endpoint, retry_timeout=10, tls=tls) as client:
        with pytest.raises(EtcdTlsRefused, match="CERTIFICATE_VERIFY_FAILED"):
            client.get("/x")
    if IPV6:  # a server whose certificate does not name the address dialled
        with (
            auth_etcd.client("root") as root,
            EtcdClient(
                f"[::1]:{auth_etcd.endpoint.rsplit(':', 1)[1]}", retry_timeout=10, tls=root.tls
            ) as client,
        ):
            with pytest.raises(EtcdTlsRefused, match="Hostname Verification"):
                client.get("/x")
    # plaintext to a TLS port: etcd closes it without a word; the error says what may be wrong
    with EtcdClient(auth_etcd.endpoint, retry_timeout=0.5, tls=None) as plain:
        with pytest.raises(EtcdUnavailable, match=CACERT_ENV):
            plain.get("/x")


def test_a_wrong_password_is_refused_and_a_missing_user_waited_for(auth_etcd: AuthEtcd) -> None:
    job = new_job()
    user = etcd_auth.trainer_user(job)
    with auth_etcd.client("trainer", user, "not-yet", retry_timeout=0.5) as early:
        with pytest.raises(EtcdAuthFailed, match=f"user '{user}'"):
            early.get(keys.spec(job))
    # the trainers start before their controller has made their user: they wait for it
    password = uuid.uuid4().hex

    def controller_starts() -> None:
        with auth_etcd.client("controller") as controller:
            etcd_auth.admit_trainers(controller, job, password, [])

    timer = threading.Timer(1.0, controller_starts)
    timer.start()
    try:
        with auth_etcd.client("trainer", user, password, retry_timeout=20) as trainer:
            trainer.put(keys.worker(job, 0), "{}")
            assert trainer.recoveries  # it rode the wait out like an outage
    finally:
        timer.join()


def test_a_dropped_token_is_fetched_again(auth_etcd: AuthEtcd) -> None:
    job = new_job()
    password = admitted(auth_etcd, job)
    with auth_etcd.client("trainer", etcd_auth.trainer_user(job), password) as trainer:
        trainer.put(keys.worker(job, 0), "1")
        # what etcd does to a token idle for 5 minutes, or on a restart: forgets it
        trainer._token = "forgotten.1"
        trainer._client.metadata = (("token", "forgotten.1"),)
        trainer.put(keys.worker(job, 0), "2")
        assert trainer._token != "forgotten.1"
        # a client passed to another process keeps its identity (not its token)
        clone = pickle.loads(pickle.dumps(trainer))
        with clone:
            assert clone.tls == trainer.tls and clone.get(keys.worker(job, 0)) == "2"


def test_setup_is_idempotent_and_only_root_runs_it(
    auth_etcd: AuthEtcd, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in auth_etcd.env("root").items():
        monkeypatch.setenv(name, value)
    assert cli.main(["etcd-auth", "setup", "--etcd", auth_etcd.endpoint]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == ["auth: enabled"]  # nothing to create
    for name, value in auth_etcd.env("dashboard").items():
        monkeypatch.setenv(name, value)
    assert cli.main(["etcd-auth", "setup", "--etcd", auth_etcd.endpoint]) == 2
    assert "is not root there" in capsys.readouterr().err


def test_a_controller_without_root_is_told_what_it_needs(auth_etcd: AuthEtcd) -> None:
    env = {etcd_auth.TRAINER_PASSWORD_ENV: "pw"}
    with auth_etcd.client("dashboard") as not_root:
        with pytest.raises(UsageError, match="needs the etcd role root"):
            etcd_auth.admit_trainers_from_env(not_root, new_job(), "r", environ=env)


# -- misconfigured clients -------------------------------------------------------------------


def test_misconfigured_clients_name_the_variable_and_the_path(
    auth_etcd: AuthEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = auth_etcd.env("dashboard")
    missing = str(tmp_path / "gone" / "tls.crt")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    other = auth_etcd.certs / "etcd-client-root" / "tls.key"
    cases = [
        ({**good, CERT_ENV: missing}, f"{CERT_ENV}={missing}: cannot read the client certificate"),
        ({**good, CACERT_ENV: str(not_pem)}, f"{CACERT_ENV}={not_pem}: not a PEM CA certificate"),
        ({**good, KEY_ENV: ""}, f"{CERT_ENV} is set but {KEY_ENV} is not"),
        ({**good, KEY_ENV: str(other)}, "do not make a pair"),
        ({CERT_ENV: good[CERT_ENV], KEY_ENV: good[KEY_ENV]}, f"{CACERT_ENV} is not"),
        ({**good, USER_ENV: "u"}, f"{USER_ENV} is set but {PASSWORD_ENV} is not"),
        ({**good, PASSWORD_FILE_ENV: missing}, f"{PASSWORD_FILE_ENV}={missing}: cannot read"),
    ]
    for env, message in cases:
        for name in TLS_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(EtcdConfigError) as caught:
            EtcdClient(auth_etcd.endpoint)
        assert message in str(caught.value) and "\n" not in str(caught.value), message
    # the rendezvous says the same in torch's words
    with pytest.raises(RendezvousConnectionError, match=f"{PASSWORD_FILE_ENV}={missing}"):
        create_backend(RendezvousParameters("etcd3", auth_etcd.endpoint, "r", 1, 1))
    # nothing set: plaintext, as every local run
    for name in TLS_ENV:
        monkeypatch.delenv(name, raising=False)
    assert EtcdTls.from_env() is None and EtcdClient("127.0.0.1:1").tls is None


# -- the members' TLS as k8s/base/etcd.yaml sets it ------------------------------------------------


def test_three_members_meet_over_tls_as_the_manifest_configures_them(tmp_path: Path) -> None:
    """The TLS settings of k8s/base/etcd.yaml (its ETCD_* variables, the Secret's files in a
    folder here, the members on loopback ports): a 3-member cluster forms over peer TLS, serves
    clients, and its peer port refuses a client's certificate from the same CA."""
    docs = yaml.safe_load_all((REPO / "k8s" / "base" / "etcd.yaml").read_text())
    (sts,) = [d for d in docs if d and d["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tls"]
    certs = make_certs(tmp_path / "certs")
    member = certs / "etcd-member-tls"
    tls_env = {  # the certificate files and the checks of them, as the manifest sets them
        e["name"]: e["value"].replace(mount, str(member))
        for e in container["env"]
        if any(part in e["name"] for part in ("CERT", "KEY", "CA_FILE", "_AUTH"))
    }
    assert {"ETCD_CLIENT_CERT_AUTH", "ETCD_PEER_CERT_ALLOWED_CN", "ETCD_PEER_KEY_FILE"} <= set(
        tls_env
    )
    ports = [(free_port(), free_port()) for _ in range(3)]
    cluster = ",".join(f"m{i}=https://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    members = []
    try:
        for i, (client, peer) in enumerate(ports):
            env = {
                **tls_env,
                "ETCD_NAME": f"m{i}",
                "ETCD_DATA_DIR": str(tmp_path / f"m{i}"),
                "ETCD_INITIAL_CLUSTER": cluster,
                "ETCD_INITIAL_CLUSTER_STATE": "new",
                "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"https://127.0.0.1:{peer}",
                "ETCD_LISTEN_PEER_URLS": f"https://127.0.0.1:{peer}",
                "ETCD_ADVERTISE_CLIENT_URLS": f"https://127.0.0.1:{client}",
                "ETCD_LISTEN_CLIENT_URLS": f"https://127.0.0.1:{client}",
                "ETCD_LOG_LEVEL": "error",
                "ETCD_UNSAFE_NO_FSYNC": "true",
            }
            members.append(
                subprocess.Popen(
                    tied_to_parent([str(etcd_binary())]),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        server = AuthEtcd(f"127.0.0.1:{ports[0][0]}", certs)
        for i, (client, _) in enumerate(ports):
            tls = server.tls("root")
            with EtcdClient(f"127.0.0.1:{client}", retry_timeout=30, tls=tls) as etcd:
                etcd.wait_ready(30)
                etcd.put(f"/member/{i}", "up")  # a write needs the quorum: the peers talk
        with server.client("dashboard") as etcd:
            assert [k for k, _ in etcd.get_prefix("/member/")] == [f"/member/{i}" for i in range(3)]
        # a client certificate from the same CA does not get in as a member
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        dashboard = certs / "etcd-client-dashboard"
        context.load_cert_chain(str(dashboard / "tls.crt"), str(dashboard / "tls.key"))
        with pytest.raises(ssl.SSLError, match="BAD_CERTIFICATE"):
            with socket.create_connection(("127.0.0.1", ports[0][1]), timeout=5) as raw:
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as peer_socket:
                    peer_socket.sendall(b"GET /members HTTP/1.1\r\nHost: m\r\n\r\n")
                    peer_socket.recv(100)
    finally:
        for proc in members:
            proc.terminate()
            proc.wait(10)


# -- the rendezvous through TLS and auth -------------------------------------------------------


def test_rendezvous_backend_and_store_through_tls_and_auth(
    auth_etcd: AuthEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = new_job()
    run = f"{job}-abc123"
    password = admitted(auth_etcd, job, (run,))
    for name, value in auth_etcd.env("trainer", etcd_auth.trainer_user(job), password).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(keys.RDZV_SECRET_ENV, "s" * 32)
    params = RendezvousParameters("etcd3", auth_etcd.endpoint, run, 1, 1, job=job)
    backend, store = create_backend(params)
    assert backend.set_state(b"state-1") is not None
    state, token = backend.get_state()
    assert state == b"state-1"
    assert backend.set_state(b"state-2", token)[2] is True
    store.set("k", b"v")
    assert store.get("k") == b"v"
    # another job's trainers have no business in this run
    other = new_job()
    other_password = admitted(auth_etcd, other)
    monkeypatch.setenv(USER_ENV, etcd_auth.trainer_user(other))
    monkeypatch.setenv(PASSWORD_ENV, other_password)
    intruder, _ = create_backend(params)
    with pytest.raises(RendezvousConnectionError, match="permission denied"):
        intruder.set_state(b"forged")


WORKER = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt"), "w") as f:
    f.write(f"{dist.get_world_size()} {value.item():g}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_torchrun_agents_rendezvous_as_their_jobs_trainers(
    auth_etcd: AuthEtcd, tmp_path: Path
) -> None:
    job = new_job()
    run = f"{job}-r"
    password = admitted(auth_etcd, job, (run,))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={auth_etcd.endpoint}",
        f"--rdzv-id={run}",
        f"--rdzv-conf=join_timeout=60,last_call_timeout=1,read_timeout=30,job={job}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", keys.RDZV_SECRET_ENV: "s" * 32}
    env |= auth_etcd.env("trainer", etcd_auth.trainer_user(job), password)
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = []
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(2)) == ["2 3"] * 2
    with auth_etcd.client("controller") as controller:
        assert verify_state(b"s" * 32, state_key(run), controller.get(state_key(run)))
        assert controller.count_prefix(store_prefix(run)) > 0
