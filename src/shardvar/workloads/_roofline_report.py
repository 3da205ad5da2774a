"""The roofline benchmark's run: probes, every path timed in interleaved rounds, a table, JSON and a chart.

``benchmarks/bench_roofline.py`` calls :func:`main`; a command line adds :func:`add_arguments`
to its parser and calls :func:`run`. The byte model is :mod:`shardvar.workloads._roofline`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

# Absolute imports: pytest's doctest collection imports these files alone while workloads/ has no __init__.py.
from shardvar._pages import huge_pages_mode, torch_advises, use_huge_pages
from shardvar.workloads._roofline import GOAL, QUICK, Case, Sizes, cases
from shardvar.workloads._roofline_harness import print_table
from shardvar.workloads._roofline_probes import bandwidth, disk_rate

__all__ = ["add_arguments", "main", "measure", "run"]


def _default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The roofline's options: ``--rounds``, ``--quick``, ``--threads``, ``--dir``, ``--json``, ``--png``."""
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every path and probe")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a check that it runs)")
    p.add_argument("--threads", type=int, default=_default_threads(), help="torch threads (default: all)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk probe and the checkpoint write")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--png", help="also draw the fractions to this PNG (needs matplotlib)")


def _once(case: Case, fn: Callable[[], object], min_s: float) -> float:
    """Seconds of one call of ``fn``: the median of ``Timer.blocked_autorange``, or one call timed whole."""
    if not case.single_call:
        timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return timer.blocked_autorange(min_run_time=min_s).median
    if case.prepare is not None:
        case.prepare()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_case(case: Case, rounds: int, min_s: float) -> tuple[list[float], list[float]]:
    """Per round, the path's and its baseline's seconds; which goes first alternates round by round."""
    mine: list[float] = []
    base: list[float] = []
    turns = [(case.fn, mine)] + ([(case.baseline, base)] if case.baseline is not None else [])
    for r in range(rounds):
        for fn, out in turns[:: 1 if r % 2 == 0 else -1]:
            out.append(_once(case, fn, min_s))
    return mine, base


def _path_result(case: Case, mine: list[float], base: list[float], rate: float) -> dict:
    """One path's JSON: its bytes by kind, its times (ms), GB/s and fractions of ``rate`` (GB/s)."""
    total = case.traffic.total
    fraction = total / statistics.median(mine) / 1e9 / rate
    return {
        "path": case.name,
        "bound": case.bound,
        "bytes": {**dataclasses.asdict(case.traffic), "total": total},
        "ms": [t * 1e3 for t in mine],
        "baseline_ms": [t * 1e3 for t in base] or None,
        "gb_per_s": total / statistics.median(mine) / 1e9,
        "fraction": fraction,
        "best_fraction": total / min(mine) / 1e9 / rate,
        "baseline_fraction": total / statistics.median(base) / 1e9 / rate if base else None,
        "meets_goal": fraction >= GOAL,
    }


def measure(sizes: Sizes, rounds: int, threads: int, directory: Path, min_s: float) -> dict:
    """Every probe and path (see the byte model); the results as the JSON the benchmark writes."""
    torch.set_num_threads(threads)
    memory = bandwidth(int(sizes.bandwidth_mib * 2**20), rounds, reps=3, threads=threads)
    disk = disk_rate(directory, int(sizes.checkpoint_mib * 2**20), rounds)
    rates = {"memory": max(memory["on"]["copy"]), "disk write": max(disk["write"]), "disk read": max(disk["read"])}
    paths = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse invariant checks")  # torch.optim's sparse Adagrad, the baseline
        for case in cases(sizes, directory):
            mine, base = _time_case(case, rounds, min_s)
            paths.append(_path_result(case, mine, base, rates[case.bound]))
    settings = {**dataclasses.asdict(sizes), "rounds": rounds, "threads": threads, "dir": str(directory),
                "thp_mode": huge_pages_mode(), "paths_huge_pages": torch_advises(), "goal": GOAL}  # fmt: skip
    return {"settings": settings, "bandwidth": memory, "disk": disk, "denominators": rates, "paths": paths}


def _spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def _header(r: dict) -> str:
    s, bw, disk = r["settings"], r["bandwidth"], r["disk"]
    lines = [f"roofline: {s['threads']} threads, THP {s['thp_mode']}, {s['rounds']} round(s); paths run with huge "
             f"pages {'on' if s['paths_huge_pages'] else 'off'}; GB/s median [min-max]"]  # fmt: skip
    for kind in ("copy", "triad"):
        lines.append(f"memory {kind} ({s['bandwidth_mib']:g} MiB arrays): huge pages on best "
                     f"{max(bw['on'][kind]):.1f} GB/s, {_spread(bw['on'][kind], '.1f')}; off best "
                     f"{max(bw['off'][kind]):.1f}, {_spread(bw['off'][kind], '.1f')}")  # fmt: skip
    lines.append(f"disk ({s['dir']}, {s['checkpoint_mib']:g} MiB): write + fsync best {max(disk['write']):.2f} "
                 f"GB/s, read after fadvise(DONTNEED) best {max(disk['read']):.2f} GB/s "
                 "(the read may be the page cache's)")  # fmt: skip
    lines.append(f"fraction = bytes the path must move / its median time / the best rate it is bound by "
                 f"(memory: copy, huge pages on); goal >= {GOAL}")  # fmt: skip
    return "\n".join(lines)


def _verdict(p: dict) -> str:
    return f">= {GOAL}" if p["meets_goal"] else f"below {GOAL} ({GOAL / p['fraction']:.2f}x to go)"


def report(r: dict) -> None:
    """Print the header lines and one row per path."""
    print(_header(r) + "\n")
    rows = []
    for p in r["paths"]:
        torch_fraction = "-" if p["baseline_fraction"] is None else f"{p['baseline_fraction']:.2f}"
        rows.append([p["path"], p["bound"], f"{p['bytes']['total'] / 2**20:.1f}", _spread(p["ms"]),
                     f"{p['gb_per_s']:.2f}", f"{p['fraction']:.2f} ({p['best_fraction']:.2f})", torch_fraction,
                     _verdict(p)])  # fmt: skip
    heads = ["path", "bound", "MiB moved", "ms", "GB/s", "fraction (best)", "torch, same bytes", "verdict"]
    print_table(heads, rows)


def chart(r: dict, path: str) -> None:
    """A bar per path: its fraction of the bandwidth; torch's plain op on the same bytes as a dot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("bench_roofline: --png needs matplotlib: pip install 'shardvar[plot]'") from None
    paths = r["paths"][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(paths) + 1.4))
    names = [p["path"] for p in paths]
    ax.barh(names, [p["fraction"] for p in paths],
            color=["tab:green" if p["meets_goal"] else "tab:orange" for p in paths])  # fmt: skip
    torch_paths = [(p["path"], p["baseline_fraction"]) for p in paths if p["baseline_fraction"] is not None]
    if torch_paths:
        ax.plot([f for _, f in torch_paths], [n for n, _ in torch_paths], "ko", label="torch, same bytes")
        ax.legend(loc="lower right")
    ax.axvline(GOAL, color="black", linestyle="--", linewidth=0.8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("fraction of the bandwidth (memory: best copy, huge pages on; checkpoints: the disk)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, and write ``args.json`` / ``args.png`` when given."""
    sizes, rounds, min_s = (QUICK, 1, 0.01) if args.quick else (Sizes(), args.rounds, 0.2)
    directory = Path(args.dir)
    if not directory.is_dir():
        raise SystemExit(f"bench_roofline: --dir {directory} is not a directory")
    if args.rounds < 1 or args.threads < 1:
        raise SystemExit(f"bench_roofline: --rounds and --threads must be >= 1; got {args.rounds}, {args.threads}")
    with tempfile.TemporaryDirectory(prefix="shardvar-roofline-", dir=directory) as tmp:
        result = measure(sizes, rounds, args.threads, Path(tmp), min_s)
    result["settings"]["dir"] = str(directory)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nresults written to {args.json}")
    if args.png:
        chart(result, args.png)
        print(f"chart written to {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``bench_roofline.py``: parse ``argv`` and :func:`run`; torch's huge-page switch on unless set."""
    use_huge_pages()  # before torch's first allocation, as the shardvar command does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
