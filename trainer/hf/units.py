"""A Hugging Face model as the pipeline's units, built from the `transformers` classes themselves
and named with the checkpoint's own parameter names, so `unit.state_dict()` keys are the
checkpoint's keys whatever the partition:

- `embed`: `<p>.embeddings.*` (`p` is the family: vit, deit, bert, roberta);
- `blocks.<i>`: `<p>.encoder.layer.<i>.*`;
- `head`: vit/deit `<p>.layernorm.*` + `classifier.*`; bert sequence classification
  `bert.pooler.*` + `classifier.*`; roberta sequence classification `classifier.dense.*` +
  `classifier.out_proj.*`; bert question answering `qa_outputs.*`.

Forward: embed(input) -> hidden states [B, T, D]; block(hidden) -> hidden; head(hidden) ->
logits ([B, num_labels]; question answering [B, T, 2], start and end logits).

Pipeline stages pass ONE tensor, but a padded text batch needs its attention mask in every
layer. So for bert/roberta:

- the first stage's input is one integer tensor [B, 3, T]: input_ids, token_type_ids and
  attention_mask stacked on dim 1 (`stack_text_inputs`);
- the embed unit appends the mask as one extra feature channel: hidden [B, T, D + 1], the last
  channel the mask as float 0/1;
- each block splits the channel off, builds the layer's attention mask from it with
  `transformers.masking_utils.create_bidirectional_mask`, exactly as `BertModel` /
  `RobertaModel` do for the configured attention implementation (`config._attn_implementation`,
  "sdpa" or "eager": set it the same for a reference model), runs the layer and re-appends the
  channel;
- the head drops the channel. The channel is detached in every block: it carries no gradient.

vit/deit pass plain [B, T, D] (no mask).

transformers 5 renamed the ViT/DeiT layer internals (`layers.<i>.attention.q_proj`, `mlp.fc1`)
but its checkpoints keep the original names (`encoder.layer.<i>.attention.attention.query`,
`intermediate.dense`), as `save_pretrained` writes them. An image block therefore registers the
layer's leaf modules (the same objects) under the checkpoint's names and calls the layer, which
it holds unregistered, so each parameter has exactly one name: the checkpoint's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, DeiTConfig, PretrainedConfig, RobertaConfig, ViTConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPooler
from transformers.models.deit.modeling_deit import DeiTEmbeddings, DeiTLayer
from transformers.models.roberta.modeling_roberta import (
    RobertaClassificationHead,
    RobertaEmbeddings,
    RobertaLayer,
)
from transformers.models.vit.modeling_vit import ViTEmbeddings, ViTLayer

from pipetransformer.core.hf_config import HFArchitecture, read_config_json

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "vit": ViTConfig,
    "deit": DeiTConfig,
    "bert": BertConfig,
    "roberta": RobertaConfig,
}
_EMBEDDINGS: dict[str, type[nn.Module]] = {
    "vit": ViTEmbeddings,
    "deit": DeiTEmbeddings,
    "bert": BertEmbeddings,
    "roberta": RobertaEmbeddings,
}
_LAYERS: dict[str, type[nn.Module]] = {
    "vit": ViTLayer,
    "deit": DeiTLayer,
    "bert": BertLayer,
    "roberta": RobertaLayer,
}
# an image layer's modules: the checkpoint's name -> the name in transformers 5's layer class
_IMAGE_LAYER_NAMES: dict[str, str] = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "layernorm_before": "layernorm_before",
    "layernorm_after": "layernorm_after",
}


def hf_config(
    directory: str | Path, arch: HFArchitecture, attn_implementation: str = "sdpa"
) -> PretrainedConfig:
    """The `transformers` config of the checkpoint in `directory` (its config.json), with
    `arch.num_labels` (a new head's outputs) and the attention implementation set."""
    config = CONFIG_CLASSES[arch.family].from_dict(read_config_json(directory))
    if config.num_labels != arch.num_labels:  # a new head's outputs (question answering: 2)
        config.num_labels = arch.num_labels
    config._attn_implementation = attn_implementation
    return config


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


def _nest(path: str, leaf: nn.Module) -> nn.ModuleDict:
    """`leaf` inside ModuleDicts, one per dotted component of `path`."""
    *outer, last = path.split(".")
    module = nn.ModuleDict({last: leaf})
    for part in reversed(outer):
        module = nn.ModuleDict({part: module})
    return module


def _merge(tree: nn.ModuleDict, path: str, leaf: nn.Module) -> None:
    """Put `leaf` at dotted `path` inside `tree`, creating ModuleDicts on the way."""
    *outer, last = path.split(".")
    node = tree
    for part in outer:
        if part not in node:
            node[part] = nn.ModuleDict()
        node = node[part]
    node[last] = leaf


class ImageEmbed(nn.Module):
    """Pixels [B, C, H, W] -> hidden [B, T, D] (`<p>.embeddings.*`)."""

    def __init__(self, config: PretrainedConfig, family: str):
        super().__init__()
        self.family = family
        self.add_module(family, nn.ModuleDict({"embeddings": _EMBEDDINGS[family](config)}))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        embeddings = getattr(self, self.family)["embeddings"]
        dtype = embeddings.patch_embeddings.projection.weight.dtype
        return embeddings(pixel_values.to(dtype))


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


class ImageBlock(nn.Module):
    """One ViT/DeiT layer under the checkpoint's names `<p>.encoder.layer.<i>.*` (see the
    module docstring): hidden [B, T, D] -> [B, T, D]."""

    def __init__(self, config: PretrainedConfig, family: str, index: int):
        super().__init__()
        layer = _LAYERS[family](config)
        # held unregistered: its leaves are registered below, under the checkpoint's names
        self.__dict__["layer"] = layer
        tree = nn.ModuleDict()
        covered: set[int] = set()
        for ckpt_name, layer_name in _IMAGE_LAYER_NAMES.items():
            try:
                leaf = layer.get_submodule(ckpt_name)  # a version without the renaming
            except AttributeError:
                leaf = layer.get_submodule(layer_name)
            _merge(tree, ckpt_name, leaf)
            covered |= {id(p) for p in leaf.parameters()}
        uncovered = [n for n, p in layer.named_parameters() if id(p) not in covered]
        if uncovered:
            raise ValueError(
                f"{type(layer).__name__} has parameters with no checkpoint name: {uncovered} "
                "(an unsupported transformers version?)"
            )
        self.add_module(family, _nest(f"encoder.layer.{index}", tree))

    def train(self, mode: bool = True) -> ImageBlock:
        super().train(mode)
        self.layer.train(mode)  # its dropouts are not registered here
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, None)


class TextBlock(nn.Module):
    """One BERT/RoBERTa layer (`<p>.encoder.layer.<i>.*`): [B, T, D + 1] -> [B, T, D + 1], the
    mask channel split off, turned into the layer's attention mask and re-appended."""

    def __init__(self, config: PretrainedConfig, family: str, index: int):
        super().__init__()
        self.config = config
        layer = _LAYERS[family](config, layer_idx=index)
        self.add_module(family, _nest(f"encoder.layer.{index}", layer))
        self.__dict__["layer"] = layer  # a handle, unregistered: registered once, above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, mask = split_mask(x)
        attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=mask
        )
        return append_mask(self.layer(hidden, attention_mask), mask)


class ImageHead(nn.Module):
    """Final norm (`<p>.layernorm`) and `classifier` on the class token: -> [B, num_labels]."""

    def __init__(self, config: PretrainedConfig, family: str):
        super().__init__()
        self.family = family
        norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.add_module(family, nn.ModuleDict({"layernorm": norm}))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(getattr(self, self.family)["layernorm"](hidden)[:, 0, :])


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


def unit_prefixes(arch: HFArchitecture, name: str) -> tuple[str, ...]:
    """The checkpoint key prefixes that belong to unit `name`."""
    p = arch.family
    if name == "embed":
        return (f"{p}.embeddings.",)
    if name.startswith("blocks."):
        return (f"{p}.encoder.layer.{_block_index(arch, name)}.",)
    if name != "head":
        raise ValueError(f"unknown unit {name!r}: expected embed, blocks.<i> or head")
    if not arch.is_text:
        return (f"{p}.layernorm.", "classifier.")
    if arch.task == "question-answering":
        return ("qa_outputs.",)
    if p == "bert":
        return ("bert.pooler.", "classifier.")
    return ("classifier.",)


def _block_index(arch: HFArchitecture, name: str) -> int:
    try:
        i = int(name.removeprefix("blocks."))
    except ValueError:
        raise ValueError(f"unknown unit {name!r}: expected blocks.<i>") from None
    if not 0 <= i < arch.depth:
        raise ValueError(f"unit {name!r} outside a model of {arch.depth} blocks")
    return i


def build_unit(config: PretrainedConfig, arch: HFArchitecture, name: str) -> nn.Module:
    """Unit `name` with `transformers`' own initialisation (build it with parameters on the
    meta device to allocate nothing; `trainer.hf.load.load_units` does)."""
    unit_prefixes(arch, name)  # validates the name
    family = arch.family
    if name == "embed":
        return TextEmbed(config, family) if arch.is_text else ImageEmbed(config, family)
    if name.startswith("blocks."):
        i = _block_index(arch, name)
        return TextBlock(config, family, i) if arch.is_text else ImageBlock(config, family, i)
    if not arch.is_text:
        return ImageHead(config, family)
    if arch.task == "question-answering":
        return QuestionAnsweringHead(config)
    if family == "bert":
        return BertSequenceHead(config)
    return RobertaSequenceHead(config)
