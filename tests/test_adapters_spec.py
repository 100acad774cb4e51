"""`model.adapters` (LoRA) in the spec: its defaults, and every bad value refused with the field
named and what it allows, before anything runs: a target the family's blocks do not have, a rank
of 0 or wider than a targeted projection, a target listed twice, adapters on a seeded model;
a ViT's targets by transformers 5's names."""

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


def test_a_vit_s_targets_are_transformers_module_names(tmp_path: Path) -> None:
    """ViT checkpoints keep the older names (`attention.attention.query`); PEFT, and so the
    targets, use transformers 5's (`attention.q_proj`, `mlp.fc1`)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from assets import make_vit

    vit = make_vit(tmp_path / "vit", image_size=16, patch_size=4, hidden=32, layers=2, heads=2)
    data = {"dataset": "image-folder", "train": "/im/train", "test": "/im/test"}

    def resolved(adapters: dict):  # noqa: ANN202
        raw = {"name": "vit", "model": {"pretrained": str(vit), "adapters": adapters}}
        return resolve_pretrained(parse_spec({**raw, "data": data}), tmp_path)

    spec = resolved({})
    targets = spec.model.family_info.adapter_targets(spec.model)
    assert targets == {
        "q_proj": 32, "k_proj": 32, "v_proj": 32, "o_proj": 32, "fc1": 32, "fc2": 32,
    }  # fmt: skip
    with pytest.raises(
        SpecError,
        match=r"model.adapters.targets: 'query' is not a projection of vit's blocks; choose "
        r"from q_proj, k_proj, v_proj, o_proj, fc1, fc2",
    ):
        resolved({"targets": ["query"]})


def test_a_seeded_model_takes_no_adapters() -> None:
    raw = {"name": "vit", "model": {"family": "vit", "adapters": {"rank": 2}}, "data": {}}
    with pytest.raises(SpecError, match=r"model.adapters needs a pretrained checkpoint"):
        parse_spec(raw)


def test_starting_from_a_checkpoint_of_adapters_needs_their_base_and_shape(
    llama: Path, tmp_path: Path
) -> None:
    """`init.checkpoint` of another job: adapters fit only the base they were trained on and
    only adapters of the same rank and targets; a checkpoint of adapters cannot start a whole
    model, nor the other way round. Each is named (orchestrator/pretrained.py, at submission:
    nothing is stored)."""
    from pipetransformer.orchestrator.pretrained import adapters_mismatch

    model = _resolved(llama, {"rank": 4}, tmp_path).model
    saved = model.model_dump()
    assert adapters_mismatch(saved, model) is None
    other_base = {**saved, "pretrained": {**saved["pretrained"], "fingerprint": "0123abcd"}}
    assert "trained on another base model (fingerprint 0123abcd)" in adapters_mismatch(
        other_base, model
    )
    wider = {**saved, "adapters": {**saved["adapters"], "rank": 8}}
    assert adapters_mismatch(wider, model) == (
        "its adapters have another shape: model.adapters.rank: 8 there, 4 here"
    )
    whole = {**saved, "adapters": None}
    assert "holds a whole model's weights, not adapters" in adapters_mismatch(whole, model)
    plain = model.model_copy(update={"adapters": None})
    assert "export it with `pipetransformer export --merge`" in adapters_mismatch(saved, plain)
    assert adapters_mismatch(whole, plain) is None


def test_a_model_too_big_to_fine_tune_whole_is_admitted_with_adapters(
    llama: Path, tmp_path: Path
) -> None:
    """Admission counts what trains: with adapters the base is its weights alone (4 bytes a
    parameter) and only the adapters carry gradients, moments and the checkpoint's snapshot.
    On a machine between the two needs, full fine-tuning is refused (naming what to change)
    and the same model with adapters admitted."""
    from pipetransformer.orchestrator.admission import admit, estimate

    lora = _resolved(llama, {"rank": 4}, tmp_path)
    whole = lora.model_copy(update={"model": lora.model.model_copy(update={"adapters": None})})
    full, small = estimate(whole), estimate(lora)
    base = sum(r.params for r in full.ranks)
    adapters = 4 * lora.model.depth * (64 + 48 + 48 + 64 + 96 + 96 + 96)  # rank x (in + out)
    assert sum(r.params for r in small.ranks) == base + adapters
    assert sum(r.state_bytes for r in full.ranks) == base * (16 + 12)
    assert sum(r.state_bytes for r in small.ranks) == base * 4 + adapters * (16 + 12)
    between = (full.job_bytes + small.job_bytes) // 2
    assert admit(lora, between) == []
    ((field, message),) = admit(whole, between)
    assert "the job needs about" in message, (field, message)
