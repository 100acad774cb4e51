"""SQuAD-style extractive question answering from a table (`model.task: question-answering`):
rows of id, question, context and answers ({text: [...], answer_start: [...]}), as SQuAD 1.1 on
the hub has them.

Each example becomes one or more features (`trainer.sources.text.squad_windows`: a context longer
than `model.seq_len` is split into windows overlapping by `data.doc_stride` tokens), computed once
with `datasets.Dataset.map` into an arrow file under the cache (`trainer.sources.cache_root`),
keyed by the table, the tokenizer, the length and the stride, and memory-mapped from there: a
feature is what the elastic sampler counts, trains on and reads exactly once per epoch.

Held-out scoring follows SQuAD's evaluation: each feature's best span (start <= end, at most
`data.max_answer_tokens` long, inside the context) by start + end logit, each example's best over
its features, mapped back to the context's characters and scored against every reference answer
by exact match and F1 (`trainer.sources.text.squad_metrics`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset as TorchDataset

from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.spec import DataSpec, ModelSpec
from pipetransformer.trainer.sources import DataError, cache_root
from pipetransformer.trainer.sources.dataset import Sample, SampleKey
from pipetransformer.trainer.sources.tabular import Columns
from pipetransformer.trainer.sources.text import (
    TextEncoder,
    check_fast_tokenizer,
    squad_metrics,
    squad_windows,
)

FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "token_type_ids": datasets.Sequence(datasets.Value("int8")),
        "attention_mask": datasets.Sequence(datasets.Value("int8")),
        "start": datasets.Value("int32"),
        "end": datasets.Value("int32"),
        "example": datasets.Value("int64"),
        # the context's character span of each token, flattened (2 per token); -1 outside it
        "offsets": datasets.Sequence(datasets.Value("int32")),
    }
)


def check_answers(table: datasets.Dataset, split: str, column: str) -> None:
    """Every example has at least one answer with a text and a start (SQuAD 1.1: each question
    is answerable); vectorised over the arrow column."""
    values = table.with_format("arrow")[column]
    kind = values.type
    if not (
        pa.types.is_struct(kind)
        and {kind.field(i).name for i in range(kind.num_fields)} >= {"text", "answer_start"}
    ):
        raise DataError(
            f"split {split!r}: column {column!r} holds {kind}, not SQuAD answers "
            "({text: [...], answer_start: [...]})"
        )
    texts = pc.list_value_length(pc.struct_field(values, "text"))
    empty = pc.fill_null(pc.less(texts, 1), True)
    if pc.any(empty).as_py():
        row = int(pc.index(empty, True).as_py())
        raise DataError(
            f"split {split!r}: column {column!r} row {row} has no answer; SQuAD 1.1 questions "
            "are answerable (unanswerable ones, as in SQuAD 2.0, are not supported)"
        )


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def feature_table(
    examples: datasets.Dataset,
    encoder: TextEncoder,
    columns: Columns,
    qa: QAColumns,
    stride: int,
    key: str,
) -> datasets.Dataset:
    """The features of `examples`, computed once per (`key`, length, stride) and memory-mapped
    from the cache afterwards. `key` names the model's tokenizer (its checkpoint fingerprint)."""
    tok, max_length = encoder.tokenizer, encoder.max_length
    check_fast_tokenizer(tok)
    fingerprint = _fingerprint(
        examples._fingerprint, key, max_length, stride, columns, qa, FEATURES
    )
    directory = cache_root() / "qa-features"
    directory.mkdir(parents=True, exist_ok=True)

    def featurize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {name: [] for name in FEATURES}
        for i, ex_id, question, context, answers in zip(
            indices,
            batch[qa.id],
            batch[columns.text],
            batch[columns.text_pair],
            batch[qa.answers],
            strict=True,
        ):
            for w in squad_windows(tok, str(ex_id), question, context, answers, max_length, stride):
                for name in ("input_ids", "token_type_ids", "attention_mask", "start", "end"):
                    out[name].append(w[name])
                out["example"].append(i)
                flat = [-1] * (2 * len(w["offsets"]))
                for t, span in enumerate(w["offsets"]):
                    if span is not None:
                        flat[2 * t], flat[2 * t + 1] = span
                out["offsets"].append(flat)
        return out

    return examples.map(
        featurize,
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=examples.column_names,
        features=FEATURES,
        cache_file_name=str(directory / f"{fingerprint}.arrow"),
        new_fingerprint=fingerprint,
        load_from_cache_file=True,
        desc="SQuAD features",
    )


@dataclass(frozen=True)
class QAColumns:
    """The columns question answering reads besides the question and the context."""

    answers: str
    id: str


class FeatureDataset(TorchDataset[Sample]):
    """Features as samples: inputs int64 [3, T] (input_ids, token_type_ids, attention_mask)."""

    deterministic = True

    def __init__(self, features: datasets.Dataset) -> None:
        self.features = features.select_columns(["input_ids", "token_type_ids", "attention_mask"])

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, key: int | SampleKey) -> Sample:
        index = int(key[0]) if isinstance(key, tuple) else int(key)
        row = self.features[index]
        inputs = torch.tensor(
            [row["input_ids"], row["token_type_ids"], row["attention_mask"]], dtype=torch.int64
        )
        return Sample(inputs, IGNORE, index)  # targets come from QASplit.labels


def best_spans(logits: torch.Tensor, offsets: torch.Tensor, max_answer_tokens: int) -> torch.Tensor:
    """Each feature's best answer span: float64 [B, 3] of (score, first character, end
    character), the score -inf where the window holds no context. `logits`: [B, T, 2] start and
    end logits; `offsets`: int [B, 2T] (trainer's flattened offsets, -1 outside the context)."""
    b, t, _ = logits.shape
    if b == 0:  # a replica's share of the last batch may hold only padding
        return torch.zeros(0, 3, dtype=torch.float64)
    start, end = logits[..., 0].double(), logits[..., 1].double()
    chars = offsets.view(b, t, 2).to(logits.device)
    inside = chars[..., 0] >= 0
    score = start[:, :, None] + end[:, None, :]  # [B, start token, end token]
    i = torch.arange(t, device=logits.device)
    length = i[None, :] - i[:, None]  # end - start
    allowed = (length >= 0) & (length < max_answer_tokens)
    allowed = allowed[None] & inside[:, :, None] & inside[:, None, :]
    score = score.masked_fill(~allowed, float("-inf"))
    best, flat = score.view(b, -1).max(dim=1)
    first, last = flat // t, flat % t
    rows = torch.arange(b, device=logits.device)
    begin = chars[rows, first, 0].double()
    finish = chars[rows, last, 1].double()
    return torch.stack([best, begin, finish], dim=1).cpu()


@dataclass
class QASplit:
    """One split's features for training and scoring: the same surface as
    `trainer.sources.splits.SourceSplit` (`dataset`, `labels`, `read`, `deterministic`), plus
    what scoring needs."""

    dataset: FeatureDataset
    labels: torch.Tensor  # int64 [N, 2]: start and end token of each feature's answer
    features: datasets.Dataset  # with `example` and `offsets`
    examples: datasets.Dataset  # id, context, answers
    columns: Columns
    qa: QAColumns
    max_answer_tokens: int
    deterministic = True

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    def read(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        return torch.stack([self.dataset[int(i)].inputs for i in indices])

    def spans(self, logits: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
        """`best_spans` of the features `indices` (rows of `logits`)."""
        offsets = torch.tensor(self.features.select_columns(["offsets"])[indices]["offsets"])
        return best_spans(logits, offsets, self.max_answer_tokens)

    def score(self, spans: torch.Tensor) -> tuple[float, float]:
        """(exact match, F1) as fractions, from every feature's span (`spans`: float64 [N, 4] of
        have, score, first character, end character; `have` 0 for a feature not scored)."""
        example = np.asarray(self.features.with_format("numpy")["example"], dtype=np.int64)
        s = spans.numpy()
        score = np.where(s[:, 0] > 0, s[:, 1], -np.inf)
        order = np.lexsort((-score, example))  # by example, best first
        first = np.ones(len(order), dtype=bool)
        first[1:] = example[order][1:] != example[order][:-1]
        best = order[first]
        rows = self.examples.select_columns([self.qa.id, self.columns.text_pair, self.qa.answers])
        predictions: dict[str, str] = {}
        for f in best:
            if not np.isfinite(score[f]):
                continue
            row = rows[int(example[f])]
            predictions[str(row[self.qa.id])] = row[self.columns.text_pair][
                int(s[f, 2]) : int(s[f, 3])
            ]
        references = {
            str(i): a for i, a in zip(rows[self.qa.id], rows[self.qa.answers], strict=True)
        }
        m = squad_metrics(predictions, references)
        return m["exact_match"] / 100.0, m["f1"] / 100.0


def _labels(features: datasets.Dataset) -> torch.Tensor:
    table = features.with_format("numpy")
    return torch.from_numpy(
        np.stack([table["start"], table["end"]], axis=1).astype(np.int64, copy=False)
    )


def qa_columns(data: DataSpec) -> Columns:
    """The columns a question-answering table must hold (checked for presence and nulls)."""
    c = data.columns
    return Columns(text=c.question, text_pair=c.context, label=None, others=(c.id, c.answers))


def qa_splits(
    tables: Sequence[tuple[str, datasets.Dataset]], data: DataSpec, model: ModelSpec
) -> tuple[QASplit, QASplit]:
    """A question-answering job's training and held-out splits from its tables (split name,
    table; opened with `qa_columns`): answers checked, windows computed."""
    pre = model.pretrained
    assert pre is not None and pre.path is not None and model.seq_len is not None
    cols = data.columns
    columns = Columns(text=cols.question, text_pair=cols.context, label=None)
    qa = QAColumns(answers=cols.answers, id=cols.id)
    encoder = TextEncoder(pre.path, max_length=model.seq_len)
    stride = data.stride(model.seq_len)
    out = []
    for name, table in tables:
        check_answers(table, name, qa.answers)
        examples = table.select_columns([qa.id, cols.question, cols.context, qa.answers])
        features = feature_table(
            examples, encoder, columns, qa, stride, pre.fingerprint or pre.path
        )
        out.append(
            QASplit(
                dataset=FeatureDataset(features),
                labels=_labels(features),
                features=features,
                examples=examples,
                columns=columns,
                qa=qa,
                max_answer_tokens=data.max_answer_tokens,
            )
        )
    return out[0], out[1]
