"""The model families' torch builds, one module each (`seeded`, `vit`, `bert`), found through the
one registry of families (`pipetransformer.core.families`: each `Family.build` names its module,
whose `BUILD` implements `FamilyBuild`), and what every family shares: a pipeline stage as a
module (`stage`), a Hugging Face checkpoint's units loaded from safetensors (`hf`), and the units
of whichever model a spec names (`units`, the one place the data plane builds them).

These modules read checkpoint files and nothing else: no etcd, SQL, processes or network (the
`model-builds` contract in pyproject.toml)."""

from __future__ import annotations

import importlib
from typing import Any

from pipetransformer.core.families import lookup


class CheckpointChanged(ValueError):
    """The pretrained checkpoint on disk is not the one the job was submitted with."""


def build_of(family: str, pretrained: bool) -> Any:
    """The `BUILD` object of family `family`'s torch build module (seeded, or from a
    checkpoint)."""
    found = lookup(family, pretrained)
    if found is None:
        raise ValueError(f"no {'checkpoint' if pretrained else 'seeded'} family {family!r}")
    return importlib.import_module(found.build).BUILD
