"""How values cross into and out of the database, and the input checks the writers share.

Times are stored as timezone-aware UTC datetimes (`tables.UTCDateTime`) and cross the API as
unix seconds where the trainer reports them that way; non-finite floats are stored as NULL
(SQLite cannot store NaN, and JSON has no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError


def from_unix(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def unix(dt: datetime) -> float:
    return dt.timestamp()


def finite_or_none(value: float | None) -> float | None:
    # SQLite stores NaN as NULL (and rejects it in NOT NULL columns); make that explicit.
    return value if value is not None and math.isfinite(value) else None


def json_safe(value: Any) -> Any:
    """Non-finite floats become null: stored JSON stays standard (a diverged loss in event data
    must not make the event unrecordable)."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def problems(err: ValidationError, what: str) -> str:
    """A validation error as one line naming each field like the caller's data: the loc is
    (row index, field), e.g. "members[3].rank"."""
    out = []
    for e in err.errors():
        loc = list(e["loc"])
        where = what + (f"[{loc.pop(0)}]" if loc and isinstance(loc[0], int) else "")
        where += "".join(f".{p}" for p in loc)
        out.append(f"{where}: {e['msg']}")
    return "; ".join(out)


def check_state(kind: str, state: str, allowed: Sequence[str]) -> None:
    if state not in allowed:
        raise ValueError(f"{kind} state {state!r} is not valid; allowed: {', '.join(allowed)}")


def finite_time(t: Any, name: str) -> float:
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise ValueError(f"{name} must be finite unix seconds, got {t!r}")
    return float(t)


def check_ranks(ranks: Sequence[int]) -> list[int]:
    """`ranks` sorted without repeats; ValueError unless every one is an integer >= 0."""
    if isinstance(ranks, str) or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
    ):
        raise ValueError(f"ranks must be integers >= 0, got {ranks!r}")
    return sorted(set(ranks))
