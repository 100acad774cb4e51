"""Hugging Face ViT and DeiT checkpoints as the pipeline's units (the torch build of
`pipetransformer.core.families.vit`), built from the `transformers` classes themselves and named
with the checkpoint's own parameter names, so `unit.state_dict()` keys are the checkpoint's keys
whatever the partition:

- `embed`: `<p>.embeddings.*` (`p` is vit or deit): pixels [B, C, H, W] -> hidden [B, T, D];
- `blocks.<i>`: `<p>.encoder.layer.<i>.*`: hidden -> hidden;
- `head`: `<p>.layernorm.*` + `classifier.*` on the class token: -> logits [B, num_labels].

transformers 5 renamed the ViT/DeiT layer internals (`layers.<i>.attention.q_proj`, `mlp.fc1`)
but its checkpoints keep the original names (`encoder.layer.<i>.attention.attention.query`,
`intermediate.dense`), as `save_pretrained` writes them. A block therefore registers the layer's
leaf modules (the same objects) under the checkpoint's names and calls the layer, which it holds
unregistered, so each parameter has exactly one name: the checkpoint's."""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import DeiTConfig, PretrainedConfig, ViTConfig
from transformers.models.deit.modeling_deit import DeiTEmbeddings, DeiTLayer, DeiTModel
from transformers.models.vit.modeling_vit import ViTEmbeddings, ViTLayer, ViTModel

from pipetransformer.core.families import Architecture, block_index
from pipetransformer.core.spec import ModelSpec
from pipetransformer.models.hf import HFBuild, merge, nest

if TYPE_CHECKING:
    from peft import LoraConfig

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"vit": ViTConfig, "deit": DeiTConfig}
_EMBEDDINGS: dict[str, type[nn.Module]] = {"vit": ViTEmbeddings, "deit": DeiTEmbeddings}
_LAYERS: dict[str, type[nn.Module]] = {"vit": ViTLayer, "deit": DeiTLayer}
_BODIES: dict[str, type[nn.Module]] = {"vit": ViTModel, "deit": DeiTModel}
# a layer's modules: the checkpoint's name -> the name in transformers 5's layer class
_LAYER_NAMES: dict[str, str] = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "layernorm_before": "layernorm_before",
    "layernorm_after": "layernorm_after",
}


class ImageEmbed(nn.Module):
    """Pixels [B, C, H, W] -> hidden [B, T, D] (`<p>.embeddings.*`)."""

    def __init__(self, config: PretrainedConfig, family: str):
        super().__init__()
        self.family = family
        self.add_module(family, nn.ModuleDict({"embeddings": _EMBEDDINGS[family](config)}))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        embeddings = getattr(self, self.family)["embeddings"]
        dtype = embeddings.patch_embeddings.projection.weight.dtype
        return embeddings(pixel_values.to(dtype))


class ImageBlock(nn.Module):
    """One ViT/DeiT layer under the checkpoint's names `<p>.encoder.layer.<i>.*` (see the
    module docstring): hidden [B, T, D] -> [B, T, D]."""

    def __init__(self, config: PretrainedConfig, family: str, index: int):
        super().__init__()
        layer = _LAYERS[family](config)
        # held unregistered: its leaves are registered below, under the checkpoint's names
        self.__dict__["layer"] = layer
        tree = nn.ModuleDict()
        covered: set[int] = set()
        paths: dict[str, str] = {}  # the checkpoint's name -> the leaf's path in the layer
        for ckpt_name, layer_name in _LAYER_NAMES.items():
            try:
                layer.get_submodule(ckpt_name)  # a version without the renaming
                paths[ckpt_name] = ckpt_name
            except AttributeError:
                paths[ckpt_name] = layer_name
            leaf = layer.get_submodule(paths[ckpt_name])
            merge(tree, ckpt_name, leaf)
            covered |= {id(p) for p in leaf.parameters()}
        uncovered = [n for n, p in layer.named_parameters() if id(p) not in covered]
        if uncovered:
            raise ValueError(
                f"{type(layer).__name__} has parameters with no checkpoint name: {uncovered} "
                "(an unsupported transformers version?)"
            )
        self.__dict__["tree"], self.__dict__["paths"] = tree, paths
        self.add_module(family, nest(f"encoder.layer.{index}", tree))

    def inject_adapters(self, config: LoraConfig, adapter: str) -> None:
        """`peft`'s LoRA layers (`inject_adapter_in_model`) in the layer, where `peft` matches
        `config`'s targets against `transformers`' module names (`q_proj`, `fc1`) as it does on
        the whole model; each adapted leaf is then registered again under the checkpoint's
        name, so its parameters are `<...>.attention.attention.query.base_layer.weight`,
        `<...>.query.lora_A.<adapter>.weight`."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, self.layer, adapter)
        for ckpt_name, path in self.paths.items():
            merge(self.tree, ckpt_name, self.layer.get_submodule(path))

    def train(self, mode: bool = True) -> ImageBlock:
        super().train(mode)
        self.layer.train(mode)  # its dropouts are not registered here
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, None)


class ImageHead(nn.Module):
    """Final norm (`<p>.layernorm`) and `classifier` on the class token: -> [B, num_labels]."""

    def __init__(self, config: PretrainedConfig, family: str):
        super().__init__()
        self.family = family
        norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.add_module(family, nn.ModuleDict({"layernorm": norm}))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(getattr(self, self.family)["layernorm"](hidden)[:, 0, :])


def build_unit(config: PretrainedConfig, arch: Architecture, name: str) -> nn.Module:
    """Unit `name` with `transformers`' own initialisation (build it with parameters on the
    meta device to allocate nothing; `pipetransformer.models.hf.load_units` does)."""
    if name == "embed":
        return ImageEmbed(config, arch.family)
    if name == "head":
        return ImageHead(config, arch.family)
    return ImageBlock(config, arch.family, block_index(name, arch.depth))


def example_input(spec: ModelSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of pixels of the model's shape (for profiling)."""
    return torch.randn(spec.family_info.input_shape(spec, batch), generator=generator)


@functools.cache
def _module_paths(family: str) -> tuple[str, dict[str, str]]:
    """Where `transformers`' model puts a layer (`<p>.layers` in version 5, `<p>.encoder.layer`
    before) and each leaf inside it, by the checkpoint's name: read off a one-layer model on
    the meta device."""
    config = CONFIG_CLASSES[family](
        hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8,
        image_size=4, patch_size=2,
    )  # fmt: skip
    with torch.device("meta"):
        block = ImageBlock(config, family, 0)
        body = _BODIES[family](config, add_pooling_layer=False)
    where = next(n for n, m in body.named_modules() if isinstance(m, _LAYERS[family]))
    return f"{family}.{where.rsplit('.', 1)[0]}", block.paths


def module_key(key: str) -> str:
    """A block's parameter name in the units (the checkpoint's:
    `vit.encoder.layer.3.attention.attention.query.lora_A.default.weight`) as it is in
    `transformers`' module tree (version 5: `vit.layers.3.attention.q_proj.lora_A.default.
    weight`); any other name unchanged."""
    match = _BLOCK_KEY.match(key)
    if match is None:
        return key
    family, index, rest = match.groups()
    layers, paths = _module_paths(family)
    leaf = next((c for c in paths if rest.startswith(c + ".")), None)
    if leaf is not None:
        rest = paths[leaf] + rest[len(leaf) :]
    return f"{layers}.{index}.{rest}"


_BLOCK_KEY = re.compile(r"^(vit|deit)\.encoder\.layer\.(\d+)\.(.+)$")

BUILD = HFBuild(CONFIG_CLASSES, build_unit, example_input, module_key=module_key)
