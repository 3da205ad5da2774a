"""The command line's one way to print: rich tables and progress bars, plain text off a terminal.

Every command builds its output here, so that all of them look alike on a terminal (a headed
table, colour unless ``NO_COLOR`` is set, live bars on stderr) and stay parseable in a pipe or a
CI log: one header line, a line of dashes, one line per row, no wrapping and no bars.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from .._format import format_bytes

__all__ = ["console", "format_bytes", "format_sizes", "print_table", "byte_progress", "loss_bar", "step_progress"]

# Off a terminal: the header underlined with ASCII dashes, nothing else drawn.
_PLAIN = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)
_UNWRAPPED = 10_000  # columns of a console that is not a terminal: a long path stays on its line


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): styled on a terminal, plain and never wrapped elsewhere.

    Built per call so that it follows ``sys.stdout`` as it is now (pytest's capture swaps it).
    Markup is off: names and paths print as they are, brackets included.
    """
    out = Console(stderr=stderr, markup=False, highlight=False, emoji=False)
    if not out.is_terminal:
        out.width, out.soft_wrap = _UNWRAPPED, True
    return out


def format_sizes(sizes: Sequence[int]) -> str:
    """Shard sizes, run-length coded when long: (3, 3, 2, 2) -> '3,3,2,2'; 16 x 500 -> '500 (x16)'."""
    if len(sizes) <= 8:
        return ",".join(map(str, sizes))
    runs: list[list[int]] = []
    for s in sizes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return ", ".join(f"{s} (x{c})" if c > 1 else str(s) for s, c in runs)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    """Print ``rows`` under ``headers`` on stdout; cells are shown as text (no markup)."""
    out = console()
    styled = out.is_terminal
    table = Table(
        *headers,
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD if styled else _PLAIN,
        show_edge=styled,
        pad_edge=styled,
        padding=(0, 1) if styled else (0, 1, 0, 0),  # plain: two spaces between columns, none before the first
        header_style="bold cyan" if styled else "",
        title_style="bold" if styled else "",
    )
    for row in rows:
        table.add_row(*(Text(str(c)) for c in row))
    out.print(table)


def _progress(*columns: object, enabled: bool) -> Progress:
    err = console(stderr=True)
    # Bars live on stderr and only on a terminal: stdout stays the result, a log stays free of redraws.
    return Progress(*columns, console=err, disable=not (enabled and err.is_terminal))


def step_progress(enabled: bool = True) -> Progress:
    """Steps of a loop (``advance`` one a step) with a status field, for training and benchmarks."""
    return _progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        enabled=enabled,
    )


@contextmanager
def byte_progress(label: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback (bytes) for save, load, reshard and compact, drawn as a bar."""
    with _progress(
        TextColumn(label), BarColumn(), TaskProgressColumn(), DownloadColumn(binary_units=True), TimeRemainingColumn(),
        enabled=enabled,
    ) as bar:  # fmt: skip
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextmanager
def loss_bar(label: str, total: int, enabled: bool = True) -> Iterator[Callable[[float], None]]:
    """A ``shardvar.workloads.StepBar``: ``total`` steps, each advanced with the running loss."""
    with step_progress(enabled) as bar:
        task = bar.add_task(label, total=total, status="")
        yield lambda loss: bar.update(task, advance=1, status=f"loss {loss:.4f}")
