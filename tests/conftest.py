"""Shared fixtures. Each area keeps its fixtures in its own module, pulled in here."""

import pytest

pytest_plugins = [
    "tests.fixtures_etcd",
    "tests.fixtures_postgres",
    "tests.fixtures_store",
    "tests.fixtures_run",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding multi-process tests (marker `slow`) first, in their usual order: under
    scripts/test.sh's two processes (pytest-xdist, whole files per process) the long files
    start early and the short ones fill in after, instead of one long file running alone at
    the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within stays
