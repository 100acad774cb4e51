"""Workers: one row per rank of each generation, written by the controller's `Roster` from
the join request, the rank's reports, its presence lease and the post-mortem."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from sqlalchemy import and_, case, insert, literal, or_, select, update
from sqlalchemy.orm import Session

from pipetransformer.store.base import StoreBase
from pipetransformer.store.rows import WorkerRow
from pipetransformer.store.tables import LEASE_STATES, WORKER_STATES, UTCDateTime, Worker, utcnow
from pipetransformer.store.values import check_ranks, finite_time, from_unix, problems, unix

# (generation, rank) pairs per statement in `touch_workers`: under bind-parameter limits
_TOUCH_CHUNK = 200


class _WorkerMember(BaseModel):
    """A rank of a generation as its join request names it (`Store.add_workers`)."""

    model_config = ConfigDict(extra="forbid")

    rank: StrictInt = Field(ge=0)
    node: str  # "host:agent-pid"; "" when the join request did not name it
    pid: StrictInt | None = Field(default=None, ge=0)
    host: str | None = None


_worker_members = TypeAdapter(list[_WorkerMember])


class _WorkerUpdate(BaseModel):
    """What `Store.update_workers` may set; fields not passed are left alone."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = None
    pid: StrictInt | None = Field(default=None, ge=0)
    stages: list[StrictInt] | None = None
    replica: StrictInt | None = Field(default=None, ge=0)
    log: str | None = None
    started_at: float | None = Field(default=None, allow_inf_nan=False)  # unix seconds
    state: str | None = None
    lease: str | None = None
    exit_code: StrictInt | None = None
    signal: StrictInt | None = Field(default=None, ge=1)
    detail: str | None = None

    @field_validator("stages")
    @classmethod
    def _stages(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(i < 0 for i in value):
            raise ValueError(f"stage indices must be >= 0, got {value}")
        return value

    @field_validator("state")
    @classmethod
    def _state(cls, value: str | None) -> str:
        if value not in WORKER_STATES:
            raise ValueError(f"{value!r} is not one of {', '.join(WORKER_STATES)}")
        return value

    @field_validator("lease")
    @classmethod
    def _lease(cls, value: str | None) -> str:
        if value not in LEASE_STATES:
            raise ValueError(f"{value!r} is not one of {', '.join(LEASE_STATES)}")
        return value

    def columns(self) -> dict[str, Any]:
        """The `workers` columns to set, from the fields the caller passed."""
        out: dict[str, Any] = {}
        for name in self.model_fields_set:
            value = getattr(self, name)
            if name == "stages":
                out["stages_json"] = None if value is None else json.dumps(value)
            elif name == "started_at":
                out["started_at"] = None if value is None else from_unix(value)
            else:
                out[name] = value
        return out


def _worker_row(w: Worker) -> WorkerRow:
    return WorkerRow(
        generation=w.generation,
        rank=w.rank,
        node=w.node,
        host=w.host,
        pid=w.pid,
        stages=None if w.stages_json is None else json.loads(w.stages_json),
        replica=w.replica,
        log=w.log,
        assigned_at=unix(w.assigned_at),
        started_at=None if w.started_at is None else unix(w.started_at),
        last_report_at=None if w.last_report_at is None else unix(w.last_report_at),
        lease=w.lease,
        state=w.state,
        exit_code=w.exit_code,
        signal=w.signal,
        detail=w.detail,
    )


class WorkersMixin(StoreBase):
    def add_workers(
        self,
        job_id: str,
        generation: int,
        members: Sequence[Mapping[str, Any]],
        time: float | None = None,
    ) -> int:
        """Record the ranks of a generation as its join request names them, in state "assigned"
        with lease "unknown": `members` are dicts with `rank`, `node` ("host:agent-pid"), and
        optionally `pid` and `host`. `time` (unix seconds, default now) is `assigned_at`.

        Ranks already recorded for the generation are left as they are (a restarted controller
        re-adds them), so this is idempotent; returns the number of rows inserted. Raises
        NotFound if the job has no such generation."""
        try:
            parsed = _worker_members.validate_python(list(members))
        except ValidationError as err:
            raise ValueError(f"invalid workers: {problems(err, 'members')}") from None
        seen: set[int] = set()
        for i, m in enumerate(parsed):
            if m.rank in seen:
                raise ValueError(f"invalid workers: members[{i}].rank: rank {m.rank} repeated")
            seen.add(m.rank)
        when = utcnow() if time is None else from_unix(finite_time(time, "time"))
        tried: set[int] = set()  # ranks an earlier try of this call inserted (may have landed)

        def tx(s: Session) -> int:
            self._generation(s, job_id, generation)
            existing = set(
                s.scalars(
                    select(Worker.rank).where(
                        Worker.job_id == job_id, Worker.generation == generation
                    )
                )
            )
            new = [
                {
                    "job_id": job_id,
                    "generation": generation,
                    "rank": m.rank,
                    "node": m.node,
                    "host": m.host,
                    "pid": m.pid,
                    "assigned_at": when,
                    "lease": "unknown",
                    "state": "assigned",
                }
                for m in sorted(parsed, key=lambda m: m.rank)
                if m.rank not in existing
            ]
            ours = len(existing & tried)
            tried.update(row["rank"] for row in new)
            if new:
                s.execute(insert(Worker), new)
            return len(new) + ours

        return self._write("add_workers", tx)

    def update_workers(
        self, job_id: str, generation: int, ranks: Sequence[int], **fields: Any
    ) -> int:
        """Set the same `fields` on some ranks of a generation, in one statement: any of
        `host, pid, stages (list[int]), replica, log, started_at (unix seconds), state, lease,
        exit_code, signal, detail`; fields not passed are left alone, None clears a nullable one.
        Setting values is idempotent. Returns the number of rows matched: ranks (or a
        generation) without a row are skipped, not an error."""
        try:
            update_ = _WorkerUpdate.model_validate(fields)
        except ValidationError as err:
            raise ValueError(f"invalid worker update: {problems(err, 'fields')}") from None
        values = update_.columns()
        if not values:
            raise ValueError("invalid worker update: no fields given")
        wanted = check_ranks(ranks)

        def tx(s: Session) -> int:
            self._job(s, job_id)
            if not wanted:
                return 0
            result = s.execute(
                update(Worker)
                .where(
                    Worker.job_id == job_id,
                    Worker.generation == generation,
                    Worker.rank.in_(wanted),
                )
                .values(**values)
                .execution_options(synchronize_session=False)  # no rows loaded in this session
            )
            return result.rowcount  # type: ignore[attr-defined]

        return self._write("update_workers", tx)

    def touch_workers(self, job_id: str, times: Mapping[tuple[int, int], float]) -> None:
        """Advance `last_report_at` of several ranks in one statement: `times` maps (generation,
        rank) to the time of its newest report (unix seconds). A time never moves back (reports
        replayed after a controller restart, clocks of other hosts); ranks without a row are
        skipped."""
        pairs: list[tuple[int, int, datetime]] = []
        for key, t in times.items():
            if not (
                isinstance(key, tuple)
                and len(key) == 2
                and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in key)
            ):
                raise ValueError(f"invalid worker times: key {key!r} is not (generation, rank)")
            pairs.append((key[0], key[1], from_unix(finite_time(t, f"times[{key!r}]"))))

        def tx(s: Session) -> None:
            self._job(s, job_id)
            for i in range(0, len(pairs), _TOUCH_CHUNK):
                chunk = pairs[i : i + _TOUCH_CHUNK]
                who = [and_(Worker.generation == g, Worker.rank == r) for g, r, _ in chunk]
                newer = [
                    and_(w, or_(Worker.last_report_at.is_(None), Worker.last_report_at < t))
                    for w, (_, _, t) in zip(who, chunk, strict=True)
                ]
                new_time = case(
                    *[
                        (w, literal(t, UTCDateTime()))
                        for w, (_, _, t) in zip(who, chunk, strict=True)
                    ],
                    else_=Worker.last_report_at,
                )
                s.execute(
                    update(Worker)
                    .where(Worker.job_id == job_id, or_(*newer))
                    .values(last_report_at=new_time)
                    .execution_options(synchronize_session=False)
                )

        self._write("touch_workers", tx)

    def workers(self, job_id: str) -> list[WorkerRow]:
        """Every rank of every generation, by generation then rank."""

        def tx(s: Session) -> list[WorkerRow]:
            self._job(s, job_id)
            rows = s.scalars(
                select(Worker)
                .where(Worker.job_id == job_id)
                .order_by(Worker.generation, Worker.rank)
            )
            return [_worker_row(w) for w in rows]

        return self._read("workers", tx)
