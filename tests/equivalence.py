"""What the tests comparing a pipelined model with `transformers` share
(tests/test_hf_equivalence.py, tests/test_lm_equivalence.py, tests/test_lora_equivalence.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipetransformer.core.partition import uniform_partition
from pipetransformer.core.sampler import IGNORE, ElasticSampler
from pipetransformer.core.state import Layout
from pipetransformer.trainer.optim import lr_at, set_lr


def served_logits(pipe, inputs, targets, indices):  # noqa: ANN001, ANN201
    """`RankPipeline.forward_only`, but entering the pipeline as a training step does (`_enter`
    with the samples' indices): the frozen prefix's outputs from the attached cache."""
    pipe.model.eval()
    try:
        with torch.no_grad():
            args = (pipe._enter(inputs, indices),) if pipe.is_first else ()
            if pipe.is_last:
                return pipe.schedule.eval(*args, target=targets, losses=[])
            pipe.schedule.eval(*args)
            return None
    finally:
        pipe.model.train()


def checkpoint_name(rank_name: str) -> str:
    """A RankModel state_dict key as the checkpoint names it: the unit prefix (`embed.`,
    `blocks.<i>.`, `head.`) dropped, what is left is the checkpoint's key (the families' units
    keep the checkpoint's names; trainer/export.py does the same)."""
    unit, rest = rank_name.split(".", 1)
    return rest.split(".", 1)[1] if unit == "blocks" else rest


def uniform_layout(
    depth: int, stages: int, replicas: int, microbatches: int, boundary: int = 0
) -> Layout:
    """`stages` x `replicas` over the blocks from `boundary` (those below it frozen), split
    uniformly."""
    ranges = [(a + boundary, b + boundary) for a, b in uniform_partition(depth - boundary, stages)]
    return Layout.build(
        ranges,
        num_blocks=depth,
        replicas=replicas,
        microbatches=microbatches,
        freeze_boundary=boundary,
    )


def train_steps(  # noqa: ANN201
    pipe,  # noqa: ANN001
    opt: torch.optim.Optimizer,
    training,  # noqa: ANN001  (TrainingSpec)
    replicas: int,
    replica: int,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    weights=None,  # noqa: ANN001
    each_step: Callable[[], None] | None = None,
):
    """`steps` of the Trainer's step on this rank (trainer/trainer.py `Trainer.step`): the
    elastic sampler's global batches of `training.global_batch_size` over the rows of `x`/`y`
    (weighted by `weights`: a language model's counted tokens), this replica's share, the loss
    over the batch's count, replica sync and clipping, AdamW; `each_step` after each. The
    losses (None off the last stage) and the global gradient norms."""
    n = len(y)
    sampler = ElasticSampler(n, training.global_batch_size, training.seed, weights=weights)
    epoch, cursor, losses, norms = 0, 0, [], []
    for step in range(steps):
        b = sampler.batch(epoch, cursor, replicas, replica)
        targets = y[b.indices].clone()
        targets[~torch.from_numpy(b.valid)] = IGNORE
        set_lr(opt, lr_at(step, steps, training))
        losses.append(
            pipe.train_step(
                x[b.indices] if pipe.is_first else None,
                targets if pipe.is_last else None,
                b.loss_count,
                indices=b.indices,
            )
        )
        norms.append(pipe.sync_and_clip(training.grad_clip).total)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if each_step is not None:
            each_step()
        cursor = b.next_cursor
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
    return losses, norms


def reference_steps(  # noqa: ANN201
    loss_of: Callable[[object], torch.Tensor],
    params: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    training,  # noqa: ANN001  (TrainingSpec)
    n: int,
    steps: int,
    weights=None,  # noqa: ANN001
):
    """The plain single-process loop the pipelines are compared with: the elastic sampler's
    global batches over `n` rows (as one replica; its real rows only), the learning rate of the
    schedule, `loss_of(rows)` backward, clipping `params` by norm, the optimizer's step. The
    losses and the gradient norms before clipping."""
    sampler = ElasticSampler(n, training.global_batch_size, training.seed, weights=weights)
    epoch, cursor, losses, norms = 0, 0, [], []
    for step in range(steps):
        b = sampler.batch(epoch, cursor, 1, 0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, training)
        loss = loss_of(b.indices[b.valid])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, training.grad_clip)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        cursor = b.next_cursor
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
    return losses, norms


def peft_model_of(model_spec, units: dict, model_class=None, **load):  # noqa: ANN001, ANN201
    """`peft.get_peft_model` over the job's pretrained model (`model_class`, by default
    `AutoModelForCausalLM`; `load`: its from_pretrained options) with the job's LoRA config, its
    adapters set to those of `units` (the pipeline's, as the job drew them, found under
    transformers' module names): the single-process model a job with adapters is compared
    with."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from pipetransformer.models.adapters import is_adapter, lora_config
    from pipetransformer.models.units import module_key

    cls = model_class or AutoModelForCausalLM
    base = cls.from_pretrained(model_spec.pretrained.path, **load)
    model = get_peft_model(base, lora_config(model_spec, model_spec.adapters))
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for unit in units.values():
            for name, p in unit.named_parameters():
                if is_adapter(name):
                    theirs[f"base_model.model.{module_key(model_spec, name)}"].copy_(p)
    return model
