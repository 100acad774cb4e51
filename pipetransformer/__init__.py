"""pipetransformer: elastic pipeline-parallel training for transformers (AutoFreeze, AutoPipe,
AutoDP, AutoCache) as a fault-tolerant job system.

One import namespace over the repository's folders (pyproject.toml maps each to a subpackage):
`pipetransformer.core` (the pure rules and messages), `pipetransformer.store` (the SQL store),
`pipetransformer.orchestrator` (the control plane and the CLI), `pipetransformer.trainer` (the
data plane), `pipetransformer.dashboard` and `pipetransformer.migrations`."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pipetransformer")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
