"""Models as an embedding, a stack of residual blocks and a head, so a pipeline stage is a
contiguous range of blocks and every parameter keeps one stable name (`embed.*`, `blocks.<i>.*`,
`head.*`) whatever the partition. Two families share the blocks and the head: a ViT (`PatchEmbed`
over images) and a BERT-style text encoder (`TextEmbed` over token ids). Pure: no I/O, no process
groups."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetransformer.core.spec import ModelSpec


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


Precision = Literal["fp32", "bf16", "bf16-weights"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "bf16-weights")


def weights_dtype(precision: Precision) -> torch.dtype:
    """The dtype of the model's parameters while it computes: bfloat16 under `bf16-weights`
    (float32 masters live in the optimizer's copy, `trainer.optim.MasterWeights`), else float32."""
    return torch.bfloat16 if precision == "bf16-weights" else torch.float32


def autocast(device: torch.device | str, precision: Precision) -> contextlib.AbstractContextManager:
    """The compute precision of a block's forward: bfloat16 autocast for `bf16` (matrix products
    and attention in bf16, norms and softmax statistics in float32; parameters and the residual
    stream stay float32), nothing for `fp32` and for `bf16-weights` (bf16 parameters compute in
    their own dtype). Backward follows the forward's dtypes."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def to_weights_dtype(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """A floating input (pixels, a stage's float32 hidden states) in the parameters' dtype; token
    ids and float32-weight precisions pass as they are."""
    dtype = weights_dtype(precision)
    return x.to(dtype) if dtype != torch.float32 and x.is_floating_point() else x


class StageModule(nn.Module):
    """Blocks [start, end) of a model, with the embedding if start == 0 and the head if end == L.

    `blocks` is a ModuleDict keyed by the global block index, so parameter names are identical to
    the full model's and a checkpoint written under one partition loads under any other.

    With `recompute` (GPipe's re-materialisation), each block runs under activation checkpointing
    while training: only block inputs are kept for backward and the activations inside a block are
    recomputed. The blocks are not wrapped, so parameter names do not change."""

    def __init__(
        self,
        spec: ModelSpec,
        start: int,
        end: int,
        embed: nn.Module | None = None,
        blocks: dict[int, nn.Module] | None = None,
        head: nn.Module | None = None,
        recompute: bool = False,
        precision: Precision = "fp32",
    ):
        super().__init__()
        if not 0 <= start < end <= spec.depth:
            raise ValueError(f"block range [{start}, {end}) outside a model of {spec.depth} blocks")
        self.spec, self.start, self.end = spec, start, end
        self.is_first, self.is_last = start == 0, end == spec.depth
        self.recompute, self.precision = recompute, precision
        self.embed = embed if self.is_first else None
        self.blocks = nn.ModuleDict(
            {str(i): blocks[i] for i in range(start, end)} if blocks else {}
        )
        self.head = head if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # autocast inside the forward, not around the schedule: backward then runs outside it
        # (as autocast wants), and recomputation replays it (checkpoint records the state)
        with autocast(x.device, self.precision):
            x = to_weights_dtype(x, self.precision)
            if self.embed is not None:
                x = self.embed(x)
            remat = self.recompute and self.training and torch.is_grad_enabled()
            for i in range(self.start, self.end):
                block = self.blocks[str(i)]
                x = checkpoint(block, x, use_reentrant=False) if remat else block(x)
            if self.head is not None:
                x = self.head(x)
        # what crosses a stage boundary (and reaches the loss) is float32 under every
        # precision: the residual stream already is under fp32 and bf16; the head's logits and
        # bf16-weights' hidden states are cast back (exactly: bf16 -> float32 loses nothing)
        return x.float()


def _embed(spec: ModelSpec) -> nn.Module:
    if spec.family == "bert":
        return TextEmbed(spec)
    return PatchEmbed(spec)


def unit_names(spec: ModelSpec) -> list[str]:
    """The partition units in model order: `embed`, `blocks.0` .. `blocks.<L-1>`, `head`."""
    return ["embed", *(f"blocks.{i}" for i in range(spec.depth)), "head"]


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


def num_tokens(spec: ModelSpec) -> int:
    """Tokens in the hidden states between blocks (`ModelSpec.tokens`)."""
    return spec.tokens


def model_input_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    """Shape of one batch of model inputs: images [B, C, H, W] (vit, deit), token ids [B, L]
    (bert built here), or ids, token types and attention mask stacked, [B, 3, L] (pretrained
    text models, `trainer.hf.units.stack_text_inputs`)."""
    if spec.is_text:
        return (batch, 3, spec.seq_len) if spec.pretrained else (batch, spec.seq_len)
    return (batch, spec.channels, spec.image_size, spec.image_size)


def stage_input_shape(spec: ModelSpec, start: int, batch: int) -> tuple[int, ...]:
    """Shape of the tensor entering the stage that begins at block `start`."""
    if start == 0:
        return model_input_shape(spec, batch)
    return (batch, spec.tokens, spec.width)


def stage_input_dtype(spec: ModelSpec, start: int) -> torch.dtype:
    """Dtype of the tensor entering the stage that begins at block `start`: int64 token ids for
    the first text stage, float32 otherwise (images, hidden states)."""
    if start == 0 and spec.is_text:
        return torch.int64
    return torch.float32


def output_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    """The head's logits: [B, classes], or [B, T, 2] start and end logits (question answering)."""
    if spec.task == "question-answering":
        return (batch, spec.tokens, 2)
    return (batch, spec.num_classes)


def stage_output_shape(spec: ModelSpec, end: int, batch: int) -> tuple[int, ...]:
    """Shape of the tensor leaving the stage that ends at block `end` (logits on the last)."""
    if end == spec.depth:
        return output_shape(spec, batch)
    return (batch, spec.tokens, spec.width)
