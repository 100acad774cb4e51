"""Hugging Face BERT and RoBERTa checkpoints as the pipeline's units (the torch build of
`pipetransformer.core.families.bert`), built from the `transformers` classes themselves and
named with the checkpoint's own parameter names, so `unit.state_dict()` keys are the
checkpoint's keys whatever the partition:

- `embed`: `<p>.embeddings.*` (`p` is bert or roberta);
- `blocks.<i>`: `<p>.encoder.layer.<i>.*`;
- `head`: bert sequence classification `bert.pooler.*` + `classifier.*`; roberta sequence
  classification `classifier.dense.*` + `classifier.out_proj.*`; question answering
  `qa_outputs.*`.

Forward: embed(input) -> hidden states [B, T, D]; block(hidden) -> hidden; head(hidden) ->
logits ([B, num_labels]; question answering [B, T, 2], start and end logits).

Pipeline stages pass ONE tensor, but a padded text batch needs its attention mask in every
layer. So:

- the first stage's input is one integer tensor [B, 3, T]: input_ids, token_type_ids and
  attention_mask stacked on dim 1 (`stack_text_inputs`);
- the embed unit appends the mask as one extra feature channel: hidden [B, T, D + 1], the last
  channel the mask as float 0/1;
- each block splits the channel off, builds the layer's attention mask from it with
  `transformers.masking_utils.create_bidirectional_mask`, exactly as `BertModel` /
  `RobertaModel` do for the configured attention implementation (`config._attn_implementation`,
  "sdpa" or "eager": set it the same for a reference model), runs the layer and re-appends the
  channel;
- the head drops the channel. The channel is detached in every block: it carries no gradient."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, PretrainedConfig, RobertaConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPooler
from transformers.models.roberta.modeling_roberta import (
    RobertaClassificationHead,
    RobertaEmbeddings,
    RobertaLayer,
)

from pipetransformer.core.families import Architecture, block_index
from pipetransformer.core.spec import ModelSpec
from pipetransformer.models.hf import HFBuild, nest

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"bert": BertConfig, "roberta": RobertaConfig}
_EMBEDDINGS: dict[str, type[nn.Module]] = {"bert": BertEmbeddings, "roberta": RobertaEmbeddings}
_LAYERS: dict[str, type[nn.Module]] = {"bert": BertLayer, "roberta": RobertaLayer}


def stack_text_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first text stage's one input tensor: [B, 3, T] int64 of input_ids, token_type_ids
    (zeros if None) and attention_mask (ones if None)."""
    ids = input_ids.long()
    types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids.long()
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.long()
    return torch.stack([ids, types, mask], dim=1)


def append_mask(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hidden [B, T, D] + mask [B, T] -> [B, T, D + 1], the mask as float 0/1, no gradient."""
    return torch.cat([hidden, mask.detach().to(hidden.dtype).unsqueeze(-1)], dim=-1)


def split_mask(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, D + 1] -> hidden [B, T, D] and the int64 0/1 mask [B, T] (detached)."""
    return x[..., :-1], (x[..., -1].detach() > 0.5).long()


class TextEmbed(nn.Module):
    """[B, 3, T] ids/types/mask -> hidden [B, T, D + 1] with the mask channel appended."""

    def __init__(self, config: PretrainedConfig, family: str):
        super().__init__()
        self.family = family
        self.add_module(family, nn.ModuleDict({"embeddings": _EMBEDDINGS[family](config)}))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() != 3 or inputs.shape[1] != 3:
            raise ValueError(
                "expected text inputs [batch, 3, seq_len] (input_ids, token_type_ids, "
                f"attention_mask stacked; see stack_text_inputs), got {list(inputs.shape)}"
            )
        ids, types, mask = inputs.long().unbind(1)
        hidden = getattr(self, self.family)["embeddings"](input_ids=ids, token_type_ids=types)
        return append_mask(hidden, mask)


class TextBlock(nn.Module):
    """One BERT/RoBERTa layer (`<p>.encoder.layer.<i>.*`): [B, T, D + 1] -> [B, T, D + 1], the
    mask channel split off, turned into the layer's attention mask and re-appended."""

    def __init__(self, config: PretrainedConfig, family: str, index: int):
        super().__init__()
        self.config = config
        layer = _LAYERS[family](config, layer_idx=index)
        self.add_module(family, nest(f"encoder.layer.{index}", layer))
        self.__dict__["layer"] = layer  # a handle, unregistered: registered once, above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, mask = split_mask(x)
        attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=mask
        )
        return append_mask(self.layer(hidden, attention_mask), mask)


class BertSequenceHead(nn.Module):
    """`bert.pooler` (dense + tanh on [CLS]), dropout, `classifier`: -> [B, num_labels]."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.bert = nn.ModuleDict({"pooler": BertPooler(config)})
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = split_mask(x)
        return self.classifier(self.dropout(self.bert["pooler"](hidden)))


class RobertaSequenceHead(nn.Module):
    """RoBERTa's `classifier` (dense + tanh + out_proj on <s>): -> [B, num_labels]."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.classifier = RobertaClassificationHead(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = split_mask(x)
        return self.classifier(hidden)


class QuestionAnsweringHead(nn.Module):
    """`qa_outputs` on every token: -> [B, T, 2] (start and end logits in the last dim)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = split_mask(x)
        return self.qa_outputs(hidden)


_SEQUENCE_HEADS: dict[str, type[nn.Module]] = {
    "bert": BertSequenceHead,
    "roberta": RobertaSequenceHead,
}


def build_unit(config: PretrainedConfig, arch: Architecture, name: str) -> nn.Module:
    """Unit `name` with `transformers`' own initialisation (build it with parameters on the
    meta device to allocate nothing; `pipetransformer.models.hf.load_units` does)."""
    if name == "embed":
        return TextEmbed(config, arch.family)
    if name == "head":
        if arch.task == "question-answering":
            return QuestionAnsweringHead(config)
        return _SEQUENCE_HEADS[arch.family](config)
    return TextBlock(config, arch.family, block_index(name, arch.depth))


def example_input(spec: ModelSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of token ids with their (zero) token types and (full) attention mask, stacked
    (for profiling)."""
    ids = torch.randint(0, spec.vocab_size or 2, (batch, spec.seq_len or 0), generator=generator)
    return stack_text_inputs(ids)


BUILD = HFBuild(CONFIG_CLASSES, build_unit, example_input)
