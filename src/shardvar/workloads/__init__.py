"""Workloads that exercise shardvar end to end: the demo's models and training loops, the DLRM-style
model of ``examples/dlrm.py``, and the benchmarks' timing harness and suites.

A layer above ``transform`` and below ``cli``: the command line parses arguments, prints, and calls
these; benchmarks/ and examples/ import them from here. Nothing here prints (progress reaches a
caller through the ``StepBar`` or ``progress(done, total)`` it passes).
"""

from ._bench import (
    BENCH_SUITES,
    HUGE_PAGE_SETTINGS,
    BenchSettings,
    bench_checkpoint,
    bench_distributed,
    bench_lookup_and_scatter,
    bench_training_step,
    measure_distributed_lookup,
    use_huge_page_setting,
)
from ._clicks import (
    Clicks,
    DemoSettings,
    RecModel,
    StepBar,
    checkpoint_dir,
    eval_batch,
    no_bar,
    other_strategy,
    rec_tables,
    restore_and_compare,
    step_summary,
    train_step,
    train_twins,
    zipf,
)
from ._clicks_distributed import train_on_processes
from ._dlrm import CRITEO, DLRM, Checkpoints, build_dlrm, criteo_tables, dlrm_batch, explain_steps, train_dlrm
from ._dlrm_demo import dlrm_on_processes, dlrm_predict, plain_dlrm, restore_dlrm, timed_train_dlrm
from ._quantized import QUANTIZED, logloss_of, serve_quantized
from ._roofline import GOAL as ROOFLINE_GOAL
from ._roofline import QUICK as ROOFLINE_QUICK
from ._roofline import Sizes as RooflineSizes
from ._roofline_measure import default_threads
from ._roofline_measure import measure as measure_roofline
from ._timing import compare, time_ms, zipf_ids

__all__ = [
    "ROOFLINE_GOAL",
    "ROOFLINE_QUICK",
    "RooflineSizes",
    "default_threads",
    "measure_roofline",
    "BENCH_SUITES",
    "CRITEO",
    "DLRM",
    "HUGE_PAGE_SETTINGS",
    "QUANTIZED",
    "BenchSettings",
    "Checkpoints",
    "Clicks",
    "DemoSettings",
    "RecModel",
    "StepBar",
    "bench_checkpoint",
    "bench_distributed",
    "bench_lookup_and_scatter",
    "bench_training_step",
    "build_dlrm",
    "checkpoint_dir",
    "compare",
    "criteo_tables",
    "dlrm_batch",
    "dlrm_on_processes",
    "dlrm_predict",
    "eval_batch",
    "explain_steps",
    "logloss_of",
    "measure_distributed_lookup",
    "no_bar",
    "other_strategy",
    "plain_dlrm",
    "rec_tables",
    "restore_and_compare",
    "restore_dlrm",
    "serve_quantized",
    "step_summary",
    "time_ms",
    "timed_train_dlrm",
    "train_dlrm",
    "train_on_processes",
    "train_step",
    "train_twins",
    "use_huge_page_setting",
    "zipf",
    "zipf_ids",
]
