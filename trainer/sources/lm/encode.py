"""Documents from rows: a text column through the tokenizer, or a chat column (a list of
{role, content} messages) rendered by the tokenizer's own chat template.

Text: `tokenizer(texts, add_special_tokens=True)` (so a tokenizer that begins documents with
BOS does so), then EOS (`packing.with_eos`). Every token is one to learn.

Chat: the template renders the conversation (`apply_chat_template`, no generation prompt) and
its text is tokenised with `add_special_tokens=False`, as `apply_chat_template(tokenize=True)`
does. The tokens to learn (the mask) are the assistant's: where the template marks them with
`{% generation %}` ... `{% endgeneration %}`, transformers' own assistant mask
(`return_assistant_tokens_mask=True`); otherwise from rendering prefixes of the conversation:
for the assistant message i, its span of the rendered text runs from the end of the render of
messages [0, i) with the generation prompt (without it, for a template that ignores the flag)
to the end of the render of messages [0, i], trailing whitespace left out, so the span holds
the assistant's content and its end-of-turn token as the template writes them. A token counts
when it overlaps a span (transformers' rule). This needs a template whose renders of a prefix
are prefixes of the whole conversation's render; one that rewrites earlier turns (dropping an
earlier reasoning trace, say) raises DataError asking for generation markers. An assistant
message that opens a conversation has its span from the very start.

Refused, with a DataError naming the file and the row: a null or empty value, a text that is not
a string, a conversation that is not a list of {role, content} messages, a role outside
`LMData.roles` or one the template raises on, a conversation without an assistant message or
longer than seq_len tokens (its end-of-document token included: it must fit one sequence). A
tokenizer without a chat template is refused before any row is read."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources.lm.packing import with_eos
from pipetransformer.trainer.sources.lm.reading import Chunk

DEFAULT_ROLES = ("system", "user", "assistant", "tool")
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class LMData:
    """How a corpus becomes documents: what, with the files and the tokenizer, the token cache
    is keyed by. `column` defaults to "text" (mode "text") or "messages" (mode "chat")."""

    seq_len: int
    mode: Literal["text", "chat"] = "text"
    column: str | None = None
    roles: tuple[str, ...] = DEFAULT_ROLES

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be positive (got {self.seq_len})")
        if self.mode not in ("text", "chat"):
            raise ValueError(f"mode must be 'text' or 'chat' (got {self.mode!r})")

    @property
    def column_name(self) -> str:
        if self.column is not None:
            return self.column
        return "text" if self.mode == "text" else "messages"


@dataclass(frozen=True)
class Document:
    ids: np.ndarray  # int64 [n], ending with EOS
    mask: np.ndarray | None  # bool [n] (chat): the tokens to learn


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """The checkpoint's tokenizer (`AutoTokenizer.from_pretrained`), fast (offsets are needed)
    and with an EOS token."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise DataError(f"cannot load a tokenizer from {directory}: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise DataError(f"the tokenizer in {directory} is not a fast (tokenizers) one")
    if tok.eos_token_id is None:
        raise DataError(
            f"the tokenizer in {directory} has no eos_token; documents are separated by it"
        )
    return tok


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _overlap(offsets: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """bool [n]: which tokens (character `offsets` [n, 2]) overlap one of `spans` (sorted)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    out = np.zeros(len(off), dtype=bool)
    if not spans or not len(off):
        return out
    a = np.array([s for s, _ in spans], dtype=np.int64)
    b = np.array([e for _, e in spans], dtype=np.int64)
    k = np.searchsorted(b, off[:, 0], side="right")  # the first span ending after the token's start
    inside = k < len(b)
    out[inside] = a[k[inside]] < off[inside, 1]
    return out


class Encoder:
    """A chunk of one column's values as documents (`encode`), through the tokenizer loaded
    from `directory`."""

    def __init__(self, tokenizer: Any, data: LMData, directory: str) -> None:
        self.tok, self.data, self.directory = tokenizer, data, directory
        self.eos = int(tokenizer.eos_token_id)
        self.markers = False
        if data.mode == "chat":
            try:
                template = tokenizer.get_chat_template()
            except Exception as exc:
                raise DataError(
                    f"the tokenizer in {directory} has no chat template (chat_template); chat "
                    "data is rendered with it, so use a checkpoint that has one or add it"
                ) from exc
            self.markers = bool(GENERATION.search(template))

    def encode(self, chunk: Chunk) -> list[Document]:
        if self.data.mode == "text":
            return self._text(chunk)
        return self._chat(chunk)

    # --- text ---------------------------------------------------------------------------------

    def _text(self, chunk: Chunk) -> list[Document]:
        column = self.data.column_name
        for k, v in enumerate(chunk.values):
            if v is None or v == "":
                raise DataError(f"{chunk.where(k)}: column {column!r} is empty")
            if not isinstance(v, str):
                raise DataError(
                    f"{chunk.where(k)}: column {column!r} holds {type(v).__name__} "
                    f"{_short(v)}, not text"
                )
        ids = self.tok(list(chunk.values), add_special_tokens=True)["input_ids"]
        return [Document(with_eos(i, self.eos), None) for i in ids]

    # --- chat ---------------------------------------------------------------------------------

    def _conversation(self, chunk: Chunk, k: int, value: object) -> list[dict[str, Any]]:
        where, column = chunk.where(k), self.data.column_name
        if value is None or (isinstance(value, list | tuple) and not value):
            raise DataError(f"{where}: column {column!r} is empty")
        if not isinstance(value, list | tuple):
            raise DataError(
                f"{where}: column {column!r} holds {type(value).__name__} {_short(value)}, not "
                "a list of {role, content} messages"
            )
        messages = []
        for j, m in enumerate(value):
            if not isinstance(m, dict):
                raise DataError(f"{where}: message {j} is {_short(m)}, not a {{role, content}}")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str):
                raise DataError(f"{where}: message {j} has no role")
            if role not in self.data.roles:
                raise DataError(
                    f"{where}: message {j} has role {role!r}, which the chat template does not "
                    f"know; the roles are {', '.join(self.data.roles)}"
                )
            if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
                raise DataError(
                    f"{where}: message {j} ({role}) has content {_short(content)}, not text"
                )
            messages.append({key: v for key, v in m.items() if v is not None})
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message to learn from")
        return messages

    def _render(
        self, chunk: Chunk, k: int, messages: list[dict[str, Any]], prompt: bool = False
    ) -> str:
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
        except Exception as exc:
            raise DataError(
                f"{chunk.where(k)}: the chat template of {self.directory} refuses the "
                f"conversation: {exc}"
            ) from exc

    def _spans(
        self, chunk: Chunk, k: int, messages: list[dict[str, Any]]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and its assistant spans, from prefix renders."""
        full = self._render(chunk, k, messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            upto = self._render(chunk, k, messages[: i + 1])
            before = self._render(chunk, k, messages[:i], prompt=True) if i else ""
            if i and not upto.startswith(before):  # a template without a generation prompt
                before = self._render(chunk, k, messages[:i])
            if not (full.startswith(upto) and upto.startswith(before)):
                raise DataError(
                    f"{chunk.where(k)}: the chat template of {self.directory} renders the "
                    f"conversation up to message {i} differently from the start of the whole "
                    "conversation, so the assistant's tokens cannot be told from prefixes; "
                    "mark them in the template with {% generation %} ... {% endgeneration %}"
                )
            spans.append((len(before), max(len(before), len(upto.rstrip()))))
        return full, spans

    def _chat(self, chunk: Chunk) -> list[Document]:
        conversations = [self._conversation(chunk, k, v) for k, v in enumerate(chunk.values)]
        if self.markers:
            try:
                out = self.tok.apply_chat_template(
                    conversations,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                )
            except Exception:
                for k, c in enumerate(conversations):  # which row: the DataError names it
                    self._render(chunk, k, c)
                raise
            ids_list, masks = out["input_ids"], out["assistant_masks"]
        else:
            rendered = [self._spans(chunk, k, c) for k, c in enumerate(conversations)]
            enc = self.tok(
                [text for text, _ in rendered],
                add_special_tokens=False,
                return_offsets_mapping=True,
            )
            ids_list = enc["input_ids"]
            masks = [
                _overlap(o, s) for o, (_, s) in zip(enc["offset_mapping"], rendered, strict=True)
            ]
        docs = []
        for k, (ids, m) in enumerate(zip(ids_list, masks, strict=True)):
            full = with_eos(ids, self.eos)
            mask = np.zeros(len(full), dtype=bool)
            mask[: len(m)] = np.asarray(m, dtype=bool)
            if len(full) > self.data.seq_len:
                raise DataError(
                    f"{chunk.where(k)}: the conversation is {len(full)} tokens (with its "
                    f"end-of-document token), longer than seq_len {self.data.seq_len}; "
                    "shorten it or raise seq_len"
                )
            if not mask.any():
                raise DataError(
                    f"{chunk.where(k)}: the chat template leaves no assistant token to learn"
                )
            docs.append(Document(full, mask))
        return docs
