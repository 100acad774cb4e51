"""The etcd-backed c10d ``Store`` the agents use before anyone knows who rank 0 is (see "The
store" in the package docstring for why etcd backs it)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store

from pipetransformer.edge.etcd_client import EtcdClient, EtcdError
from pipetransformer.orchestrator.rendezvous.codec import _b64, _unb64


class EtcdStore(Store):
    """A c10d ``Store`` whose keys live in etcd under ``prefix`` (values base64 encoded)."""

    _POLL_MIN = 0.01

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta | None = None,
        poll_max: float = 0.2,
    ) -> None:
        """`poll_max`: the longest pause between two reads of a blocking wait."""
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._poll_max = poll_max
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _k(self, key: str | bytes) -> str:
        return self._prefix + (key.decode() if isinstance(key, bytes) else key)

    def _etcd(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except EtcdError as exc:
            # c10d raises DistStoreError (a RuntimeError) for store failures; callers such as
            # torch's elastic agent catch RuntimeError.
            raise dist.DistStoreError(f"etcd store at {self._client.endpoint}: {exc}") from exc

    # Plain operations ------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._etcd(self._client.put, self._k(key), _b64(value))

    def get(self, key: str) -> bytes:
        """Value of ``key``, waiting up to the store timeout for it to be set."""
        return self.multi_get([key])[0]

    def check(self, keys: Sequence[str]) -> bool:
        """True if every key exists now (no waiting)."""
        return all(v is not None for v in self._get_many([self._k(k) for k in keys]))

    def _get_many(self, keys: Sequence[str]) -> list[str | None]:
        # Range reads, not a transaction: etcd takes at most --max-txn-ops (128) reads in one
        # (torchrun's rank 0 reads every agent's role at once: 1,024 keys at 1,024), and before
        # 3.5.5 it crashes when a client gives up on a read-only one (etcd-io/etcd#14110). The
        # keys of one call share a prefix (torchrun's role_info/0..N-1): one range reads them.
        if len(keys) == 1:
            return [self._etcd(self._client.get, keys[0])]
        common = os.path.commonprefix(list(keys))
        if not common.startswith(self._prefix):  # not expected; read them one by one
            return [self._etcd(self._client.get, key) for key in keys]
        found = dict(self._etcd(self._client.get_prefix, common))
        return [found.get(key) for key in keys]

    def num_keys(self) -> int:
        return int(self._etcd(self._client.count_prefix, self._prefix))

    def delete_key(self, key: str) -> bool:
        return bool(self._etcd(self._client.delete, self._k(key)))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set: keys and values differ in length")
        items = [(self._k(k), _b64(v)) for k, v in zip(keys, values, strict=True)]
        self._etcd(self._client.put_many, items)

    # Atomic read-modify-write (CAS on the key's mod revision) ----------------------------

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (absent = 0)."""
        full = self._k(key)
        value, revision = self._etcd(self._client.get_with_revision, full)
        while True:
            current = int(_unb64(value).decode()) if value is not None else 0
            result = current + int(amount)
            applied, value, revision = self._etcd(
                self._client.try_put_at_revision, full, _b64(str(result)), revision
            )
            if applied:
                return result
            time.sleep(random.uniform(0, 0.01))  # contended: spread the retries

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """c10d compare_set: set ``desired`` if the value is ``expected`` (``""``: absent);
        return the value now stored (``expected`` if the key is absent and expected non-empty)."""
        full = self._k(key)
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        value, revision = self._etcd(self._client.get_with_revision, full)
        while True:
            current = _unb64(value) if value is not None else None
            if (current is None and want == b"") or (current is not None and current == want):
                applied, value, revision = self._etcd(
                    self._client.try_put_at_revision, full, _b64(new), revision
                )
                if applied:
                    return new
                continue
            return current if current is not None else want

    def append(self, key: str, value: bytes | str) -> None:
        full = self._k(key)
        extra = value.encode() if isinstance(value, str) else bytes(value)
        current, revision = self._etcd(self._client.get_with_revision, full)
        while True:
            base = _unb64(current) if current is not None else b""
            applied, current, revision = self._etcd(
                self._client.try_put_at_revision, full, _b64(base + extra), revision
            )
            if applied:
                return

    # Blocking reads ----------------------------------------------------------------------

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Wait until every key exists (``timeout`` defaults to the store timeout)."""
        self._wait_values(keys, timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys``, waiting up to the store timeout for all of them."""
        return [_unb64(v) for v in self._wait_values(keys, None)]

    def _wait_values(self, keys: Sequence[str], timeout: timedelta | None) -> list[str]:
        budget = (timeout if timeout is not None else self.timeout).total_seconds()
        # c10d's kNoTimeout (0) means wait forever.
        deadline = time.monotonic() + budget if budget > 0 else float("inf")
        full = [self._k(k) for k in keys]
        delay = self._POLL_MIN
        while True:
            values = self._get_many(full)
            if all(v is not None for v in values):
                return [v for v in values if v is not None]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise dist.DistStoreError(
                    f"etcd store: timed out after {budget:.1f}s waiting for keys {missing} "
                    f"under {self._prefix}"
                )
            time.sleep(min(delay * random.uniform(0.75, 1.25), remaining))
            delay = min(delay * 2, self._poll_max)
