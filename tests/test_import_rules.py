"""The dependency rules (docs/architecture.md, "Dependency rules") hold, and break when they
should.

The rules are import-linter contracts in pyproject.toml (`[tool.importlinter]`); scripts/test.sh
runs `lint-imports` on them. Here the real tree must keep every contract, and a copy of the
packages with one forbidden import added must break the contract that forbids it, naming the chain
(the line number of the added import proves the graph was built from the copy, not from the
editable install). import-linter cannot forbid a subpackage of an external package, so the one rule
it cannot state, "pure cores never touch torch.distributed", is checked here with grimp and ast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pipetransformer"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
NAMES = {contract["id"]: contract["name"] for contract in CONFIG["contracts"]}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(root: Path, *contracts: str) -> tuple[int, str]:
    """Run lint-imports on the tree at `root` (all contracts, or the ones named): its exit
    status and its output with every run of whitespace made one space (it wraps long names)."""
    cmd = [str(LINT_IMPORTS), str(root / "pyproject.toml"), "--no-cache", "--no-logo"]
    for contract in contracts:
        cmd += ["--contract", contract]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package (its folders, through its links, copied as plain folders) and
    pyproject.toml, to break."""
    shutil.copytree(
        ROOT / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_line(root: Path, module: str, line: str) -> int:
    """Append `line` to `module`'s file under `root` (creating the module if it does not exist
    yet); returns its line number."""
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    path.write_text(f"{text}{line}\n")
    return text.count("\n") + 1


def test_config_names_every_contract():
    assert LINT_IMPORTS.exists(), "import-linter is missing: pip install -e '.[test]'"
    assert CONFIG["root_packages"] == [PACKAGE]
    assert all(NAMES.values()) and len(NAMES) == len(CONFIG["contracts"])


def test_real_tree_keeps_every_contract():
    rc, out = lint(ROOT)
    assert rc == 0, out
    assert f"Contracts: {len(NAMES)} kept, 0 broken." in out, out


# (case, lines added as (module, line), [(contract broken, chain named)]). "{n}" in a chain is
# the added line's number; a chain of several imports is one string (the output joins them).
VIOLATIONS = [
    (
        "freeze imports the SQL store",
        [("pipetransformer.core.freeze", "import pipetransformer.store")],
        [
            ("pure-cores", "pipetransformer.core.freeze -> pipetransformer.store (l.{n})"),
            ("layers", "pipetransformer.core.freeze -> pipetransformer.store (l.{n})"),
        ],
    ),
    (
        "sampler imports the controller",
        [("pipetransformer.core.sampler", "from pipetransformer.orchestrator import controller")],
        [
            (
                "pure-cores",
                "pipetransformer.core.sampler -> pipetransformer.orchestrator.controller (l.{n})",
            ),
            (
                "layers",
                "pipetransformer.core.sampler -> pipetransformer.orchestrator.controller (l.{n})",
            ),
        ],
    ),
    (
        "a module added to core is pure by its folder",
        [("pipetransformer.core.spawn", "import subprocess")],
        [("pure-cores", "pipetransformer.core.spawn -> subprocess (l.{n})")],
    ),
    (
        "a module added to the model builds is held by their rule",
        [("pipetransformer.models.spawn", "import subprocess")],
        [("model-builds", "pipetransformer.models.spawn -> subprocess (l.{n})")],
    ),
    (
        "the core imports torch",
        [("pipetransformer.core.partition", "import torch")],
        [("pure-cores", "pipetransformer.core.partition -> torch (l.{n})")],
    ),
    (
        "the controller builds a model",
        [("pipetransformer.orchestrator.admission", "import pipetransformer.models.units")],
        [
            (
                "no-builds-in-control",
                "pipetransformer.orchestrator.admission -> pipetransformer.models.units (l.{n})",
            )
        ],
    ),
    (
        "the planner is a pure core",
        [("pipetransformer.core.planner", "import pipetransformer.trainer.cache")],
        [
            ("pure-cores", "pipetransformer.core.planner -> pipetransformer.trainer.cache (l.{n})"),
            ("layers", "pipetransformer.core.planner -> pipetransformer.trainer.cache (l.{n})"),
        ],
    ),
    (
        "the control plane imports the data plane",
        [("pipetransformer.orchestrator.admission", "import pipetransformer.trainer.worker")],
        [
            (
                "layers",
                "pipetransformer.orchestrator.admission -> pipetransformer.trainer.worker (l.{n})",
            )
        ],
    ),
    (
        "the data plane imports the control plane",
        [("pipetransformer.trainer.optim", "import pipetransformer.orchestrator.controller")],
        [
            (
                "layers",
                "pipetransformer.trainer.optim -> pipetransformer.orchestrator.controller (l.{n})",
            )
        ],
    ),
    (
        "the data plane writes SQL",
        [("pipetransformer.trainer.data", "from pipetransformer.store import Store")],
        [("workers-write-no-sql", "pipetransformer.trainer.data -> pipetransformer.store (l.{n})")],
    ),
    (
        "the dashboard reads past the store",
        [("pipetransformer.dashboard.figures", "import pipetransformer.orchestrator.controller")],
        [
            (
                "layers",
                "pipetransformer.dashboard.figures -> pipetransformer.orchestrator.controller (l.{n})",
            )
        ],
    ),
    (
        "the CLI imports the dashboard",
        [("pipetransformer.orchestrator.cli", "import pipetransformer.dashboard.launch")],
        [
            (
                "layers",
                "pipetransformer.orchestrator.cli -> pipetransformer.dashboard.launch (l.{n})",
            )
        ],
    ),
    (
        "the store imports the control plane",
        [("pipetransformer.store.tables", "import pipetransformer.orchestrator.roster")],
        [("layers", "pipetransformer.store.tables -> pipetransformer.orchestrator.roster (l.{n})")],
    ),
    (
        "trainer imports tests",
        [("pipetransformer.trainer.optim", "from tests import mp")],
        [("no-tests-or-bench", "pipetransformer.trainer.optim -> tests (l.{n})")],
    ),
    (
        "dashboard imports bench",
        [("pipetransformer.dashboard.figures", "import bench._common")],
        [("no-tests-or-bench", "pipetransformer.dashboard.figures -> bench (l.{n})")],
    ),
]


@pytest.mark.parametrize(
    "added, broken", [case[1:] for case in VIOLATIONS], ids=[case[0] for case in VIOLATIONS]
)
def test_a_forbidden_import_breaks_its_contract(tree, added, broken):
    for module, line in added:
        n = add_line(tree, module, line)  # the chains name the last line added
    rc, out = lint(tree)
    assert rc != 0, out
    for contract, chain in broken:
        rc, out = lint(tree, contract)
        assert rc != 0, out
        assert f"{NAMES[contract]} BROKEN" in out, out
        assert chain.format(n=n) in out, out


def test_a_module_added_later_is_placed_by_its_folder(tree):
    """No list names the modules: a new control-plane module is forbidden to the data plane
    because of the folder it is in."""
    (tree / PACKAGE / "orchestrator" / "novelty.py").write_text(
        '"""A module added after the rules."""\n'
    )
    n = add_line(
        tree, "pipetransformer.trainer.optim", "import pipetransformer.orchestrator.novelty"
    )
    rc, out = lint(tree, "layers")
    assert rc != 0, out
    assert f"{NAMES['layers']} BROKEN" in out, out
    assert (
        f"pipetransformer.trainer.optim -> pipetransformer.orchestrator.novelty (l.{n})" in out
    ), out


def test_the_core_opens_no_way_between_the_planes(tree):
    """`trainer.checkpoint` imports `edge.manifest`. If manifest imported the launcher, the data
    plane would reach the control plane through the edge: broken at the import that opens the
    way."""
    n = add_line(
        tree, "pipetransformer.edge.manifest", "import pipetransformer.orchestrator.launch"
    )
    rc, out = lint(tree, "layers")
    assert rc != 0, out
    assert f"{NAMES['layers']} BROKEN" in out, out
    assert f"pipetransformer.edge.manifest -> pipetransformer.orchestrator.launch (l.{n})" in out, (
        out
    )


# Run in a fresh interpreter with the tree's root as its working directory (grimp finds packages
# through sys.path, and in this process they are already imported from the real tree). Reads the
# pure cores from the `pure-cores` and `model-builds` contracts, follows every import of ours from them, and prints
# each use of torch.distributed (an import, or `torch.distributed` as an attribute) with a chain.
DISTRIBUTED_CHECK = r"""
import ast, sys, tomllib
from pathlib import Path
import grimp

config = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["importlinter"]
graph = grimp.build_graph(*config["root_packages"], cache_dir=None)
sources = [
    expression
    for c in config["contracts"]
    if c["id"] in ("pure-cores", "model-builds")
    for expression in c["source_modules"]
]
cores = set()
for expression in sources:
    if "*" in expression:
        cores |= graph.find_matching_modules(expression)
    else:  # a folder: every module in it
        cores |= {expression} | graph.find_descendants(expression)
reached = {core: core for core in cores}
for core in sorted(cores):
    for module in graph.find_upstream_modules(core):
        reached.setdefault(module, core)


def dotted(node):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return [f"{node.value.id}.{node.attr}"]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


found = 0
for module, core in sorted(reached.items()):
    path = Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in dotted(node)):
            chain = core
            if module != core:
                chain = " -> ".join(graph.find_shortest_chain(importer=core, imported=module))
            line = source.splitlines()[node.lineno - 1].strip()
            print(f"{path}:{node.lineno}: {line}  [pure core {chain}]")
            found += 1
print(f"{len(reached)} modules reached from {len(cores)} pure cores; {found} use torch.distributed")
sys.exit(1 if found else 0)
"""


def distributed_check(root: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", DISTRIBUTED_CHECK],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_pure_cores_never_touch_torch_distributed():
    rc, out = distributed_check(ROOT)
    assert rc == 0, out
    assert "0 use torch.distributed" in out, out


@pytest.mark.parametrize(
    "added, where",
    [
        (
            [("pipetransformer.core.sampler", "import torch.distributed as dist")],
            "pipetransformer/core/sampler.py",
        ),
        (
            [
                (
                    "pipetransformer.models.reduce",
                    "import torch\n\nreduce = torch.distributed.all_reduce",
                ),
                ("pipetransformer.models.seeded", "from pipetransformer.models import reduce"),
            ],
            "pipetransformer/models/reduce.py:3",
        ),
    ],
    ids=["directly", "through a new module, as an attribute"],
)
def test_torch_distributed_in_a_pure_core_fails(tree, added, where):
    for module, line in added:
        add_line(tree, module, line)
    rc, out = distributed_check(tree)
    assert rc != 0, out
    assert where in out, out
