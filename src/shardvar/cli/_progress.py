"""A progress bar for long work: drawn on a terminal once the work has taken a second, else silent."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ._table import format_bytes

__all__ = ["ProgressBar", "StepBar"]


class ProgressBar:
    """Call with (done, total) bytes; use as a context manager to end the line."""

    def __init__(self, label: str, stream: TextIO | None = None, delay: float = 1.0, width: int = 30) -> None:
        self.label, self.stream, self.delay, self.width = label, stream or sys.stderr, delay, width
        self.start = time.monotonic()
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.stream.isatty() or time.monotonic() - self.start < self.delay:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        self.stream.write(
            f"\r{self.label} [{bar:<{self.width}}] {frac:4.0%} {format_bytes(done)} / {format_bytes(total)}"
        )
        self.stream.flush()
        self.drawn = True

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


class StepBar:
    """Steps of a loop with a status text: a live bar on a terminal, a line every tenth otherwise."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 30
    ) -> None:
        self.label, self.total, self.stream, self.enabled, self.width = (
            label,
            total,
            stream or sys.stdout,
            enabled,
            width,
        )
        self.tty = self.stream.isatty()
        self.next_line = 0

    def update(self, done: int, status: str = "") -> None:
        if not self.enabled:
            return
        if self.tty:
            bar = "#" * int(done / max(self.total, 1) * self.width)
            self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {done}/{self.total} {status}")
            self.stream.flush()
        elif done >= self.next_line or done == self.total:
            self.stream.write(f"{self.label} step {done:>6}/{self.total} {status}\n")
            self.stream.flush()
            self.next_line = done + max(1, self.total // 10)

    def __enter__(self) -> StepBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
