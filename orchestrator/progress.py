"""Progress display for a running job: a rich progress bar on a terminal, periodic status lines
elsewhere (CI logs, pipes)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipetransformer.core.readings import held_out_text, mfu_text, peak_memory_text
from pipetransformer.core.state import Layout
from pipetransformer.orchestrator.controller import Progress as JobProgress


def _fmt(p: JobProgress, layout: Layout) -> str:
    parts = [f"epoch {p.epoch}", f"step {p.step}" + (f"/{p.total_steps}" if p.total_steps else "")]
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.samples_per_s is not None:
        parts.append(f"{p.samples_per_s:,.0f} samples/s")
    if (mfu := mfu_text(p.mfu)) is not None:  # unknown on the CPU: the line stays as it was
        parts.append(f"MFU {mfu}")
    if (peak := peak_memory_text(p.peak_memory_mib)) is not None:
        parts.append(f"peak {peak}")
    if (held_out := held_out_text(p.accuracy, p.f1, token_loss=p.token_loss)) is not None:
        parts.append(f"held-out {held_out}")
    parts.append(f"layout {layout.short}")
    return "  ".join(parts)


class ProgressView:
    def __init__(self, console: Console, layout: Layout, every_s: float = 5.0):
        self.console, self.layout, self.every_s = console, layout, every_s
        self._bar: Progress | None = None
        self._task = None
        self._last_line = 0.0
        self._last_acc: float | None = None
        self._shown = False
        self._noticed = 0  # the controller's notices printed so far

    def __enter__(self) -> ProgressView:
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold blue]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=None, info="waiting for workers")
        return self

    def update(self, p: JobProgress) -> None:
        # what a failure changed, one line each, as it happens (before the layout it led to)
        for notice in p.notices[self._noticed :]:
            self.console.print(f"[bold yellow]recovery[/] {escape(notice)}", soft_wrap=True)
        self._noticed = len(p.notices)
        # the layout in force, once the supervision started (after what the launch printed)
        # and again whenever it changes
        if not self._shown or (p.layout is not None and p.layout != self.layout):
            self.layout = p.layout or self.layout
            self.console.print(f"[bold]layout[/] {escape(self.layout.describe())}")
            self._shown = True
        if self._bar is not None:
            self._bar.update(
                self._task, completed=p.step, total=p.total_steps, info=escape(_fmt(p, self.layout))
            )
            held_out = held_out_text(p.accuracy, p.f1, token_loss=p.token_loss)
            if held_out is not None and p.accuracy != self._last_acc:
                self._bar.console.print(f"epoch {p.epoch}: held-out {held_out}")
        elif p.step and (
            time.monotonic() - self._last_line >= self.every_s or p.accuracy != self._last_acc
        ):
            self.console.print(escape(_fmt(p, self.layout)), soft_wrap=True)
            self._last_line = time.monotonic()
        self._last_acc = p.accuracy

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
