"""The frozen part of the model, run forward-only for AutoCache (`FrozenPrefix`), and what the
cache needs of it (`PrefixRunner`).

`FrozenPrefix` runs the frozen part forward-only (eval mode, no autograd, under the model's
`autocast(device, precision)`) and fingerprints its weights and precision. Its output is float32
under either precision (bf16 autocast computes the matrix products in bfloat16; the residual
stream and the cached rows stay float32). The worker must run its frozen blocks through it on
the cached *and* the uncached path, so that both give the same numbers (eval mode: no dropout;
the same precision). Its device is read from the modules' parameters at each call, so a prefix
built on meta-device modules follows them to where `to_empty` materialises them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from pipetransformer.models.stage import PRECISIONS, Precision, autocast, to_weights_dtype


class PrefixRunner(Protocol):
    """What the cache needs from the model: compute the prefix output from the inputs, and run
    blocks [start, end) on hidden states (for incremental advance)."""

    def compute(self, inputs: torch.Tensor, boundary: int) -> torch.Tensor: ...

    def run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor: ...


class FrozenPrefix:
    """Forward-only runner over a model's embedding and its blocks (`blocks.<i>`).

    Runs in eval mode (no dropout; each module's train/eval flag is restored afterwards) under
    `torch.no_grad()` and `autocast(device, precision)` (models.stage: bfloat16 matrix products
    for `bf16`, as `StageModule` runs them), so outputs carry no autograd history, are
    deterministic and are float32 under either precision. Only blocks below the boundary asked
    for are touched. Inputs are moved to `device`: where the embedding's parameters are now (read
    at each call, not at construction: modules built on the meta device and materialised later
    with `to_empty(device=...)` report their real device)."""

    def __init__(
        self,
        embed: nn.Module,
        blocks: Mapping[int, nn.Module] | Mapping[str, nn.Module],
        *,
        precision: Precision = "fp32",
    ):
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})"
            )
        self.embed = embed
        self.blocks = {int(k): m for k, m in blocks.items()}
        self.precision: Precision = precision
        self._digests: dict[tuple, str] = {}

    @classmethod
    def of(cls, model: nn.Module, *, precision: Precision | None = None) -> FrozenPrefix:
        """From a module with `.embed` and `.blocks` (e.g. `build_model(...)` or the first
        `StageModule` holding the frozen blocks). `precision` defaults to the module's own
        (`StageModule.precision`), else fp32."""
        if getattr(model, "embed", None) is None:
            raise ValueError("the frozen prefix needs the embedding (the model's first stage)")
        if precision is None:
            precision = getattr(model, "precision", "fp32")
        return cls(model.embed, model.blocks, precision=precision)

    @property
    def device(self) -> torch.device:
        """The device of the embedding's first parameter (of the lowest block's when the
        embedding has none; the CPU when neither has any)."""
        for module in (self.embed, *(self.blocks[i] for i in sorted(self.blocks))):
            first = next(iter(module.parameters()), None)
            if first is not None:
                return first.device
        return torch.device("cpu")

    def _check(self, start: int, end: int) -> None:
        missing = [i for i in range(start, end) if i not in self.blocks]
        if missing:
            raise ValueError(f"frozen prefix does not hold blocks {missing}")

    @contextmanager
    def _frozen(self, modules: list[nn.Module], device: torch.device) -> Iterator[None]:
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            with torch.no_grad(), autocast(device, self.precision):
                yield
        finally:
            for m, mode in zip(modules, modes, strict=True):
                m.train(mode)

    def compute(self, inputs: torch.Tensor, boundary: int) -> torch.Tensor:
        """Embedding + blocks [0, boundary) on `inputs` (a batch); float32."""
        self._check(0, boundary)
        blocks = [self.blocks[i] for i in range(boundary)]
        device = self.device
        with self._frozen([self.embed, *blocks], device):
            x = self.embed(to_weights_dtype(inputs.to(device), self.precision))
            for block in blocks:
                x = block(x)
        return x.float()

    def run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Blocks [start, end) on hidden states `x` (a batch); float32."""
        self._check(start, end)
        blocks = [self.blocks[i] for i in range(start, end)]
        device = self.device
        with self._frozen(blocks, device):
            x = to_weights_dtype(x.to(device), self.precision)
            for block in blocks:
                x = block(x)
        return x.float()

    @staticmethod
    def _memo(name: str, module: nn.Module) -> tuple:
        # in-place updates bump a tensor's version counter, so an unchanged key means unchanged
        # values: frozen blocks are hashed once (the device is part of the key: pointers of
        # different devices may coincide)
        tensors = module.state_dict(keep_vars=True).items()
        return (name, tuple((k, str(t.device), t.data_ptr(), t._version) for k, t in tensors))

    def _digest(self, name: str, module: nn.Module) -> str:
        tensors = list(module.state_dict(keep_vars=True).items())
        meta = [k for k, t in tensors if t.is_meta]
        if meta:
            raise RuntimeError(
                f"{name}.{meta[0]} is on the meta device: materialise the module (to_empty + "
                "load its weights) before fingerprinting it"
            )
        memo = self._memo(name, module)
        if memo not in self._digests:
            h = hashlib.blake2b(digest_size=16)
            h.update(f"{name}:{type(module).__name__}".encode())
            for key, t in tensors:
                h.update(f"{key}:{t.dtype}:{t.numel()}".encode())
                h.update(tensor_digest(t))
            self._digests[memo] = h.hexdigest()
        return self._digests[memo]

    def inherit_digests(self, other: FrozenPrefix) -> None:
        """Take `other`'s digests of the embedding and the blocks both hold, instead of hashing
        their weights again: for a prefix whose weights were moved here bit for bit from
        `other`'s (an in-memory re-layout), where they were frozen already. Blocks `other`
        does not hold are hashed when first fingerprinted, as ever."""
        pairs = [("embed", self.embed, other.embed)]
        pairs += [
            (f"blocks.{i}", self.blocks[i], m) for i, m in other.blocks.items() if i in self.blocks
        ]
        for name, mine, theirs in pairs:
            self._digests[self._memo(name, mine)] = other._digest(name, theirs)

    def fingerprints(self, boundary: int) -> list[str]:
        """Chained fingerprints of the frozen weights and the compute precision: element k
        identifies embedding + blocks [0, k), for k = 0 .. boundary. A cache level at boundary k
        is valid for these weights iff its key was made with element k, so any older level whose
        fingerprint still matches can serve as the source of an incremental advance. Rows made
        under bf16 differ from fp32 ones by far more than rounding, so the precision is part of
        the chain (fp32 chains are unchanged from before precision existed); the device is not
        (CPU and GPU rows agree within float rounding, and the digest hashes CPU bytes)."""
        self._check(0, boundary)
        head = self._digest("embed", self.embed)
        if self.precision != "fp32":
            head = hashlib.blake2b(f"{head}:{self.precision}".encode(), digest_size=16).hexdigest()
        chain = [head]
        for i in range(boundary):
            h = hashlib.blake2b(digest_size=16)
            h.update(chain[-1].encode())
            h.update(self._digest(f"blocks.{i}", self.blocks[i]).encode())
            chain.append(h.hexdigest())
        return chain


_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# per projection: the multiplier and increment of the index, and the final multiplier (odd)
_PROJECTIONS = (
    (0x9E3779B97F4A7C15, 0x632BE59BD9B4E5, 0xBF58476D1CE4E5B9),
    (0x94D049BB133111EB, 0x2545F4914F6CDD1D, 0xD6E8FEB86659FD93),
)


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def tensor_digest(t: torch.Tensor) -> bytes:
    """16 bytes that identify a tensor's values, computed where it lives (no copy to the host:
    hashing a large frozen prefix byte by byte on the CPU cost a GPU job's re-layout a third of
    a second). Each of two projections reads the elements' bits as integers and sums them, each
    times a pseudo-random odd coefficient of its position, modulo 2^64: changing any one
    element always changes both sums, and any other change leaves them both unchanged with
    probability about 2^-128. Integer sums do not depend on the order of addition, so the same
    values give the same digest on any device."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    ints = flat.view(_AS_INT[flat.element_size()]).to(torch.int64)
    index = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    sums = []
    for scale, offset, final in _PROJECTIONS:
        c = index * _int64(scale) + _int64(offset)  # wraps modulo 2^64
        c = (c ^ (c >> 31)) * _int64(final)
        sums.append(int((ints * (c | 1)).sum()) & ((1 << 64) - 1))
    return b"".join(v.to_bytes(8, "little") for v in sums)
