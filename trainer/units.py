"""The model's units (`embed`, `blocks.<i>`, `head`) for whichever model a spec names: the seeded
models of `trainer.models`, or a Hugging Face checkpoint (`model.pretrained`, `trainer.hf`).
Everything that builds units goes through here (the rank's model share, AutoPipe's profiling),
so the rest of the data plane does not care where a model came from.

A pretrained model's units are filled from its safetensors files, each rank reading only its
own units' tensors; a new head (another task or `num_classes` than the checkpoint's head, or a
checkpoint without one) is initialised as
`transformers` does, from a stream derived from the job's seed and the unit's name, so every
rank and every restart gives it the same values."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from pipetransformer.core.hf_config import HFArchitecture, fingerprint, read_architecture
from pipetransformer.core.spec import ModelSpec
from pipetransformer.trainer import models

log = logging.getLogger("pipetransformer.worker")


class CheckpointChanged(ValueError):
    """The pretrained checkpoint on disk is not the one the job was submitted with."""


@functools.lru_cache(maxsize=8)
def _architecture(path: str, task: str, num_classes: int, expected: str | None) -> HFArchitecture:
    if expected is not None and (found := fingerprint(path)) != expected:
        raise CheckpointChanged(
            f"the pretrained checkpoint in {path} changed since the job was submitted "
            f"(fingerprint {found}, submitted {expected}); restore it or submit a new job"
        )
    return read_architecture(path).for_task(task, num_classes)  # type: ignore[arg-type]


def architecture(spec: ModelSpec) -> HFArchitecture:
    """The model the job trains from its checkpoint: the checkpoint's body with the spec's task
    and label count (a pretrained spec only)."""
    pre = spec.pretrained
    if pre is None or pre.path is None:
        raise ValueError("model.pretrained is not resolved: submit the job to resolve it")
    return _architecture(pre.path, spec.task, spec.num_classes, pre.fingerprint)


def empty_unit(spec: ModelSpec, name: str) -> nn.Module:
    """A unit with its parameters on the meta device (nothing allocated or initialised)."""
    if spec.pretrained is None:
        with torch.device("meta"):
            return models.empty_unit(spec, name)
    from pipetransformer.trainer.hf.load import parameters_on_meta
    from pipetransformer.trainer.hf.units import build_unit

    arch = architecture(spec)
    with parameters_on_meta():
        return build_unit(_hf_config(spec, arch), arch, name)


def _hf_config(spec: ModelSpec, arch: HFArchitecture):  # noqa: ANN202 (transformers' type)
    from pipetransformer.trainer.hf.units import hf_config

    assert spec.pretrained is not None and spec.pretrained.path is not None
    return hf_config(spec.pretrained.path, arch)


def initial_units(spec: ModelSpec, seed: int, names: Iterable[str]) -> dict[str, nn.Module]:
    """Units `names` with their initial weights, on the CPU: seed-derived (`models.init_unit`),
    or read from the pretrained checkpoint (a new head initialised from the seed)."""
    names = list(names)
    if spec.pretrained is None:
        return {name: models.init_unit(spec, seed, name) for name in names}
    from pipetransformer.trainer.hf.load import load_units

    arch = architecture(spec)
    assert spec.pretrained.path is not None
    # a new head draws from torch's global generator: fork it, seeded per unit
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(models.unit_seed(seed, "head"))
        loaded = load_units(Path(spec.pretrained.path), arch, names)
    if loaded.new:
        log.info(
            "a new %s head (%d outputs): %s initialised%s",
            arch.task,
            arch.num_labels,
            ", ".join(loaded.new),
            f"; the checkpoint's {', '.join(loaded.skipped)} left out" if loaded.skipped else "",
        )
    return loaded.units


def example_input(spec: ModelSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of model inputs of the right shape and dtype (for profiling)."""
    shape = models.model_input_shape(spec, batch)
    if not spec.is_text:
        return torch.randn(shape, generator=generator)
    if spec.pretrained is None:
        return torch.randint(0, spec.vocab_size or 2, shape, generator=generator)
    b, _, t = shape
    ids = torch.randint(0, spec.vocab_size or 2, (b, t), generator=generator)
    return torch.stack([ids, torch.zeros_like(ids), torch.ones_like(ids)], dim=1)
