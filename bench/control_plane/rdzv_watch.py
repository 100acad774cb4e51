"""`RdzvWatch`: reads torch's rendezvous state from etcd every half second while a size runs, for
the rendezvous's progress over time and, once steady, how many participants the round keeps and
how old its oldest heartbeat is."""

from __future__ import annotations

import threading
import time
from typing import Any

from core.etcd_client import EtcdClient

from .figures import _dist


class RdzvWatch:
    """Reads the rendezvous state blob every `every` s while steady: how many participants the
    round still has, and how old the oldest heartbeat in it is (torch drops a node whose
    heartbeat is older than keep_alive_interval x keep_alive_max_attempt)."""

    def __init__(self, endpoint: str, run_id: str, every: float = 0.5) -> None:
        from orchestrator.rendezvous import state_key

        self.client = EtcdClient(endpoint)
        self.key = state_key(run_id)
        self.every = every
        # (time, participants, waiting, round, oldest heartbeat age, state bytes)
        self.samples: list[tuple[float, int, int, int, float, int]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rdzv-watch", daemon=True)

    def _run(self) -> None:
        import base64
        import pickle
        from datetime import UTC, datetime

        while not self._stop.wait(self.every):
            try:
                raw = self.client.get(self.key)
                if raw is None:
                    continue
                state = pickle.loads(base64.b64decode(raw))  # torch's own pickled state
                now = datetime.now(UTC)
                beats = state.last_heartbeats.values()
                age = max(((now - hb).total_seconds() for hb in beats), default=0.0)
                self.samples.append(
                    (
                        time.time(),
                        len(state.participants),
                        len(state.wait_list),
                        state.round,
                        age,
                        len(raw) * 3 // 4,
                    )
                )
            except Exception as exc:  # keep watching; say what went wrong once
                self.error = self.error or f"{type(exc).__name__}: {exc}"[:300]

    def start(self) -> RdzvWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.client.close()

    def last(self) -> tuple[float, int, int, int, float, int] | None:
        return self.samples[-1] if self.samples else None

    def progression(self, start: float, end: float, points: int = 40) -> list[list[float]]:
        """[seconds since start, participants, waiting] while the rendezvous ran (<= points)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        step = max(1, len(inside) // points)
        picked = inside[::step] + ([inside[-1]] if inside and (len(inside) - 1) % step else [])
        return [[round(s[0] - start, 1), s[1], s[2]] for s in picked]

    def figures(self, steady: float, t0: float, t1: float) -> dict[str, Any]:
        """The steady phase (from `steady`), heartbeat ages inside the window [t0, t1)."""
        after = [s for s in self.samples if s[0] >= steady]
        inside = [s for s in after if t0 <= s[0] < t1]
        return {
            "rdzv_heartbeat_age_s": _dist([s[4] for s in inside], 1.0, 3),
            "rdzv_participants_min": min((s[1] for s in after), default=None),
            "rdzv_participants_end": after[-1][1] if after else None,
            "rdzv_waiting_max": max((s[2] for s in after), default=None),
            "rdzv_rounds_seen": sorted({s[3] for s in after}),
        }
