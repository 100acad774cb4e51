"""The kinds of data a job can read (`data.dataset`), one registry: `KINDS`. A kind is one module
here (its description: `core/datasets/base.py` says what that holds) and one function of the
data plane that opens it (`DataKind.opens`). Adding a kind is its module, one line below, its
data-plane function and its tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetransformer.core.datasets import digits, image_folder, synthetic, table
from pipetransformer.core.datasets.base import BuiltinKind, DataKind, DataSize, FilesKind

if TYPE_CHECKING:
    from pipetransformer.core.spec import DataSpec

KINDS: tuple[DataKind, ...] = (
    digits.DIGITS,
    synthetic.SYNTHETIC,
    synthetic.SYNTHETIC_TEXT,
    image_folder.IMAGE_FOLDER,
    table.TABLE,
)
_BY_NAME = {kind.name: kind for kind in KINDS}
NAMES: tuple[str, ...] = tuple(_BY_NAME)
FILES: tuple[str, ...] = tuple(kind.name for kind in KINDS if kind.files)

__all__ = ["FILES", "KINDS", "NAMES", "BuiltinKind", "DataKind", "DataSize", "FilesKind", "kind_of"]


def kind_of(data: DataSpec | str) -> DataKind:
    """The kind of `data` (or of a `data.dataset` name)."""
    name = data if isinstance(data, str) else data.dataset
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"dataset {name!r} is not available; choose one of {', '.join(NAMES)}"
        ) from None
