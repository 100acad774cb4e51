"""Hugging Face decoder-only language models, read from their config.json and trained for the
next token (task `causal-lm`): Llama (`LlamaForCausalLM`: rotary positions, RMSNorm, SwiGLU,
grouped-query attention), Qwen2 (`Qwen2ForCausalLM`: Llama with q/k/v biases), Qwen3
(`Qwen3ForCausalLM`: Llama with RMSNorms on each head's queries and keys), Mistral
(`MistralForCausalLM`) and GPT-2 (`GPT2LMHeadModel`: learned positions, LayerNorm, a GELU MLP,
`Conv1D` weights, biases everywhere); their base models (`LlamaModel`, ..., `GPT2Model`) as a
body that gets a new output projection (or the tied embedding). Built by
`pipetransformer.models.decoder`.

Units under the checkpoint's own names: `embed` is `model.embed_tokens.*` (GPT-2:
`transformer.wte.*` + `transformer.wpe.*`), `blocks.<i>` is `model.layers.<i>.*`
(`transformer.h.<i>.*`), `head` is the final norm `model.norm.*` (`transformer.ln_f.*`) and
`lm_head.*`. With `tie_word_embeddings` (GPT-2, small Qwen models) the output projection is the
input embedding's tensor: the head holds its own copy (`tied_parameters` names the pair).

The first stage reads token ids and document-start flags stacked ([B, 2, T]), the stages pass
the hidden states with the flag as one extra channel ([B, T, D + 1]): every block derives each
token's position and the attention mask (causal, within its document) from that channel.

Sliding-window attention (Mistral's `sliding_window`, Qwen's `use_sliding_window`) is computed
as the `transformers` model computes it (its own masks); the FLOPs count full causal attention.
Llama's optional `attention_bias`/`mlp_bias` are loaded and trained, but left out of the
parameter count (a few thousandths of it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pipetransformer.core.families.base import (
    Architecture,
    Family,
    HeadTask,
    TiedParameter,
    _int,
    block_index,
)
from pipetransformer.core.tasks import CAUSAL_LM

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec

Style = Literal["rotary", "gpt2"]

# config.json's names for a Llama-style model's fields (GPT-2 writes its own: `GPT2_NAMES`)
LLAMA_NAMES = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "max_position_embeddings": "max_position_embeddings",
}
GPT2_NAMES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
}


def _flag(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json: `{name}` must be true or false, got {value!r}")
    return value


def _optional_int(raw: dict[str, Any], name: str, default: int | None) -> int | None:
    value = raw.get(name, default)
    return None if value is None else _int({name: value}, name)


@dataclass(frozen=True)
class DecoderFamily(Family):
    """A decoder-only language model family (the module docstring)."""

    style: Style = "rotary"
    body_prefix: str = "model"  # the body's key prefix in a *ForCausalLM checkpoint
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys (Qwen3)
    # what the `transformers` config class assumes where config.json says nothing
    default_head_dim: int | None = None  # None: hidden_size / num_attention_heads
    default_tie: bool = False
    default_sliding_window: int | None = None  # Mistral's config class: 4096
    sliding_switch: str | None = None  # the flag that turns the window on (Qwen)
    names: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_NAMES))

    @property
    def is_gpt2(self) -> bool:
        return self.style == "gpt2"

    # -- what travels -----------------------------------------------------------------------

    def width(self, model: ModelSpec) -> int:
        return model.dim + 1  # the document-start flag's channel

    def input_shape(self, model: ModelSpec, batch: int) -> tuple[int, ...]:
        return (batch, 2, model.seq_len or 0)  # token ids, document-start flags

    def problem(self, model: ModelSpec) -> str | None:
        if self.is_gpt2 and model.max_positions and (model.seq_len or 0) > model.max_positions:
            return (
                f"seq_len ({model.seq_len}) is longer than the position table holds "
                f"(max_positions {model.max_positions})"
            )
        return None

    # -- adapters ---------------------------------------------------------------------------

    def adapter_layers(self, model: ModelSpec) -> dict[str, list[tuple[int, int]]] | None:
        """Llama-style: q_proj (d x q), k_proj and v_proj (d x kv), o_proj (q x d), the SwiGLU
        MLP's gate_proj, up_proj (d x h) and down_proj (h x d). GPT-2 (`Conv1D`, which `peft`
        adapts as well): c_attn (d x 3d), c_proj (the attention's d x d and the MLP's h x d),
        c_fc (d x h)."""
        d, h = model.dim, self.hidden(model)
        if self.is_gpt2:
            return {"c_attn": [(d, 3 * d)], "c_proj": [(d, d), (h, d)], "c_fc": [(d, h)]}
        q, kv = self.attention_widths(model)
        return {
            "q_proj": [(d, q)],
            "k_proj": [(d, kv)],
            "v_proj": [(d, kv)],
            "o_proj": [(q, d)],
            "gate_proj": [(d, h)],
            "up_proj": [(d, h)],
            "down_proj": [(h, d)],
        }

    # -- parameters and FLOPs ---------------------------------------------------------------

    def hidden(self, model: ModelSpec) -> int:
        return round(model.dim * model.mlp_ratio)  # intermediate_size / hidden_size, back

    def head_width(self, model: ModelSpec) -> int:
        return model.head_dim or model.dim // model.heads

    def attention_widths(self, model: ModelSpec) -> tuple[int, int]:
        """(queries' width, keys' (= values') width): heads and kv_heads times head_dim."""
        hd = self.head_width(model)
        return model.heads * hd, (model.kv_heads or model.heads) * hd

    def block_params(self, model: ModelSpec) -> int:
        """GPT-2: c_attn (q, k, v) and c_proj with biases, the MLP's two matrices with biases,
        two LayerNorms. Llama-style: q, k and v (grouped-query: k and v kv_heads wide), o, the
        SwiGLU MLP's three matrices, two RMSNorms; Qwen2's q/k/v biases, Qwen3's per-head
        query and key RMSNorms."""
        d, h = model.dim, self.hidden(model)
        if self.is_gpt2:
            return 4 * d * d + 2 * d * h + 9 * d + h
        q, kv = self.attention_widths(model)
        params = 2 * d * q + 2 * d * kv + 3 * d * h + 2 * d
        if self.qkv_bias:
            params += q + 2 * kv
        if self.qk_norm:
            params += 2 * self.head_width(model)
        return params

    def embed_params(self, model: ModelSpec) -> int:
        """The token table (GPT-2: and its learned position table)."""
        d = model.dim
        params = (model.vocab_size or 0) * d
        if self.is_gpt2:
            params += (model.max_positions or 0) * d
        return params

    def head_params(self, model: ModelSpec) -> int:
        """The final norm and the output projection: a copy of its own in the head even when
        tied to the embedding (the pipeline holds both), so a tied model's units hold
        vocab_size x dim more than the `transformers` model, which holds the tensor once."""
        d = model.dim
        return (2 * d if self.is_gpt2 else d) + (model.vocab_size or 0) * d

    def block_flops(self, model: ModelSpec) -> float:
        """2 T (d q + 2 d kv + q d + m d h) for the projections (m: SwiGLU's 3 matrices,
        GPT-2's 2) plus 4 T^2 q for attention (q: heads x head_dim; the full T x T, as the
        default count, whatever the causal or sliding-window mask leaves out)."""
        t, d, h = self.tokens(model), model.dim, self.hidden(model)
        q, kv = self.attention_widths(model)
        matrices = 2 if self.is_gpt2 else 3
        return float(2 * t * (2 * d * q + 2 * d * kv + matrices * d * h) + 4 * t * t * q)

    def embed_flops(self, model: ModelSpec) -> float:
        return 0.0  # table lookups

    def head_flops(self, model: ModelSpec) -> float:
        """The output projection at every token: 2 d V T."""
        return float(2 * model.dim * (model.vocab_size or 0) * self.tokens(model))

    # -- a checkpoint -----------------------------------------------------------------------

    @property
    def key_prefix(self) -> str:
        return self.body_prefix

    def parse_config(self, raw: dict[str, Any]) -> Architecture:
        archs = raw.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in self.architectures:
            raise ValueError(
                f"config.json: unsupported `architectures` {archs!r} for model_type "
                f"{self.model_type!r}; allowed: one of {', '.join(sorted(self.architectures))}"
            )
        n = self.names
        hidden = _int(raw, n["hidden_size"])
        heads = _int(raw, n["num_attention_heads"])
        head_dim = _optional_int(raw, "head_dim", self.default_head_dim)
        if self.is_gpt2:
            kv_heads, head_dim = heads, None
            intermediate = _optional_int(raw, "n_inner", None) or 4 * hidden
            if raw.get("add_cross_attention"):
                raise ValueError(
                    "config.json: `add_cross_attention` true (a GPT-2 decoder of an "
                    "encoder-decoder model) is not supported; a language model has none"
                )
        else:
            kv_heads = _optional_int(raw, "num_key_value_heads", None) or heads
            intermediate = _int(raw, "intermediate_size")
            if heads % kv_heads:
                raise ValueError(
                    f"config.json: `num_key_value_heads` {kv_heads} does not divide "
                    f"`num_attention_heads` {heads}"
                )
        if head_dim is None and hidden % heads:
            raise ValueError(
                f"config.json: `{n['hidden_size']}` {hidden} is not a multiple of "
                f"`{n['num_attention_heads']}` {heads}"
            )
        self._check_window(raw)
        vocab = _int(raw, "vocab_size")
        task: HeadTask = self.architectures[archs[0]]
        return Architecture(
            family=self.name,
            task=task,
            architecture=archs[0],
            depth=_int(raw, n["num_hidden_layers"]),
            hidden_size=hidden,
            heads=heads,
            intermediate_size=intermediate,
            num_labels=vocab,  # the head's outputs: the vocabulary
            vocab_size=vocab,
            max_position_embeddings=_int(raw, n["max_position_embeddings"]),
            kv_heads=kv_heads,
            head_dim=head_dim or hidden // heads,
            tie_embeddings=_flag(raw, "tie_word_embeddings", self.default_tie),
        )

    def _check_window(self, raw: dict[str, Any]) -> None:
        """A sliding window in force must be a positive size (the build computes it)."""
        if self.sliding_switch is not None and not _flag(raw, self.sliding_switch, False):
            return
        if self.sliding_switch is not None or self.default_sliding_window is not None:
            _optional_int(raw, "sliding_window", self.default_sliding_window)

    def head_task(self, task: str) -> HeadTask:
        return "causal-lm"

    def for_task(self, arch: Architecture, task: str, num_labels: int) -> Architecture:
        """The causal language model a job trains (its outputs: the vocabulary, whatever
        `num_labels` says)."""
        cls = self.task_classes.get(task)
        if cls is None:
            raise ValueError(
                f"model.task: {task!r} is not available for {self.name} models; choose "
                f"{' or '.join(self.tasks)}"
            )
        return dataclasses.replace(
            arch, task="causal-lm", architecture=cls, num_labels=arch.vocab_size or 0
        )

    def spec_fields(self, arch: Architecture) -> dict[str, Any]:
        """The checkpoint's model; the task is always `causal-lm` and `num_classes` the
        vocabulary, a base model's too (its new head's outputs are decided as well)."""
        fields: dict[str, Any] = {
            "family": self.name,
            "task": CAUSAL_LM.name,
            "dim": arch.hidden_size,
            "depth": arch.depth,
            "heads": arch.heads,
            "mlp_ratio": arch.intermediate_size / arch.hidden_size,
            "vocab_size": arch.vocab_size,
            "num_classes": arch.vocab_size,
            "kv_heads": arch.kv_heads,
            "head_dim": arch.head_dim,
            "tie_embeddings": arch.tie_embeddings,
        }
        if self.is_gpt2:
            fields["max_positions"] = arch.max_position_embeddings
        return fields

    def unit_prefixes(self, arch: Architecture, name: str) -> tuple[str, ...]:
        p = self.key_prefix
        if name == "embed":
            if self.is_gpt2:
                return (f"{p}.wte.", f"{p}.wpe.")
            return (f"{p}.embed_tokens.",)
        if name.startswith("blocks."):
            layers = "h" if self.is_gpt2 else "layers"
            return (f"{p}.{layers}.{block_index(name, arch.depth)}.",)
        if name != "head":
            raise ValueError(f"unknown unit {name!r}: expected embed, blocks.<i> or head")
        return self.head_prefixes(arch)

    def head_prefixes(self, arch: Architecture) -> tuple[str, ...]:
        norm = "ln_f" if self.is_gpt2 else "norm"
        return (f"{self.key_prefix}.{norm}.", "lm_head.")

    def embedding_key(self) -> str:
        """The input embedding's parameter name (in the embed unit and the checkpoint)."""
        return f"{self.key_prefix}.{'wte' if self.is_gpt2 else 'embed_tokens'}.weight"

    def tied_parameters(
        self, model: Architecture | ModelSpec
    ) -> tuple[TiedParameter, TiedParameter] | None:
        if not model.tie_embeddings:
            return None
        return (("embed", self.embedding_key()), ("head", "lm_head.weight"))


BUILD = "pipetransformer.models.decoder"
TASKS = (CAUSAL_LM.name,)


def _family(name: str, base: str, causal_lm: str, **more: Any) -> DecoderFamily:
    return DecoderFamily(
        name=name,
        source="checkpoint",
        modality="text",
        build=BUILD,
        tasks=TASKS,
        model_type=name,
        architectures={base: "body", causal_lm: "causal-lm"},
        task_classes={CAUSAL_LM.name: causal_lm},
        **more,
    )


LLAMA = _family("llama", "LlamaModel", "LlamaForCausalLM")
QWEN2 = _family(
    "qwen2", "Qwen2Model", "Qwen2ForCausalLM", qkv_bias=True, sliding_switch="use_sliding_window"
)
QWEN3 = _family(
    "qwen3",
    "Qwen3Model",
    "Qwen3ForCausalLM",
    qk_norm=True,
    default_head_dim=128,
    sliding_switch="use_sliding_window",
)
MISTRAL = _family("mistral", "MistralModel", "MistralForCausalLM", default_sliding_window=4096)
GPT2 = _family(
    "gpt2",
    "GPT2Model",
    "GPT2LMHeadModel",
    style="gpt2",
    body_prefix="transformer",
    default_tie=True,
    names=dict(GPT2_NAMES),
)
