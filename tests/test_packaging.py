"""One import namespace that installs beside anything (docs/architecture.md, "Parts").

What is installed is one package, `pipetransformer`, whose subpackages are the folders the
repository keeps at its root (through the links in `pipetransformer/`), plus our module in
torchx's plugin namespace. Two ways that used to go wrong are checked for real here:

- a user's project with folders named like ours (`core/`, `trainer/`, ...) is the working
  directory of every process of a job: none of them may import the user's modules;
- another distribution with a top-level `trainer` package installs into the same environment:
  both must import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import write_spec

REPO = Path(__file__).resolve().parents[1]
# every package folder at the root but the tests is a subpackage of ours
FOLDERS = tuple(
    sorted(
        p.parent.name
        for p in REPO.glob("*/__init__.py")
        if p.parent.name not in ("tests", "pipetransformer")
    )
)


def test_every_folder_is_a_subpackage_through_its_link() -> None:
    """pipetransformer/<folder> is a link to the folder at the root, for each of ours, and
    nothing else is linked there."""
    assert {"core", "edge", "models", "orchestrator", "trainer"} <= set(FOLDERS)
    links = {p.name for p in (REPO / "pipetransformer").iterdir() if p.is_symlink()}
    assert links == set(FOLDERS)
    for folder in FOLDERS:
        link = REPO / "pipetransformer" / folder
        assert link.is_symlink(), f"{link} is not a link"
        assert link.resolve() == (REPO / folder).resolve()
        assert (REPO / folder / "__init__.py").is_file()
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    found = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert found == ["pipetransformer*", "torchx_plugins*"]


def test_the_installed_modules_are_the_namespaces() -> None:
    import pipetransformer.core.planner as planner
    import pipetransformer.trainer.worker as worker

    assert Path(planner.__file__).resolve() == REPO / "core" / "planner.py"
    assert Path(worker.__file__).resolve() == REPO / "trainer" / "worker.py"
    for name in FOLDERS:  # no folder of ours is a top-level module
        assert name not in sys.modules, sys.modules[name]


SHADOW = "raise ImportError('the job imported the user\\'s {name}/ instead of ours')\n"


@pytest.mark.slow
def test_a_job_runs_from_a_directory_whose_folders_are_named_like_ours(tmp_path: Path) -> None:
    """The user's project holds `core/`, `trainer/`, `store/`, `orchestrator/` (and
    `pipetransformer/`, `dashboard/`, `yaml/`) packages that raise on import; a job run from
    there trains to completion: the CLI, the etcd, the torchrun agents, the fork servers and
    the workers all start in that directory."""
    project = tmp_path / "project"
    for name in (*FOLDERS, "pipetransformer", "yaml"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(SHADOW.format(name=name))
    spec = write_spec(
        project / "job.yaml",
        name="shadowed",
        model={"depth": 2, "dim": 16, "heads": 2, "mlp_ratio": 2.0},
        training={"epochs": 1, "max_steps": 4, "global_batch_size": 32},
    )
    command = Path(sys.executable).with_name("pipetransformer")
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(command), "run", spec.name, "--job-id", "shadowed", "--workdir", "runs"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    logs = "".join(p.read_text(errors="replace") for p in (project / "runs").rglob("*.log"))
    assert "instead of ours" not in out + logs
    with Store.open(sqlite_url(project / "runs" / "store.db"), migrate=False) as store:
        job = store.get_job("shadowed")
        assert job.state == "completed", job
        assert job.step == 4


def _source_copy(to: Path) -> Path:
    """What a wheel is built from, copied: setuptools builds in the source tree, and a build/
    left in the checkout would keep files a later wheel should not have."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("pipetransformer", *FOLDERS, "torchx_plugins"):
        shutil.copytree(REPO / name, to / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, to / name)
    return to


def _build_wheel(source: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--wheel-dir", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_installs_beside_a_distribution_with_a_top_level_trainer(
    tmp_path: Path,
) -> None:
    """A wheel built from the repository, installed into a fresh virtual environment that
    already holds another distribution's top-level `trainer` package (a speech toolkit's
    training library ships `trainer/trainer.py`): both import, each its own, and ours installs
    no generic top-level name."""
    other = tmp_path / "other"
    (other / "trainer").mkdir(parents=True)
    (other / "trainer" / "__init__.py").write_text("WHOSE = 'theirs'\n")
    (other / "trainer" / "trainer.py").write_text("class Trainer:\n    whose = 'theirs'\n")
    (other / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "other-trainer"\nversion = "1.0"\n'
        '[tool.setuptools]\npackages = ["trainer"]\n'
    )
    theirs = _build_wheel(other, tmp_path / "theirs")
    ours = _build_wheel(_source_copy(tmp_path / "source"), tmp_path / "ours")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    for wheel in (theirs, ours):  # theirs first: ours must not overwrite it
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
            + ["--no-deps", "--no-index", str(wheel)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    top_level = {
        p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth", "_pth"))
    } - {"__pycache__", "_distutils_hack"}
    assert top_level == {"pipetransformer", "torchx_plugins", "trainer"}, top_level
    # our dependencies (torch, ...) come from this environment, after the fresh one's own
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    check = (
        "import trainer, trainer.trainer\n"
        "import pipetransformer.trainer.trainer as ours\n"
        "import pipetransformer.orchestrator.cli\n"
        "print(trainer.WHOSE, trainer.trainer.Trainer.whose, ours.__file__)\n"
    )
    proc = subprocess.run(
        [str(python), "-P", "-c", check],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0, proc.stderr
    whose, cls, our_file = proc.stdout.split()
    assert (whose, cls) == ("theirs", "theirs")
    assert Path(our_file).is_relative_to(site), our_file
    helped = subprocess.run(
        [str(venv / "bin" / "pipetransformer"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert helped.returncode == 0 and "run" in helped.stdout, helped.stderr
