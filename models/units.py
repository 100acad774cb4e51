"""The model's units (`embed`, `blocks.<i>`, `head`) for whichever model a spec names, through
its family's build (`pipetransformer.core.families`, `Family.build`): the seeded models, or a
Hugging Face checkpoint (`model.pretrained`). Everything that builds units goes through here
(the rank's model share, AutoPipe's profiling, the export), so the rest of the data plane does
not care which family a model is or where it came from.

A family's build module holds a `BUILD` object with three methods:

    empty_unit(spec, name)            a unit with its parameters on the meta device
    initial_units(spec, seed, names)  units with their initial weights, on the CPU
    example_input(spec, batch, gen)   a batch of model inputs (for profiling)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pipetransformer.core.spec import ModelSpec
from pipetransformer.models import CheckpointChanged, build_of

if TYPE_CHECKING:
    from pipetransformer.core.families import Architecture

__all__ = ["CheckpointChanged", "FamilyBuild", "architecture", "empty_unit", "initial_units"]


class FamilyBuild(Protocol):
    def empty_unit(self, spec: ModelSpec, name: str) -> nn.Module: ...

    def initial_units(
        self, spec: ModelSpec, seed: int, names: Iterable[str]
    ) -> dict[str, nn.Module]: ...

    def example_input(
        self, spec: ModelSpec, batch: int, generator: torch.Generator
    ) -> torch.Tensor: ...


def architecture(spec: ModelSpec) -> Architecture:
    """The model a pretrained spec trains (`pipetransformer.models.hf.architecture`; imported
    here when asked, so a seeded job's processes never import `transformers`)."""
    from pipetransformer.models.hf import architecture as of_checkpoint

    return of_checkpoint(spec)


def build(spec: ModelSpec) -> FamilyBuild:
    """The build of the family `spec` names."""
    return build_of(spec.family, pretrained=spec.pretrained is not None)


def module_key(spec: ModelSpec, key: str) -> str:
    """A unit's parameter name (the checkpoint's) as it is in `transformers`' module tree,
    which PEFT's format names adapters by: the same, but where the family's build renames it
    (ViT and DeiT under transformers 5)."""
    rename = getattr(build(spec), "module_key", None)
    return key if rename is None else rename(key)


def _adapted(spec: ModelSpec, name: str, unit: nn.Module, seed: int) -> nn.Module:
    """`unit` with the spec's LoRA adapters (`models.adapters`), if it has any."""
    if spec.adapters is None:
        return unit
    from pipetransformer.models.adapters import with_adapters
    from pipetransformer.models.hf import new_head

    # a new head's output layer (the last of the head's checkpoint prefixes) trains
    arch = architecture(spec)
    trains = arch.family_info.head_prefixes(arch)[-1] if new_head(spec) else None
    return with_adapters(spec, name, unit, seed, trains)


def empty_unit(spec: ModelSpec, name: str) -> nn.Module:
    """A unit with its parameters on the meta device (nothing allocated or initialised); with
    `model.adapters`, its adapters too."""
    return _adapted(spec, name, build(spec).empty_unit(spec, name), 0)


def initial_units(spec: ModelSpec, seed: int, names: Iterable[str]) -> dict[str, nn.Module]:
    """Units `names` with their initial weights, on the CPU: seed-derived, or read from the
    pretrained checkpoint (a new head initialised from the seed); with `model.adapters`, the
    blocks' adapters drawn from the seed, what does not train frozen."""
    units = build(spec).initial_units(spec, seed, list(names))
    return {name: _adapted(spec, name, unit, seed) for name, unit in units.items()}


def example_input(spec: ModelSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of model inputs of the right shape and dtype (for profiling)."""
    return build(spec).example_input(spec, batch, generator)
