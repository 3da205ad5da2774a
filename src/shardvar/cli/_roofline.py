"""``shardvar bench --view roofline``: each hot path's bytes per second as a fraction of the machine's bandwidth.

The measuring is ``shardvar.workloads``' (``measure_roofline``, whose module documents the byte
model); this prints its table, writes the JSON and draws the chart. ``benchmarks/bench_roofline.py``
runs the same view.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from ..workloads import ROOFLINE_GOAL as GOAL
from ..workloads import ROOFLINE_QUICK, RooflineSizes, measure_roofline
from ._console import print_table

__all__ = ["run_roofline"]


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
        raise SystemExit("shardvar bench: --png needs matplotlib: pip install 'shardvar[plot]'") from None
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


def run_roofline(args: argparse.Namespace) -> int:
    """Measure, print the table, and write ``args.json`` / ``args.png`` when given (flags checked when parsed)."""
    sizes, rounds, min_s = (ROOFLINE_QUICK, 1, 0.01) if args.quick else (RooflineSizes(), args.rounds, 0.2)
    directory = Path(args.dir)
    with tempfile.TemporaryDirectory(prefix="shardvar-roofline-", dir=directory) as tmp:
        result = measure_roofline(sizes, rounds, args.threads, Path(tmp), min_s)
    result["settings"]["dir"] = str(directory)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nresults written to {args.json}")
    if args.png:
        chart(result, args.png)
        print(f"chart written to {args.png}")
    return 0
