"""The registries a job is assembled from: model families (`core.families`, their torch builds in
`pipetransformer.models`), tasks (`core.tasks`, their torch side in `trainer.tasks`) and kinds
of data (`core.datasets`, their data-plane openers). Each is one table of registered
implementations; nothing dispatches on a spec string or on a tensor's shape instead."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F

from pipetransformer.core import datasets, families, tasks
from pipetransformer.core.families import FAMILIES, checkpoint_family, family_of, lookup
from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.spec import DataSpec, ModelSpec
from pipetransformer.models import build_of
from pipetransformer.trainer.tasks import loss_sum, scorer


def test_each_family_is_registered_once_with_a_build_that_has_the_interface() -> None:
    keys = [(f.name, f.source) for f in FAMILIES]
    assert len(keys) == len(set(keys))
    for family in FAMILIES:
        build = build_of(family.name, pretrained=family.source == "checkpoint")
        for method in ("empty_unit", "initial_units", "example_input"):
            assert callable(getattr(build, method)), (family.name, method)
        assert family.tasks and all(t in tasks.TASKS for t in family.tasks)
        if family.source == "checkpoint":
            assert family.model_type and family.architectures
            assert set(family.task_classes) == set(family.tasks), family.name
            assert checkpoint_family({"model_type": family.model_type}) is family


def test_a_spec_finds_its_family_by_name_and_source() -> None:
    assert family_of(ModelSpec()) is lookup("vit", pretrained=False)
    seeded_bert = ModelSpec(family="bert", vocab_size=50, seq_len=16)
    assert family_of(seeded_bert).source == "seed" and seeded_bert.tokens == 17
    with pytest.raises(ValueError, match="comes from a checkpoint"):
        ModelSpec(family="roberta")
    with pytest.raises(ValueError, match="choose one of vit, bert, deit, roberta, llama"):
        ModelSpec(family="t5")
    with pytest.raises(ValueError, match="unsupported `model_type` 't5'"):
        checkpoint_family({"model_type": "t5"})


def test_what_travels_between_stages_is_the_familys() -> None:
    vit = ModelSpec(image_size=8, patch_size=2)
    assert (vit.tokens, vit.width) == (17, 64)  # 16 patches + CLS
    deit = families.vit.DEIT
    assert deit.tokens(vit) == 18  # + the distillation token
    bert = families.bert.BERT
    text = ModelSpec(family="bert", vocab_size=50, seq_len=16)
    assert bert.width(text) == 65  # the attention mask's channel
    assert bert.input_shape(text, 4) == (4, 3, 16)  # ids, token types, mask
    assert family_of(text).input_shape(text, 4) == (4, 16)  # the seeded bert reads ids


def test_the_task_not_the_logits_shape_chooses_the_loss() -> None:
    """A [B, T, V] output (as a language model's) under classification is one cross-entropy
    per position, not question answering's mean of two: the loss is the task's."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 2, generator=g)
    targets = torch.randint(0, 5, (3, 2), generator=g)
    targets[0, 1] = IGNORE
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    assert torch.equal(loss_sum(tasks.CLASSIFICATION, logits, targets), ce)
    assert torch.equal(loss_sum(tasks.QUESTION_ANSWERING, logits, targets), ce / 2)
    assert tasks.task_of("question-answering").output_shape(3, 5, 2) == (3, 5, 2)
    assert tasks.task_of("classification").output_shape(3, 5, 7) == (3, 7)
    with pytest.raises(ValueError, match="choose one of classification, question-answering"):
        tasks.task_of("summarisation")


def test_classification_scores_the_fraction_of_correct_real_samples() -> None:
    class Split:
        def __len__(self) -> int:
            return 4

    score = scorer(tasks.CLASSIFICATION, Split(), torch.device("cpu"))
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 5.0]])
    targets = torch.tensor([0, 0, 0, IGNORE])
    valid = torch.tensor([True, True, True, False]).numpy()
    score.add(logits, targets, valid, torch.arange(4).numpy())
    assert score.result() == (0.5, None)  # 2 of the 4 samples of the split


def test_each_kind_of_data_opens_through_a_registered_function() -> None:
    names = [k.name for k in datasets.KINDS]
    assert len(names) == len(set(names)) and tuple(names) == datasets.NAMES
    for kind in datasets.KINDS:
        module, _, function = kind.opens.partition(":")
        opener = getattr(importlib.import_module(module), function)
        assert list(inspect.signature(opener).parameters) == ["data", "model"], kind.name
    assert DataSpec().kind is datasets.kind_of("digits")
    with pytest.raises(ValueError, match="dataset 'imagenet' is not available"):
        DataSpec(dataset="imagenet")


def test_a_kind_of_data_says_what_it_reads_for_the_task() -> None:
    table = DataSpec(dataset="table", train="a.parquet", test="b.parquet")
    table = table.model_copy(update={"columns": table.columns.model_copy(update={"text": "s"})})
    assert table.kind.columns(table, tasks.CLASSIFICATION) == {"text": "s", "label": "label"}
    assert table.kind.columns(table, tasks.QUESTION_ANSWERING) == {
        "id": "id",
        "question": "question",
        "context": "context",
        "answers": "answers",
    }
    assert DataSpec().kind.columns(DataSpec(), tasks.CLASSIFICATION) is None
    assert DataSpec(dataset="synthetic", seed=3).kind.details(DataSpec(dataset="synthetic")) == (
        "2,048 samples, seed 0"
    )
