"""``shardvar bench`` under both huge-page settings, side by side.

torch reads its switch (``THP_MEM_ALLOC_ENABLE``) once per process, so each setting runs the
benchmarks in a child process of its own; shardvar's own buffers are huge-page backed under
both, torch's (the baselines', and outputs torch allocates) only with the switch on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .._errors import ShardvarValueError
from .._pages import SWITCH, huge_pages_mode
from ..workloads import HUGE_PAGE_SETTINGS as SETTINGS
from ._console import print_table

__all__ = ["child_argv", "run_both_settings"]

_PASSED = ("rows", "dim", "ids", "shards", "procs", "checkpoint_mib", "repeats")


def child_argv(args: argparse.Namespace, setting: str, json_path: str) -> list[str]:
    """The ``shardvar bench`` command line that repeats ``args`` under one setting."""
    argv = [sys.executable, "-m", "shardvar", "bench", "--huge-pages", setting, "--json", json_path]
    for name in _PASSED:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for suite in args.only or []:
        argv += ["--only", suite]
    return argv


def _run_child(args: argparse.Namespace, setting: str, directory: Path) -> list[dict]:
    path = directory / f"{setting}.json"
    env = {**os.environ, SWITCH: SETTINGS[setting]}
    out = subprocess.run(child_argv(args, setting, str(path)), env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise ShardvarValueError(f"shardvar bench --huge-pages {setting} failed:\n{out.stdout}{out.stderr}")
    return [{**r, "huge_pages": setting} for r in json.loads(path.read_text())["results"]]


def run_both_settings(args: argparse.Namespace, chart: Callable[[list[dict], str], None]) -> int:
    """Run the chosen benchmarks with the switch off, then on; print one table, write one JSON (and ``chart``)."""
    with tempfile.TemporaryDirectory(prefix="shardvar-bench-") as tmp:
        results = {s: _run_child(args, s, Path(tmp)) for s in SETTINGS}
    headers = ["benchmark", "baseline", "off: ms, sharded / base", "off: ratio", "on: ms, sharded / base"]
    headers += ["on: ratio", "on / off"]
    rows = [
        [
            off["benchmark"],
            off["baseline"],
            f"{off['sharded_ms']:.1f} / {off['baseline_ms']:.1f}",
            f"{off['ratio']:.2f}x",
            f"{on['sharded_ms']:.1f} / {on['baseline_ms']:.1f}",
            f"{on['ratio']:.2f}x",
            f"{on['sharded_ms'] / off['sharded_ms']:.2f}x",
        ]
        for off, on in zip(results["off"], results["on"], strict=True)
    ]
    title = f"huge pages off / on (THP mode: {huge_pages_mode()}); ratio = sharded / unsharded time"
    print_table(headers, rows, title=title)
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    Path(args.json).write_text(json.dumps({"settings": settings, "results": results["off"] + results["on"]}, indent=1))
    print(f"\nresults written to {args.json}")
    if args.png:
        named = [
            {**r, "benchmark": f"{r['benchmark']} [huge pages {r['huge_pages']}]"}
            for r in results["off"] + results["on"]
        ]
        chart(named, args.png)
        print(f"chart written to {args.png}")
    return 0
