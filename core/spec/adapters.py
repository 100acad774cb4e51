"""`model.adapters`: low-rank adapters (LoRA) on a pretrained model's projections, so that only
the adapters (and a new head, where there is one) train and the base weights stay as the
checkpoint has them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from pipetransformer.core.spec.base import MAX_NAME, Number, PositiveInt, _Strict

MAX_RANK = 4_096  # LoRA ranks in use are 4-256; a rank near the width is full fine-tuning
MAX_LORA_ALPHA = 65_536.0
MAX_TARGETS = 64  # a block has a handful of projections


class AdaptersSpec(_Strict):
    """LoRA (Hu et al., 2021) on each block's projections, as the `peft` library builds it:
    every targeted linear layer W gets W x + (alpha / rank) B A x, A initialised at random, B at
    zero, so training starts from the pretrained model exactly. The base weights, the embedding
    and a pretrained head are frozen; the adapters (and a new head) train. A frozen block's
    adapter is merged into its weights. Exported in PEFT's format (`adapter_config.json`,
    `adapter_model.safetensors`), or merged into a plain model (`export --merge`)."""

    kind: Literal["lora"] = Field("lora", description="the adapter: 'lora'")
    rank: Annotated[PositiveInt, Field(le=MAX_RANK)] = Field(
        8,
        description="r: the adapters' inner width; at most the narrowest side of every "
        "targeted projection",
    )
    alpha: Annotated[Number, Field(gt=0, le=MAX_LORA_ALPHA)] = Field(
        16.0, description="lora_alpha: the update is scaled by alpha / rank"
    )
    dropout: Annotated[Number, Field(ge=0, lt=1)] = Field(
        0.0, description="lora_dropout: dropout on each adapter's input while training"
    )
    targets: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_NAME)]],
            Field(min_length=1, max_length=MAX_TARGETS),
        ]
        | None
    ) = Field(
        None,
        description="the projections to adapt, by the family's module names (e.g. q_proj, "
        "v_proj for Llama; query, value for BERT and ViT); default: every attention and MLP "
        "projection of each block",
    )

    @field_validator("targets")
    @classmethod
    def _distinct(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            twice = sorted({t for t in value if value.count(t) > 1})
            raise ValueError(f"each target once: {', '.join(twice)} listed more than once")
        return value
