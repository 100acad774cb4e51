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
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=spec.lr, fused=fused or None)


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
