"""The etcd3 torchrun rendezvous: entry point, state backend, c10d store, real torchrun agents."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from base64 import b64encode
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from pipetransformer.core import keys
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd, free_port
from pipetransformer.orchestrator.rendezvous import (
    EtcdRendezvousBackend,
    EtcdStore,
    create_etcd3_handler,
    delete_rendezvous,
    handler_factory,
    load_secret,
    sign_state,
    state_key,
    store_prefix,
    verify_state,
)


def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def params(endpoint: str, rid: str, min_nodes: int = 1, max_nodes: int = 1, **config: Any):
    return RendezvousParameters(
        backend="etcd3",
        endpoint=endpoint,
        run_id=rid,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr="127.0.0.1",
        **config,
    )


# -- entry point ----------------------------------------------------------------------------


def test_entry_point_is_discoverable_and_builds_our_handler(etcd_server: EmbeddedEtcd) -> None:
    (ep,) = [ep for ep in entry_points(group="torchrun.handlers") if ep.name == "etcd3"]
    assert ep.value == "pipetransformer.orchestrator.rendezvous:handler_factory"
    # torch calls the loaded object with no arguments and registers what it returns.
    creator = ep.load()()
    assert callable(creator)

    handler = get_rendezvous_handler(params(etcd_server.endpoint, run_id()))
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.get_backend() == "etcd3"
    assert handler_factory()(params(etcd_server.endpoint, run_id())).get_backend() == "etcd3"


def test_entry_point_registers_even_when_we_import_torch_rendezvous_first(
    etcd_server: EmbeddedEtcd,
) -> None:
    # torch loads all torchrun.handlers entry points while its rendezvous package initialises;
    # if our module is what triggers that import, the entry point must still resolve.
    code = textwrap.dedent(
        f"""
        import pipetransformer.orchestrator.rendezvous
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
        p = RendezvousParameters("etcd3", "{etcd_server.endpoint}", "fresh", 1, 1)
        print("BACKEND", get_rendezvous_handler(p).get_backend())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "BACKEND etcd3" in proc.stdout
    assert "Exception while registering" not in proc.stderr, proc.stderr


# -- backend --------------------------------------------------------------------------------


def test_backend_cas_the_stale_token_loses(etcd_server: EmbeddedEtcd, etcd: EtcdClient) -> None:
    rid = run_id()
    with EtcdClient(etcd_server.endpoint) as other:
        a = EtcdRendezvousBackend(etcd, rid)
        b = EtcdRendezvousBackend(other, rid)
        assert a.name == "etcd3"
        assert a.get_state() is None and b.get_state() is None

        # Both try to create the state; only the first wins, the second gets the winner's.
        state_a, token_a, ok = a.set_state(b"from-a")
        assert (state_a, ok) == (b"from-a", True)
        assert b.set_state(b"from-b") == (b"from-a", token_a, False)

        # b now holds the current token and wins; a's token is stale and loses.
        state_b, token_b, ok = b.set_state(b"from-b", token_a)
        assert (state_b, ok) == (b"from-b", True) and token_b != token_a
        assert a.set_state(b"again-a", token_a) == (b"from-b", token_b, False)
        assert a.get_state() == (b"from-b", token_b)
        # A token we never handed out cannot match.
        assert a.set_state(b"bogus", "not-a-revision") == (b"from-b", token_b, False)

    # Stored base64 under the run's rendezvous key.
    assert state_key(rid).startswith(keys.rendezvous(rid) + "/")
    assert etcd.get(state_key(rid)) == b64encode(b"from-b").decode()


def test_backend_reports_corrupt_state_and_lost_connection(etcd: EtcdClient) -> None:
    rid = run_id()
    etcd.put(state_key(rid), "%%% not base64 %%%")
    with pytest.raises(RendezvousStateError):
        EtcdRendezvousBackend(etcd, rid).get_state()

    with EtcdClient(f"127.0.0.1:{free_port()}", timeout=0.3, retry_timeout=0.3) as dead:
        with pytest.raises(RendezvousConnectionError, match="127.0.0.1"):
            EtcdRendezvousBackend(dead, rid).get_state()


# -- signed state ---------------------------------------------------------------------------

SECRET = b"0123456789abcdef0123456789abcdef"


def test_signed_state_verifies_and_every_forgery_is_refused() -> None:
    key, other_key = state_key("run-a"), state_key("run-b")
    value = sign_state(SECRET, key, b"state")
    assert value.startswith("v1:") and verify_state(SECRET, key, value) == b"state"
    forgeries = {
        "unsigned": b64encode(b"state").decode(),
        "another secret": sign_state(b"f" * 32, key, b"state"),
        "another run's key": sign_state(SECRET, other_key, b"state"),
        "body swapped": value.rsplit(":", 1)[0] + ":" + b64encode(b"evil").decode(),
        "no MAC": "v1:" + b64encode(b"state").decode(),
        "a MAC that is not ASCII": "v1:é" + value[4:],
    }
    for name, forged in forgeries.items():
        with pytest.raises(RendezvousStateError, match="refused before unpickling") as exc:
            verify_state(SECRET, key, forged)
        assert key in str(exc.value), name
    # a foreign torchrun job (no secret): plain base64 as ever; a signed state it cannot check
    assert verify_state(None, key, b64encode(b"state").decode()) == b"state"
    with pytest.raises(RendezvousStateError, match="no secret to check it with"):
        verify_state(None, key, value)


def test_secret_comes_from_the_environment_or_its_file(tmp_path: Path) -> None:
    assert load_secret({}) is None
    assert load_secret({keys.RDZV_SECRET_ENV: SECRET.decode() + "\n"}) == SECRET
    path = tmp_path / "secret"
    path.write_text(SECRET.decode())
    assert load_secret({keys.RDZV_SECRET_FILE_ENV: str(path)}) == SECRET
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_secret({keys.RDZV_SECRET_ENV: "short"})
    with pytest.raises(ValueError, match="cannot be read"):
        load_secret({keys.RDZV_SECRET_FILE_ENV: str(tmp_path / "missing")})


class _Payload:
    """A pickle that would make a directory when loaded: proof of whether anything unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_a_forged_state_is_refused_before_torch_unpickles_it(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    from pipetransformer.core.protocol import RendezvousRefused

    rid, marker = run_id(), tmp_path / "pwned"
    monkeypatch.setenv(keys.RDZV_SECRET_ENV, SECRET.decode())
    handler = create_etcd3_handler(params(etcd_server.endpoint, rid, join_timeout=10, job="job-x"))
    try:
        # what any pod of the namespace could write without the secret
        etcd.put(state_key(rid), b64encode(pickle.dumps(_Payload(marker))).decode())
        with pytest.raises(RendezvousStateError, match="not signed with the job's secret"):
            handler.next_rendezvous()
        assert not marker.exists(), "the forged state was unpickled"
        ((key, raw),) = etcd.get_prefix(keys.alerts("job-x"))
        alert = RendezvousRefused.model_validate_json(raw)
        assert alert.run_id == rid and alert.key == state_key(rid) and alert.pid == os.getpid()
        assert "not signed" in alert.reason

    finally:
        handler.shutdown()
    # what passes is only what the MAC covers: the same bytes, signed, are handed on
    other = run_id()
    etcd.put(state_key(other), sign_state(SECRET, state_key(other), pickle.dumps(b"x")))
    assert EtcdRendezvousBackend(etcd, other, SECRET).get_state()[0] == pickle.dumps(b"x")


def test_create_handler_validates_options(etcd_server: EmbeddedEtcd) -> None:
    with pytest.raises(ValueError, match="read_timeout"):
        create_etcd3_handler(params(etcd_server.endpoint, run_id(), read_timeout="0"))
    with pytest.raises(ValueError, match="endpoint"):
        create_etcd3_handler(params("", run_id()))
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="cannot reach etcd"):
        create_etcd3_handler(params(f"127.0.0.1:{free_port()}", run_id(), read_timeout=1))
    assert time.monotonic() - started < 5


# -- store ----------------------------------------------------------------------------------


def test_store_has_c10d_semantics(etcd: EtcdClient) -> None:
    rid = run_id()
    raw = EtcdStore(etcd, store_prefix(rid), timeout=timedelta(seconds=2))
    store = dist.PrefixStore("round.0", raw)  # how torch's handler wraps it

    store.set("addr", "10.0.0.1")
    assert store.get("addr") == b"10.0.0.1"
    store.set("blob", b"\x00\xff\x10")
    assert store.get("blob") == b"\x00\xff\x10"

    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.get("n") == b"5"

    # compare_set: "" means absent; on mismatch the current value comes back unchanged
    assert store.compare_set("cs", "", "x") == b"x"
    assert store.compare_set("cs", "", "y") == b"x"
    assert store.compare_set("cs", "x", "z") == b"z"
    assert store.compare_set("missing", "expected", "w") == b"expected"
    assert not store.check(["missing"])

    store.multi_set(["m1", "m2"], ["v1", "v2"])
    assert store.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert store.check(["m1", "m2"]) and not store.check(["m1", "nope"])

    assert raw.num_keys() == 6
    assert raw.delete_key("round.0/m1") and not raw.delete_key("round.0/m1")
    assert etcd.count_prefix(store_prefix(rid)) == 5

    # Blocking reads wait for the key ...
    threading.Timer(0.3, lambda: store.set("late", "L")).start()
    assert store.get("late") == b"L"
    store.wait(["late", "addr"], timedelta(seconds=1))
    # ... and time out with c10d's error type.
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="never"):
        store.wait(["never"], timedelta(milliseconds=300))
    raw.set_timeout(timedelta(milliseconds=500))  # get() waits up to the store timeout
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    assert time.monotonic() - started < 3

    assert delete_rendezvous(etcd, rid) == 6  # addr blob n cs m2 late
    assert etcd.get_prefix(keys.rendezvous(rid)) == []


def test_store_add_is_atomic_under_contention(etcd_server: EmbeddedEtcd, etcd: EtcdClient) -> None:
    prefix = store_prefix(run_id())

    def bump(_: int) -> None:
        with EtcdClient(etcd_server.endpoint) as client:
            store = EtcdStore(client, prefix)
            for _ in range(20):
                store.add("count", 1)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(bump, range(4)))
    assert EtcdStore(etcd, prefix).get("count") == b"80"


# -- handlers in-process: a lost rank-0 node ------------------------------------------------


def _rendezvous_all(handlers: list[DynamicRendezvousHandler]) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def _die(handler: Any) -> None:
    """What a node's death stops: torch's heartbeats and the backend's lease refresher."""
    handler._stop_heartbeats()
    handler._state_holder._backend.close()


def test_survivors_follow_the_new_rank0_after_rank0_is_lost(etcd_server: EmbeddedEtcd) -> None:
    rid = run_id()
    conf = {
        "join_timeout": 30,
        "last_call_timeout": 1,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
    }
    # Handlers created in this order sort (and so rank) in this order.
    a, b, c = (
        create_etcd3_handler(params(etcd_server.endpoint, rid, 2, 3, **conf)) for _ in range(3)
    )
    try:
        first = _rendezvous_all([a, b, c])
        assert [(i.rank, i.world_size) for i in first] == [(0, 3), (1, 3), (2, 3)]
        old_master = first[0].bootstrap_store_info.master_port
        assert all(i.bootstrap_store_info.master_port == old_master for i in first)

        # Node a dies: no more heartbeats (nor lease refreshes); b and c re-rendezvous without it.
        _die(a)
        second = _rendezvous_all([b, c])
        assert [(i.rank, i.world_size) for i in second] == [(0, 2), (1, 2)]
        new_master = second[0].bootstrap_store_info.master_port
        assert new_master != old_master
        # torch 2.13 alone would hand c the dead node's store; ours follows the new rank 0.
        assert second[1].bootstrap_store_info.master_port == new_master

        # Workers do not share the agents' store (see create_etcd3_handler): the new round's
        # rank-0 worker hosts a fresh one on that port, and its peers reach it there.
        assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        host = second[1].bootstrap_store_info.master_addr
        server = dist.TCPStore(host, new_master, is_master=True, timeout=timedelta(seconds=5))
        client = dist.TCPStore(host, new_master, is_master=False, timeout=timedelta(seconds=5))
        client.set("probe", "ok")
        assert server.get("probe") == b"ok"
    finally:
        for h in (b, c):
            h.shutdown()
        _die(a)


def test_the_first_round_waits_its_first_call_and_later_rounds_their_last_call(
    etcd_server: EmbeddedEtcd,
) -> None:
    """A launch's nodes start together but not at the same moment: the first round waits
    first_call_timeout for a node 3 s late, where a 1 s last call starts without it; the round
    after a loss waits only the last call."""

    def launch(**extra: Any) -> tuple[list[Any], list[RendezvousInfo | None]]:
        rid = run_id()
        conf = {"last_call_timeout": 1, "keep_alive_interval": 1, **extra}
        a, b = (
            create_etcd3_handler(params(etcd_server.endpoint, rid, 1, 2, **conf)) for _ in range(2)
        )
        with ThreadPoolExecutor(2) as pool:
            early = pool.submit(a.next_rendezvous)
            time.sleep(3)  # b starts late
            late = pool.submit(b.next_rendezvous)
            infos: list[RendezvousInfo | None] = [early.result(timeout=60)]
            try:
                infos.append(late.result(timeout=60))
            except RendezvousTimeoutError:  # queued for a round that never opened
                infos.append(None)
        return [a, b], infos

    handlers, infos = launch(join_timeout=6)
    try:  # the 1 s last call: a starts alone, b misses the round
        assert infos[0] is not None and infos[0].world_size == 1 and infos[1] is None
    finally:
        for h in handlers:
            h.shutdown()
    (a, b), infos = launch(join_timeout=60, first_call_timeout=20)
    try:
        assert [(i.rank, i.world_size) for i in infos if i] == [(0, 2), (1, 2)]
        _die(b)  # lost: a's next round waits the 1 s last call, not the first call's 20 s
        started = time.monotonic()
        again = a.next_rendezvous()
        assert again.world_size == 1
        assert time.monotonic() - started < 15, "the round after a loss waited the first call"
    finally:
        a.shutdown()
        _die(b)


def test_the_launch_command_gives_the_first_round_a_longer_call(
    etcd_server: EmbeddedEtcd,
) -> None:
    """What `pipetransformer run` and the trainer pods start torchrun with."""
    from pipetransformer.orchestrator.launch import FIRST_CALL_S, torchrun_command

    cmd = torchrun_command(etcd_server.endpoint, "job", run_id(), 1, "1:2")
    conf = dict(kv.split("=", 1) for kv in cmd[cmd.index("--rdzv-conf") + 1].split(","))
    handler = create_etcd3_handler(params(etcd_server.endpoint, run_id(), 1, 2, **conf))
    try:
        first_call = handler._state_holder._backend._combiner.first_call
        assert first_call == timedelta(seconds=FIRST_CALL_S) > handler._settings.timeout.last_call
    finally:
        handler.shutdown()


def test_create_handler_refuses_a_first_call_that_is_not_a_positive_number(
    etcd_server: EmbeddedEtcd,
) -> None:
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ValueError, match="'first_call_timeout' must be"):
            create_etcd3_handler(params(etcd_server.endpoint, run_id(), first_call_timeout=bad))


def _state_history(etcd: EtcdClient, rid: str) -> list[Any]:
    """Every state written to the rendezvous, oldest first (etcd keeps a key's history)."""
    from pyetcd.etcdrpc import rpc_pb2 as pb

    key, states, revision = state_key(rid), [], 0
    while True:
        request = pb.RangeRequest(key=key.encode(), revision=revision)
        kvs = etcd._client.kvstub.Range(request, 5).kvs
        if not kvs:
            break
        value = verify_state(load_secret(), key, kvs[0].value.decode())
        states.append(decode_state(value))
        if kvs[0].version == 1:
            break
        revision = kvs[0].mod_revision - 1
    return states[::-1]


def test_survivors_queue_in_one_change_each_and_the_reopened_round_takes_them_at_once(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient
) -> None:
    rid = run_id()
    n = 5
    conf = {
        "join_timeout": 30,
        "last_call_timeout": 1,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
    }
    handlers = [
        create_etcd3_handler(params(etcd_server.endpoint, rid, n - 1, n, **conf)) for _ in range(n)
    ]
    lost, survivors = handlers[-1], handlers[:-1]
    try:
        assert {i.world_size for i in _rendezvous_all(handlers)} == {n}
        before = len(_state_history(etcd, rid))
        intents = sum(h._state_holder._backend.stats["intents"] for h in survivors)
        _die(lost)
        again = _rendezvous_all(survivors)
        # an intent for each survivor's leave at most (and one more for a last leaver that
        # opened the round itself): joining from the wait list and completing the round are
        # made by one node for all, and the others wait without queueing intents
        intents = sum(h._state_holder._backend.stats["intents"] for h in survivors) - intents
        assert intents <= len(survivors) + 1
        assert sorted(i.rank for i in again) == list(range(n - 1))
        assert {i.world_size for i in again} == {n - 1}
        history = _state_history(etcd, rid)[before - 1 :]  # from the first round, complete
        ours = {h._this_node for h in survivors}
        first = history[0]
        assert first.complete and set(first.participants) == ours | {lost._this_node}
        # each survivor's exit and its join of the wait list are one write: no state written
        # in the old round has a survivor that is in neither
        for state in history:
            if state.round == first.round:
                assert ours <= set(state.participants) | state.wait_list
        # the round that opens once the lost node's lease lapsed takes the whole wait list in
        # its first write, instead of one change per waiter
        opened = next(i for i, state in enumerate(history) if state.round > first.round)
        assert history[opened - 1].wait_list <= set(history[opened].participants)
        assert not history[opened].wait_list
        assert history[-1].complete and set(history[-1].participants) == ours
    finally:
        for h in survivors:
            h.shutdown()
        _die(lost)


# -- two real torchrun agents ---------------------------------------------------------------

WORKER = """
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
out = os.path.join(sys.argv[1], f"rank{rank}.txt")
with open(out, "w") as f:
    f.write(f"{rank} {world} {value.item():g}\\n")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_torchrun_agents_rendezvous_through_etcd(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rid = run_id()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={etcd_server.endpoint}",
        f"--rdzv-id={rid}",
        "--rdzv-conf=join_timeout=60,last_call_timeout=1,read_timeout=30",
        "--local-addr=127.0.0.1",  # hermetic: do not depend on this host's DNS name
        "--max-restarts=0",
        "--monitor-interval=0.1",
        str(script),
        str(out_dir),
    ]
    # with the job's secret, as every launch of this project runs them
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env[keys.RDZV_SECRET_ENV] = SECRET.decode()
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=120)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                outputs.append(agent.communicate()[0])
    logs = "\n".join(f"--- agent {i} ---\n{out}" for i, out in enumerate(outputs))
    assert [a.returncode for a in agents] == [0, 0], logs

    results = sorted((out_dir / f"rank{r}.txt").read_text().split() for r in range(2))
    assert results == [["0", "2", "3"], ["1", "2", "3"]], logs
    # The rendezvous really went through etcd: its state (signed) and store keys are there.
    assert verify_state(SECRET, state_key(rid), etcd.get(state_key(rid)))
    assert etcd.count_prefix(store_prefix(rid)) > 0


# -- scale: merging, leases, combining (orchestrator/rendezvous/, "Scale") -----------------

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _NodeDesc,
    _RendezvousState,
)

from pipetransformer.orchestrator.rendezvous import (  # noqa: E402
    ALIVE,
    DELTA_SLOTS,
    MEMBERSHIP_ACTIONS,
    RELOAD,
    action_valid,
    alive_prefix,
    apply_diff,
    decode_delta,
    decode_state,
    delta_prefix,
    encode_delta,
    encode_state,
    node_id,
    overlay,
    persisted,
    read_rendezvous,
    replay,
    sanitize,
    state_diff,
)

A = _Action


def settings(min_nodes: int = 2, max_nodes: int = 3) -> RendezvousSettings:
    return RendezvousSettings(
        "run", min_nodes, max_nodes, RendezvousTimeout(), timedelta(seconds=1), 3
    )


def node(i: int) -> _NodeDesc:
    return _NodeDesc("10.0.0.1", 100 + i // 10, i)


def leased_nodes(
    etcd: EtcdClient, rid: str, n: int, s: RendezvousSettings
) -> list[EtcdRendezvousBackend]:
    """`n` backends bound to nodes 0 to n-1, each with its lease (its alive key) in etcd."""
    nodes = [EtcdRendezvousBackend(etcd, rid) for _ in range(n)]
    for i, b in enumerate(nodes):
        b.bind(node(i), s)
        b._node_lease.keep()
    return nodes


def round_of(n: int) -> _RendezvousState:
    """A state whose participants are nodes 0 to n-1, each with a heartbeat of now."""
    state = _RendezvousState()
    state.participants = {node(i): 0 for i in range(n)}
    state.last_heartbeats = {node(i): datetime.now(UTC) for i in range(n)}
    return state


def test_a_state_is_unpickled_with_torchs_classes_only(tmp_path: Path) -> None:
    import pickle

    state = _RendezvousState()
    state.participants = {node(1): 0, node(2): 1}
    back = decode_state(encode_state(state))
    assert back.participants == state.participants and isinstance(back, _RendezvousState)
    marker = tmp_path / "pwned"
    for bad in (pickle.dumps(_Payload(marker)), pickle.dumps({"a": 1}), b"not a pickle"):
        with pytest.raises(RendezvousStateError):
            decode_state(bad)
    assert not marker.exists()


def test_the_view_marks_live_leases_alive_and_only_they_survive_torchs_expiry() -> None:
    from datetime import UTC, datetime

    old = datetime.now(UTC) - timedelta(minutes=5)  # stored long ago: heartbeats are leases now
    stored = _RendezvousState()
    for i in (1, 2, 3):
        stored.participants[node(i)] = 0
        stored.last_heartbeats[node(i)] = old
    mine = datetime.now(UTC)
    view = overlay(stored, alive={node(1), node(2), node(9)}, me=node(1), my_heartbeat=mine)
    # this node's own heartbeat is real (the handler times its keep-alives by it); others ALIVE
    assert view.last_heartbeats == {node(1): mine, node(2): ALIVE, node(3): old}
    assert node(9) not in view.last_heartbeats  # a lease alone does not make a participant
    assert stored.last_heartbeats[node(2)] == old  # the stored state is left as it was
    assert sanitize(view, settings()) == [node(3)]  # torch's own expiry: the lapsed lease only
    assert set(view.participants) == {node(1), node(2)}
    # nothing ALIVE is ever written back: it would never expire once the lease lapses
    written = persisted(view, stored)
    assert ALIVE not in written.last_heartbeats.values()
    assert written.last_heartbeats[node(2)] == old and written.last_heartbeats[node(1)] == mine


def test_replayed_joins_fill_the_round_complete_it_and_are_refused_after() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    state = _RendezvousState()
    changes = [(node(i), A.ADD_TO_PARTICIPANTS) for i in (5, 1, 3, 4)] + [
        (node(4), A.ADD_TO_WAIT_LIST),  # torch: a full round makes the 4th redundant ...
        (node(4), A.ADD_TO_REDUNDANCY_LIST),  # ... not a waiter
        (node(3), A.MARK_RENDEZVOUS_COMPLETE),  # decided before the round filled: done already
    ]
    # the 4th's refused join goes on as torch's join operation would, into the redundancy
    # list: its own later change to the same end is then made already
    assert replay(state, changes, s) == [True, True, True, False, False, False, False]
    # complete at max_nodes with torch's ranks (sorted nodes); the 4th is redundant
    assert state.complete and state.deadline is None
    assert state.participants == {node(1): 0, node(3): 1, node(5): 2}
    assert state.redundancy_list == {node(4)} and not state.wait_list


def test_completing_a_round_ranks_its_nodes_as_torch_does() -> None:
    """The completion the handlers and the combiner apply (`apply_action`) ranks by the
    nodes' fields as tuples where torch sorts its node dataclasses: the same ranks, the same
    dict order, complete and without a deadline, on nodes that tie on their address or pid."""
    import random

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _DistributedRendezvousOpExecutor,
    )

    from pipetransformer.orchestrator.rendezvous.replay import _NO_HOLDER, _quiet, apply_action

    rng = random.Random(7)
    nodes = list(
        dict.fromkeys(
            _NodeDesc(f"10.0.{rng.randint(0, 3)}.{rng.randint(0, 9)}", rng.randint(1, 9), i % 3)
            for i in range(300)
        )
    )
    rng.shuffle(nodes)
    s = settings(min_nodes=1, max_nodes=len(nodes) + 1)

    def open_round() -> _RendezvousState:
        state = _RendezvousState()
        state.participants = dict.fromkeys(nodes, 0)
        state.deadline = datetime.now(UTC)
        return state

    ours = open_round()
    apply_action(ours, nodes[0], A.MARK_RENDEZVOUS_COMPLETE, s)
    torchs = open_round()
    executor = _DistributedRendezvousOpExecutor(nodes[0], _NO_HOLDER, s)
    executor._state, executor._record = torchs, _quiet
    executor._mark_rendezvous_complete()
    assert list(ours.participants.items()) == list(torchs.participants.items())
    assert ours.complete and ours.deadline is None
    assert sorted(ours.participants.values()) == list(range(len(nodes)))


def test_replay_takes_an_action_only_where_torchs_operation_would() -> None:
    s = settings(min_nodes=1, max_nodes=2)
    state = _RendezvousState()
    replay(state, [(node(1), A.ADD_TO_PARTICIPANTS), (node(2), A.ADD_TO_PARTICIPANTS)], s)
    assert state.complete and state.round == 0
    # a stale join or completion decided on an older state is refused on the complete round
    assert not action_valid(state, node(3), A.ADD_TO_PARTICIPANTS, s)
    assert not action_valid(state, node(1), A.MARK_RENDEZVOUS_COMPLETE, s)
    assert action_valid(state, node(3), A.ADD_TO_REDUNDANCY_LIST, s)  # full: redundant
    # leaving: each participant removes itself; the last one out opens the next round
    assert replay(state, [(node(1), A.REMOVE_FROM_PARTICIPANTS)], s) == [True]
    assert state.complete and state.round == 0  # a complete round is not reopened by one exit
    assert replay(state, [(node(1), A.REMOVE_FROM_PARTICIPANTS)], s) == [False]  # not twice
    assert replay(state, [(node(2), A.REMOVE_FROM_PARTICIPANTS)], s) == [True]
    assert not state.complete and state.round == 1 and not state.participants
    # once closed, nothing joins again
    assert replay(state, [(node(1), A.MARK_RENDEZVOUS_CLOSED)], s) == [True]
    assert replay(state, [(node(3), A.ADD_TO_PARTICIPANTS)], s) == [False]
    assert state.closed and not state.participants


def _random_replays(seed: int, trials: int, per_batch: int) -> Any:
    """(settings, state before, state after, changes, applied) of random batches of changes
    replayed on states that start empty, a few batches each."""
    import random

    rng = random.Random(seed)
    actions = sorted(MEMBERSHIP_ACTIONS, key=lambda a: a.value)
    for _trial in range(trials):
        s = settings(min_nodes=rng.randint(1, 4), max_nodes=rng.randint(4, 6))
        state = _RendezvousState()
        for _batch in range(rng.randint(1, 6)):
            before = decode_state(encode_state(state))
            # (node, action, rejoin, the round it saw: none said, behind, current or ahead)
            seen = [None, state.round - 1, state.round, state.round + 1]
            changes = [
                (node(rng.randint(1, 8)), rng.choice(actions), rng.random() < 0.5, rng.choice(seen))
                for _ in range(per_batch)
            ]
            applied = replay(state, changes, s)
            yield s, before, state, changes, applied


def test_random_interleavings_never_lose_duplicate_or_reopen() -> None:
    for s, before, state, changes, applied in _random_replays(26, 300, 12):
        # every applied change shows in the state; nothing is both waiting and in the round
        assert len(applied) == len(changes)
        assert not set(state.participants) & state.wait_list
        assert len(state.participants) <= s.max_nodes
        assert set(state.participants) <= set(state.last_heartbeats)
        if before.closed:
            assert state.closed  # never reopened
        if before.complete and state.round == before.round:
            assert state.complete  # a complete round stays complete until a new one
        if state.complete:  # torch's ranks, one each (a node leaving later leaves a gap)
            ranks = list(state.participants.values())
            assert len(set(ranks)) == len(ranks)
        elif not state.closed:  # an open round has taken every waiting node
            assert state.wait_list <= state.redundancy_list
        assert state.round >= before.round


def _same(a: _RendezvousState, b: _RendezvousState, ordered: bool = True) -> bool:
    """Equal in every field, the dicts in the same order unless not `ordered`."""
    fields = ("round", "complete", "deadline", "closed", "wait_list", "redundancy_list")
    as_is = (lambda d: list(d.items())) if ordered else dict
    return all(getattr(a, f) == getattr(b, f) for f in fields) and all(
        as_is(getattr(a, f)) == as_is(getattr(b, f)) for f in ("participants", "last_heartbeats")
    )


def test_a_delta_turns_the_state_before_into_the_state_after() -> None:
    for _s, before, state, _changes, _applied in _random_replays(7, 200, 8):
        stored = decode_delta(encode_delta(17, 3, state_diff(before, state)))
        assert stored is not None and stored[:2] == (17, 3)
        after = apply_diff(before, stored[2])
        assert _same(after, state, ordered=False)
        assert _same(before, decode_state(encode_state(before)))  # the old one untouched
    # a delta is O(what changed): one join into a round of 200 carries that node only
    big = _RendezvousState()
    for i in range(200):
        big.participants[node(i)] = 0
        big.last_heartbeats[node(i)] = datetime.now(UTC)
    grown = decode_state(encode_state(big))
    replay(grown, [(node(200), A.ADD_TO_PARTICIPANTS)], settings(1, 300))
    assert len(encode_delta(1, 2, state_diff(big, grown))) < len(encode_state(grown)) // 50
    # ... and one node of a complete round leaving it to wait for the next carries that node
    grown.complete = True
    left = decode_state(encode_state(grown))
    replay(left, [(node(100), A.REMOVE_FROM_PARTICIPANTS, True)], settings(1, 300))
    assert left.wait_list == {node(100)}
    assert len(encode_delta(2, 3, state_diff(grown, left))) < len(encode_state(left)) // 50
    # what is not a delta is read as "read the whole state", never unpickled beyond torch's
    assert decode_delta(RELOAD) is None
    assert decode_delta(b"not a pickle") is None
    assert decode_delta(pickle.dumps(("x", 1, ()))) is None
    bad = list(state_diff(big, grown))
    bad[4] = {("host", "not a pid", 0): 0}
    assert decode_delta(pickle.dumps((1, 2, tuple(bad)))) is None
    # a delta's nodes are plain tuples on the wire, and one object per node once read: the
    # state's dicts then find them by identity (the dataclass hashes and compares in Python)
    nodes: dict[Any, Any] = {}
    wire = encode_delta(1, 2, state_diff(big, grown))
    first, again = decode_delta(wire, nodes), decode_delta(wire, nodes)
    assert first is not None and again is not None
    assert next(iter(first[2][4])) is next(iter(again[2][4])) == node(200)


def test_a_round_taking_its_wait_list_and_its_ranks_are_named_in_the_delta_not_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two changes of every node (a round that opens takes its whole wait list; a round
    that completes ranks its participants) are named in the delta, not listed node by node
    (each of a thousand nodes read ~150 kB of them); what they do not cover is listed, and
    the delta still turns the state before into the state after."""
    import pipetransformer.orchestrator.rendezvous.delta as rdzv_delta

    s = settings(1, 300)
    old = _RendezvousState()
    old.round, old.complete = 4, True
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    old.participants = {node(200): 0}  # the lost node: its heartbeat expired long ago
    old.last_heartbeats = {node(200): long_ago}
    for i in range(200):  # the survivors, queued for the next round
        old.wait_list.add(node(i))
        old.last_heartbeats[node(i)] = datetime.now(UTC)
    opened = decode_state(encode_state(old))
    replay(opened, [(node(5), A.ADD_TO_PARTICIPANTS, False, 5)], s)
    assert opened.round == 5 and not opened.wait_list and len(opened.participants) == 200
    wire = encode_delta(1, 2, state_diff(old, opened))
    assert len(wire) < 600 < len(encode_state(opened)) // 10
    stored = decode_delta(wire)
    assert stored is not None and _same(apply_diff(old, stored[2]), opened, ordered=False)

    opened.deadline = datetime.now(UTC) - timedelta(seconds=1)  # the last call is over
    done = decode_state(encode_state(opened))
    replay(done, [(node(7), A.MARK_RENDEZVOUS_COMPLETE)], s)
    assert done.complete and sorted(done.participants.values()) == list(range(200))
    wire = encode_delta(2, 3, state_diff(opened, done))
    assert len(wire) < 600
    stored = decode_delta(wire)
    assert stored is not None and _same(apply_diff(opened, stored[2]), done, ordered=False)
    # a bulk change this version does not know is read as "read the whole state"
    unknown = list(stored[2])
    unknown[12] = (("shuffled",),)
    assert decode_delta(pickle.dumps((2, 3, tuple(unknown)))) is None

    # named from one node on, random changes still come out exact (the list corrects the name)
    monkeypatch.setattr(rdzv_delta, "_BULK_MIN", 1)
    named = 0
    for _s, before, state, _changes, _applied in _random_replays(11, 200, 8):
        diff = state_diff(before, state)
        named += bool(diff[12])
        stored = decode_delta(encode_delta(5, 6, diff))
        assert stored is not None and _same(apply_diff(before, stored[2]), state, ordered=False)
    assert named > 20


def test_a_node_named_in_keys_is_one_object_whichever_key_or_delta_names_it() -> None:
    """Every node reads every other node's alive key: its name is parsed once, into the same
    object that deltas and the state hold (sets and dicts then find it by identity)."""
    b = EtcdRendezvousBackend(None, "run", SECRET)  # fed by hand: it never calls etcd here
    b.bind(node(0), settings())
    first = b._leases.named(node_id(node(3)))
    assert first == node(3) and b._leases.named(node_id(node(3))) is first
    state = _RendezvousState()
    state.participants = {node(3): 0}
    state.last_heartbeats = {node(3): datetime.now(UTC)}
    delta = decode_delta(encode_delta(1, 2, state_diff(_RendezvousState(), state)), b._nodes)
    assert delta is not None and next(iter(delta[2][4])) is first
    assert b._leases.named("not-a-node") is None and b._leases.named(node_id(node(0))) is b._me


def alive_read(
    key: str, secret: bytes, lease: int, revision: int, signed: int | None = None
) -> list[tuple[bytes, Any]]:
    """An alive key put under `lease` at `revision`, as a read returns it ((key, kv), what
    `LeaseView.see` takes), its value naming lease `signed` (default: the same)."""
    from pyetcd.etcdrpc import kv_pb2

    value = sign_state(secret, key, b"%x" % (lease if signed is None else signed))
    kv = kv_pb2.KeyValue(
        key=key.encode(),
        value=value.encode(),
        lease=lease,
        create_revision=revision,
        mod_revision=revision,
    )
    return [(kv.key, kv)]


def test_backends_of_one_process_share_what_they_parse_but_each_trusts_its_own_secret() -> None:
    """A simulator host runs a hundred nodes in one process: a name parsed or an alive key
    verified by one is not parsed or verified again by the next (one object per node for all
    of them), but a value that verifies under one job's secret is refused under another's, and
    a key re-signed for a new lease is checked again."""

    other = b"another job's secret, 32 bytes.."
    a, b, c = (EtcdRendezvousBackend(None, "run", k) for k in (SECRET, SECRET, other))
    for i, backend in enumerate((a, b, c)):
        backend.bind(node(i), settings(1, 12))
    key = alive_prefix("run") + node_id(node(5))

    def alive(secret: bytes, lease: int, signed: int | None = None) -> list[tuple[bytes, Any]]:
        return alive_read(key, secret, lease, lease, signed)  # a new lease is a new put

    a._leases.see(alive(SECRET, 100))
    b._leases.see(alive(SECRET, 100))
    c._leases.see(alive(SECRET, 100))  # not signed with c's secret
    assert node(5) in a._leases.alive and node(5) in b._leases.alive
    assert next(iter(a._leases.alive - {a._me})) is next(iter(b._leases.alive - {b._me}))
    assert node(5) not in c._leases.alive
    c._leases.see(alive(other, 100))
    assert node(5) in c._leases.alive
    # a value that names another lease than the key is under is refused, though the same value
    # verified under the lease it names: the verdict is per (secret, key, value, lease)
    b._leases.see(alive(SECRET, 101, signed=100))
    assert node(5) not in b._leases.alive and node(5) in a._leases.alive
    b._leases.see(alive(SECRET, 102))
    assert node(5) in b._leases.alive


def joins_through(writer: EtcdRendezvousBackend, s: RendezvousSettings) -> Any:
    """`join(count, reader=None)`: the next `count` nodes (0, 1, ...) joined by plain writes of
    `writer`, `reader` reading after each."""
    joined = 0

    def join(count: int, reader: Any = None) -> None:
        nonlocal joined
        for _ in range(count):
            state, token = writer.read()
            state = state or _RendezvousState()
            replay(state, [(node(joined), A.ADD_TO_PARTICIPANTS)], s)
            joined += 1
            assert writer._write_as_is(state, token)[2]
            if reader is not None:
                reader.read()

    return join


def test_backends_of_one_process_apply_a_delta_once_and_share_the_state(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient
) -> None:
    """Backends of one process that hold the state a delta applies to take the first one's
    result instead of decoding and applying it again (a simulator host runs a hundred), and
    get what a whole read gets; one further behind than the ring still reads the state whole,
    and backends that read the same state whole share it."""
    rid = run_id()
    s = RendezvousSettings("run", 1, 2 * DELTA_SLOTS, RendezvousTimeout(), timedelta(hours=1), 3)
    writer, a, b = (EtcdRendezvousBackend(etcd, rid, SECRET) for _ in range(3))
    for i, backend in enumerate((writer, a, b)):
        backend.bind(node(3000 + i), s)
    join = joins_through(writer, s)

    def stored() -> _RendezvousState:
        return decode_state(verify_state(SECRET, state_key(rid), etcd.get(state_key(rid))))

    join(1)
    a.read()
    b.read()
    assert a._follower.stored() is b._follower.stored()  # read whole, the same value: one object
    join(3)
    a.read()
    b.read()
    assert a.stats["deltas"] == b.stats["deltas"] == 3
    assert (a.stats["deltas_shared"], b.stats["deltas_shared"]) == (0, 3)
    assert (
        a._follower.stored() is b._follower.stored()
        and a._follower.revision == b._follower.revision
    )
    assert _same(b._follower.stored(), stored()) and len(b._follower.stored().participants) == 4
    # `a` follows every write; `b` falls further behind than the ring: the deltas `a` applied
    # do not lead on from the state `b` holds, and `b` reads the state whole
    whole = b.stats["state_reads"]
    join(DELTA_SLOTS + 2, a)
    b.read()
    assert b.stats["state_reads"] == whole + 1
    assert _same(b._follower.stored(), stored()) and _same(
        a._follower.stored(), stored(), ordered=False
    )
    assert len(b._follower.stored().participants) == 4 + DELTA_SLOTS + 2
    # another job's secret: nothing shared verifies there, the state is refused
    c = EtcdRendezvousBackend(etcd, rid, b"another job's secret, 32 bytes..")
    c.bind(node(3100), s)
    with pytest.raises(RendezvousStateError):
        c.read()


def test_nodes_follow_the_state_by_its_deltas_and_read_it_whole_only_when_behind(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every state write leaves its delta in a ring of slots; a node that holds the state the
    delta starts from applies it instead of reading the whole state, and gets what a whole
    read gets. A node further behind than the ring, or after a write without a delta (an
    unbound writer's), reads the whole state."""
    monkeypatch.setenv(keys.RDZV_SECRET_ENV, SECRET.decode())
    rid = run_id()
    # heartbeats that do not expire while the test runs (torch's expiry is not the point here)
    s = RendezvousSettings("run", 1, 2 * DELTA_SLOTS, RendezvousTimeout(), timedelta(hours=1), 3)
    writer, follower, laggard = (EtcdRendezvousBackend(etcd, rid, SECRET) for _ in range(3))
    for i, b in enumerate((writer, follower, laggard)):
        b.bind(node(1000 + i), s)
    writer.read()
    follower.read()
    laggard.read()
    join = joins_through(writer, s)

    whole = follower.stats["state_reads"]
    join(10, follower)
    assert follower.stats["deltas"] >= 9 and follower.stats["state_reads"] - whole <= 1
    stored = decode_state(verify_state(SECRET, state_key(rid), etcd.get(state_key(rid))))
    assert _same(follower._follower.stored(), stored)
    assert len(follower._follower.stored().participants) == 10
    # the ring is bounded: DELTA_SLOTS keys at most, whatever the number of writes
    join(DELTA_SLOTS + 5, None)
    assert etcd.count_prefix(delta_prefix(rid)) == DELTA_SLOTS
    laggard_whole = laggard.stats["state_reads"]
    laggard.read()  # more writes behind than the ring holds: the whole state
    assert laggard.stats["state_reads"] == laggard_whole + 1
    stored = decode_state(verify_state(SECRET, state_key(rid), etcd.get(state_key(rid))))
    assert _same(laggard._follower.stored(), stored)
    assert len(stored.participants) == 10 + DELTA_SLOTS + 5
    # an unbound writer (torch's interface) leaves no delta: the others read the whole state
    plain = EtcdRendezvousBackend(etcd, rid, SECRET)
    raw, token = plain.get_state()
    state = decode_state(raw)
    replay(state, [(node(999), A.ADD_TO_PARTICIPANTS)], s)
    assert plain.set_state(encode_state(state), token)[2]
    follower.read()
    assert node(999) in follower._follower.stored().participants
    # nothing changed since: a read is two reads of a key and a count, not of the span
    requests, unchanged = follower.stats["requests"], follower.stats["reads_unchanged"]
    follower.read()
    assert follower.stats["reads_unchanged"] == unchanged + 1
    assert follower.stats["requests"] == requests + 2
    # a new node's lease, and its lapse, change no state but the count: read in full
    late = EtcdRendezvousBackend(etcd, rid, SECRET)
    late.bind(node(2000), s)
    try:
        late._node_lease.keep()
        follower.read()
        assert node(2000) in follower._leases.alive
        late.close()
        etcd.revoke_lease(late._node_lease.lease.id)
        follower.read()
        assert node(2000) not in follower._leases.alive
        assert follower.stats["reads_unchanged"] == unchanged + 1
    finally:
        late.close()


def test_the_view_kept_up_to_date_is_the_overlay_built_whole() -> None:
    """A node's view follows deltas and new leases by what changed (`_vb`); it must be what
    `overlay` builds from the whole state and the alive nodes, at every step."""
    import random

    from pyetcd.etcdrpc import kv_pb2

    rng = random.Random(3)
    s = RendezvousSettings("run", 1, 12, RendezvousTimeout(), timedelta(hours=1), 3)
    b = EtcdRendezvousBackend(None, "run", SECRET)  # fed by hand: it never calls etcd here
    me = node(0)
    b.bind(me, s)
    b._node_lease.heartbeat = datetime.now(UTC)
    state = _RendezvousState()
    b._follower.set_stored(sign_state(SECRET, b.key, encode_state(state)), 1, 1)
    revision, lease = 1, 100
    actions = [A.ADD_TO_PARTICIPANTS, A.ADD_TO_WAIT_LIST, A.REMOVE_FROM_PARTICIPANTS]
    for _step in range(300):
        revision += 1
        if rng.random() < 0.5:  # a state write, followed by its delta
            before = decode_state(encode_state(state))
            replay(state, [(node(rng.randint(0, 11)), rng.choice(actions))], s)
            slot = f"{delta_prefix('run')}00"
            delta = encode_delta(
                b._follower.revision, b._follower.version + 1, state_diff(before, state)
            )
            kv = kv_pb2.KeyValue(
                key=slot.encode(),
                value=sign_state(SECRET, slot, delta).encode(),
                mod_revision=revision,
            )
            assert b._follower.follow(kv)
        else:  # a node's lease, new or granted again
            lease += 1
            key = alive_prefix("run") + node_id(node(rng.randint(0, 11)))
            b._leases.see(alive_read(key, SECRET, lease, revision))
        if rng.random() < 0.3:
            kept = b._follower.overlaid(b._follower.stored())
            whole = overlay(b._follower.stored(), b._leases.alive, me, b._node_lease.heartbeat)
            assert _same(kept, whole, ordered=False)
            assert kept.last_heartbeats == whole.last_heartbeats


def test_a_lapsed_lease_is_found_by_counting_and_many_by_listing(etcd: EtcdClient) -> None:
    """When leases lapse a node finds which by count-only reads of halves of the keys it knows
    (a relist reads every alive key, and every node does it for each lapse); past a few at
    once it lists them all again. Either way it ends up with exactly the leases alive."""
    rid = run_id()
    s = RendezvousSettings("run", 1, 16, RendezvousTimeout(), timedelta(seconds=1), 3)
    nodes = leased_nodes(etcd, rid, 12, s)
    reader = nodes[0]
    reader.read()
    assert reader._leases.alive == {node(i) for i in range(12)}
    for b in nodes[3:5]:
        b._node_lease.lease.revoke()
    reader.read()
    assert reader.stats["found_gone"] == 2 and reader.stats["relists"] == 0
    assert reader._leases.alive == {node(i) for i in range(12)} - {node(3), node(4)}
    for b in nodes[5:11]:
        b._node_lease.lease.revoke()
    reader.read()
    assert reader.stats["relists"] == 1 and reader.stats["found_gone"] == 2
    assert reader._leases.alive == {node(i) for i in (0, 1, 2, 11)}
    reader.read()  # the count agrees again: nothing more to look for
    assert reader.stats["relists"] == 1 and reader.stats["found_gone"] == 2


def test_beyond_64_nodes_a_lapse_is_learnt_from_the_write_that_takes_the_node_out(
    etcd: EtcdClient,
) -> None:
    """Every node counts a lapsed lease within the same second. Beyond 64 alive keys a node
    does not look for it at once: it waits a random part of a heartbeat interval (its reads
    stay cheap meanwhile), and when a write takes the dead node out of the state it looks
    that node's key up alone; only a node whose wait ran out looks for the key itself."""
    rid = run_id()
    n = 70
    s = RendezvousSettings("run", 1, n, RendezvousTimeout(), timedelta(seconds=30), 3)
    nodes = leased_nodes(etcd, rid, n, s)
    state = round_of(n)
    writer = EtcdRendezvousBackend(etcd, rid)  # unbound: the state written whole
    _, token, ok = writer.set_state(encode_state(state))
    assert ok
    reader, searcher = nodes[0], nodes[1]
    for b in (reader, searcher):
        b.read()
        assert b._leases.alive == {node(i) for i in range(n)}
    nodes[7]._node_lease.lease.revoke()

    for b in (reader, searcher):
        b.read()
        assert b.stats["gone_deferred"] == 1 and b.stats["found_gone"] == 0
        assert node(7) in b._leases.alive and b._leases.unfound == 1
    unchanged = reader.stats["reads_unchanged"]
    reader.read()  # the lapse is known: nothing new, and the read stays cheap
    assert reader.stats["reads_unchanged"] == unchanged + 1 and reader._leases.unfound == 1

    searcher._leases.search_at = time.monotonic()  # its wait ran out before any write
    searcher.read()
    assert searcher.stats["found_gone"] == 1 and searcher._leases.unfound == 0
    assert searcher._leases.alive == {node(i) for i in range(n)} - {node(7)}

    del state.participants[node(7)], state.last_heartbeats[node(7)]
    _, token, ok = writer.set_state(encode_state(state), token)
    assert ok
    requests = reader.stats["requests"]
    reader.read()
    assert reader.stats["found_probed"] == 1 and reader.stats["found_gone"] == 0
    assert reader._leases.unfound == 0 and reader._leases.search_at is None
    assert reader._leases.alive == {node(i) for i in range(n)} - {node(7)}
    # whether the state was written, the read, the whole state (written unbound), one probe
    assert reader.stats["requests"] - requests == 4

    # a re-rendezvous: every survivor has left the old round for the wait list, and the node
    # that never left is the one lost; it is looked up first, and found at once
    state.complete = True
    state.participants = {node(9): 0}
    state.wait_list = {node(i) for i in range(n) if i not in (7, 9)}
    assert writer.set_state(encode_state(state), token)[2]
    reader.read()
    deferred = reader.stats["gone_deferred"]
    nodes[9]._node_lease.lease.revoke()
    reader.read()
    assert reader.stats["found_probed"] == 2 and reader.stats["gone_deferred"] == deferred
    assert node(9) not in reader._leases.alive and reader._leases.unfound == 0
    for b in nodes:
        b.close()


def test_the_unchanged_check_reads_serializable_and_the_reads_after_a_change_do_not(
    etcd: EtcdClient,
) -> None:
    """A waiting node's check whether anything changed (the state written? as many keys?)
    skips etcd's read-index round: at 1,024 nodes on a slower machine linearizable reads
    waited seconds for it. A stale answer only costs the linearizable read that follows."""
    rid = run_id()
    s = RendezvousSettings("run", 1, 4, RendezvousTimeout(), timedelta(seconds=30), 3)
    nodes = leased_nodes(etcd, rid, 3, s)
    state = round_of(3)
    writer = EtcdRendezvousBackend(etcd, rid)
    assert writer.set_state(encode_state(state))[2]
    reader = nodes[0]
    asked: dict[str, bool] = {}
    ranged = reader._wire.range

    def recording(what: str, request: Any) -> Any:
        asked[what] = request.serializable
        return ranged(what, request)

    reader._wire.range = recording  # type: ignore[method-assign]
    reader.read()
    unchanged = reader.stats["reads_unchanged"]
    reader.read()  # nothing changed: the cheap check only
    assert reader.stats["reads_unchanged"] == unchanged + 1
    assert asked["written"] and asked["count"], asked
    assert not asked["read"] and not asked["state"], asked
    for b in nodes:
        b.close()


def test_a_live_node_keeps_its_lease_while_its_handler_stalls_but_a_hung_combiner_does_not(
    etcd: EtcdClient,
) -> None:
    """The lease is refreshed from a thread of its own, so a handler that makes no call for
    longer than the lease (a slow etcd, a starved process) is not taken for dead; while the
    node holds the combine lock only the combining keeps it, so a combiner that hangs lets
    the lock (and its lease) go after one lease."""
    rid = run_id()
    s = RendezvousSettings("run", 1, 4, RendezvousTimeout(), timedelta(seconds=1), 2)
    b = EtcdRendezvousBackend(etcd, rid)
    b.bind(node(1), s)
    try:
        b._node_lease.keep()
        lease = b._node_lease.lease
        time.sleep(3 * b._node_lease.ttl)  # no handler call at all for three leases
        # alive: etcd counts a lease's time left in whole seconds, so a lease refreshed a
        # second or more ago (the thread refreshes once a second) reads 0; a gone one reads -1
        assert lease.remaining() >= 0 and b.stats["lease_refreshes_timer"] >= 2
        b._node_lease.combining = True  # as if it hung holding the lock
        time.sleep(2 * b._node_lease.ttl + 1)
        assert lease.remaining() <= 0
    finally:
        b.close()


def _bound(etcd_server: EmbeddedEtcd, rid: str, i: int, **conf: Any) -> Any:
    """A handler (and its backend) as torchrun builds them: bound, heartbeats as leases."""
    return create_etcd3_handler(params(etcd_server.endpoint, rid, **conf))


def test_heartbeats_refresh_a_lease_and_never_rewrite_the_state(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(keys.RDZV_SECRET_ENV, SECRET.decode())
    rid = run_id()
    conf = {"join_timeout": 30, "last_call_timeout": 1, "keep_alive_interval": 1}
    handlers = [_bound(etcd_server, rid, i, min_nodes=3, max_nodes=3, **conf) for i in range(3)]
    try:
        infos = _rendezvous_all(handlers)
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        _, revision = etcd.get_with_revision(state_key(rid))
        backend = handlers[0]._state_holder._backend

        def refreshed() -> int:  # by the handler's heartbeats or by the lease's own thread
            return backend.stats["lease_refreshes"] + backend.stats["lease_refreshes_timer"]

        before = refreshed()
        time.sleep(1.1)
        for h in handlers:
            h._keep_alive()  # what torch's heartbeat timer calls
        time.sleep(0.6)
        assert refreshed() > before
        assert etcd.get_with_revision(state_key(rid))[1] == revision  # the state untouched
        # what a monitor sees: signed state, every participant's lease alive, no ALIVE stored
        state, alive, _ = read_rendezvous(etcd, rid, SECRET)
        assert set(state.participants) == alive and len(alive) == 3
        assert ALIVE not in state.last_heartbeats.values()
        assert etcd.get(state_key(rid)).startswith("v1:")
        assert all(v.startswith("v1:") for _, v in etcd.get_prefix(alive_prefix(rid)))
        # an unchanged state is handed back as the very object the handler holds (no reload)
        holder = handlers[1]._state_holder
        assert holder._backend.read(holder.state)[0] is holder.state
    finally:
        for h in handlers:
            h.shutdown()


def test_joins_are_combined_into_few_state_writes(etcd_server: EmbeddedEtcd) -> None:
    rid = run_id()
    n = 12
    conf = {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 1}
    handlers = [_bound(etcd_server, rid, i, min_nodes=n, max_nodes=n, **conf) for i in range(n)]
    try:
        infos = _rendezvous_all(handlers)
        assert sorted(i.rank for i in infos) == list(range(n))
        assert {i.world_size for i in infos} == {n}
        stats = [h._state_holder._backend.stats for h in handlers]
        changes = sum(s["changes"] for s in stats)
        combined = sum(s["combined"] for s in stats)
        writes = sum(s["combines"] for s in stats)
        assert changes == combined >= n  # every join applied exactly once, by someone
        assert writes <= combined  # a write carries one change or more, never none
    finally:
        for h in handlers:
            h.shutdown()


def test_a_forged_intent_is_dropped_unapplied_and_a_stuck_change_is_withdrawn(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipetransformer.orchestrator.rendezvous import node_id

    monkeypatch.setenv(keys.RDZV_SECRET_ENV, SECRET.decode())
    rid = run_id()
    prefix = keys.rendezvous(rid)
    intruder = node(7)
    # without the secret: an intent and a lease-less alive key for a node that is not there
    etcd.put(f"{prefix}/intent/{node_id(intruder)}", b64encode(b"ADD_TO_PARTICIPANTS").decode())
    etcd.put(f"{alive_prefix(rid)}{node_id(intruder)}", b64encode(b"1").decode())
    h = _bound(etcd_server, rid, 0, min_nodes=1, max_nodes=2, join_timeout=20, last_call_timeout=1)
    try:
        h.next_rendezvous()
        state, alive, _ = read_rendezvous(etcd, rid, SECRET)
        assert intruder not in state.participants and intruder not in state.wait_list
        assert etcd.get_prefix(f"{prefix}/intent/") == []  # deleted by the combiner
        backend = h._state_holder._backend
        assert intruder not in backend._leases.alive  # an alive key that does not verify
        # a change that is made already (a join into the round the node is in) writes nothing
        token = etcd.get_with_revision(state_key(rid))[1]
        backend.note(A.ADD_TO_PARTICIPANTS)
        after, _, applied = backend.write(h._state_holder.state, None)
        assert not applied and backend.stats["combines_unwritten"] == 1
        assert etcd.get_with_revision(state_key(rid))[1] == token
        # someone holds the combine lock and never combines: the change is taken back in time
        lease = etcd.lease(30)
        etcd.put(f"{prefix}/combiner", "someone-else", lease)
        backend._combiner.budget = 0.5
        backend.note(A.ADD_TO_REDUNDANCY_LIST)
        after, _, applied = backend.write(h._state_holder.state, None)
        assert not applied and h._this_node not in after.redundancy_list
        assert etcd.get_prefix(f"{prefix}/intent/") == []  # withdrawn, not left behind
        assert backend.stats["withdrawn"] == 1
        # closing (as completing) is one node's change for all: no intent queues for it, the
        # node waits for the lock (or for someone to have made it)
        intents = backend.stats["intents"]
        backend.note(A.MARK_RENDEZVOUS_CLOSED)
        after, _, applied = backend.write(h._state_holder.state, None)
        assert not applied and not after.closed
        assert backend.stats["intents"] == intents and backend.stats["shared_waits"] == 1
        lease.revoke()
        backend.note(A.MARK_RENDEZVOUS_CLOSED)
        after, _, applied = backend.write(h._state_holder.state, None)
        assert applied and after.closed
    finally:
        _die(h)


def test_a_node_that_expired_itself_leaves_the_round_it_asks_to_wait_after() -> None:
    # torch: a node whose own heartbeats were late expires itself in its view and joins the
    # wait list; its write carries that removal. Replayed on a state where the others still
    # count it, the removal comes first (else it stays in a round it left, and the round never
    # opens again for the others).
    s = settings(min_nodes=1, max_nodes=2)
    state = _RendezvousState()
    replay(state, [(node(i), A.ADD_TO_PARTICIPANTS) for i in (1, 2)], s)
    assert state.complete and set(state.participants) == {node(1), node(2)}
    assert replay(state, [(node(1), A.ADD_TO_WAIT_LIST)], s) == [True]
    assert set(state.participants) == {node(2)} and state.wait_list == {node(1)}
    # the last one out opens the next round, which takes the waiter at once; the waiter's own
    # join, decided before it saw that, changes nothing
    assert replay(state, [(node(2), A.REMOVE_FROM_PARTICIPANTS)], s) == [True]
    assert not state.complete and state.round == 1
    assert set(state.participants) == {node(1)} and not state.wait_list
    deadline = state.deadline
    assert replay(state, [(node(1), A.ADD_TO_PARTICIPANTS)], s) == [False]
    assert set(state.participants) == {node(1)} and state.deadline == deadline


def test_a_leaver_queues_at_once_and_the_round_that_opens_takes_the_queue() -> None:
    s = settings(min_nodes=3, max_nodes=5)
    state = _RendezvousState()
    replay(state, [(node(i), A.ADD_TO_PARTICIPANTS) for i in (1, 2, 3, 4)], s)
    state.deadline = datetime.now(UTC) - timedelta(seconds=1)  # the last call is over
    replay(state, [(node(1), A.MARK_RENDEZVOUS_COMPLETE)], s)
    assert state.complete and len(state.participants) == 4
    # torch's next_rendezvous: exit (leave the round), then join (queue for the next one); a
    # leave that rejoins is both, in one change
    assert replay(state, [(node(1), A.REMOVE_FROM_PARTICIPANTS, True)], s) == [True]
    assert node(1) not in state.participants and state.wait_list == {node(1)}
    # a leave that does not rejoin (torch's rollback on timeout) only leaves
    assert replay(state, [(node(2), A.REMOVE_FROM_PARTICIPANTS)], s) == [True]
    assert state.wait_list == {node(1)} and set(state.participants) == {node(3), node(4)}
    replay(state, [(node(3), A.REMOVE_FROM_PARTICIPANTS, True)], s)
    assert state.complete and state.wait_list == {node(1), node(3)}
    # the last one out opens the next round: the wait list is in it at once, the leaver not
    # (its own exit would find it in the round it leaves); it joins after, as torch's join does
    assert replay(state, [(node(4), A.REMOVE_FROM_PARTICIPANTS, True)], s) == [True]
    assert state.round == 1 and not state.complete and not state.wait_list
    assert set(state.participants) == {node(1), node(3)}
    assert state.deadline is None  # two of min 3: no last call yet
    assert replay(state, [(node(4), A.ADD_TO_PARTICIPANTS)], s) == [True]
    assert set(state.participants) == {node(1), node(3), node(4)} and state.deadline is not None
    # a join made once the last call is over completes the round, as the joiner's next step
    state.deadline = datetime.now(UTC) - timedelta(seconds=1)
    assert replay(state, [(node(2), A.ADD_TO_PARTICIPANTS)], s) == [True]
    assert state.complete and state.participants == {
        n: r for r, n in enumerate(sorted(node(i) for i in (1, 2, 3, 4)))
    }


def test_a_round_opened_by_a_lost_node_takes_the_whole_wait_list() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    state = _RendezvousState()
    replay(state, [(node(i), A.ADD_TO_PARTICIPANTS) for i in (1, 2, 3)], s)
    assert state.complete
    replay(state, [(node(i), A.REMOVE_FROM_PARTICIPANTS, True) for i in (1, 2)], s)
    assert set(state.participants) == {node(3)} and state.wait_list == {node(1), node(2)}
    # node 3 is lost: torch's expiry takes it out, the round opens, and the first change made
    # on it (one waiter's own join) finds every waiter in the round
    state.last_heartbeats[node(3)] = datetime.now(UTC) - timedelta(minutes=5)
    assert replay(state, [(node(2), A.ADD_TO_PARTICIPANTS)], s) == [False]
    assert state.round == 1 and set(state.participants) == {node(1), node(2)}
    assert not state.wait_list and state.deadline is not None


def test_a_join_decided_before_the_node_was_moved_in_changes_nothing() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    state = _RendezvousState()
    replay(state, [(node(i), A.ADD_TO_PARTICIPANTS) for i in (1, 2, 3)], s)
    replay(state, [(node(i), A.REMOVE_FROM_PARTICIPANTS, True, 0) for i in (1, 2)], s)
    state.last_heartbeats[node(3)] = datetime.now(UTC) - timedelta(minutes=5)  # lost
    replay(state, [], s)
    assert state.round == 1 and set(state.participants) == {node(1), node(2)}
    state.deadline = datetime.now(UTC) - timedelta(seconds=1)
    replay(state, [(node(1), A.MARK_RENDEZVOUS_COMPLETE, False, 1)], s)
    assert state.complete
    # node 2 saw round 1 open without itself (before it was moved in) and asked to join it;
    # a wait-list join decided back in round 0 comes late too: neither takes it out of the
    # round it is in (which would leave a complete round one short)
    stale = [(node(2), A.ADD_TO_PARTICIPANTS, False, 1), (node(2), A.ADD_TO_WAIT_LIST, False, 0)]
    assert replay(state, stale, s) == [False, False]
    assert state.complete and set(state.participants) == {node(1), node(2)}
    assert not state.wait_list
    # a node whose own view expired it and asks to wait in the same round leaves it (torch)
    assert replay(state, [(node(2), A.ADD_TO_WAIT_LIST, False, 1)], s) == [True]
    assert set(state.participants) == {node(1)} and state.wait_list == {node(2)}


def test_a_node_whose_rendezvous_failed_stops_keeping_itself_alive(
    etcd_server: EmbeddedEtcd,
) -> None:
    # torch's heartbeats stay stopped after a failed next_rendezvous, so the others see the
    # node die; the backend's own refresher must stop too (a live-looking node that gave up
    # would wait in the wait list for good, and be moved into the next round)
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    h = _bound(etcd_server, run_id(), 0, min_nodes=2, max_nodes=2, join_timeout=1)
    backend = h._state_holder._backend
    try:
        with pytest.raises(RendezvousTimeoutError):
            h.next_rendezvous()
        assert backend._node_lease.refresher is None
        backend._node_lease.keep()  # used again: it keeps itself alive again
        assert backend._node_lease.refresher is not None
    finally:
        _die(h)


def test_large_jobs_heartbeat_at_torchs_interval_small_ones_every_second() -> None:
    """torchrun's rendezvous conf from `torchrun_command`: 1 s heartbeats up to 64 nodes (a lost
    node is noticed in 3 s), torch's 5 s beyond (a false loss re-forms the whole job, and its
    chance grows with the node count)."""
    from pipetransformer.orchestrator.launch import torchrun_command

    def conf(nnodes: str) -> dict[str, str]:
        cmd = torchrun_command("127.0.0.1:2379", "job", "rdzv", 1, nnodes=nnodes)
        raw = cmd[cmd.index("--rdzv-conf") + 1]
        return dict(item.split("=", 1) for item in raw.split(","))

    assert conf("1")["keep_alive_interval"] == "1"
    assert conf("63:64")["keep_alive_interval"] == "1"
    assert conf("64:65")["keep_alive_interval"] == "5"
    assert conf("1024")["keep_alive_interval"] == "5"
    assert conf("4")["keep_alive_max_attempt"] == "3" and conf("4")["job"] == "job"
    with pytest.raises(ValueError, match="nnodes"):
        torchrun_command("127.0.0.1:2379", "job", "rdzv", 1, nnodes="many")
