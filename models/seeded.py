"""The seeded families' torch build (`pipetransformer.core.families.seeded`): an embedding, a
stack of residual blocks and a head, so a pipeline stage is a contiguous range of blocks and every
parameter keeps one stable name (`embed.*`, `blocks.<i>.*`, `head.*`) whatever the partition. Two
families share the blocks and the head: a ViT (`PatchEmbed` over images) and a BERT-style text
encoder (`TextEmbed` over token ids). Every unit's initial weights come from its own seed
(`unit_seed`). Pure: no I/O, no process groups."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pipetransformer.core.families import unit_names as _unit_names
from pipetransformer.core.spec import ModelSpec
from pipetransformer.models.stage import StageModule, model_input_shape


class PatchEmbed(nn.Module):
    """Image -> patch tokens (+ a class token) with learned positions."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.patch = spec.patch_size
        n_patches = (spec.image_size // spec.patch_size) ** 2
        self.proj = nn.Linear(spec.channels * spec.patch_size**2, spec.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, spec.dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, spec.dim) * 0.02)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p)  # b, c, h/p, w/p, p, p
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
        tokens = torch.cat([self.cls.expand(b, -1, -1), self.proj(patches)], dim=1)
        return self.drop(tokens + self.pos)


class TextEmbed(nn.Module):
    """Token ids [B, seq_len] -> hidden states [B, seq_len + 1, dim], BERT style: token embedding
    plus a learned position embedding, a learned CLS vector prepended at position 0 (the token the
    head reads), then LayerNorm and dropout. Sequences are fixed-length (no padding mask)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.seq_len = spec.seq_len
        self.tok = nn.Embedding(spec.vocab_size, spec.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, spec.dim))
        self.pos = nn.Parameter(torch.randn(1, spec.seq_len + 1, spec.dim) * 0.02)
        self.norm = nn.LayerNorm(spec.dim)
        self.drop = nn.Dropout(spec.dropout)
        nn.init.normal_(self.tok.weight, std=0.02)  # BERT's initialiser

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != self.seq_len:
            raise ValueError(
                f"expected token ids of shape [batch, {self.seq_len}] (model.seq_len), "
                f"got {list(ids.shape)}"
            )
        b = ids.shape[0]
        tokens = torch.cat([self.cls.expand(b, -1, -1), self.tok(ids)], dim=1)
        return self.drop(self.norm(tokens + self.pos))


class SelfAttention(nn.Module):
    """Multi-head self-attention whose key projection has no bias (as in BEiT): softmax is
    invariant to it, so its exact gradient is zero and in float32 it is rounding noise, which
    Adam would normalise into real, layout-dependent updates."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        nn.init.xavier_uniform_(self.qkv.weight)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])
        qkv = F.linear(x, self.qkv.weight, bias).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each b, heads, t, d/heads
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-norm transformer encoder block: two residual units kept together, so a partition
    cut can only fall between blocks, never inside a residual connection."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        hidden = int(spec.dim * spec.mlp_ratio)
        self.norm1 = nn.LayerNorm(spec.dim)
        self.attn = SelfAttention(spec.dim, spec.heads, spec.dropout)
        self.norm2 = nn.LayerNorm(spec.dim)
        self.mlp = nn.Sequential(
            nn.Linear(spec.dim, hidden),
            nn.GELU(),
            nn.Dropout(spec.dropout),
            nn.Linear(hidden, spec.dim),
            nn.Dropout(spec.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h)
        return x + self.mlp(self.norm2(x))


class ClassifierHead(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm = nn.LayerNorm(spec.dim)
        self.fc = nn.Linear(spec.dim, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x[:, 0]))


def _embed(spec: ModelSpec) -> nn.Module:
    return TextEmbed(spec) if spec.is_text else PatchEmbed(spec)


def unit_names(spec: ModelSpec) -> list[str]:
    """The partition units in model order: `embed`, `blocks.0` .. `blocks.<L-1>`, `head`."""
    return _unit_names(spec.depth)


def unit_seed(seed: int, unit: str) -> int:
    """The seed of one unit's initialisation: derived from the job's seed and the unit's name
    alone, so a unit's initial weights do not depend on which other units a process builds."""
    digest = hashlib.blake2b(f"{seed}:{unit}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def empty_unit(spec: ModelSpec, unit: str) -> nn.Module:
    """A unit's module without initialising it (build it under `torch.device("meta")` to
    allocate nothing)."""
    if unit == "embed":
        return _embed(spec)
    if unit == "head":
        return ClassifierHead(spec)
    return Block(spec)


def init_unit(spec: ModelSpec, seed: int, unit: str) -> nn.Module:
    """One unit with its seed-derived initial weights, on the CPU (the same values on every
    machine and device; move them afterwards). The global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, unit))
        with torch.device("cpu"):
            return empty_unit(spec, unit)


def build_model(spec: ModelSpec, seed: int, recompute: bool = False) -> StageModule:
    """The whole model as one stage, initialised from `seed`: each unit from its own
    seed-derived stream (`init_unit`), so a process that builds only some units (a pipeline
    rank) gets exactly the weights they have here."""
    embed = init_unit(spec, seed, "embed")
    blocks = {i: init_unit(spec, seed, f"blocks.{i}") for i in range(spec.depth)}
    head = init_unit(spec, seed, "head")
    return StageModule(spec, 0, spec.depth, embed, blocks, head, recompute=recompute)


def build_stage(
    spec: ModelSpec, seed: int, start: int, end: int, recompute: bool = False
) -> StageModule:
    """Blocks [start, end) with exactly the weights they have in `build_model(spec, seed)`
    (only these units are built)."""
    return StageModule(
        spec,
        start,
        end,
        init_unit(spec, seed, "embed") if start == 0 else None,
        {i: init_unit(spec, seed, f"blocks.{i}") for i in range(start, end)},
        init_unit(spec, seed, "head") if end == spec.depth else None,
        recompute=recompute,
    )


class SeededBuild:
    """The build interface `pipetransformer.models.units` calls (`Family.build` names this
    module; `BUILD` is its object)."""

    def empty_unit(self, spec: ModelSpec, name: str) -> nn.Module:
        with torch.device("meta"):
            return empty_unit(spec, name)

    def initial_units(
        self, spec: ModelSpec, seed: int, names: Iterable[str]
    ) -> dict[str, nn.Module]:
        return {name: init_unit(spec, seed, name) for name in names}

    def example_input(
        self, spec: ModelSpec, batch: int, generator: torch.Generator
    ) -> torch.Tensor:
        shape = model_input_shape(spec, batch)
        if spec.is_text:
            return torch.randint(0, spec.vocab_size or 2, shape, generator=generator)
        return torch.randn(shape, generator=generator)


BUILD = SeededBuild()
