"""Where a job's roles run, one registry: `PLATFORMS`. A platform is one module here (the
interface it implements: `base.Platform`): it resolves one launch's options from the
component's arguments and decorates the two roles orchestrator/appdef.py builds alike for every
platform. Adding a platform is its module, one line below, and its tests.

`train` (orchestrator/components.py) runs on `kubernetes` when given `--image` (container mode),
else `local` (torchx's `local_cwd`): `TrainInputs.platform`."""

from __future__ import annotations

from pipetransformer.orchestrator.platforms.base import Platform
from pipetransformer.orchestrator.platforms.kubernetes import Kubernetes
from pipetransformer.orchestrator.platforms.local import Local

PLATFORMS: dict[str, type[Platform]] = {"local": Local, "kubernetes": Kubernetes}

__all__ = ["PLATFORMS", "Kubernetes", "Local", "Platform"]
