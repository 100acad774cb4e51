"""Materialise some units of a Hugging Face checkpoint, reading only their tensors: the units
are built with their parameters on the meta device (buffers, e.g. BERT's position ids, are
computed as usual), then each parameter is filled from the checkpoint's safetensors file(s)
(`model.safetensors`, or the shards `model.safetensors.index.json` names) through
`safetensors.safe_open`, which reads one tensor at a time: a pipeline rank never reads the
rest of the model.

A checkpoint's own names are read as `transformers` reads them: a base model's (`ViTModel`,
`BertModel`: keys without the `<family>.` prefix) and legacy LayerNorm `gamma`/`beta` names map
onto the units' names.

A new head (another task or label count than the checkpoint's head, or a checkpoint without one:
a base model, or a pretraining head such as `BertForMaskedLM`'s): the head unit reads what the
checkpoint has of it in the right shape (a ViT's final norm, BERT's pooler), the checkpoint's
head tensors that no longer fit are skipped, and the rest is initialised as `transformers` does
(Linear: normal(0, initializer_range) weight, zero bias); both lists are returned, so the caller
can say so."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from pipetransformer.core.hf_config import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    HFArchitecture,
    parse_architecture,
    read_config_json,
)
from pipetransformer.trainer.hf.units import build_unit, hf_config, unit_prefixes

SINGLE_FILE, INDEX_FILE = WEIGHTS_FILE, WEIGHTS_INDEX  # what save_pretrained writes


@dataclasses.dataclass
class LoadedUnits:
    """The units by name (in the order asked); for a new head, the checkpoint keys skipped and
    the parameters initialised; the `transformers` config they were built from."""

    units: dict[str, nn.Module]
    skipped: list[str]
    config: PretrainedConfig
    new: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init cost)
    while buffers stay real. Patches `nn.Module.register_parameter` for the duration: not
    thread-safe."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def checkpoint_index(directory: str | Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint -> the safetensors file holding it (headers only)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no `weight_map` object")
        return {key: directory / file for key, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.exists():
        raise ValueError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return {key: single for key in f.keys()}


_LEGACY_SUFFIXES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def unit_keys(index: dict[str, Path], family: str) -> dict[str, str]:
    """The units' name of each checkpoint key -> the key as the checkpoint spells it: a base
    model's keys get the `<family>.` prefix the task models have, legacy LayerNorm names the
    current ones (what `transformers` does when it loads the checkpoint)."""
    prefixed = any(k.startswith(f"{family}.") for k in index)
    out: dict[str, str] = {}
    for key in index:
        name = key
        for old, new in _LEGACY_SUFFIXES.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        if not prefixed:
            name = f"{family}.{name}"
        out[name] = key
    return out


def _check_same_model(arch: HFArchitecture, checkpoint: HFArchitecture) -> None:
    head = {"num_labels", "task", "architecture"}  # a job may give the body a new head
    fields = [f.name for f in dataclasses.fields(HFArchitecture) if f.name not in head]
    diff = [f for f in fields if getattr(arch, f) != getattr(checkpoint, f)]
    if diff:
        raise ValueError(
            "the architecture differs from the checkpoint's in "
            + ", ".join(f"{f} ({getattr(arch, f)!r} != {getattr(checkpoint, f)!r})" for f in diff)
        )


def _init_new(module: nn.Module, name: str, shape: torch.Size, std: float) -> torch.Tensor:
    """A new parameter's initial value, as `transformers`' `_init_weights` gives it."""
    if isinstance(module, nn.Linear) and name == "weight":
        return torch.empty(shape).normal_(0.0, std)
    if isinstance(module, (nn.Linear, nn.LayerNorm)) and name == "bias":
        return torch.zeros(shape)
    if isinstance(module, nn.LayerNorm) and name == "weight":
        return torch.ones(shape)
    raise ValueError(f"no initialisation for a new {type(module).__name__}.{name}")


def _fmt(keys: Iterable[str]) -> str:
    return ", ".join(sorted(keys))


def load_units(
    directory: str | Path,
    arch: HFArchitecture,
    names: Iterable[str],
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedUnits:
    """Units `names` of the checkpoint in `directory`, on `device`, in float32, with the
    checkpoint's values (a new head, see the module docstring, freshly initialised). Raises
    `ValueError` naming missing or unexpected keys, or tensors of the wrong shape."""
    directory = Path(directory)
    checkpoint_arch = parse_architecture(read_config_json(directory))
    _check_same_model(arch, checkpoint_arch)
    new_head = not arch.same_head(checkpoint_arch)
    config = hf_config(directory, arch, attn_implementation)
    names = list(names)
    with parameters_on_meta():
        units = {name: build_unit(config, arch, name) for name in names}
    index = checkpoint_index(directory)
    keys = unit_keys(index, arch.family)
    skipped: list[str] = []
    new: list[str] = []
    for name, unit in units.items():
        prefixes = unit_prefixes(arch, name)
        expected = unit.state_dict(keep_vars=True)
        present = {k for k in keys if k.startswith(prefixes)}
        missing, unexpected = set(expected) - present, present - set(expected)
        fresh = name == "head" and new_head  # what the checkpoint lacks is initialised
        if (missing or unexpected) and not fresh:
            raise ValueError(
                f"{directory}: unit {name!r} does not match the checkpoint: "
                f"missing keys [{_fmt(missing)}]; unexpected keys [{_fmt(unexpected)}]"
            )
        skipped += sorted(keys[k] for k in unexpected)  # a new head's leftovers
        by_file: dict[Path, list[str]] = {}
        for key in sorted(set(expected) & present):
            by_file.setdefault(index[keys[key]], []).append(key)
        values: dict[str, torch.Tensor] = {}
        for file, names_in_file in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for key in names_in_file:
                    stored = keys[key]
                    shape = torch.Size(f.get_slice(stored).get_shape())
                    want = expected[key].shape
                    if shape != want:
                        if fresh:
                            skipped.append(stored)
                            continue
                        raise ValueError(
                            f"{file}: {stored} has shape {list(shape)}, the unit wants {list(want)}"
                        )
                    values[key] = f.get_tensor(stored).to(expected[key].dtype)
        for key in sorted(set(expected) - set(values)):  # a new head's parameters
            module_name, _, param_name = key.rpartition(".")
            module = unit.get_submodule(module_name)
            values[key] = _init_new(
                module, param_name, expected[key].shape, config.initializer_range
            )
            new.append(key)
        unit.load_state_dict(values, strict=True, assign=True)
        unit.to(device)
    return LoadedUnits(units=units, skipped=skipped, config=config, new=new)
