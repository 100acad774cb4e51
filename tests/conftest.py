"""Shared fixtures. Each area keeps its fixtures in its own module, pulled in here."""

import os

import pytest

pytest_plugins = [
    "tests.fixtures_etcd",
    "tests.fixtures_postgres",
    "tests.fixtures_store",
    "tests.fixtures_run",
]


# The files that take longest (measured under scripts/test.sh), longest first
LONGEST = (
    "test_k8s_rehearsal.py",
    "test_faults.py",
    "test_e2e.py",
    "test_freeze_scaling.py",
    "test_hf_jobs.py",
    "test_dashboard_browser.py",
    "test_freeze_e2e.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (`LONGEST`), then the other files holding multi-process tests
    (marker `slow`), in their usual order: under scripts/test.sh's two processes
    (pytest-xdist, whole files per process) the long files start early and the short ones fill
    in after, instead of one long file running alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def order(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST:
            return (0, LONGEST.index(name))
        return (1 if item.path in slow else 2, 0)

    items.sort(key=order)  # stable: the order within a file stays
    if os.environ.get("PT_SLOW_ONE_PER_FUNCTION") == "1":
        _one_slow_case_per_function(config, items)


def _one_slow_case_per_function(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep every fast test but only the last case of each slow (multi-process) test function
    (its widest layout, as the cases are written): scripts/test.sh's numerics row for another
    CPU's kernels checks that each comparison holds there, which one layout shows as well as
    all of them, in a third of the time."""
    last = {(item.path, getattr(item, "originalname", item.name)): item for item in items}
    drop = [
        item
        for item in items
        if item.get_closest_marker("slow")
        and last[(item.path, getattr(item, "originalname", item.name))] is not item
    ]
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in dropped]
