"""A Hugging Face checkpoint directory's files, read without `transformers` or torch (the
controller reads them at submission too): its `config.json` (and the `Architecture` its family
reads from it, `pipetransformer.core.families`), its safetensors weight files, and a cheap
fingerprint of both. A file that is missing or malformed is a `ValueError` naming it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipetransformer.core.families import Architecture, parse_architecture


def read_config_json(directory: str | Path) -> dict[str, Any]:
    """A checkpoint directory's config.json, parsed."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no config.json in the checkpoint directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def read_architecture(directory: str | Path) -> Architecture:
    """The `Architecture` of the checkpoint in `directory` (its config.json only)."""
    return parse_architecture(read_config_json(directory))


WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
_MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else the one file."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError) as e:
            raise ValueError(f"{index}: not valid JSON ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no `weight_map` object")
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    if (directory / "pytorch_model.bin").is_file():
        raise ValueError(
            f"{directory}: only pytorch_model.bin (a pickle); load it in transformers and "
            "save_pretrained it again to get model.safetensors"
        )
    raise ValueError(f"{directory}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}")


def fingerprint(directory: str | Path) -> str:
    """A digest of a checkpoint's config.json and each safetensors file's size and header
    (tensor names, dtypes, shapes, offsets): cheap at any model size, and it changes when the
    checkpoint is replaced by another one (weights rewritten in place with the same layout are
    not seen)."""
    directory = Path(directory)
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in weight_files(directory):
        try:
            with path.open("rb") as f:
                raw = f.read(8)
                n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
                if not 0 < n <= _MAX_HEADER:
                    raise ValueError(f"{path}: not a safetensors file")
                digest.update(path.name.encode() + path.stat().st_size.to_bytes(8, "little"))
                digest.update(f.read(n))
        except FileNotFoundError:
            raise ValueError(f"{path}: missing (named by {WEIGHTS_INDEX})") from None
    return digest.hexdigest()[:32]
