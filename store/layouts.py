"""Layouts: every version a job ran under, by version; the highest is the one in force and
owns the job's freeze boundary."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipetransformer.core.state import Layout
from pipetransformer.store.base import StoreBase
from pipetransformer.store.errors import StoreConflict
from pipetransformer.store.rows import RecordedLayout
from pipetransformer.store.tables import LayoutRow, utcnow


class LayoutsMixin(StoreBase):
    def record_layout(self, job_id: str, layout: Layout, reason: str) -> None:
        """Store `layout` under its version. Recording the same layout again is a no-op; a
        different layout under an existing version raises StoreConflict."""

        def tx(s: Session) -> None:
            self._job(s, job_id)
            existing = s.scalar(
                select(LayoutRow).where(
                    LayoutRow.job_id == job_id, LayoutRow.version == layout.version
                )
            )
            if existing is not None:
                if Layout.model_validate_json(existing.layout_json) != layout:
                    raise StoreConflict(
                        f"job {job_id!r} already has a different layout v{layout.version}; "
                        "a changed layout needs a new version"
                    )
                return
            s.add(
                LayoutRow(
                    job_id=job_id,
                    version=layout.version,
                    layout_json=layout.model_dump_json(),
                    reason=reason,
                    created_at=utcnow(),
                )
            )

        self._write("record_layout", tx)

    def current_layout(self, job_id: str) -> Layout | None:
        """The highest-versioned layout, or None before the first one is recorded."""

        def tx(s: Session) -> Layout | None:
            self._job(s, job_id)
            row = s.scalar(
                select(LayoutRow)
                .where(LayoutRow.job_id == job_id)
                .order_by(LayoutRow.version.desc())
                .limit(1)
            )
            return None if row is None else Layout.model_validate_json(row.layout_json)

        return self._read("current_layout", tx)

    def layouts(self, job_id: str) -> list[RecordedLayout]:
        """Every recorded layout with its reason and time, by version."""

        def tx(s: Session) -> list[RecordedLayout]:
            self._job(s, job_id)
            rows = s.scalars(
                select(LayoutRow).where(LayoutRow.job_id == job_id).order_by(LayoutRow.version)
            )
            return [
                RecordedLayout(
                    layout=Layout.model_validate_json(r.layout_json),
                    reason=r.reason,
                    created_at=r.created_at,
                )
                for r in rows
            ]

        return self._read("layouts", tx)
