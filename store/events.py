"""The job's event log: what happened, when, from which rank, with its data as JSON."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipetransformer.store.base import StoreBase
from pipetransformer.store.rows import EventRow
from pipetransformer.store.tables import EVENT_KEY_MAX_CHARS, Event, utcnow
from pipetransformer.store.values import from_unix, json_safe, unix


class EventsMixin(StoreBase):
    def add_event(
        self,
        job_id: str,
        kind: str,
        message: str,
        rank: int | None = None,
        data: dict[str, Any] | None = None,
        time: float | None = None,
        key: str | None = None,
    ) -> bool:
        """Append to the job's event log (`time`: unix seconds, default now).

        `key` makes the event idempotent: an event whose key the job already has is skipped
        (returns False). Pass a stable key (e.g. the etcd key of a worker report) when the same
        event may be recorded again after a crash; without one, each call gets a fresh key, so
        a retried commit still records it exactly once.
        """
        if not kind or len(kind) > 32:
            raise ValueError(f"event kind {kind!r} must be 1-32 characters")
        if key is not None and not 1 <= len(key) <= EVENT_KEY_MAX_CHARS:
            raise ValueError(f"event key must be 1-{EVENT_KEY_MAX_CHARS} characters")
        try:
            data_json = None if data is None else json.dumps(json_safe(data), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event data must be JSON-serialisable: {exc}") from None
        when = utcnow() if time is None else from_unix(time)
        dedup_key = key if key is not None else f"auto:{uuid.uuid4().hex}"
        tried = False  # an earlier try of this call inserted it (its commit may have landed)

        def tx(s: Session) -> bool:
            nonlocal tried
            self._job(s, job_id)
            seen = s.scalar(
                select(Event.id).where(Event.job_id == job_id, Event.dedup_key == dedup_key)
            )
            if seen is not None:
                return tried
            tried = True
            s.add(
                Event(
                    job_id=job_id,
                    time=when,
                    kind=kind,
                    rank=rank,
                    message=message,
                    data_json=data_json,
                    dedup_key=dedup_key,
                )
            )
            return True

        return self._write("add_event", tx)

    def events(
        self, job_id: str, limit: int = 100, kinds: Sequence[str] | None = None
    ) -> list[EventRow]:
        """The job's most recent events, newest first. `kinds`: only events of these kinds
        (e.g. `["freeze_requested"]`); None for all."""
        if isinstance(kinds, str):  # "freeze" would otherwise mean the kinds f, r, e, ...
            raise ValueError(f"kinds must be a sequence of event kinds, not the string {kinds!r}")
        wanted = None if kinds is None else list(kinds)

        def tx(s: Session) -> list[EventRow]:
            self._job(s, job_id)
            q = select(Event).where(Event.job_id == job_id)
            if wanted is not None:
                q = q.where(Event.kind.in_(wanted))
            rows = s.scalars(q.order_by(Event.time.desc(), Event.id.desc()).limit(limit))
            return [
                EventRow(
                    id=e.id,
                    time=unix(e.time),
                    kind=e.kind,
                    rank=e.rank,
                    message=e.message,
                    data=None if e.data_json is None else json.loads(e.data_json),
                )
                for e in rows
            ]

        return self._read("events", tx)
