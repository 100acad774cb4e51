"""Models as an embedding, a stack of residual blocks and a head, so a pipeline stage is a
contiguous range of blocks and every parameter keeps one stable name (`embed.*`, `blocks.<i>.*`,
`head.*`) whatever the partition. Pure: no I/O, no process groups."""

from __future__ import annotations

import torch
from torch import nn

from orchestrator.spec import ModelSpec


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


class Block(nn.Module):
    """A pre-norm transformer encoder block: two residual units kept together, so a partition
    cut can only fall between blocks, never inside a residual connection."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        hidden = int(spec.dim * spec.mlp_ratio)
        self.norm1 = nn.LayerNorm(spec.dim)
        self.attn = nn.MultiheadAttention(
            spec.dim, spec.heads, dropout=spec.dropout, batch_first=True
        )
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
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ClassifierHead(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm = nn.LayerNorm(spec.dim)
        self.fc = nn.Linear(spec.dim, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x[:, 0]))


class StageModule(nn.Module):
    """Blocks [start, end) of a model, with the embedding if start == 0 and the head if end == L.

    `blocks` is a ModuleDict keyed by the global block index, so parameter names are identical to
    the full model's and a checkpoint written under one partition loads under any other."""

    def __init__(
        self,
        spec: ModelSpec,
        start: int,
        end: int,
        embed: nn.Module | None = None,
        blocks: dict[int, nn.Module] | None = None,
        head: nn.Module | None = None,
    ):
        super().__init__()
        if not 0 <= start < end <= spec.depth:
            raise ValueError(f"block range [{start}, {end}) outside a model of {spec.depth} blocks")
        self.spec, self.start, self.end = spec, start, end
        self.is_first, self.is_last = start == 0, end == spec.depth
        self.embed = embed if self.is_first else None
        self.blocks = nn.ModuleDict(
            {str(i): blocks[i] for i in range(start, end)} if blocks else {}
        )
        self.head = head if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for i in range(self.start, self.end):
            x = self.blocks[str(i)](x)
        if self.head is not None:
            x = self.head(x)
        return x


def build_model(spec: ModelSpec, seed: int) -> StageModule:
    """The whole model as one stage, initialised from `seed` (the same on every rank, so every
    layout starts from identical weights)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        embed = PatchEmbed(spec)
        blocks = {i: Block(spec) for i in range(spec.depth)}
        head = ClassifierHead(spec)
    finally:
        torch.random.set_rng_state(gen_state)
    return StageModule(spec, 0, spec.depth, embed, blocks, head)


def build_stage(spec: ModelSpec, seed: int, start: int, end: int) -> StageModule:
    """Blocks [start, end) with exactly the weights they have in `build_model(spec, seed)`."""
    full = build_model(spec, seed)
    return StageModule(
        spec,
        start,
        end,
        full.embed,
        {i: full.blocks[str(i)] for i in range(start, end)},
        full.head,
    )


def stage_input_shape(spec: ModelSpec, start: int, batch: int) -> tuple[int, ...]:
    """Shape of the tensor entering the stage that begins at block `start`."""
    if start == 0:
        return (batch, spec.channels, spec.image_size, spec.image_size)
    return (batch, (spec.image_size // spec.patch_size) ** 2 + 1, spec.dim)


def stage_output_shape(spec: ModelSpec, end: int, batch: int) -> tuple[int, ...]:
    if end == spec.depth:
        return (batch, spec.num_classes)
    return (batch, (spec.image_size // spec.patch_size) ** 2 + 1, spec.dim)
