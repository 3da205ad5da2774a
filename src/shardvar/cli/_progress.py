"""A progress bar for long work: drawn on a terminal once the work has taken a second, else silent."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ._table import format_bytes

__all__ = ["ProgressBar"]


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
