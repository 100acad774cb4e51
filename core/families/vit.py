"""Hugging Face ViT and DeiT checkpoints (`transformers`' `ViT*` and `DeiT*` classes), read from
their config.json; built by `pipetransformer.models.vit`.

Units under the checkpoint's own names: `embed` is `<p>.embeddings.*`, `blocks.<i>` is
`<p>.encoder.layer.<i>.*`, `head` the final `<p>.layernorm` and the `classifier` on the class
token (`p` is vit or deit). Stages pass plain hidden states [B, T, D]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.families.base import Architecture, Family

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec


@dataclass(frozen=True)
class VitFamily(Family):
    extra_tokens: int = 1  # the class token (DeiT adds a distillation token)

    def tokens(self, model: ModelSpec) -> int:
        return (model.image_size // model.patch_size) ** 2 + self.extra_tokens

    def head_prefixes(self, arch: Architecture) -> tuple[str, ...]:
        return (f"{self.key_prefix}.layernorm.", "classifier.")

    def adapter_layers(self, model: ModelSpec) -> dict[str, list[tuple[int, int]]] | None:
        """By `transformers` 5's module names, what `peft` matches on its ViT and DeiT
        classes (the checkpoints keep the older `query`, `intermediate.dense`, ...): q_proj,
        k_proj, v_proj and o_proj (d x d), the MLP's fc1 (d x h) and fc2 (h x d)."""
        d, h = model.dim, self.hidden(model)
        square = [(d, d)]
        return {
            "q_proj": square,
            "k_proj": square,
            "v_proj": square,
            "o_proj": square,
            "fc1": [(d, h)],
            "fc2": [(h, d)],
        }


BUILD = "pipetransformer.models.vit"

VIT = VitFamily(
    name="vit",
    source="checkpoint",
    modality="image",
    build=BUILD,
    model_type="vit",
    architectures={"ViTModel": "body", "ViTForImageClassification": "image-classification"},
    task_classes={"classification": "ViTForImageClassification"},
)
DEIT = VitFamily(
    name="deit",
    source="checkpoint",
    modality="image",
    build=BUILD,
    model_type="deit",
    architectures={"DeiTModel": "body", "DeiTForImageClassification": "image-classification"},
    task_classes={"classification": "DeiTForImageClassification"},
    extra_tokens=2,
)
