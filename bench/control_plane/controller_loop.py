"""`ControllerLoop`: the real controller's `Controller.run` in a thread of the benchmark's
process, every tick and drain timed; it is also the `Workers` handle the controller supervises."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from pipetransformer.core import keys
from pipetransformer.orchestrator.controller import Controller

from .config import CONTROLLER_TICK_S
from .figures import _dist


class ControllerLoop:
    """`Controller.run` in a thread, every tick and drain timed. It is also the `Workers` the
    controller supervises: the simulated agents run until `stop`."""

    def __init__(self, ctrl: Controller, rdzv_id: str) -> None:
        self.ctrl, self.rdzv_id = ctrl, rdzv_id
        self.ticks: list[tuple[float, float]] = []  # (end wall time, seconds)
        self.drains: list[tuple[float, float, int]] = []  # (end, seconds, events)
        self.ages: list[tuple[float, float]] = []  # (drained at, age of the report)
        self.kinds: Counter[str] = Counter()
        self.error: str | None = None
        self.cpu: list[tuple[float, float]] = []  # (wall, this thread's CPU seconds)
        self._stop = threading.Event()
        self._published = threading.Event()
        drain, tick = ctrl.drain, ctrl.tick

        def timed_drain() -> list:
            p0 = time.perf_counter()
            events = drain()
            now = time.time()
            self.drains.append((now, time.perf_counter() - p0, len(events)))
            for e in events:
                self.ages.append((now, now - e.time))
                self.kinds[e.kind] += 1
            return events

        def timed_tick() -> None:
            p0 = time.perf_counter()
            tick()
            self.ticks.append((time.time(), time.perf_counter() - p0))
            self.cpu.append((time.time(), time.thread_time()))

        ctrl.drain = timed_drain  # supervise/tick call self.drain(): the instance's wins
        ctrl.tick = timed_tick
        self.thread = threading.Thread(target=self._run, name="controller", daemon=True)

    def poll(self) -> int | None:
        # what `pipetransformer controller` asks etcd besides its tick (orchestrator/roles.py)
        self.ctrl.workers_alive()
        self.ctrl.etcd.count_prefix(keys.agents(self.ctrl.job_id))
        return 0 if self._stop.is_set() else None

    def detail(self, code: int | None) -> str:
        return ""

    def close(self) -> None:
        pass

    def _launch(self, attached: bool) -> ControllerLoop:
        self._published.set()  # the job is in etcd: the agents may start
        return self

    def _run(self) -> None:
        try:
            self.ctrl.run(self.rdzv_id, self._launch, interval=CONTROLLER_TICK_S)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            logging.getLogger(__name__).exception("controller loop failed")
        finally:
            self._published.set()  # never leave start() waiting on a controller that failed

    def start(self) -> ControllerLoop:
        self.thread.start()
        self._published.wait()
        return self

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self.thread.join(timeout)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        drains = [d for d in self.drains if t0 <= d[0] < t1]
        ticks = [t for t in self.ticks if t0 <= t[0] < t1]
        ages = [a for when, a in self.ages if t0 <= when < t1]
        cpu = [c for c in self.cpu if t0 <= c[0] <= t1]
        span = t1 - t0
        return {
            "drains": len(drains),
            "drain_ms": _dist([d[1] for d in drains], 1e3),
            "events_drained": sum(d[2] for d in drains),
            "events_per_drain_max": max((d[2] for d in drains), default=0),
            "tick_ms": _dist([t[1] for t in ticks], 1e3),
            "ticks_per_s": round(len(ticks) / span, 2),
            "controller_busy": round(sum(t[1] for t in ticks) / span, 3),
            "controller_cpu_cores": round((cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]), 3)
            if len(cpu) > 1 and cpu[-1][0] > cpu[0][0]
            else None,
            "report_age_s": _dist(ages, 1.0, 3),
        }
