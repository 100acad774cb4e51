"""`RdzvWatch`: reads the rendezvous from etcd every half second while a phase runs (the stored
state and the nodes whose lease is alive, `orchestrator.rendezvous.read_rendezvous`), for the
rendezvous's progress over time and, once steady, how many participants the round keeps and how
many of them have no live lease (torch's handler drops those from the round)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.rendezvous import load_secret, read_rendezvous


class RdzvWatch:
    """Reads the rendezvous every `every` s: participants, waiting, round, participants without
    a live lease, state bytes."""

    def __init__(self, endpoint: str, run_id: str, every: float = 0.5) -> None:
        self.client = EtcdClient(endpoint)
        self.run_id = run_id
        self.every = every
        # (time, participants, waiting, round, participants without a live lease, state bytes,
        # the round complete: 1)
        self.samples: list[tuple[float, int, int, int, int, int, int]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rdzv-watch", daemon=True)

    def _run(self) -> None:
        secret = load_secret()
        while not self._stop.wait(self.every):
            try:
                state, alive, size = read_rendezvous(self.client, self.run_id, secret)
                if state is None:
                    continue
                if alive:
                    dead = sum(node not in alive for node in state.participants)
                else:  # a backend without leases (torch's own): heartbeats in the state
                    now = datetime.now(UTC)
                    window = 3.0  # the project's 1 s x 3 (orchestrator.launch)
                    beats = state.last_heartbeats
                    dead = sum(
                        (now - beats[n]).total_seconds() > window
                        for n in state.participants
                        if n in beats
                    )
                self.samples.append(
                    (
                        time.time(),
                        len(state.participants),
                        len(state.wait_list),
                        state.round,
                        dead,
                        size,
                        int(state.complete),
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

    def last(self) -> tuple[float, int, int, int, int, int, int] | None:
        return self.samples[-1] if self.samples else None

    def progression(self, start: float, end: float, points: int = 40) -> list[list[float]]:
        """[seconds since start, participants, waiting, complete (1) or not (0)] while a phase ran
        (<= points, and every change of the round's completeness)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        step = max(1, len(inside) // points)
        picked = set(range(0, len(inside), step)) | ({len(inside) - 1} if inside else set())
        # when the round completed (or opened again) matters more than evenly spaced samples
        picked |= {i for i in range(1, len(inside)) if inside[i][6] != inside[i - 1][6]}
        return [
            [round(s[0] - start, 1), s[1], s[2], s[6]] for i, s in enumerate(inside) if i in picked
        ]

    def figures(self, steady: float, t0: float, t1: float) -> dict[str, Any]:
        """The steady phase (from `steady`); unleased participants inside the window [t0, t1)."""
        after = [s for s in self.samples if s[0] >= steady]
        inside = [s for s in after if t0 <= s[0] < t1]
        return {
            "rdzv_unleased_max": max((s[4] for s in inside), default=None),
            "rdzv_participants_min": min((s[1] for s in after), default=None),
            "rdzv_participants_end": after[-1][1] if after else None,
            "rdzv_waiting_max": max((s[2] for s in after), default=None),
            "rdzv_rounds_seen": sorted({s[3] for s in after}),
        }
