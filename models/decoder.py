"""Hugging Face decoder-only language models as the pipeline's units (the torch build of
`pipetransformer.core.families.decoder`: Llama, Qwen2, Qwen3, Mistral, GPT-2), built from the
`transformers` classes themselves (`LlamaDecoderLayer`, `Qwen3DecoderLayer`, `GPT2Block`, the
family's RMSNorm and rotary embedding) and named with the checkpoint's own parameter names, so
`unit.state_dict()` keys are the checkpoint's keys whatever the partition:

- `embed`: `model.embed_tokens.*` (GPT-2: `transformer.wte.*` + `transformer.wpe.*`);
- `blocks.<i>`: `model.layers.<i>.*` (GPT-2: `transformer.h.<i>.*`);
- `head`: `model.norm.*` + `lm_head.*` (GPT-2: `transformer.ln_f.*` + `lm_head.*`).

Forward: embed([B, 2, T]) -> [B, T, D + 1]; block([B, T, D + 1]) -> [B, T, D + 1];
head([B, T, D + 1]) -> logits [B, T, V].

Packed documents. Pipeline stages pass ONE tensor, and a row may hold several documents one
after the other; each must see only itself, from position 0. So:

- the first stage reads token ids and document-start flags stacked, int64 [B, 2, T]
  (`stack_lm_inputs`: the flag is 1 at the first token of each document, column 0 always 1; a
  row that is one document is [1, 0, 0, ...]);
- the embed unit appends the flag as one extra channel, float 0/1 (exact in bf16 too, which a
  document id or a position would not be): hidden [B, T, D + 1];
- each block splits the channel off and derives what it needs from it: the position of each
  token in its document (`document_positions`: restarting at 0 at each start; GPT-2's embed
  adds its learned positions there), the rotary cos/sin from those positions (the family's own
  rotary module, per block) and the attention mask, causal and within each document, built by
  `transformers.masking_utils` exactly as the family's model builds it for those position ids
  (`create_causal_mask`, or `create_sliding_window_causal_mask` for a sliding-window layer: a
  restart in the positions is a new packed sequence to it). When every row is one document the
  positions are plain aranges and, under sdpa, the mask is None: sdpa's `is_causal` kernel runs
  (no dense mask); with packed rows it is the bool [B, 1, T, T] mask (eager: its additive form);
- the head drops the channel. The channel is detached everywhere: it carries no gradient.

The rotary module's inverse frequencies are a non-persistent buffer (not a checkpoint key): the
block holds the module unregistered, so casting the unit to bf16 (`bf16-weights`) leaves them
float32, and moves it to the hidden states' device on first use.

Tied embeddings (`tie_word_embeddings`): the head has its own `lm_head.weight`, read from the
embedding's tensor (`models.hf`); `Family.tied_parameters` names the pair."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import (
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from pipetransformer.core.families import Architecture, block_index
from pipetransformer.core.families.decoder import DecoderFamily
from pipetransformer.core.spec import ModelSpec
from pipetransformer.models.hf import HFBuild, nest

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "gpt2": GPT2Config,
}
# the rotary families' layer, RMSNorm and rotary embedding classes
_ROTARY_CLASSES: dict[str, tuple[type[nn.Module], type[nn.Module], type[nn.Module]]] = {
    "llama": (LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding),
    "qwen2": (Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding),
    "qwen3": (Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding),
    "mistral": (MistralDecoderLayer, MistralRMSNorm, MistralRotaryEmbedding),
}
# old GPT-2 checkpoints hold each layer's causal-mask buffer (GPT2PreTrainedModel's
# _keys_to_ignore_on_load_unexpected)
GPT2_IGNORED = (r"\.attn\.(masked_)?bias$", r"\.crossattention\.(masked_)?bias$")


def stack_lm_inputs(
    input_ids: torch.Tensor, doc_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """The first stage's one input tensor: int64 [B, 2, T] of token ids and document-start
    flags (1 at the first token of each document; None: every row is one document). Column 0
    is a start whatever `doc_starts` says: a row begins a document."""
    ids = input_ids.long()
    if doc_starts is None:
        flags = torch.zeros_like(ids)
    else:
        if doc_starts.shape != ids.shape:
            raise ValueError(
                f"doc_starts {list(doc_starts.shape)} must have input_ids' shape {list(ids.shape)}"
            )
        flags = (doc_starts != 0).long()
    flags[..., 0] = 1
    return torch.stack([ids, flags], dim=-2)


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document: [B, T] int64 from the bool start flags [B, T]
    (0 at a start, counting up to the next)."""
    index = torch.arange(starts.shape[-1], device=starts.device).expand_as(starts)
    begin = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - begin


def document_ids(starts: torch.Tensor) -> torch.Tensor:
    """Each token's document in its row: [B, T] int64, 0 for the first (cumsum of the flags)."""
    return starts.long().cumsum(dim=-1) - 1


def append_flags(hidden: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Hidden [B, T, D] + start flags [B, T] -> [B, T, D + 1], the flag as 0/1, no gradient."""
    return torch.cat([hidden, starts.detach().to(hidden.dtype).unsqueeze(-1)], dim=-1)


def split_flags(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, D + 1] -> hidden [B, T, D] and the bool start flags [B, T] (detached)."""
    return x[..., :-1], x[..., -1].detach() > 0.5


def split_lm_inputs(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 2, T] -> token ids [B, T] and the bool start flags [B, T]."""
    if inputs.dim() != 3 or inputs.shape[1] != 2:
        raise ValueError(
            "expected language-model inputs [batch, 2, seq_len] (token ids and document-start "
            f"flags stacked; see stack_lm_inputs), got {list(inputs.shape)}"
        )
    ids, starts = inputs.long().unbind(1)
    return ids, starts != 0


def _family(arch: Architecture) -> DecoderFamily:
    family = arch.family_info
    assert isinstance(family, DecoderFamily), family
    return family


class TokenEmbed(nn.Module):
    """[B, 2, T] ids/flags -> hidden [B, T, D + 1]: `model.embed_tokens` (GPT-2:
    `transformer.wte` plus `transformer.wpe` at each token's position in its document, then
    the embedding dropout), the flag channel appended."""

    def __init__(self, config: PretrainedConfig, family: DecoderFamily):
        super().__init__()
        self.prefix, self.gpt2 = family.key_prefix, family.is_gpt2
        if self.gpt2:
            modules = {
                "wte": nn.Embedding(config.vocab_size, config.hidden_size),
                "wpe": nn.Embedding(config.max_position_embeddings, config.hidden_size),
                "drop": nn.Dropout(config.embd_pdrop),
            }
        else:
            padding = getattr(config, "pad_token_id", None)
            modules = {"embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size, padding)}
        self.add_module(self.prefix, nn.ModuleDict(modules))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ids, starts = split_lm_inputs(inputs)
        body = getattr(self, self.prefix)
        if not self.gpt2:
            return append_flags(body["embed_tokens"](ids), starts)
        hidden = body["wte"](ids) + body["wpe"](document_positions(starts))
        return append_flags(body["drop"](hidden), starts)


def _is_sliding(config: PretrainedConfig, family: str, index: int) -> bool:
    """Whether layer `index` attends within a sliding window, as the family's model decides:
    Mistral's every layer when `sliding_window` is set; Qwen's by `layer_types`."""
    if family == "mistral":
        return getattr(config, "sliding_window", None) is not None
    types = getattr(config, "layer_types", None)
    return bool(types) and types[index] == "sliding_attention"


class DecoderBlock(nn.Module):
    """One decoder layer under the checkpoint's names (`model.layers.<i>.*`,
    `transformer.h.<i>.*`): [B, T, D + 1] -> [B, T, D + 1], the positions, rotary cos/sin and
    attention mask derived from the flag channel (the module docstring)."""

    def __init__(self, config: PretrainedConfig, family: DecoderFamily, index: int):
        super().__init__()
        self.config = config
        if family.is_gpt2:
            layer: nn.Module = GPT2Block(config, layer_idx=index)
            self.add_module(family.key_prefix, nest(f"h.{index}", layer))
            rotary = None
        else:
            layer_cls, _, rotary_cls = _ROTARY_CLASSES[family.name]
            layer = layer_cls(config, layer_idx=index)
            self.add_module(family.key_prefix, nest(f"layers.{index}", layer))
            rotary = rotary_cls(config=config)
        self.__dict__["layer"] = layer  # a handle, unregistered: registered once, above
        self.__dict__["rotary"] = rotary  # unregistered: stays float32 (the module docstring)
        self.make_mask: Callable[..., Any] = (
            create_sliding_window_causal_mask
            if _is_sliding(config, family.name, index)
            else create_causal_mask
        )

    def _rotary_on(self, device: torch.device) -> nn.Module:
        rotary = self.rotary
        if rotary.inv_freq.device != device:
            rotary.to(device)
        return rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, starts = split_flags(x)
        positions = document_positions(starts)
        mask = self.make_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        extra: dict[str, Any] = {}
        if self.rotary is not None:
            extra["position_embeddings"] = self._rotary_on(hidden.device)(hidden, positions)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, **extra)
        return append_flags(out, starts)


class LMHead(nn.Module):
    """The final norm (`model.norm`, GPT-2 `transformer.ln_f`) and `lm_head` on every token:
    [B, T, D + 1] -> logits [B, T, V]."""

    def __init__(self, config: PretrainedConfig, family: DecoderFamily):
        super().__init__()
        self.prefix = family.key_prefix
        if family.is_gpt2:
            self.norm_name = "ln_f"
            norm: nn.Module = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        else:
            self.norm_name = "norm"
            norm = _ROTARY_CLASSES[family.name][1](config.hidden_size, eps=config.rms_norm_eps)
        self.add_module(self.prefix, nn.ModuleDict({self.norm_name: norm}))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = split_flags(x)
        return self.lm_head(getattr(self, self.prefix)[self.norm_name](hidden))


def build_unit(config: PretrainedConfig, arch: Architecture, name: str) -> nn.Module:
    """Unit `name` with `transformers`' own initialisation (build it with parameters on the
    meta device to allocate nothing; `pipetransformer.models.hf.load_units` does)."""
    family = _family(arch)
    if name == "embed":
        return TokenEmbed(config, family)
    if name == "head":
        return LMHead(config, family)
    return DecoderBlock(config, family, block_index(name, arch.depth))


def example_input(spec: ModelSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of token ids, each row one document (for profiling)."""
    ids = torch.randint(0, spec.vocab_size or 2, (batch, spec.seq_len or 0), generator=generator)
    return stack_lm_inputs(ids)


BUILD = HFBuild(CONFIG_CLASSES, build_unit, example_input, ignored_keys=GPT2_IGNORED)
