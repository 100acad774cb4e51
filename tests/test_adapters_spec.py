"""`model.adapters` (LoRA) in the spec: its defaults, and every bad value refused with the field
named and what it allows, before anything runs: a target the family's blocks do not have, a rank
of 0 or wider than a targeted projection, a target listed twice, adapters on a seeded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetransformer.core.spec import AdaptersSpec, SpecError, parse_spec
from pipetransformer.orchestrator.sources import resolve_pretrained
from tests.lm_assets import make_lm

DATA = {"dataset": "table", "train": "a.jsonl", "test": "b.jsonl"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # width 32, 4 heads of 8 over 2 KV heads (k_proj, v_proj: 32 -> 16), MLP 64
    return make_lm(tmp_path_factory.mktemp("lm") / "llama")


def _resolved(checkpoint: Path, adapters: dict, root: Path):  # noqa: ANN202
    raw = {"name": "lm", "model": {"pretrained": str(checkpoint), "adapters": adapters}}
    return resolve_pretrained(parse_spec({**raw, "data": DATA}), root)


def test_adapters_default_to_rank_8_on_every_projection(llama: Path, tmp_path: Path) -> None:
    spec = _resolved(llama, {}, tmp_path)
    assert spec.model.adapters == AdaptersSpec(rank=8, alpha=16.0, dropout=0.0, targets=None)
    targets = spec.model.family_info.adapter_targets(spec.model)
    assert targets == {
        "q_proj": 32, "k_proj": 16, "v_proj": 16, "o_proj": 32,
        "gate_proj": 32, "up_proj": 32, "down_proj": 32,
    }  # fmt: skip
    chosen = _resolved(llama, {"rank": 16, "targets": ["q_proj", "v_proj"]}, tmp_path)
    assert chosen.model.adapters.targets == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "adapters,message",
    [
        (
            {"targets": ["q_proj", "qkv"]},
            r"model.adapters.targets: 'qkv' is not a projection of llama's blocks; choose from "
            r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        ),
        (
            {"rank": 17},
            r"model.adapters.rank \(17\) is wider than k_proj, whose narrowest side is 16: at "
            r"most 16",
        ),
        ({"rank": 24, "targets": ["q_proj"]}, None),  # q_proj is 32 wide: allowed
        ({"rank": 0}, r"model.adapters.rank: .*greater than 0"),
        ({"alpha": 0}, r"model.adapters.alpha: .*greater than 0"),
        ({"dropout": 1}, r"model.adapters.dropout: .*less than 1"),
        ({"kind": "ia3"}, r"model.adapters.kind: .*'lora'"),
        ({"targets": []}, r"model.adapters.targets: .*at least 1"),
        ({"targets": ["q_proj", "q_proj"]}, r"each target once: q_proj listed more than once"),
        ({"ranks": 4}, r"model.adapters.ranks: unknown field"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(
    llama: Path, tmp_path: Path, adapters: dict, message: str | None
) -> None:
    if message is None:
        assert _resolved(llama, adapters, tmp_path).model.adapters.rank == adapters["rank"]
        return
    with pytest.raises(SpecError, match=message):
        _resolved(llama, adapters, tmp_path)


def test_a_seeded_model_takes_no_adapters() -> None:
    raw = {"name": "vit", "model": {"family": "vit", "adapters": {"rank": 2}}, "data": {}}
    with pytest.raises(SpecError, match=r"model.adapters needs a pretrained checkpoint"):
        parse_spec(raw)
