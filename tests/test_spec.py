"""Job spec validation: good specs parse, bad ones name the field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.spec import JobSpec, SpecError, load_spec, parse_spec

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
        ({"name": "x", "parallel": {"stages": 7}}, "<spec>", "exceeds model.depth"),
        ({"name": "x", "data": {"dataset": "imagenet"}}, "data", "'imagenet' is not available"),
        ({"name": "x", "parallel": {"schedule": "pipedream"}}, "parallel", "choose one of gpipe"),
        ({"name": "x", "training": {"global_batch_size": 30}}, "<spec>", "multiple of"),
        (
            {"name": "x", "model": {"dim": 30, "heads": 4}},
            "model",
            "heads (4) must divide dim (30)",
        ),
        ({"name": "Bad Name"}, "<spec>", "lowercase"),
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
