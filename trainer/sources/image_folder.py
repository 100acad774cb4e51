"""An image folder (one subfolder per class, JPEG and PNG files) opened as a Hugging Face
`datasets.Dataset`: the index (absolute path and label of every image) is written once as arrow
under a cache directory and memory-mapped from there; images are decoded only when a row is read.
Labels are the sorted class folder names (`dataset.features["label"].names`).

`preprocess` turns a decoded image into the float tensor [3, H, W] a vision model takes, as the
model's own image processor configuration (`preprocessor_config.json`) says: resize to `size`
with `resample`, rescale by `rescale_factor`, normalise by `image_mean` / `image_std`. The
arithmetic is done here (numpy + Pillow, the way `transformers`' PIL image processors do it); the
`transformers` backend calls the processor class loaded from the model directory instead.

`Augmentation` is the training-time random resized crop and horizontal flip, seeded per
(seed, epoch, sample id) so a run can be repeated exactly; a source with it on is not
`deterministic` (the same id reads differently in different epochs)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np
import torch
from datasets.arrow_writer import ArrowWriter
from PIL import Image as PILImage

from pipetransformer.trainer.sources import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
PROCESSOR_CONFIG = "preprocessor_config.json"
Backend = Literal["native", "transformers", "auto"]


def cache_root() -> Path:
    """Where indexes are written: `$PIPETRANSFORMER_CACHE` (default ~/.cache/pipetransformer)."""
    root = os.environ.get("PIPETRANSFORMER_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pipetransformer"


def _scan(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Sorted class names and (absolute path, class index) of every image under them."""
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a directory")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"image folder {root} has no class subfolders (one folder per class)")
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        found = sorted(
            p
            for p in (root / name).rglob("*")
            if p.is_file()
            and p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not found:
            raise DataError(f"class folder {root / name} holds no JPEG or PNG image")
        files.extend((str(p.resolve()), label) for p in found)
    return classes, files


def _fingerprint(root: Path, files: list[tuple[str, int]], classes: list[str]) -> str:
    h = hashlib.sha256(str(root.resolve()).encode())
    h.update(json.dumps(classes).encode())
    for path, label in files:
        st = os.stat(path)
        h.update(f"{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def decode_image(value: Any) -> PILImage.Image:
    """An RGB image from what an image column holds: a path, `{"bytes", "path"}` (the arrow form
    of `datasets.Image`), raw bytes or a PIL image. Failure -> DataError naming the file."""
    path = None
    try:
        if isinstance(value, PILImage.Image):
            image = value
        elif isinstance(value, str | os.PathLike):
            path = str(value)
            image = PILImage.open(path)
        elif isinstance(value, bytes | bytearray):
            image = PILImage.open(io.BytesIO(value))
        elif isinstance(value, Mapping):
            path = value.get("path")
            data = value.get("bytes")
            image = PILImage.open(io.BytesIO(data) if data is not None else path)
        else:
            raise TypeError(f"unsupported image value of type {type(value).__name__}")
        image.load()
        return image.convert("RGB")
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"cannot read image {path or '<bytes>'}: {exc}") from exc


def open_image_folder(
    root: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    verify: bool = False,
) -> datasets.Dataset:
    """The images under `root/<class>/...` as a memory-mapped `datasets.Dataset` with columns
    `image` (`datasets.Image`, decoded lazily on access) and `label` (`ClassLabel`, the sorted
    folder names). The index is cached under `cache_dir` (default `cache_root()/image_folder`)
    keyed by the folder's listing, sizes and modification times. `verify` opens every file's
    header up front (Pillow's `verify`, no full decode) so a corrupt file fails before training;
    otherwise a bad file fails when its row is read. Both raise DataError naming the file."""
    root = Path(root)
    classes, files = _scan(root)
    if verify:
        for path, _ in files:
            try:
                with PILImage.open(path) as im:
                    im.verify()
            except Exception as exc:
                raise DataError(f"cannot read image {path}: {exc}") from exc
    base = Path(cache_dir) if cache_dir is not None else cache_root() / "image_folder"
    target = base / f"{_fingerprint(root, files, classes)}.arrow"
    if not target.exists():
        base.mkdir(parents=True, exist_ok=True)
        features = datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
        )
        # ArrowWriter keeps the image column as paths (save_to_disk would copy every image in)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".arrow", dir=base)
        os.close(fd)
        try:
            with ArrowWriter(features=features, path=tmp) as writer:
                writer.write_batch(
                    {"image": [p for p, _ in files], "label": [lab for _, lab in files]}
                )
                writer.finalize()
            os.replace(tmp, target)  # atomic: a concurrent writer wrote the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return datasets.Dataset.from_file(str(target))  # memory-mapped


@dataclass(frozen=True)
class ImageProcessing:
    """The resize / rescale / normalise a model's image processor applies, as plain numbers."""

    height: int = 224
    width: int = 224
    do_resize: bool = True
    resample: int = 2  # PIL.Image.Resampling.BILINEAR, transformers' default for ViT
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "") -> ImageProcessing:
        """From the keys of a `preprocessor_config.json`; missing keys take ViT's defaults."""
        size = config.get("size", 224)
        where = f" in {source}" if source else ""
        if isinstance(size, int):
            height = width = size
        elif isinstance(size, Mapping) and "height" in size and "width" in size:
            height, width = int(size["height"]), int(size["width"])
        else:
            raise DataError(
                f"image processor size {size!r}{where} is not {{height, width}} or an int; "
                "use backend='transformers' for this processor"
            )
        if config.get("do_center_crop"):
            raise DataError(
                f"image processor{where} center-crops; use backend='transformers' for it"
            )
        d = cls()

        def triple(key: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
            v = config.get(key)
            if v is None:
                return default
            v = [float(v)] * 3 if isinstance(v, int | float) else [float(x) for x in v]
            if len(v) != 3:
                raise DataError(f"image processor {key} {v}{where} needs 3 channels")
            return (v[0], v[1], v[2])

        def flag(key: str, default: bool) -> bool:
            v = config.get(key)
            return default if v is None else bool(v)

        return cls(
            height=height,
            width=width,
            do_resize=flag("do_resize", d.do_resize),
            resample=int(d.resample if config.get("resample") is None else config["resample"]),
            do_rescale=flag("do_rescale", d.do_rescale),
            rescale_factor=float(config.get("rescale_factor", d.rescale_factor)),
            do_normalize=flag("do_normalize", d.do_normalize),
            image_mean=triple("image_mean", d.image_mean),
            image_std=triple("image_std", d.image_std),
        )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ImageProcessing:
        path = Path(directory)
        path = path / PROCESSOR_CONFIG if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read image processor configuration {path}: {exc}") from exc
        return cls.from_config(config, str(path))

    def __call__(self, image: PILImage.Image) -> torch.Tensor:
        """float32 [3, H, W], as transformers' PIL image processors compute it."""
        image = image.convert("RGB")
        if self.do_resize:
            image = image.resize(
                (self.width, self.height), resample=self.resample, reducing_gap=None
            )
        x = np.asarray(image, dtype=np.float32)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)
            std = np.asarray(self.image_std, dtype=np.float32)
            x = (x - mean) / std
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def _get(size: Any, key: str) -> Any:
    if size is None:
        return None
    return size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)


def load_transformers_processor(directory: str | os.PathLike[str]) -> Any:
    """The model's own image processor class (a PIL one, which needs no torchvision)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(directory), backend="pil")
    except Exception as exc:
        raise DataError(f"cannot load the image processor in {directory}: {exc}") from exc


class ImagePreprocessor:
    """`preprocess` bound to one configuration and backend (picklable, for DataLoader workers).

    `native` does the arithmetic of `ImageProcessing`; `transformers` runs the processor class
    loaded from `directory`; `auto` takes `transformers` when the directory has a processor
    transformers can load and `native` otherwise."""

    def __init__(
        self,
        processor_config: ImageProcessing | Mapping[str, Any] | str | os.PathLike[str],
        backend: Backend = "native",
    ) -> None:
        self.processor: Any = None
        directory = None
        if isinstance(processor_config, ImageProcessing):
            self.native = processor_config
        elif isinstance(processor_config, Mapping):
            self.native = ImageProcessing.from_config(processor_config)
        else:
            directory = Path(processor_config)
            self.native = None  # type: ignore[assignment]
        if backend not in ("native", "transformers", "auto"):
            raise ValueError(f"unknown image backend {backend!r}")
        if backend != "native" and directory is not None:
            try:
                self.processor = load_transformers_processor(directory)
            except DataError:
                if backend == "transformers":
                    raise
        elif backend == "transformers":
            raise ValueError("the transformers backend needs the model directory")
        if self.processor is None and directory is not None:
            self.native = ImageProcessing.from_pretrained(directory)

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the output."""
        if self.processor is not None:
            for size in (getattr(self.processor, "crop_size", None), self.processor.size):
                height, width = _get(size, "height"), _get(size, "width")
                if height and width and (size is self.processor.size or self.do_center_crop):
                    return int(height), int(width)
            raise DataError(f"image processor size {self.processor.size} is not height x width")
        return self.native.height, self.native.width

    @property
    def do_center_crop(self) -> bool:
        return bool(getattr(self.processor, "do_center_crop", False))

    @property
    def do_resize(self) -> bool:
        if self.processor is not None:
            return bool(self.processor.do_resize)
        return self.native.do_resize

    def __call__(self, image: PILImage.Image) -> torch.Tensor:
        if self.processor is not None:
            out = self.processor(images=image.convert("RGB"), return_tensors="pt")
            return out["pixel_values"][0].to(torch.float32)
        return self.native(image)

    def batch(self, images: Sequence[PILImage.Image]) -> torch.Tensor:
        """float32 [N, 3, H, W], each image as `self(image)` makes it: the `transformers` backend
        calls the processor once for all of them (its per-call overhead is most of its time on
        small images), falling back to one call each if it returns another shape."""
        if not images:
            return torch.empty(0, 3, *self.size)
        if self.processor is not None:
            out = self.processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
            pixels = out["pixel_values"]
            if tuple(pixels.shape) == (len(images), 3, *self.size):
                return pixels.to(torch.float32)
        return torch.stack([self(im) for im in images])


def preprocess(
    images: PILImage.Image | Sequence[PILImage.Image],
    processor_config: ImageProcessing | Mapping[str, Any] | str | os.PathLike[str],
    backend: Backend = "native",
) -> torch.Tensor:
    """One image -> float32 [3, H, W]; a sequence -> [N, 3, H, W]. `processor_config` is a model
    directory (or its `preprocessor_config.json`), the configuration's keys, or an
    `ImageProcessing`; see `ImagePreprocessor` for `backend`."""
    pre = ImagePreprocessor(processor_config, backend)
    if isinstance(images, PILImage.Image):
        return pre(images)
    return torch.stack([pre(im) for im in images])


@dataclass(frozen=True)
class Augmentation:
    """Random resized crop (torchvision's algorithm: area fraction in `scale`, aspect ratio in
    `ratio`, log-uniform) and a horizontal flip with probability `flip`, drawn from
    `np.random.default_rng([seed, epoch, sample_id])`: the same triple gives the same image."""

    seed: int = 0
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5

    def __call__(self, image: PILImage.Image, epoch: int, sample_id: int) -> PILImage.Image:
        rng = np.random.default_rng([self.seed, epoch, sample_id])
        width, height = image.size
        area = width * height
        box = None
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(rng.integers(0, height - h + 1))
                left = int(rng.integers(0, width - w + 1))
                box = (left, top, left + w, top + h)
                break
        if box is None:  # torchvision's fallback: the central crop of the clamped ratio
            in_ratio = width / height
            if in_ratio < self.ratio[0]:
                w, h = width, round(width / self.ratio[0])
            elif in_ratio > self.ratio[1]:
                w, h = round(height * self.ratio[1]), height
            else:
                w, h = width, height
            top, left = (height - h) // 2, (width - w) // 2
            box = (left, top, left + w, top + h)
        image = image.crop(box)
        if rng.random() < self.flip:
            image = image.transpose(PILImage.Transpose.FLIP_LEFT_RIGHT)
        return image
