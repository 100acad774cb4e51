"""Reading a job spec file safely: bounded bytes, strict UTF-8, and a YAML loader that refuses
what a spec never needs and a careless or hostile file could use to hang or mislead the CLI.

* Size: at most `MAX_BYTES` (a spec is a few kilobytes).
* Text: UTF-8 (a leading BOM is allowed); a binary file or another encoding is refused with the
  byte offset and line of the first byte that is not UTF-8 text.
* Duplicate keys in one mapping are refused (PyYAML keeps the last silently), naming the key and
  both lines. Keys merged in with `<<: *anchor` may still be overridden, as YAML intends.
* Aliases: at most `MAX_ALIASES` references, and the document expanded (every alias replaced by
  a copy of its anchor) at most `MAX_NODES` nodes, counted while composing, before anything is
  constructed: a "billion laughs" document is refused in milliseconds. An alias inside its own
  anchor (a recursive structure) is refused.
* Nesting: at most `MAX_NESTING` levels (PyYAML's composer recurses per level).
* Numbers: `1e9` and `3e-4` are floats, as in YAML 1.2 and JSON (YAML 1.1, which PyYAML follows,
  reads them as strings, so `dim: 1e9` would be refused as "not an integer" rather than "too big");
  an integer of more than `MAX_DIGITS` digits is refused. Dates are not resolved (no spec value is
  one): `2024-01-01` stays a string.

Pure apart from reading the file; no pydantic here (core/spec/ validates the result).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

MAX_BYTES = 1 << 20
MAX_ALIASES = 100
MAX_NODES = 10_000  # a spec has ~100 values; a per-stage recompute list at most 128
MAX_NESTING = 50
MAX_DIGITS = 100

_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
_MERGE = "tag:yaml.org,2002:merge"
_FLOAT = "tag:yaml.org,2002:float"
_INT = "tag:yaml.org,2002:int"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class SpecFileError(ValueError):
    """The file cannot be read as a YAML mapping; the message says why and where."""


class _Refused(yaml.YAMLError):
    """A document the loader refuses on purpose (its message is shown as is)."""


class SpecLoader(yaml.SafeLoader):
    """SafeLoader with bounded aliases and nesting, duplicate keys refused and YAML 1.2 floats."""

    def __init__(self, stream: str, name: str = "<spec>"):
        super().__init__(stream)
        self.name = name  # marks in PyYAML's own messages then name the file
        self._aliases = 0
        self._expanded = 0  # nodes composed so far, every alias counted as its anchor's size
        self._nesting = 0
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its expanded size, once complete

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Refused(
                    f"more than {MAX_ALIASES} alias references (*name), at line "
                    f"{event.start_mark.line + 1}; a job spec needs few, if any"
                )
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:  # its anchor is still being composed: the alias is inside it
                raise _Refused(
                    f"alias *{event.anchor} at line {event.start_mark.line + 1} refers to a node "
                    "that contains it (a recursive structure); a job spec cannot be recursive"
                )
            self._count(size, event.start_mark)
            return node
        event = self.peek_event()
        self._nesting += 1
        if self._nesting > MAX_NESTING:
            raise _Refused(
                f"nested more than {MAX_NESTING} levels deep at line {event.start_mark.line + 1}; "
                "a job spec is a few levels of mappings"
            )
        self._count(1, event.start_mark)
        before = self._expanded - 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._nesting -= 1
        if getattr(event, "anchor", None) is not None:
            self._sizes[id(node)] = self._expanded - before
        return node

    def _count(self, nodes: int, mark: yaml.Mark) -> None:
        self._expanded += nodes
        if self._expanded > MAX_NODES:
            how = " once its aliases are expanded" if self._aliases else ""
            raise _Refused(
                f"more than {MAX_NODES} values{how} (at line {mark.line + 1}); a job spec has "
                "a few dozen"
            )

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE:
                    continue  # merged keys may be overridden; PyYAML refuses non-scalar keys
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    shown = repr(key) if len(repr(key)) <= 60 else f"{repr(key)[:50]}..."
                    raise _Refused(
                        f"duplicate key {shown} at line {seen[key]} and line {line}: YAML "
                        "would keep only the last one; remove one of them"
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        # Python refuses int <-> str past 4300 digits with advice about sys settings; no spec
        # value has more than a few dozen
        if len(node.value) > MAX_DIGITS:
            raise _Refused(
                f"the number at line {node.start_mark.line + 1} has more than {MAX_DIGITS} "
                "digits; no spec value is that large"
            )
        return super().construct_yaml_int(node)


# A spec holds no dates: unquoted `2024-13-45` would otherwise fail as a bad date, and a name
# like `2024-01-01` would become a date instead of the string it is meant to be.
SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
SpecLoader.add_implicit_resolver(_FLOAT, _FLOAT_12, list("-+0123456789."))
SpecLoader.add_constructor(_INT, SpecLoader.construct_yaml_int)


def _line(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


def read_text(path: Path) -> str:
    """The file's text: at most MAX_BYTES of UTF-8 (SpecFileError naming the problem if not)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SpecFileError(f"cannot read the file: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise SpecFileError(
            f"larger than {MAX_BYTES // 1024} KiB; a job spec is a few kilobytes of YAML (is "
            "this the right file?)"
        )
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise SpecFileError("UTF-16 text; save the file as UTF-8")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise SpecFileError(
            f"a binary file, not YAML text (a NUL byte at byte offset {nul}, "
            f"line {_line(raw, nul)})"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start
        raise SpecFileError(
            f"not UTF-8 text: byte 0x{raw[at]:02x} at byte offset {at} (line "
            f"{_line(raw, at)}) is not valid UTF-8; save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def parse_yaml(text: str, name: str = "<spec>") -> Any:
    """One YAML document parsed with SpecLoader (SpecFileError saying why it cannot be)."""
    loader = SpecLoader(text, name)
    try:
        return loader.get_single_data()
    except _Refused as exc:
        raise SpecFileError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise SpecFileError(f"not valid YAML: {exc}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # a tagged scalar its constructor rejects (`!!int x`, `!!binary` that is not base64)
        raise SpecFileError(f"not valid YAML: a value cannot be read ({exc})") from None
    finally:
        loader.dispose()


def read_spec_file(path: Path) -> Any:
    """The file's YAML (or JSON) document, read and parsed with the bounds above."""
    return parse_yaml(read_text(path), str(path))
