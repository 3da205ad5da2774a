"""``shardvar demo --tables N``: the DLRM-style model with N Criteo-shaped tables in one collection.

One process trains it with the collection (one kernel per group of alike tables) and, side by
side, the unsharded model (one ``nn.EmbeddingBag`` per table, the same initial values); with
``--procs P`` the collection runs over P processes (gloo, ``placement="auto"``) and the
checkpoint it writes is compared with the one-process model. Then the checkpoint is restored into
other layouts and the predictions compared. The model and loops are ``shardvar.workloads``'.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import save
from ..workloads import (
    build_dlrm,
    checkpoint_dir,
    criteo_tables,
    dlrm_batch,
    dlrm_on_processes,
    dlrm_predict,
    logloss_of,
    plain_dlrm,
    restore_dlrm,
    serve_quantized,
    timed_train_dlrm,
)
from ._console import format_bytes, print_table
from ._demo_quantized import print_quantized
from ._demo_settings import settings_of, where

__all__ = ["run_tables_demo"]


def _checkpoint_and_restore(
    args: argparse.Namespace, path: Path, configs: dict, model: nn.Module, losses: list[float], rows: dict, batch: tuple
) -> float:
    """Save (from P processes with ``--procs P``), restore into other layouts; the predictions' max |diff|."""
    dense, ids, reference = batch
    if args.procs > 1:
        run = dlrm_on_processes(settings_of(args), path)
        kinds = [p if isinstance(p, str) else "table" for p in run["placement"].values()]
        spread = ", ".join(f"{kinds.count(k)} {k}" for k in ("row", "table", "replicate") if kinds.count(k))
        rows[f"{args.procs} processes"] = f"{run['per_step'] * 1e3:.1f} ms per step; placement auto: {spread}"
        rows["loss, processes vs one"] = (
            f"max |diff| = {max(abs(a - b) for a, b in zip(run['losses'], losses, strict=True)):.1e}"
        )
    else:
        save({"model": model}, path)
    restored = restore_dlrm(path, configs)
    with torch.no_grad():
        diff = float((restored(dense, ids) - reference).abs().max())
    rows["checkpoint"] = (
        f"{where(args, path)}; restored into 2 div shards per table: predictions max |diff| = {diff:.1e}"
    )
    return diff


def run_tables_demo(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    configs = criteo_tables(args.scale, args.tables)
    model = build_dlrm(configs, 1)
    plain = plain_dlrm(model, configs)
    total = sum(c.num_embeddings * c.embedding_dim * 4 for c in configs.values())
    print(f"shardvar demo: DLRM-style model, {args.tables} Criteo-shaped tables ({format_bytes(total)}), "
          f"{args.steps} steps of {args.batch}, {args.procs} process(es)")  # fmt: skip
    losses, step_s = timed_train_dlrm(model, configs, settings)
    _, plain_s = timed_train_dlrm(plain, configs, settings)
    n = min(10, len(losses))
    rows = {f"loss (first {n} steps -> last {n})": f"{sum(losses[:n]) / n:.4f} -> {sum(losses[-n:]) / n:.4f}"}
    groups = len(model.embeddings._groups)
    rows["lookups per step"] = f"{groups} kernel(s) for {args.tables} tables (one per group of alike tables)"
    rows["time per step (median)"] = f"{step_s * 1e3:.1f} ms (unsharded tables: {plain_s * 1e3:.1f} ms)"
    dense, ids, _ = dlrm_batch(configs, 64, 10_000)
    with torch.no_grad():
        reference = model(dense, ids)
        rows["collection vs unsharded model"] = f"max |diff| = {float((reference - plain(dense, ids)).abs().max()):.1e}"
    with checkpoint_dir(args.checkpoint) as path:
        diff = _checkpoint_and_restore(args, path, configs, model, losses, rows, (dense, ids, reference))
    print_table(["summary", ""], [[k, v] for k, v in rows.items()])
    if args.quantize:
        print_quantized(serve_quantized(model, ["embeddings"], logloss_of(lambda m: dlrm_predict(m, configs))))
    ok = diff <= 1e-5 and losses[-1] == losses[-1]
    if not ok:
        print("shardvar demo: FAILED (restored predictions differ)")
    return 0 if ok else 1
