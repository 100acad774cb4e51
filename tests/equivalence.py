"""What the tests comparing a pipelined model with `transformers` share
(tests/test_hf_equivalence.py, tests/test_lm_equivalence.py)."""

from __future__ import annotations

import torch


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
