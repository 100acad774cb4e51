"""Shared fixtures. Each area keeps its fixtures in its own module, pulled in here."""

pytest_plugins = [
    "tests.fixtures_etcd",
    "tests.fixtures_postgres",
    "tests.fixtures_store",
    "tests.fixtures_run",
]
