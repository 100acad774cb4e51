"""How a report's figures read to a person: the held-out result, model FLOPs utilisation and the
largest rank's peak GPU memory, as the progress lines, `pipetransformer status`, the summary and
the dashboard header all write them. None where unknown (the CPU), so those displays add
nothing. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["held_out_text", "largest_peak", "mfu_text", "peak_memory_text", "perplexity"]


def held_out_text(
    accuracy: float | None,
    f1: float | None = None,
    digits: int = 1,
    token_loss: float | None = None,
) -> str | None:
    """The latest held-out result: "acc 91.2%" for classification; question answering's exact
    match (its accuracy) and F1, "EM 80.1% F1 88.0%"; a language model's perplexity (from its
    mean loss per token, `token_loss`) and next-token accuracy, "ppl 27.13 acc 19.8%"; None
    before the first evaluation."""
    if accuracy is None:
        return None
    if token_loss is not None:
        return f"ppl {perplexity(token_loss):.2f} acc {accuracy:.{digits}%}"
    if f1 is None:
        return f"acc {accuracy:.{digits}%}"
    return f"EM {accuracy:.{digits}%} F1 {f1:.{digits}%}"


def perplexity(token_loss: float) -> float:
    """exp of a mean loss per token (inf where that overflows a float)."""
    return math.exp(token_loss) if token_loss < 700 else math.inf


def mfu_text(mfu: float | None) -> str | None:
    """Model FLOPs utilisation (a fraction) as a percentage, "41.2 %"; None where unknown."""
    if mfu is None or not math.isfinite(mfu):
        return None
    return f"{mfu * 100:.1f} %"


def largest_peak(peak_memory_mib: Sequence[float | None] | None) -> tuple[int, float] | None:
    """The rank with the largest peak GPU memory and that peak in MiB (the lowest such rank on
    a tie), from a per-rank list (index = rank); None where no rank's peak is known."""
    known = [
        (rank, mib)
        for rank, mib in enumerate(peak_memory_mib or ())
        if mib is not None and math.isfinite(mib)
    ]
    if not known:
        return None
    return max(known, key=lambda rank_mib: (rank_mib[1], -rank_mib[0]))


def peak_memory_text(peak_memory_mib: Sequence[float | None] | None) -> str | None:
    """The largest rank's peak GPU memory, "12.3 GiB (rank 2)"; None where unknown."""
    peak = largest_peak(peak_memory_mib)
    if peak is None:
        return None
    rank, mib = peak
    return f"{mib / 1024:.1f} GiB (rank {rank})"
