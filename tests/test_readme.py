"""The README is the way in: short, every command in its table, every link to a file that exists;
the rest lives in docs/. And the CLI says what each positional argument is."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pipetransformer.orchestrator.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_readme_is_short_and_its_lines_readable() -> None:
    """Before: 1,063 lines, no table of contents, 45 lines over 200 characters."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    assert [n for n, line in enumerate(lines, 1) if len(line) > 200] == []
    assert "## Contents" in lines
    # the two commands of the first screen, within its first 15 lines
    first = "\n".join(lines[:15])
    assert "./scripts/run-example.sh" in first and "./scripts/test.sh" in first


def test_the_commands_table_has_every_command() -> None:
    """Before: `export`, `db`, `etcd` and `etcd-auth` were missing."""
    text = README.read_text()
    table = text[text.index("## Commands") :]
    table = table[: table.index("\n## ")]
    for name in _subcommands():
        assert f"`pipetransformer {name}" in table, name


def test_every_positional_argument_says_what_it_is() -> None:
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"pipetransformer {name}: {action.dest} has no help"


def test_every_relative_link_points_at_a_file() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(REPO)}: {target}"
