"""Check an environment against the lock: every distribution that a requirement reaches (the
project with its extras, then what each of those requires, markers evaluated for this
interpreter) is pinned in the lock, and installed at the pinned version.

    python scripts/check_lock.py requirements/lock.txt 'pipetransformer[test,bench]'

scripts/install.sh runs it after each install (CI, the image's builders). It reads only the
installed metadata and the lock file: no network. A CUDA build of torch pins its own nvidia-*
and triton wheels exactly (==), and those pins count as pinned: the lock is resolved against the
CPU build (scripts/lock.sh), whose metadata lists none of them.

Exit status: 0 when everything is pinned and installed as pinned, 1 with one line per problem.
Standard library only (plus `packaging`, pip's own copy when the environment has none), so that
it runs in any environment the lock installs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare venv: pip's vendored copy of the same library
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet


def normalize(name: str) -> str:
    """PEP 503: `Foo_bar.baz` and `foo-bar-baz` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    version: str
    marker: Marker | None

    def applies(self) -> bool:
        return self.marker is None or self.marker.evaluate()


def read_lock(text: str) -> dict[str, list[Pin]]:
    """name -> its pins (several where markers split it, e.g. by Python version). A line that is
    not `name==version [; marker]` is refused: a lock pins, it does not range."""
    pins: dict[str, list[Pin]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise ValueError(f"line {number}: {raw.strip()!r} is not an exact pin (name==version)")
        pins.setdefault(normalize(req.name), []).append(Pin(specs[0].version, req.marker))
    return pins


def pinned_version(pins: dict[str, list[Pin]], name: str) -> str | None:
    """The version the lock pins `name` at for this interpreter, or None."""
    return next((p.version for p in pins.get(normalize(name), []) if p.applies()), None)


def _wanted(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in ("", *extras))


@dataclass
class Node:
    """One installed distribution of the closure and the requirements that reached it."""

    version: str
    root: bool = False
    # (the requiring distribution's name, or None for the command line; the requirement)
    incoming: list[tuple[str | None, Requirement]] = field(default_factory=list)


def closure(roots: Iterable[str]) -> tuple[dict[str, Node], list[str]]:
    """Every installed distribution the `roots` reach (markers and extras evaluated), and the
    requirements that are not installed."""
    nodes: dict[str, Node] = {}
    missing: list[str] = []
    expanded: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[Requirement, str | None]] = [(Requirement(r), None) for r in roots]
    while todo:
        req, parent = todo.pop()
        name = normalize(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(
                f"{req.name} (required by {parent or 'the command line'}) is not installed"
            )
            continue
        node = nodes.setdefault(name, Node(dist.version))
        node.root = node.root or parent is None
        node.incoming.append((parent, req))
        key = (name, frozenset(req.extras))
        if key in expanded:
            continue
        expanded.add(key)
        for dep in dist.requires or []:
            sub = Requirement(dep)
            if _wanted(sub, req.extras):
                todo.append((sub, name))
    return nodes, missing


def problems(pins: dict[str, list[Pin]], roots: Iterable[str]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of this environment against the lock, one line each. `roots` are
    requirements (`pipetransformer[test,bench]`); each must be installed, and is not itself
    looked up in the lock (the project is no dependency of itself).

    A distribution is pinned when the lock pins it (and then it must be installed at that
    version) or when a requirement that reached it pins it exactly: a CUDA build of torch pins
    its nvidia-* wheels so. One that is neither is a problem where a root or a package of the
    lock needs it (the lock is stale), and only a warning where nothing but such exactly pinned
    wheels does: it comes with torch's build, which the lock does not resolve (scripts/lock.sh).
    """
    nodes, found = closure(roots)
    warned: list[str] = []
    for name, node in sorted(nodes.items()):
        if node.root:
            continue
        pin = pinned_version(pins, name)
        if pin is not None:
            if not SpecifierSet(f"=={pin}").contains(node.version, prereleases=True):
                found.append(f"{name} is installed at {node.version}, the lock pins {pin}")
            continue
        if any(s.operator in ("==", "===") for _, req in node.incoming for s in req.specifier):
            continue
        parents = sorted({p for p, _ in node.incoming if p is not None})
        via = "; ".join(f"{p}: {req}" for p, req in node.incoming)
        line = f"{name}=={node.version} (required by {via}) is not pinned in the lock"
        locked = [p for p in parents if nodes[p].root or pinned_version(pins, p) is not None]
        (found if locked else warned).append(line)
    return found, warned


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    lock = Path(argv[0])
    try:
        pins = read_lock(lock.read_text())
    except (OSError, ValueError) as exc:
        print(f"check_lock: {lock}: {exc}", file=sys.stderr)
        return 1
    found, warned = problems(pins, argv[1:])
    for line in warned:
        print(f"check_lock: warning: {line}, but comes with torch's build", file=sys.stderr)
    for line in found:
        print(f"check_lock: {line}", file=sys.stderr)
    if found:
        print(
            f"check_lock: {lock} does not pin what {' '.join(argv[1:])} needs: change "
            "pyproject.toml, then run scripts/lock.sh (docs/image.md)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
