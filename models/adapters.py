"""LoRA adapters on a unit (`model.adapters`), built with the `peft` library's own layers
(`inject_adapter_in_model`): each targeted projection W of a block becomes peft's `lora.Linear`
(GPT-2's `Conv1D` too), computing W x + (alpha / r) B A x, with A drawn at random (seeded per
unit, so every rank draws the same) and B zero, so a job starts from the pretrained model
exactly.

What trains: the adapters, and a new head's output layer (one the checkpoint does not have). The
base weights, the embedding and a pretrained head are frozen (`requires_grad=False`): no gradient, no
optimizer state, nothing in a checkpoint (`trained_names`).

Names: peft moves a targeted layer's weight under `base_layer` and adds `lora_A.default`,
`lora_B.default` beside it (`model.layers.3.self_attn.q_proj.base_layer.weight`, `...q_proj.
lora_A.default.weight`). `peft_key` gives PEFT's saved name of an adapter tensor.

A frozen block's adapters are merged into its base weights (`merge`): the block is then the
fixed function base + BA that the frozen prefix computes and AutoCache serves, at the cost of
the base layer alone. The adapters themselves are kept (merging leaves them in place), so what
a checkpoint or a re-layout moves is the same merged or not."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pipetransformer.core.spec import AdaptersSpec, ModelSpec
from pipetransformer.models.seeded import unit_seed

ADAPTER = "default"  # peft's adapter name: one adapter per job
_LORA = (".lora_A.", ".lora_B.")


def lora_config(model: ModelSpec, adapters: AdaptersSpec):  # noqa: ANN201 (peft.LoraConfig)
    """peft's `LoraConfig` for `adapters` on `model`: the targets (default: every projection
    the family names) matched by module name, as `peft` matches them."""
    from peft import LoraConfig

    targets = adapters.targets or list(model.family_info.adapter_targets(model) or ())
    return LoraConfig(
        r=adapters.rank,
        lora_alpha=float(adapters.alpha),
        lora_dropout=float(adapters.dropout),
        target_modules=targets,
        bias="none",
        # GPT-2's Conv1D holds its weight transposed (in x out); peft reads it so when told
        fan_in_fan_out=model.family_info.name == "gpt2",
    )


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`lora_A`, `lora_B`)."""
    return any(part in name for part in _LORA)


def in_state(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter of a model with adapters is part of its training state (what
    checkpoints hold, re-layouts move and `bf16-weights` keeps float32 masters of): an adapter
    (a frozen block's too: a merged block is rebuilt from them) or what trains (a new head).
    The base weights are not: the pretrained checkpoint's, read wherever needed, never
    written."""
    return is_adapter(name) or param.requires_grad


def peft_key(name: str) -> str:
    """An adapter tensor's name as PEFT saves it (`adapter_model.safetensors`): under
    `base_model.model.`, without the adapter's name. `name` is the tensor's name in
    `transformers`' module tree (`pipetransformer.models.hf.HFBuild.module_key`)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def with_adapters(
    model: ModelSpec, name: str, unit: nn.Module, seed: int, new_head: str | None
) -> nn.Module:
    """`unit` as a job with `model.adapters` trains it: a block with its adapters injected (A
    drawn from the job's `seed` and the unit's name), its base frozen; the embedding frozen; the
    head frozen but for a new output layer, the parameters under the prefix `new_head` (None:
    the checkpoint's head is the job's). Unchanged without adapters."""
    if model.adapters is None:
        return unit
    if name.startswith("blocks."):
        from peft import inject_adapter_in_model

        config = lora_config(model, model.adapters)
        with _seeded(unit_seed(seed, f"{name}/lora")):
            # marks the base frozen and the adapters trainable; a unit whose modules are not
            # named as in transformers (ViT's, under its checkpoint's names) injects itself
            inject = getattr(unit, "inject_adapters", None)
            if inject is not None:
                inject(config, ADAPTER)
            else:
                inject_adapter_in_model(config, unit, ADAPTER)
        return unit
    unit.requires_grad_(False)
    if name == "head" and new_head is not None:
        for key, param in unit.named_parameters():
            param.requires_grad_(key.startswith(new_head))
    return unit


def new_head_modules(unit: nn.Module) -> list[str]:
    """The modules of a head unit that train whole beside the adapters (a new output layer):
    what PEFT's `modules_to_save` names."""
    return sorted({key.rsplit(".", 1)[0] for key, p in unit.named_parameters() if p.requires_grad})


def trained_names(unit: nn.Module) -> list[str]:
    """The parameters of `unit` that a job with adapters trains and checkpoints (`in_state`):
    its adapters, or, in a unit without any, those that train (a new head's output layer)."""
    return [n for n, p in unit.named_parameters() if in_state(n, p)]


def lora_layers(unit: nn.Module) -> list[nn.Module]:
    """The unit's peft LoRA layers."""
    from peft.tuners.lora import LoraLayer

    return [m for m in unit.modules() if isinstance(m, LoraLayer)]


@torch.no_grad()
def merge(unit: nn.Module) -> None:
    """Fold each adapter into its base weight (W + (alpha / r) B A), for a frozen block; the
    adapters stay (frozen) beside it. Merging twice is refused by peft: call once per build."""
    for layer in lora_layers(unit):
        if not layer.merged:
            layer.merge(adapter_names=[ADAPTER])
    for p in unit.parameters():
        p.requires_grad_(False)


def is_merged(unit: nn.Module) -> bool:
    layers = lora_layers(unit)
    return bool(layers) and all(layer.merged for layer in layers)
