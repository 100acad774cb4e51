"""What every Hugging Face family's torch build shares (`pipetransformer.models.vit`, `.bert`):
`HFBuild`, the build interface over a family's `build_unit`; the `transformers` config of a
checkpoint; and `load_units`, which materialises some units of a checkpoint, reading only their
tensors: the units are built with their parameters on the meta device (buffers, e.g. BERT's
position ids, are computed as usual), then each parameter is filled from the checkpoint's safetensors file(s)
(`model.safetensors`, or the shards `model.safetensors.index.json` names) through
`safetensors.safe_open`, which reads one tensor at a time: a pipeline rank never reads the
rest of the model.

A checkpoint's own names are read as `transformers` reads them: a base model's (`ViTModel`,
`BertModel`: keys without the `<family>.` prefix) and legacy LayerNorm `gamma`/`beta` names map
onto the units' names.

A tied pair (a language model's output projection tied to its input embedding,
`Family.tied_parameters`): each unit holds its own copy, both read from the checkpoint's one
tensor (save_pretrained writes a tied pair once, under the embedding's name).

Checkpoint keys that `transformers` ignores when it loads them (old GPT-2 checkpoints' causal-mask
buffers `attn.bias`) are ignored here too (`HFBuild.ignored_keys`).

A new head (another task or label count than the checkpoint's head, or a checkpoint without one:
a base model, or a pretraining head such as `BertForMaskedLM`'s): the head unit reads what the
checkpoint has of it in the right shape (a ViT's final norm, BERT's pooler), the checkpoint's
head tensors that no longer fit are skipped, and the rest is initialised as `transformers` does
(Linear: normal(0, initializer_range) weight, zero bias); both lists are returned, so the caller
can say so."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from pipetransformer.core.families import Architecture, parse_architecture
from pipetransformer.core.spec import ModelSpec
from pipetransformer.edge.hf_files import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    fingerprint,
    read_architecture,
    read_config_json,
)
from pipetransformer.models import CheckpointChanged, build_of
from pipetransformer.models.seeded import unit_seed

log = logging.getLogger("pipetransformer.worker")

SINGLE_FILE, INDEX_FILE = WEIGHTS_FILE, WEIGHTS_INDEX  # what save_pretrained writes


@functools.lru_cache(maxsize=8)
def _architecture(path: str, task: str, num_classes: int, expected: str | None) -> Architecture:
    if expected is not None and (found := fingerprint(path)) != expected:
        raise CheckpointChanged(
            f"the pretrained checkpoint in {path} changed since the job was submitted "
            f"(fingerprint {found}, submitted {expected}); restore it or submit a new job"
        )
    return read_architecture(path).for_task(task, num_classes)


def architecture(spec: ModelSpec) -> Architecture:
    """The model the job trains from its checkpoint: the checkpoint's body with the spec's task
    and label count (a pretrained spec only)."""
    pre = spec.pretrained
    if pre is None or pre.path is None:
        raise ValueError("model.pretrained is not resolved: submit the job to resolve it")
    return _architecture(pre.path, spec.task, spec.num_classes, pre.fingerprint)


def new_head(spec: ModelSpec) -> bool:
    """Whether the job's head is one the checkpoint does not have (another task or label
    count, or a body without one): its weights are initialised, not read."""
    assert spec.pretrained is not None and spec.pretrained.path is not None
    return not architecture(spec).same_head(read_architecture(spec.pretrained.path))


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


def unit_keys(index: dict[str, Path], prefix: str) -> dict[str, str]:
    """The units' name of each checkpoint key -> the key as the checkpoint spells it: a base
    model's keys get the `<prefix>.` the task models have (the family's `key_prefix`), legacy
    LayerNorm names the current ones (what `transformers` does when it loads the checkpoint)."""
    prefixed = any(k.startswith(f"{prefix}.") for k in index)
    out: dict[str, str] = {}
    for key in index:
        name = key
        for old, new in _LEGACY_SUFFIXES.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        if not prefixed:
            name = f"{prefix}.{name}"
        out[name] = key
    return out


def _check_same_model(arch: Architecture, checkpoint: Architecture) -> None:
    head = {"num_labels", "task", "architecture"}  # a job may give the body a new head
    fields = [f.name for f in dataclasses.fields(Architecture) if f.name not in head]
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
    arch: Architecture,
    names: Iterable[str],
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedUnits:
    """Units `names` of the checkpoint in `directory` (of the family `arch` names, built by its
    build module), on `device`, in float32, with the checkpoint's values (a new head, see the
    module docstring, freshly initialised). Raises `ValueError` naming missing or unexpected
    keys, or tensors of the wrong shape."""
    return build_of(arch.family, pretrained=True).load_units(
        directory, arch, names, device, attn_implementation
    )


def nest(path: str, leaf: nn.Module) -> nn.ModuleDict:
    """`leaf` inside ModuleDicts, one per dotted component of `path`."""
    *outer, last = path.split(".")
    module = nn.ModuleDict({last: leaf})
    for part in reversed(outer):
        module = nn.ModuleDict({part: module})
    return module


def merge(tree: nn.ModuleDict, path: str, leaf: nn.Module) -> None:
    """Put `leaf` at dotted `path` inside `tree`, creating ModuleDicts on the way."""
    *outer, last = path.split(".")
    node = tree
    for part in outer:
        if part not in node:
            node[part] = nn.ModuleDict()
        node = node[part]
    node[last] = leaf


UnitBuilder = Callable[[PretrainedConfig, Architecture, str], nn.Module]
ExampleInput = Callable[[ModelSpec, int, torch.Generator], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class HFBuild:
    """A Hugging Face family's build: its `transformers` config classes (by family name), how
    it builds a unit from a config, and a batch of example inputs. The methods are the build
    interface `pipetransformer.models.units` calls; the architecture a spec trains is
    `architecture(spec)` (the checkpoint's body with the job's task)."""

    config_classes: Mapping[str, type[PretrainedConfig]]
    build_unit: UnitBuilder
    example: ExampleInput
    # checkpoint keys no unit holds that are not an error (`transformers`' own
    # `_keys_to_ignore_on_load_unexpected`, as regular expressions searched in the key)
    ignored_keys: tuple[str, ...] = ()
    # a unit's parameter name (the checkpoint's) -> its name in `transformers`' module tree,
    # which PEFT's format uses; they differ where transformers renamed modules (ViT, DeiT)
    module_key: Callable[[str], str] = str  # str(key) is the key: the same names

    def config(
        self, directory: str | Path, arch: Architecture, attn_implementation: str = "sdpa"
    ) -> PretrainedConfig:
        """The `transformers` config of the checkpoint in `directory` (its config.json), with
        `arch.num_labels` (a new head's outputs) and the attention implementation set."""
        config = self.config_classes[arch.family].from_dict(read_config_json(directory))
        # a new head's outputs (question answering: 2); a language model's are its vocabulary,
        # which the config holds as vocab_size (num_labels would make an id2label of it)
        if arch.task != "causal-lm" and config.num_labels != arch.num_labels:
            config.num_labels = arch.num_labels
        config._attn_implementation = attn_implementation
        return config

    def load_units(
        self,
        directory: str | Path,
        arch: Architecture,
        names: Iterable[str],
        device: torch.device | str = "cpu",
        attn_implementation: str = "sdpa",
    ) -> LoadedUnits:
        """See `load_units`."""
        directory = Path(directory)
        checkpoint_arch = parse_architecture(read_config_json(directory))
        _check_same_model(arch, checkpoint_arch)
        new_head = not arch.same_head(checkpoint_arch)
        family = arch.family_info
        config = self.config(directory, arch, attn_implementation)
        names = list(names)
        with parameters_on_meta():
            units = {name: self.build_unit(config, arch, name) for name in names}
        index = checkpoint_index(directory)
        keys = unit_keys(index, family.key_prefix)
        if (tied := family.tied_parameters(arch)) is not None:
            (_, source), (_, copy) = tied
            if source in keys:  # the copy is the source's tensor, stored or not
                keys[copy] = keys[source]
        ignored = [re.compile(pattern) for pattern in self.ignored_keys]
        skipped: list[str] = []
        new: list[str] = []
        for name, unit in units.items():
            prefixes = family.unit_prefixes(arch, name)
            expected = unit.state_dict(keep_vars=True)
            present = {k for k in keys if k.startswith(prefixes)}
            missing, unexpected = set(expected) - present, present - set(expected)
            unexpected = {k for k in unexpected if not any(p.search(k) for p in ignored)}
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

    def empty_unit(self, spec: ModelSpec, name: str) -> nn.Module:
        arch = architecture(spec)
        assert spec.pretrained is not None and spec.pretrained.path is not None
        with parameters_on_meta():
            return self.build_unit(self.config(spec.pretrained.path, arch), arch, name)

    def initial_units(
        self, spec: ModelSpec, seed: int, names: Iterable[str]
    ) -> dict[str, nn.Module]:
        arch = architecture(spec)
        assert spec.pretrained is not None and spec.pretrained.path is not None
        # a new head draws from torch's global generator: fork it, seeded per unit
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(seed, "head"))
            loaded = self.load_units(Path(spec.pretrained.path), arch, names)
        if loaded.new:
            log.info(
                "a new %s head (%d outputs): %s initialised%s",
                arch.task,
                arch.num_labels,
                ", ".join(loaded.new),
                f"; the checkpoint's {', '.join(loaded.skipped)} left out"
                if loaded.skipped
                else "",
            )
        return loaded.units

    def example_input(
        self, spec: ModelSpec, batch: int, generator: torch.Generator
    ) -> torch.Tensor:
        return self.example(spec, batch, generator)
