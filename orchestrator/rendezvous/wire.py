"""How the backend talks to etcd below the client's key/value API: the request builders
(keys-only, count-only and nested reads, compares) and `_Wire`, which sends them under the
client's retry policy, counts what they cost, and signs and checks what is stored."""

from __future__ import annotations

import binascii
import collections
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from pyetcd import utils as etcd_utils
from pyetcd.etcdrpc import rpc_pb2 as pb
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from pipetransformer.core import keys
from pipetransformer.core.protocol import RendezvousRefused
from pipetransformer.edge.etcd_client import EtcdClient, EtcdError
from pipetransformer.orchestrator.rendezvous.codec import (
    StateRefused,
    _b64,
    sign_state,
    verify_state,
)
from pipetransformer.orchestrator.rendezvous.layout import state_key


def _b(text: str) -> bytes:
    return text.encode()


def _rng(
    key: str,
    end: bytes = b"",
    *,
    keys_only: bool = False,
    count_only: bool = False,
    min_mod: int = 0,
    max_create: int = 0,
    limit: int = 0,
    oldest_first: bool = False,
    revision: int = 0,
    serializable: bool = False,
) -> pb.RequestOp:
    request = pb.RangeRequest(
        key=_b(key),
        range_end=end,
        keys_only=keys_only,
        count_only=count_only,
        min_mod_revision=min_mod,
        max_create_revision=max_create,
        limit=limit,
        revision=revision,
        serializable=serializable,
    )
    if oldest_first:
        request.sort_target = pb.RangeRequest.CREATE
        request.sort_order = pb.RangeRequest.ASCEND
    return pb.RequestOp(request_range=request)


def _put(key: str, value: str, lease: int = 0) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=_b(key), value=_b(value), lease=lease))


def _delete(key: str) -> pb.RequestOp:
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=_b(key)))


def _nested(
    compare: Sequence[pb.Compare],
    success: Sequence[pb.RequestOp],
    failure: Sequence[pb.RequestOp] = (),
) -> pb.RequestOp:
    return pb.RequestOp(
        request_txn=pb.TxnRequest(compare=compare, success=success, failure=failure)
    )


def _mod_is(key: str, revision: int) -> pb.Compare:
    """True while `key` was last written at `revision` (0: the key does not exist)."""
    return pb.Compare(
        key=_b(key), target=pb.Compare.MOD, result=pb.Compare.EQUAL, mod_revision=revision
    )


def _absent(key: str) -> pb.Compare:
    return pb.Compare(
        key=_b(key), target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=0
    )


def _prefix_end(prefix: str) -> bytes:
    return bytes(etcd_utils.prefix_range_end(_b(prefix)))


def _lease_gone(exc: Exception) -> bool:
    """Whether etcd refused a write because the lease it was put under had expired."""
    return "requested lease not found" in str(exc)


class Wire:
    """A backend's way to etcd: its client, the run's state key and the job's secret; what the
    backend cost etcd (`stats`), and the store revision its last range read was answered at
    (`header_revision`)."""

    def __init__(
        self, client: EtcdClient, run_id: str, secret: bytes | None, job_id: str | None
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.key = state_key(run_id)
        self.secret = secret
        self.job_id = job_id
        # requests, bytes, heartbeats, combines ...: what this node cost etcd (the benchmark)
        self.stats: collections.Counter[str] = collections.Counter()
        self.header_revision = 0

    def txn(
        self,
        what: str,
        compare: Sequence[pb.Compare],
        success: Sequence[pb.RequestOp],
        failure: Sequence[pb.RequestOp] = (),
    ) -> pb.TxnResponse:
        """One etcd transaction, under the client's retry policy (edge/etcd_client offers no
        keys-only, count-only or nested reads; this is the one place that goes below it)."""
        request = pb.TxnRequest(compare=compare, success=success, failure=failure)
        return self.rpc("Txn", what, request)

    def range(self, what: str, request: pb.RangeRequest) -> pb.RangeResponse:
        """One etcd range read under the client's retry policy; `header_revision` is the store
        revision it was answered at."""
        answer = self.rpc("Range", what, request)
        self.header_revision = int(answer.header.revision)
        return answer

    def rpc(self, method: str, what: str, request: Any) -> Any:
        """`request` to etcd's KV service `method`, retried as the client retries, counted."""
        client = self.client

        def call() -> Any:
            raw = client._client  # pyetcd; the client's sign-in keeps its token in `metadata`
            return getattr(raw.kvstub, method)(
                request, client.timeout, credentials=raw.call_credentials, metadata=raw.metadata
            )

        reply = self.etcd(client._call, f"rendezvous {what}", call)
        self.stats["requests"] += 1
        self.stats["bytes_out"] += request.ByteSize()
        self.stats["bytes_in"] += reply.ByteSize()
        return reply

    def seal(self, key: str, data: bytes) -> str:
        return _b64(data) if self.secret is None else sign_state(self.secret, key, data)

    def open(self, key: str, value: str) -> bytes:
        return verify_state(self.secret, key, value)

    def etcd(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd at {self.client.endpoint} has failed: {exc}"
            ) from exc

    def decode(self, value: str) -> bytes:
        try:
            return verify_state(self.secret, self.key, value)
        except StateRefused as exc:
            self.report(str(exc))
            raise
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError(
                f"The rendezvous state at {self.key} is corrupt (not base64)."
            ) from exc

    def report(self, reason: str) -> None:
        """Tell the controller (keys.alert), best effort: the refusal itself is what protects."""
        if self.job_id is None:
            return
        host, pid = socket.gethostname(), os.getpid()
        alert = RendezvousRefused(
            run_id=self.run_id, key=self.key, reason=reason[:400], host=host, pid=pid
        )
        try:
            self.client.put(keys.alert(self.job_id, host, pid), alert.model_dump_json())
        except EtcdError:
            pass
