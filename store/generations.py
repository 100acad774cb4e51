"""Generations: each incarnation of a job's worker group, opened at a rendezvous and closed
with how (and why) it ended."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipetransformer.store.base import StoreBase
from pipetransformer.store.rows import GenerationRow
from pipetransformer.store.tables import GENERATION_STATES, Generation, utcnow
from pipetransformer.store.values import check_state


class GenerationsMixin(StoreBase):
    def start_generation(self, job_id: str, world_size: int) -> int:
        """Open the job's next generation (numbered from 1) in state "running"."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        started = utcnow()  # this call's identity across retries

        def tx(s: Session) -> int:
            self._job(s, job_id)
            mine = s.scalar(
                select(Generation.number).where(
                    Generation.job_id == job_id,
                    Generation.started_at == started,
                    Generation.world_size == world_size,
                )
            )
            if mine is not None:
                return mine  # an earlier try of this call committed
            last = s.scalar(select(func.max(Generation.number)).where(Generation.job_id == job_id))
            number = (last or 0) + 1
            s.add(
                Generation(
                    job_id=job_id,
                    number=number,
                    world_size=world_size,
                    state="running",
                    started_at=started,
                    ended_at=None,
                )
            )
            return number

        return self._write("start_generation", tx)

    def end_generation(
        self, job_id: str, number: int, state: str, reason: str | None = None
    ) -> None:
        """Close a generation in `state`, saying why (`reason`) when there is more to say than
        the state."""
        ended = tuple(g for g in GENERATION_STATES if g != "running")
        check_state("generation end", state, ended)

        def tx(s: Session) -> None:
            gen = self._generation(s, job_id, number)
            gen.state = state
            gen.ended_at = utcnow()
            if reason is not None:
                gen.reason = reason

        self._write("end_generation", tx)

    def explain_generation(self, job_id: str, number: int, reason: str) -> None:
        """Replace a generation's end reason: what ended it is sometimes learnt after it ended
        (a dead process's exit status or lapsed lease arrives after its peers' reports)."""

        def tx(s: Session) -> None:
            self._generation(s, job_id, number).reason = reason

        self._write("explain_generation", tx)

    def generations(self, job_id: str) -> list[GenerationRow]:
        """The job's generations, oldest first."""

        def tx(s: Session) -> list[GenerationRow]:
            self._job(s, job_id)
            rows = s.scalars(
                select(Generation).where(Generation.job_id == job_id).order_by(Generation.number)
            )
            return [
                GenerationRow(
                    number=g.number,
                    world_size=g.world_size,
                    state=g.state,
                    started_at=g.started_at,
                    ended_at=g.ended_at,
                    reason=g.reason,
                )
                for g in rows
            ]

        return self._read("generations", tx)
