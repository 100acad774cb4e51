"""Optimizer and learning-rate schedule built from the training spec. Pure apart from the
optimizer object itself."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pipetransformer.core.spec import TrainingSpec


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
    """Low-precision (bf16) model parameters trained through float32 master copies
    (`training.precision: bf16-weights`): the model computes in its parameters' dtype (no
    autocast, no per-step weight casts, bf16 activations), the optimizer updates the masters.

    The masters live in `module`, a module of their own under the model's parameter names (and
    with its persistent buffers), so it is what the optimizer is built over and what
    checkpoints save and load: a checkpoint holds the float32 masters, the same tensors a
    float32 job writes, and resumes under any precision. Per step: `load_grads` copies the
    model's gradients into the masters' float32 gradients (replica sums, clipping and AutoFreeze
    then work on those), the optimizer steps, and `write_back` rounds the trained masters into
    the model's parameters."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype = torch.bfloat16,
        keep: Callable[[str, torch.Tensor], bool] | None = None,
    ):
        """Masters from `model`'s parameters as they are (float32: nothing is lost); then
        `model` is cast to `dtype` in place (the same parameter objects). `keep(name, tensor)`:
        which parameters and buffers are training state and get a master (default: all); the
        others (LoRA's base weights, which nothing updates or checkpoints) are only cast."""
        self.module = nn.Module()
        masters: dict[int, nn.Parameter] = {}  # tied parameters share one master
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for name, tensor in model.state_dict(keep_vars=True).items():
            if keep is not None and not keep(name, tensor):
                continue
            *path, leaf = name.split(".")
            owner = self.module
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            if isinstance(tensor, nn.Parameter):
                if id(tensor) not in masters:
                    master = nn.Parameter(tensor.detach().float().clone(), tensor.requires_grad)
                    masters[id(tensor)] = master
                    self._pairs.append((tensor, master))
                owner.register_parameter(leaf, masters[id(tensor)])
            else:
                owner.register_buffer(leaf, tensor.detach().clone())
        model.to(dtype)
        self._grads: dict[int, torch.Tensor] = {}  # float32 gradient buffers, kept across steps

    def resident(self) -> list[torch.Tensor]:
        """The float32 tensors it keeps (masters and gradient buffers): what it costs in memory."""
        return [m for _, m in self._pairs] + list(self._grads.values())

    @torch.no_grad()
    def load_grads(self) -> None:
        """The model's gradients into the masters' float32 gradients; a parameter without a
        gradient leaves its master without one (as it would have in a float32 model)."""
        dst, src = [], []
        for param, master in self._pairs:
            if param.grad is None:
                master.grad = None
                continue
            buf = self._grads.get(id(master))
            if buf is None:
                buf = self._grads[id(master)] = torch.empty_like(master)
            master.grad = buf
            dst.append(buf)
            src.append(param.grad)
        if dst:
            torch._foreach_copy_(dst, src)

    @torch.no_grad()
    def write_back(self, everything: bool = False) -> None:
        """The model's trainable parameters (`everything`: all of them, after the masters were
        loaded from a checkpoint) become their masters' rounded copies; the model's gradients
        are dropped (the masters' copies served the step)."""
        pairs = [(p, m) for p, m in self._pairs if everything or p.requires_grad]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        for param, _ in self._pairs:
            param.grad = None


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
