"""A pipeline stage as a module, whatever the family: `StageModule` runs blocks [start, end) of a
model (with its embedding on the first stage and its head on the last) under the job's precision,
with stable parameter names (`embed.*`, `blocks.<i>.*`, `head.*`); and the shapes and dtypes of
what enters and leaves a stage, from the family's and the task's descriptions
(`pipetransformer.core.families`, `pipetransformer.core.tasks`)."""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetransformer.core.spec import ModelSpec
from pipetransformer.core.tasks import task_of

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


def num_tokens(spec: ModelSpec) -> int:
    """Tokens in the hidden states between blocks (`ModelSpec.tokens`)."""
    return spec.tokens


def model_input_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    """Shape of one batch of model inputs, as the family reads them: images [B, C, H, W], token
    ids [B, L] (the seeded bert), or ids, token types and attention mask stacked, [B, 3, L]
    (pretrained text models, `pipetransformer.models.bert.stack_text_inputs`)."""
    return spec.family_info.input_shape(spec, batch)


def stage_input_shape(spec: ModelSpec, start: int, batch: int) -> tuple[int, ...]:
    """Shape of the tensor entering the stage that begins at block `start`."""
    if start == 0:
        return model_input_shape(spec, batch)
    return (batch, spec.tokens, spec.width)


def stage_input_dtype(spec: ModelSpec, start: int) -> torch.dtype:
    """Dtype of the tensor entering the stage that begins at block `start`: the family's input
    dtype on the first (int64 token ids for text), float32 hidden states after it."""
    if start == 0 and spec.family_info.input_dtype(spec) == "int64":
        return torch.int64
    return torch.float32


def output_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    """The head's logits, as the task shapes them: [B, classes], or [B, T, 2] start and end
    logits (question answering)."""
    return task_of(spec).output_shape(batch, spec.tokens, spec.num_classes)


def stage_output_shape(spec: ModelSpec, end: int, batch: int) -> tuple[int, ...]:
    """Shape of the tensor leaving the stage that ends at block `end` (logits on the last)."""
    if end == spec.depth:
        return output_shape(spec, batch)
    return (batch, spec.tokens, spec.width)
