"""Job spec validation: good specs parse, bad ones name the field and what is allowed."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipetransformer.core.spec import JobSpec, SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[1]


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return dict(info.value.problems)


def test_examples_are_valid() -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        spec = load_spec(path)
        assert isinstance(spec, JobSpec)
    spec = load_spec(REPO / "examples" / "vit-digits.yaml")
    assert (spec.parallel.stages, spec.model.depth, spec.data.dataset) == (2, 6, "digits")


def test_defaults_fill_everything_but_the_name() -> None:
    spec = parse_spec({"name": "minimal"})
    assert spec.training.global_batch_size == 64 and spec.parallel.schedule == "gpipe"
    assert "name" in _problems({})


@pytest.mark.parametrize(
    ("data", "field", "phrase"),
    [
        ({"name": "x", "colour": 1}, "colour", "unknown field"),
        (
            {"name": "x", "training": {"global_batch_sise": 8}},
            "training.global_batch_sise",
            "unknown field",
        ),
        (
            {"name": "x", "training": {"global_batch_size": -64}},
            "training.global_batch_size",
            "greater than 0",
        ),
        ({"name": "x", "training": {"lr": 0}}, "training.lr", "greater than 0"),
        ({"name": "x", "parallel": {"stages": 7}}, "parallel.stages", "exceeds model.depth"),
        (
            {"name": "x", "data": {"dataset": "imagenet"}},
            "data.dataset",
            "'imagenet' is not available",
        ),
        ({"name": "x", "parallel": {"schedule": "pipedream"}}, "parallel", "choose one of gpipe"),
        (
            {"name": "x", "training": {"global_batch_size": 30}},
            "training.global_batch_size",
            "multiple of",
        ),
        (
            {"name": "x", "model": {"dim": 30, "heads": 4}},
            "model",
            "heads (4) must divide dim (30)",
        ),
        ({"name": "Bad Name"}, "name", "lowercase"),
        ({"name": "x", "training": {"epochs": "many"}}, "training.epochs", "valid integer"),
        ({"name": "x", "parallel": {"schedule": "zbv"}}, "parallel", "exactly 2 stage(s) per rank"),
        (
            {"name": "x", "parallel": {"schedule": "1f1b", "stages": 4, "microbatches": 2}},
            "parallel",
            "at least as many micro-batches as stages",
        ),
        (
            {
                "name": "x",
                "parallel": {
                    "schedule": "interleaved-1f1b",
                    "virtual_stages": 2,
                    "partition": "autopipe",
                },
            },
            "parallel",
            "plan one stage per rank",
        ),
        ({"name": "x", "parallel": {"recompute": [True]}}, "parallel", "one flag per stage"),
        (
            {"name": "x", "parallel": {"microbatches": "some"}},
            "parallel.microbatches.literal['auto']",
            "'auto'",
        ),
        (
            {"name": "x", "model": {"family": "bert"}},
            "model.vocab_size",
            "required when family is 'bert'",
        ),
    ],
)
def test_bad_specs_name_the_field(data: dict, field: str, phrase: str) -> None:
    problems = _problems(data)
    assert field in problems, problems
    assert phrase in problems[field]


def test_relayout_modes_parse_and_repartition_needs_a_trainable_block_per_stage() -> None:
    assert parse_spec({"name": "x"}).freeze.relayout == "elastic"  # today's behaviour
    base = {"name": "x", "model": {"depth": 8}, "parallel": {"stages": 2}}
    for mode in ("elastic", "off"):  # neither keeps every stage with an active block
        assert parse_spec({**base, "freeze": {"relayout": mode}}).freeze.relayout == mode
    assert "freeze.relayout" in _problems({**base, "freeze": {"relayout": "sometimes"}})
    ok = {"relayout": "repartition", "policy": "schedule", "keep_trainable": 2}
    assert parse_spec({**base, "freeze": ok}).freeze.relayout == "repartition"
    # with policy 'off' too: a manual override may freeze up to keep_trainable
    for policy in ("gradient", "schedule", "off"):
        freeze = {"relayout": "repartition", "policy": policy}
        msg = _problems({**base, "freeze": freeze})["freeze.keep_trainable"]
        assert "freeze.keep_trainable (1)" in msg and "parallel.stages" in msg, msg
        assert "(2 x 1 = 2)" in msg and "'repartition'" in msg and "raise" in msg, msg
    virtual = {"stages": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b"}
    freeze = {"relayout": "repartition", "policy": "schedule", "keep_trainable": 3}
    msg = _problems({**base, "parallel": virtual, "freeze": freeze})["freeze.keep_trainable"]
    assert "freeze.keep_trainable (3)" in msg and "(2 x 2 = 4)" in msg, msg


def test_measured_and_multi_stage_options_parse() -> None:
    spec = parse_spec({"name": "x", "parallel": {"partition": "autopipe", "microbatches": "auto"}})
    assert spec.parallel.microbatches == "auto" and spec.parallel.partition == "autopipe"
    spec = parse_spec(
        {
            "name": "x",
            "parallel": {"schedule": "zbv", "virtual_stages": 2, "recompute": [1, 0, 0, 1]},
        }
    )
    assert spec.parallel.num_stages == 4 and spec.parallel.recompute_for(3)


def test_every_problem_is_reported_at_once() -> None:
    problems = _problems({"name": "x", "colour": 1, "training": {"epochs": 0, "lr": -1}})
    assert {"colour", "training.epochs", "training.lr"} <= set(problems)
    # a bad field, a bad name and two contradictions between sections: one round, each named
    # (before: the field first, then the name, then one contradiction per run)
    spec = {
        "name": "Bad_Name",
        "model": {"depth": 4, "bogus": 1},
        "training": {"epochs": 0, "global_batch_size": 30},
        "parallel": {"stages": 5, "microbatches": 4},
    }
    problems = _problems(spec)
    assert set(problems) == {
        "name",
        "model.bogus",
        "training.epochs",
        "parallel.stages",
        "training.global_batch_size",
    }, problems
    assert "exceeds model.depth (4)" in problems["parallel.stages"]
    # a contradiction that names a field in error is not guessed at from its default
    only = _problems({"name": "x", "model": {"depth": "four"}, "parallel": {"stages": 9}})
    assert set(only) == {"model.depth"}, only


def test_error_message_is_readable(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "training": {"global_batch_size": -1}}))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert text.startswith(f"invalid job spec in {path}:")
    assert "training.global_batch_size: Input should be greater than 0 (got -1)" in text


def test_missing_or_unparsable_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(listy)


def test_checkpoint_intervals_parse() -> None:
    spec = parse_spec({"name": "x"})
    c = spec.checkpoint
    assert (c.every_epochs, c.every_steps, c.every_seconds, c.async_save) == (1, None, None, True)
    c = parse_spec(
        {
            "name": "x",
            "checkpoint": {
                "every_epochs": None,
                "every_steps": 50,
                "every_seconds": 2.5,
                "async_save": False,
            },
        }
    ).checkpoint
    assert (c.every_epochs, c.every_steps, c.every_seconds, c.async_save) == (None, 50, 2.5, False)
    assert JobSpec.model_validate_json(spec.to_json()) == spec  # round-trips


@pytest.mark.parametrize(
    ("checkpoint", "field", "phrase"),
    [
        ({"every_steps": 0}, "checkpoint.every_steps", "greater than 0"),
        ({"every_steps": 2.5}, "checkpoint.every_steps", "valid integer"),
        ({"every_steps": True}, "checkpoint.every_steps", "not a boolean"),
        ({"every_seconds": -1}, "checkpoint.every_seconds", "greater than 0"),
        ({"every_seconds": "soon"}, "checkpoint.every_seconds", "valid number"),
        ({"every_seconds": float("inf")}, "checkpoint.every_seconds", "finite number"),
        ({"every_epochs": 0}, "checkpoint.every_epochs", "greater than 0"),
        ({"async_save": "maybe"}, "checkpoint.async_save", "valid boolean"),
        ({"every_minutes": 5}, "checkpoint.every_minutes", "unknown field"),
        ({"every_epochs": None}, "checkpoint", "set at least one of checkpoint.every_epochs"),
    ],
)
def test_bad_checkpoint_settings_name_the_field(checkpoint: dict, field: str, phrase: str) -> None:
    problems = _problems({"name": "x", "checkpoint": checkpoint})
    assert field in problems, problems
    assert phrase in problems[field]


# -- bounds: every number finite and within what makes sense ----------------------------------


@pytest.mark.parametrize(
    ("section", "values", "field", "phrase"),
    [
        ("model", {"depth": 100000}, "model.depth", "less than or equal to 1024"),
        ("model", {"dim": 1e9}, "model.dim", "less than or equal to 65536"),
        ("model", {"dim": 64.5}, "model.dim", "fractional part"),
        ("model", {"heads": True}, "model.heads", "not a boolean"),
        ("model", {"mlp_ratio": float("nan")}, "model.mlp_ratio", "finite number"),
        ("model", {"mlp_ratio": 0.001}, "model", "no hidden units"),
        ("model", {"image_size": 10**6}, "model.image_size", "less than or equal to 4096"),
        ("model", [1, 2], "model", "valid dictionary"),
        ("data", {"synthetic_samples": 1e12}, "data.synthetic_samples", "less than or equal"),
        ("data", {"seed": -1}, "data.seed", "greater than or equal to 0"),
        ("data", {"seed": 2**32}, "data.seed", "less than or equal to 4294967295"),
        ("data", {"test_fraction": float("-inf")}, "data.test_fraction", "finite number"),
        ("data", {"dataset": "x" * 100_000}, "data.dataset", "at most 64 characters"),
        ("data", {"classes": [0] * 1000}, "data.classes", "at most 10 items"),
        ("training", {"global_batch_size": 1e12}, "training.global_batch_size", "less than"),
        ("training", {"seed": 2**70}, "training.seed", "less than or equal to 4294967295"),
        ("training", {"seed": "2**70"}, "training.seed", "valid integer"),
        ("training", {"epochs": 1e9}, "training.epochs", "less than or equal to 100000"),
        ("training", {"epochs": True}, "training.epochs", "not a boolean"),
        ("training", {"lr": float("inf")}, "training.lr", "finite number"),
        ("training", {"lr": float("nan")}, "training.lr", "finite number"),
        ("training", {"lr": float("1e400")}, "training.lr", "finite number"),
        ("training", {"lr": -0.0}, "training.lr", "greater than 0"),
        ("training", {"lr": 50}, "training.lr", "less than or equal to 1"),
        ("training", {"lr": 0.5, "weight_decay": 5}, "training", "lr x weight_decay"),
        ("training", {"max_steps": 10**12}, "training.max_steps", "less than or equal"),
        ("training", {"warmup_steps": -1}, "training.warmup_steps", "greater than or equal"),
        ("parallel", {"replicas": 10**6}, "parallel.replicas", "less than or equal to 1024"),
        (
            "parallel",
            {"stages": 64, "virtual_stages": 4, "schedule": "interleaved-1f1b"},
            "parallel",
            "at most 128 pipeline stages",
        ),
        ("checkpoint", {"every_seconds": 1e12}, "checkpoint.every_seconds", "less than"),
        ("checkpoint", {"keep": 10**9}, "checkpoint.keep", "less than or equal to 1000"),
        ("runtime", {"lease_ttl_s": 1e12}, "runtime.lease_ttl_s", "less than or equal to 3600"),
        ("runtime", {"lease_ttl_s": 0}, "runtime.lease_ttl_s", "greater than 0"),
        ("runtime", {"max_restarts": 10**9}, "runtime.max_restarts", "less than or equal"),
        ("freeze", {"every": 10**12}, "freeze.every", "(at most 100000000)"),
        ("freeze", {"alpha": float("nan")}, "freeze.alpha", "finite number"),
        ("init", {"checkpoint": "/x" * 10_000}, "init.checkpoint", "at most 4096 characters"),
    ],
)
def test_numbers_are_bounded(section: str, values: object, field: str, phrase: str) -> None:
    problems = _problems({"name": "x", section: values})
    assert field in problems, problems
    assert phrase in problems[field], problems[field]
    assert len(problems[field]) < 300, "the value is quoted, not dumped"


def test_bounds_admit_real_models() -> None:
    """The bounds leave room for the models people train (ViT-B/16, BERT-base)."""
    parse_spec(
        {
            "name": "vit-b",
            "model": {"image_size": 224, "patch_size": 16, "channels": 3, "dim": 768},
            "data": {"dataset": "synthetic", "synthetic_samples": 100_000, "seed": 2**32 - 1},
            "training": {"seed": 2**32 - 1, "lr": 1e-3, "epochs": 300},
        }
    )
    parse_spec(
        {
            "name": "bert-base",
            "model": {
                "family": "bert",
                "vocab_size": 30522,
                "seq_len": 512,
                "dim": 768,
                "heads": 12,
                "depth": 12,
                "num_classes": 2,
            },
            "data": {"dataset": "synthetic-text"},
            "runtime": {"lease_ttl_s": 3600},
            "checkpoint": {"every_seconds": 3600.0},
        }
    )


# -- spec files as a new user might write them (issue 12, section 4) ---------------------------

_LAUGHS = b"name: lol\na: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + b"".join(
    b"%c: &%c [%s]\n" % (c, c, b", ".join([b"*%c" % (c - 1)] * 9)) for c in b"bcdefghi"
)

# name -> (file contents, field named, phrase in its message): each of these once started a job
# that could not run, hung the CLI or ended in a traceback
UNRUNNABLE: dict[str, tuple[bytes, str, str]] = {
    "billion-laughs": (_LAUGHS, "<file>", "more than 10000 values once its aliases are expanded"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "<file>", "binary"),
    "invalid-utf8": (b"name: caf\xe9\nmodel:\n  dim: 64\n", "<file>", "not UTF-8 text"),
    "duplicate-key": (
        b"name: x\ntraining:\n  lr: 0.1\n  epochs: 3\n  lr: 0.2\n",
        "<file>",
        "duplicate key 'lr' at line 3 and line 5",
    ),
    "depth": (b"name: x\nmodel:\n  depth: 100000\n", "model.depth", "less than or equal to 1024"),
    "dim": (b"name: x\nmodel:\n  dim: 1e9\n", "model.dim", "less than or equal to 65536"),
    "global-batch": (
        b"name: x\ntraining:\n  global_batch_size: 1e12\n",
        "training.global_batch_size",
        "less than or equal to 1048576",
    ),
    "synthetic-samples": (
        b"name: x\ndata:\n  dataset: synthetic\n  synthetic_samples: 1e12\n",
        "data.synthetic_samples",
        "less than or equal to 10000000",
    ),
    "seed": (
        b"name: x\ntraining:\n  seed: %d\n" % 2**70,
        "training.seed",
        "less than or equal to 4294967295",
    ),
    "epochs": (b"name: x\ntraining:\n  epochs: 1e9\n", "training.epochs", "less than or equal"),
    "lr": (b"name: x\ntraining:\n  lr: .inf\n", "training.lr", "finite number"),
    "lease-ttl": (
        b"name: x\nruntime:\n  lease_ttl_s: 1e12\n",
        "runtime.lease_ttl_s",
        "less than or equal to 3600",
    ),
}

MORE_BAD_FILES: dict[str, tuple[bytes, str, str]] = {
    "utf-16": ("name: x\n".encode("utf-16"), "<file>", "UTF-16"),
    "nul-in-text": (b"name: x\x00\n", "<file>", "NUL byte at byte offset 7"),
    "deep-nesting": (b"name: x\nmodel: " + b"[" * 100_000 + b"]" * 100_000, "<file>", "nested"),
    "recursive-alias": (b"name: x\nmodel: &m {a: *m}\n", "<file>", "recursive"),
    "many-aliases": (
        b"name: x\nv: &v 1\nl: [" + b", ".join([b"*v"] * 200) + b"]\n",
        "<file>",
        "more than 100 alias references",
    ),
    "many-values": (b"name: x\nl:\n" + b"- 1\n" * 20_000, "<file>", "more than 10000 values"),
    "too-large": (b"name: x\n#" + b"x" * (1 << 20), "<file>", "larger than 1024 KiB"),
    "huge-integer": (b"name: x\ntraining:\n  seed: " + b"9" * 5000, "<file>", "100 digits"),
    "flow-duplicate": (b"name: x\nmodel: {dim: 32, dim: 64}\n", "<file>", "duplicate key 'dim'"),
    "top-duplicate": (b"name: a\nname: b\n", "<file>", "duplicate key 'name' at line 1"),
    "bad-tag": (b"name: x\nmodel:\n  dim: !!int zz\n", "<file>", "cannot be read"),
    "syntax": (b"name: [unclosed\n", "<file>", "not valid YAML"),
    "empty": (b"", "<spec>", "must be a mapping"),
    "list": (b"- name: x\n", "<spec>", "must be a mapping"),
    "huge-string": (b"name: " + b"x" * 500_000 + b"\n", "name", "at most 40 characters"),
    "list-for-mapping": (b"name: x\ntraining: [1, 2]\n", "training", "valid dictionary"),
    "negative-zero": (b"name: x\ntraining:\n  lr: -0.0\n", "training.lr", "greater than 0"),
    "nan": (b"name: x\ntraining:\n  lr: .nan\n", "training.lr", "finite number"),
    "overflow": (b"name: x\ntraining:\n  lr: 1e400\n", "training.lr", "finite number"),
    "power": (b"name: x\ntraining:\n  seed: 2**70\n", "training.seed", "valid integer"),
    "negative-seed": (b"name: x\ndata:\n  seed: -1\n", "data.seed", "greater than or equal to 0"),
    "yes-as-number": (b"name: x\ntraining:\n  epochs: yes\n", "training.epochs", "boolean"),
}


def _load_problems(tmp_path: Path, content: bytes) -> dict[str, str]:
    path = tmp_path / "spec.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"invalid job spec in {path}:")
    return dict(info.value.problems)


@pytest.mark.parametrize("case", [*UNRUNNABLE, *MORE_BAD_FILES])
def test_bad_spec_files_are_refused(tmp_path: Path, case: str) -> None:
    content, field, phrase = {**UNRUNNABLE, **MORE_BAD_FILES}[case]
    started = time.monotonic()
    problems = _load_problems(tmp_path, content)
    assert time.monotonic() - started < 2, "refused at once, not after expanding or scanning"
    assert field in problems, problems
    assert phrase in problems[field], problems[field]
    assert len(problems[field]) < 400, "the message quotes, never dumps"


def test_yaml_files_parse_as_a_person_means_them(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(
        b"\xef\xbb\xbfname: 2024-01-01\n"  # a UTF-8 BOM; a date-like name stays a string
        b"model:\n  <<: {dim: 32, heads: 4}\n  dim: 64\n"  # merged keys may be overridden
        b"training:\n  lr: 3e-4\n  global_batch_size: 6.4e1\n"  # YAML 1.2 / JSON floats
    )
    spec = load_spec(path)
    assert spec.name == "2024-01-01"
    assert (spec.model.dim, spec.model.heads) == (64, 4)
    assert spec.training.lr == 3e-4 and spec.training.global_batch_size == 64


def _pipetransformer() -> list[str]:
    script = Path(sys.executable).parent / "pipetransformer"
    return (
        [str(script)]
        if script.exists()
        else [sys.executable, "-m", "pipetransformer.orchestrator.cli"]
    )


def _jobs_stored(workdir: Path) -> int:
    db = workdir / "store.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM jobs").fetchone()[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(UNRUNNABLE))
def test_cli_refuses_unrunnable_specs(tmp_path: Path, case: str) -> None:
    """`pipetransformer run` refuses each input of issue 12 (section 4) within 5 s: exit 2, the
    field or the file's problem named, no traceback, nothing stored."""
    content, field, phrase = UNRUNNABLE[case]
    spec, workdir = tmp_path / f"{case}.yaml", tmp_path / "runs"
    spec.write_bytes(content)
    started = time.monotonic()
    res = subprocess.run(
        [*_pipetransformer(), "run", str(spec), "--workdir", str(workdir)],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    elapsed = time.monotonic() - started
    output = res.stdout + res.stderr
    assert res.returncode == 2, output
    assert elapsed < 5, f"took {elapsed:.1f}s"
    assert "Traceback" not in output
    assert f"{field}: " in res.stderr and phrase in res.stderr, res.stderr
    assert _jobs_stored(workdir) == 0 and not workdir.exists(), "nothing was created"
