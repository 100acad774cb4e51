"""What the CLI does for a pod: the store's URL from the environment (a Secret), migrations as
their own step (`pipetransformer db upgrade`), and the controller's spec as YAML text in the
environment (the submitting machine's files are not in the pod)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from alembic.script import ScriptDirectory

from pipetransformer.core.keys import SPEC_ENV
from pipetransformer.store import DB_ENV, Store, alembic_config, sqlite_url
from tests.fixtures_run import REPO, cli

HEAD_REVISION = ScriptDirectory.from_config(alembic_config()).get_current_head()


def env_cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = cli(*args, timeout=120)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return proc.returncode, proc.stdout + proc.stderr


def test_db_upgrade_from_the_environment(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "pods.db")
    code, out = env_cli("db", "current", "--workdir", str(tmp_path / "x"), env={DB_ENV: url})
    assert code == 0 and "none (empty)" in out, out
    code, out = env_cli("db", "upgrade", "--workdir", str(tmp_path / "x"), env={DB_ENV: url})
    assert code == 0 and HEAD_REVISION in out, out
    assert "pods.db" in out  # names the store it upgraded
    store = Store(url, read_only=True)
    try:
        assert store.revision() == HEAD_REVISION
    finally:
        store.close()
    # again: nothing to do, still at head
    code, out = env_cli("db", "upgrade", env={DB_ENV: url})
    assert code == 0 and HEAD_REVISION in out
    # the environment is only a default: --db wins
    other = sqlite_url(tmp_path / "other.db")
    code, out = env_cli("db", "upgrade", "--db", other, env={DB_ENV: url})
    assert code == 0 and (tmp_path / "other.db").exists()


def test_status_reads_the_store_url_from_the_environment(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "pods.db")
    Store.open(url).close()
    code, out = env_cli("status", "--all", "--workdir", str(tmp_path / "empty"), env={DB_ENV: url})
    assert code == 0 and "no jobs yet" in out, out


def test_controller_reads_its_spec_from_the_environment(tmp_path: Path) -> None:
    from pipetransformer.orchestrator.cli import UsageError, _read_spec

    spec = yaml.safe_load((REPO / "examples" / "vit-digits.yaml").read_text())
    os.environ[SPEC_ENV] = yaml.safe_dump(spec)
    try:
        assert _read_spec(None).name == spec["name"]
    finally:
        del os.environ[SPEC_ENV]
    with pytest.raises(UsageError, match=SPEC_ENV):
        _read_spec(None)
    # a bad spec in the environment is refused before anything starts, naming field and source
    bad = {**spec, "model": {**spec["model"], "depth": 0}}
    code, out = env_cli(
        "controller",
        "--workdir",
        str(tmp_path / "runs"),
        "--etcd",
        "127.0.0.1:1",
        env={SPEC_ENV: yaml.safe_dump(bad)},
    )
    assert code == 2 and "model.depth" in out and f"${SPEC_ENV}" in out, out
    assert not (tmp_path / "runs").exists()
