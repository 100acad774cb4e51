"""Optimizer and learning-rate schedule built from the training spec. Pure apart from the
optimizer object itself."""

from __future__ import annotations

import math

import torch
from torch import nn

from core.spec import TrainingSpec


def build_optimizer(module: nn.Module, spec: TrainingSpec) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms/biases/embeddings-of-position do not (the usual ViT recipe).
    Groups are chosen by parameter shape, so every stage makes the same choice for a block."""
    decay = [p for p in module.parameters() if p.ndim >= 2 and p.requires_grad]
    no_decay = [p for p in module.parameters() if p.ndim < 2 and p.requires_grad]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # on a GPU the fused kernel updates every parameter in a few launches (the step counts live
    # on the device too); elsewhere the default (for-each) implementation
    fused = all(p.is_cuda for p in decay + no_decay) and bool(decay + no_decay)
    # a rank whose blocks are all frozen in place (`freeze.relayout: off`) trains nothing, but
    # the loop still steps, sets the LR and checkpoints its optimizer: AdamW refuses an empty
    # parameter list, not one empty group (a step over it does nothing)
    kept = [g for g in groups if g["params"]] or [{"params": [], "weight_decay": 0.0}]
    return torch.optim.AdamW(kept, lr=spec.lr, fused=fused or None)


class MasterWeights:
    """Low-precision (bf16) model parameters trained through float32 master copies: the model
    computes in its parameters' dtype (no autocast, no per-step weight casts, bf16 activations),
    `load_grads` copies its gradients into the masters' float32 gradients (where clipping then
    applies), `optimizer` (AdamW from `build_optimizer`, the same groups) updates the masters, and
    `step` writes them back rounded to the model's dtype. Measured in bench/mfu.py (`bf16w`
    configurations, issue 29); not wired into the training loop (`training.precision` keeps
    float32 weights under autocast)."""

    def __init__(self, module: nn.Module, spec: TrainingSpec, dtype: torch.dtype = torch.bfloat16):
        """Masters from `module`'s trainable parameters as they are (float32: nothing is lost),
        then `module` is cast to `dtype` in place (the same parameter objects)."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        holder = nn.ParameterList(nn.Parameter(p.detach().float().clone()) for p in self.params)
        module.to(dtype)
        self.master: list[nn.Parameter] = list(holder)
        self.grads = [torch.zeros_like(m) for m in self.master]
        self.optimizer = build_optimizer(holder, spec)

    @torch.no_grad()
    def load_grads(self) -> None:
        """The model's gradients (None counts as zero) into the masters' float32 gradients."""
        have = [
            (g, p.grad) for g, p in zip(self.grads, self.params, strict=True) if p.grad is not None
        ]
        for g, p in zip(self.grads, self.params, strict=True):
            if p.grad is None:
                g.zero_()
        if have:
            torch._foreach_copy_([g for g, _ in have], [src for _, src in have])
        for m, g in zip(self.master, self.grads, strict=True):
            m.grad = g

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the masters, then the model's parameters are their rounded copies."""
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.master)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None


def lr_at(step: int, total_steps: int, spec: TrainingSpec) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    if spec.warmup_steps and step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    span = max(1, total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    floor = spec.lr * spec.min_lr_ratio
    return floor + (spec.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
