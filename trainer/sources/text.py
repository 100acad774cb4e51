"""Text through the model's own tokenizer (`AutoTokenizer.from_pretrained(directory)`): single
sentences and sentence pairs, truncated and padded to `max_length`, as ONE int64 tensor [3, T]
per sample (input_ids, token_type_ids, attention_mask; the pipeline's first stage takes
[B, 3, T]).

SQuAD-style extractive question answering: `squad_windows` tokenises question + context, splits
a context longer than `max_length` into overlapping windows (`stride` tokens of overlap), and
gives each window its start/end token positions (the CLS position when the answer is not inside
that window) and its offset mapping (`trainer.sources.qa` makes them a job's samples).
`squad_metrics` is exact match and F1 as the official SQuAD v1.1 evaluation script defines
them."""

from __future__ import annotations

import collections
import json
import os
import re
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pipetransformer.trainer.sources import DataError


def _model_vocab_size(model_dir: Path) -> int:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read the model configuration {path}: {exc}") from exc
    size = config.get("vocab_size")
    if size is None:  # multi-part configurations keep it under text_config
        size = (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise DataError(f"{path} has no integer vocab_size")
    return size


class TextEncoder:
    """The model's tokenizer, checked against its `config.json`, turning text into [3, T].

    The tokenizer's vocabulary (`len(tokenizer)`, added tokens included) must equal the model's
    `vocab_size`, or a token id would index past the embedding (or a checkpoint be paired with the
    wrong tokenizer); `allow_larger_embedding` accepts an embedding padded beyond the vocabulary
    (some models round it up), never a smaller one. Picklable, for DataLoader workers."""

    def __init__(
        self,
        tokenizer_dir: str | os.PathLike[str],
        max_length: int,
        model_dir: str | os.PathLike[str] | None = None,
        allow_larger_embedding: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 (got {max_length})")
        self.max_length = max_length
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except Exception as exc:
            raise DataError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc
        model = Path(model_dir if model_dir is not None else tokenizer_dir)
        vocab = _model_vocab_size(model)
        have = len(self.tokenizer)
        if have != vocab and not (allow_larger_embedding and have < vocab):
            raise DataError(
                f"the tokenizer in {tokenizer_dir} has {have} tokens but the model's "
                f"{model / 'config.json'} has vocab_size {vocab}; use the tokenizer the model "
                "was trained with"
            )

    def encode(self, text: str, text_pair: str | None = None) -> torch.Tensor:
        """int64 [3, T]: input_ids, token_type_ids (zeros where the tokenizer has none),
        attention_mask; truncated (longest first for pairs) and padded to max_length."""
        enc = self.tokenizer(
            text,
            text_pair,
            max_length=self.max_length,
            truncation=True,
            padding="max_length",
            return_token_type_ids=True,
            return_attention_mask=True,
        )
        ids = enc["input_ids"]
        types = enc.get("token_type_ids") or [0] * len(ids)
        return torch.tensor([ids, types, enc["attention_mask"]], dtype=torch.int64)

    __call__ = encode


def squad_windows(
    tok: Any,
    ex_id: str,
    question: str,
    context: str,
    answers: Mapping[str, Any] | None,
    max_length: int,
    stride: int,
) -> list[dict[str, Any]]:
    """One SQuAD example's windows: dicts of `input_ids`, `token_type_ids`, `attention_mask`
    (lists of max_length ints), `start`/`end` (the answer's token positions, the CLS position
    when the answer is not in the window; the first answer is the target) and `offsets` (the
    character span of each token in the context, None outside it). `tok`: a fast tokenizer."""
    question = question.lstrip()  # leading spaces waste the window (as `run_qa.py` does)
    try:
        enc = tok(
            question,
            context,
            truncation="only_second",
            max_length=max_length,
            stride=stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length",
            return_token_type_ids=True,
        )
    except Exception as exc:  # e.g. a question longer than max_length - stride
        raise DataError(f"example {ex_id}: cannot split into windows: {exc}") from exc
    answers = answers or {}
    texts, starts = list(answers.get("text") or []), list(answers.get("answer_start") or [])
    if len(texts) != len(starts):
        raise DataError(
            f"example {ex_id}: answers has {len(texts)} texts but {len(starts)} answer_start"
        )
    a0 = a1 = None
    if texts:
        a0 = int(starts[0])
        a1 = a0 + len(texts[0])
        if context[a0:a1] != texts[0]:
            raise DataError(
                f"example {ex_id}: answer {texts[0]!r} is not at character {a0} of its context"
            )
    out = []
    for w in range(len(enc["input_ids"])):
        ids = enc["input_ids"][w]
        seq = enc.sequence_ids(w)
        offsets = [
            tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][w], seq, strict=True)
        ]
        cls = ids.index(tok.cls_token_id) if tok.cls_token_id in ids else 0
        start = end = cls
        ctx = [t for t, o in enumerate(offsets) if o is not None]
        if a0 is not None and ctx and offsets[ctx[0]][0] <= a0 and offsets[ctx[-1]][1] >= a1:
            start = next(t for t in ctx if offsets[t][1] > a0)
            end = next(t for t in reversed(ctx) if offsets[t][0] < a1)
        out.append(
            {
                "input_ids": ids,
                "token_type_ids": enc["token_type_ids"][w],
                "attention_mask": enc["attention_mask"][w],
                "start": start,
                "end": end,
                "offsets": offsets,
            }
        )
    return out


def check_fast_tokenizer(tok: Any) -> None:
    """SQuAD features need offset mappings (a fast tokenizer) and right padding."""
    if not getattr(tok, "is_fast", False):
        raise DataError("question answering needs a fast tokenizer (offset mappings)")
    if tok.padding_side != "right":
        raise DataError("question answering needs a tokenizer that pads on the right")


# --- the official SQuAD v1.1 evaluation (evaluate-v1.1.py), restated -----------------------------


def normalize_answer(s: str) -> str:
    """Lower case, remove punctuation, the articles a/an/the, and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, ground_truth: str) -> float:
    pred = normalize_answer(prediction).split()
    truth = normalize_answer(ground_truth).split()
    common = collections.Counter(pred) & collections.Counter(truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def _texts(ref: Any) -> list[str]:
    if isinstance(ref, Mapping):
        ref = ref.get("answers", ref)
        if isinstance(ref, Mapping):
            ref = ref["text"]
        elif ref and isinstance(ref[0], Mapping):
            ref = [a["text"] for a in ref]
    if isinstance(ref, str):
        return [ref]
    return list(ref)


def squad_metrics(
    predictions: Mapping[str, str] | Sequence[Mapping[str, Any]],
    references: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> dict[str, float]:
    """{"exact_match", "f1"} in percent over the referenced questions, each the best over a
    question's ground-truth answers. `predictions`: id -> text, or a list of {"id",
    "prediction_text"}; `references`: id -> answer text(s), or a list of {"id", "answers":
    {"text": [...]}} (the `evaluate` squad format). A question without a prediction scores 0, as
    in the official script."""
    if not isinstance(predictions, Mapping):
        predictions = {str(p["id"]): p["prediction_text"] for p in predictions}
    if not isinstance(references, Mapping):
        references = {str(r["id"]): r for r in references}
    if not references:
        raise ValueError("no references")
    em = f1 = 0.0
    for qid, ref in references.items():
        truths = _texts(ref)
        if qid not in predictions:
            continue
        pred = predictions[qid]
        em += max(float(exact_match_score(pred, t)) for t in truths)
        f1 += max(f1_score(pred, t) for t in truths)
    n = len(references)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n}
