"""``shardvar bench``: lookup, scatter, training step, checkpoint and distributed lookup benchmarks.

Each row is a sharded operation timed against its unsharded baseline in the same run
(``shardvar.workloads``' suites); the ratios print as a table, go to a JSON file, and (with
matplotlib) to a PNG chart. The benchmarks/ scripts are the longer, more detailed versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import tempfile
from pathlib import Path

import torch

from ..workloads import BENCH_SUITES, HUGE_PAGE_SETTINGS, BenchSettings, default_threads, use_huge_page_setting
from ._args import existing_dir, integer, output_file, real
from ._bench_pages import run_both_settings
from ._console import print_table, step_progress
from ._roofline import run_roofline

__all__ = ["add_bench_parser", "bench_settings", "plain_settings"]


def bench_settings(args: argparse.Namespace) -> BenchSettings:
    """The workload's settings from the parsed flags."""
    return BenchSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchSettings)})


def plain_settings(args: argparse.Namespace) -> dict:
    """The flags as the JSON file records them."""
    return {k: v for k, v in vars(args).items() if not callable(v) and k not in ("defaults", "flags")}


# The flags each view reads; a flag of the other view given a value is refused (it would be ignored).
ROOFLINE_FLAGS = ("rounds", "quick", "threads", "dir")
RATIO_FLAGS = ("rows", "dim", "ids", "shards", "procs", "checkpoint_mib", "repeats", "only", "progress", "huge_pages")


def run_bench(args: argparse.Namespace) -> int:
    if args.view == "roofline":
        return run_roofline(args)
    if args.huge_pages == "both":
        return run_both_settings(args, _chart)
    use_huge_page_setting(args.huge_pages)
    chosen = args.only or list(BENCH_SUITES)
    print(
        f"shardvar bench: table {args.rows} x {args.dim} float32, {args.ids} Zipf(1.05) ids, "
        f"{args.shards} shards, {torch.get_num_threads()} threads; ratio = sharded / unsharded time\n"
    )
    settings, results = bench_settings(args), []
    with step_progress(args.progress) as bar:
        task = bar.add_task("bench", total=len(chosen), status="")
        for name in chosen:
            bar.update(task, status=name)
            results += BENCH_SUITES[name](settings)
            bar.advance(task)
    table = []
    for r in results:
        extra = f"  (bytes sent {r['bytes_sent_vs_bound']:.3f}x the bound)" if r.get("bytes_sent_vs_bound") else ""
        table.append(
            [
                r["benchmark"],
                f"{r['sharded_ms']:.1f}",
                f"{r['baseline_ms']:.1f}",
                f"{r['ratio']:.2f}x{extra}",
                r["baseline"],
            ]
        )
    print_table(["benchmark", "sharded ms", "baseline ms", "ratio", "baseline"], table)
    Path(args.json).write_text(json.dumps({"settings": plain_settings(args), "results": results}, indent=1))
    print(f"\nresults written to {args.json}")
    if args.png:
        _chart(results, args.png)
        print(f"chart written to {args.png}")
    return 0


def _chart(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(results) + 1.2))
    names = [r["benchmark"] for r in results][::-1]
    ratios = [r["ratio"] for r in results][::-1]
    ax.barh(names, ratios, color=["tab:green" if x <= 1.1 else "tab:orange" for x in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("sharded time / unsharded time (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_bench(args: argparse.Namespace) -> str | None:
    """What the flags cannot do together, and what --png needs, found before the benchmarks run."""
    if args.png and importlib.util.find_spec("matplotlib") is None:
        return "--png needs matplotlib: pip install 'shardvar[plot]'"
    unread = RATIO_FLAGS if args.view == "roofline" else ROOFLINE_FLAGS
    given = [args.flags[name] for name in unread if getattr(args, name) != args.defaults[name]]
    if given:
        verb = "does" if len(given) == 1 else "do"
        view = f"--view {args.view}"
        return f"{', '.join(given)} {verb} not apply to {view}: leave it out, or choose the view that reads it"
    if args.view == "roofline":
        return None
    runs_distributed = not args.only or "distributed" in args.only
    if runs_distributed and args.ids < args.procs:
        return f"--ids {args.ids} gives no ids to some of --procs {args.procs} processes; use at least one per process"
    return None


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark sharded operations against their unsharded baselines")
    p.add_argument("--rows", type=integer(1), default=1 << 19)
    p.add_argument("--dim", type=integer(1), default=64)
    p.add_argument("--ids", type=integer(1), default=1 << 19)
    p.add_argument("--shards", type=integer(1), default=8)
    p.add_argument("--procs", type=integer(1, 64), default=2, help="processes for the distributed lookup")
    p.add_argument("--checkpoint-mib", type=real(positive=True), default=256.0)
    p.add_argument("--repeats", type=integer(1), default=7)
    p.add_argument("--only", action="append", choices=list(BENCH_SUITES))
    p.add_argument("--json", type=output_file, default="bench-results.json", help="where to write the results")
    p.add_argument("--png", type=output_file, help="also draw the ratios to this PNG (needs matplotlib)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--huge-pages",
        choices=["both", *HUGE_PAGE_SETTINGS],
        default="both",
        help="torch's THP_MEM_ALLOC_ENABLE off, on, or both",
    )
    p.add_argument(
        "--view",
        choices=["ratios", "roofline"],
        default="ratios",
        help="ratios: sharded / unsharded time; roofline: each hot path's share of the memory and disk bandwidth",
    )
    p.add_argument("--rounds", type=integer(1), default=5, help="roofline: interleaved rounds of every path and probe")
    p.add_argument("--quick", action="store_true", help="roofline: tiny sizes, one round (a check that it runs)")
    p.add_argument("--threads", type=integer(1), default=default_threads(), help="roofline: torch threads")
    p.add_argument(
        "--dir", type=existing_dir, default=tempfile.gettempdir(), help="roofline: where the disk probes write"
    )
    p.set_defaults(func=run_bench, check=check_bench)
    p.set_defaults(
        defaults={a.dest: a.default for a in p._actions}, flags={a.dest: a.option_strings[-1] for a in p._actions}
    )
