"""Leases: :class:`Lease`, the shared keep-alive stream of a client's leases
(``_KeepAliveStream``), and :class:`KeepAlive`, the background refresher."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc
from pyetcd.etcdrpc import rpc_pb2

from pipetransformer.edge.etcd_client.errors import EtcdError, LeaseExpired

if TYPE_CHECKING:
    from pipetransformer.edge.etcd_client.client import EtcdClient

log = logging.getLogger(__name__)


class Lease:
    """An etcd lease; keys put with it are deleted when it expires or is revoked."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int) -> None:
        self._client = client
        self.id = lease_id
        self.ttl = ttl

    def refresh(self) -> int:
        """Reset the TTL; returns it. Raises :class:`LeaseExpired` if the lease is gone."""
        return self._client.refresh_lease(self.id)

    def remaining(self) -> int:
        """Seconds left (-1 once expired)."""
        return self._client.lease_remaining(self.id)

    def revoke(self) -> None:
        """Drop the lease now (its keys go with it). Revoking a gone lease is a no-op."""
        self._client.revoke_lease(self.id)

    def __repr__(self) -> str:
        return f"Lease(id={self.id:#x}, ttl={self.ttl})"


_ENDED = object()  # a keep-alive stream ended before it answered


class _KeepAliveStream:
    """One lease keep-alive stream per client, shared by every lease refreshed through it (as
    etcd's own Go client multiplexes its leases): pyetcd opens a stream, and a thread to feed
    it, for every refresh (a millisecond of CPU, every second, for every lease), and streams
    opened per refresh on one connection serialise on its channel. A reader thread hands each
    answer to the refresh waiting for that lease. A stream lives `_LIFE_S` at most; whatever
    goes wrong ends it and fails the refreshes waiting on it, which are sent once more on a
    fresh stream, then the ordinary way (`EtcdClient.refresh_lease`). A refresh not answered
    within the client's timeout ends the stream only if it answered nothing meanwhile
    (hung); a stream that answers
    others is behind, not hung, and the refresh waits on (up to `_PATIENCE` timeouts): ending
    it would send every lease of the client to a stream of its own at once, on an etcd or a
    host already too slow (1,024 simulated nodes' refreshes then never got through)."""

    _LIFE_S = 30.0
    _PATIENCE = 3

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._requests: queue.Queue[rpc_pb2.LeaseKeepAliveRequest | None] | None = None
        self._replies: Any = None
        self._pid = 0  # the process that opened the stream (a forked child opens its own)
        self._answered = 0.0  # when the stream last answered (monotonic)
        # the open stream's lease id -> the refreshes waiting for its answer, oldest first:
        # (done, [TTL or None]); each stream has its own (an ended one fails only its own)
        self._waiting: dict[int, list[tuple[threading.Event, list[int | None]]]] = {}

    def refresh(self, lease_id: int) -> int | None:
        """The lease's TTL after the refresh (0: it is gone); None when the stream gave no
        answer in time (or could not open). A refresh whose stream ended before answering (its
        life ran out, etcd closed it) is sent once more on a fresh one: the way out, a stream
        of its own, cost a starved process seconds (1,024 simulated nodes' last survivors)."""
        for _attempt in range(2):
            ttl = self._refresh_once(lease_id)
            if ttl is not _ENDED:
                return ttl if isinstance(ttl, int) else None
        return None

    def _refresh_once(self, lease_id: int) -> int | None | object:
        """`refresh` on the current stream; `_ENDED` if that stream ended first."""
        waiter: tuple[threading.Event, list[int | None]] = (threading.Event(), [None])
        with self._lock:
            try:
                if self._requests is None or self._pid != os.getpid():
                    self._open()
            except grpc.RpcError:
                return None
            assert self._requests is not None
            waiting = self._waiting
            waiting.setdefault(lease_id, []).append(waiter)
            self._requests.put(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
        timeout = self._client.timeout
        sent = time.monotonic()
        while not waiter[0].wait(timeout):
            now = time.monotonic()
            if now - self._answered > timeout or now - sent >= self._PATIENCE * timeout:
                break  # hung (nothing answered meanwhile), or too far behind
        if waiter[0].is_set():
            return _ENDED if waiter[1][0] is None else waiter[1][0]
        with self._lock:
            if waiter[0].is_set():  # answered, or ended, just now
                return _ENDED if waiter[1][0] is None else waiter[1][0]
            waiters = waiting.get(lease_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
                hung = time.monotonic() - self._answered > timeout
                if hung and waiting is self._waiting and self._replies is not None:
                    # a stream that hangs is not used again: the next refresh opens another
                    self._replies.cancel()
                    self._requests = self._replies = None
        return None

    def _open(self) -> None:
        requests: queue.Queue[rpc_pb2.LeaseKeepAliveRequest | None] = queue.Queue()
        life = self._LIFE_S

        def feed() -> Iterable[rpc_pb2.LeaseKeepAliveRequest]:
            # gRPC's feeding thread waits here; it ends with the stream, or when idle that long
            while True:
                try:
                    item = requests.get(timeout=life)
                except queue.Empty:
                    return
                if item is None:
                    return
                yield item

        raw = self._client._client  # pyetcd: its lease stub and the client's sign-in token
        replies = raw.leasestub.LeaseKeepAlive(feed(), life, metadata=raw.metadata)
        self._requests, self._replies, self._pid = requests, replies, os.getpid()
        self._answered = time.monotonic()
        self._waiting = waiting = {}
        threading.Thread(
            target=self._read,
            args=(requests, replies, waiting),
            name="etcd-keepalive-stream",
            daemon=True,
        ).start()

    def _read(
        self,
        requests: queue.Queue[Any],
        replies: Any,
        waiting: dict[int, list[tuple[threading.Event, list[int | None]]]],
    ) -> None:
        try:
            for reply in replies:
                with self._lock:
                    self._answered = time.monotonic()
                    waiters = waiting.get(int(reply.ID))
                    if waiters:
                        done, answer = waiters.pop(0)
                        answer[0] = int(reply.TTL)
                        done.set()
        except grpc.RpcError:
            pass  # its life ran out, or etcd went: the waiting refreshes go the ordinary way
        finally:
            with self._lock:
                if self._requests is requests:
                    self._requests = self._replies = None
                for waiters in waiting.values():
                    for done, _answer in waiters:
                        done.set()
                waiting.clear()
            requests.put(None)
            replies.cancel()


class KeepAlive:
    """Background thread refreshing a lease every ``interval`` (default ttl/3) seconds.

    It keeps trying through etcd outages (etcd extends leases when it comes back); it stops
    for good only when the lease is reported gone, then sets :attr:`expired` and calls
    ``on_expired`` once (from the keep-alive thread).
    """

    def __init__(
        self,
        lease: Lease,
        interval: float | None = None,
        on_expired: Callable[[Lease], None] | None = None,
    ) -> None:
        self.lease = lease
        self.interval = interval if interval is not None else max(lease.ttl / 3.0, 0.1)
        self.on_expired = on_expired
        self.expired = threading.Event()
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-keepalive-{lease.id:x}", daemon=True
        )

    def start(self) -> KeepAlive:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.lease.refresh()
                self.last_error = None
            except LeaseExpired as exc:
                if self._stop.is_set():  # revoked by our own stop(revoke=True): not a loss
                    return
                self.last_error = exc
                self.expired.set()
                log.warning("etcd lease %#x expired", self.lease.id)
                if self.on_expired is not None:
                    self.on_expired(self.lease)
                return
            except EtcdError as exc:  # unavailable for a while: try again next tick
                self.last_error = exc
                log.warning("etcd lease %#x refresh failed: %s", self.lease.id, exc)

    def stop(self, revoke: bool = False) -> None:
        """Stop refreshing; ``revoke=True`` also drops the lease (and its keys) now."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if revoke and not self.expired.is_set():
            self.lease.revoke()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> KeepAlive:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
