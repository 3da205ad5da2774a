"""Every option of ShardedEmbedding(Bag) works distributed, equal to the single-process module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from dist_module_workers import CASES, batch, pooled
from dist_workers import DIM, ROWS
from distributed import batched, run_ranks
from shardvar.variables import RowInitializer


def single_process(world: int, case: str, shards: int, strategy: str, steps: int):
    kind, options = CASES[case]
    cls = shardvar.ShardedEmbedding if kind == "embedding" else shardvar.ShardedEmbeddingBag
    torch.manual_seed(0)
    head = nn.Linear(DIM, 1)
    table = RowInitializer(4)((ROWS, DIM))
    if options.get("padding_idx") is not None:
        table[options["padding_idx"]] = 0  # as the distributed module initialises it
    emb = cls.from_pretrained(table, freeze=False, partitioner=shards, partition_strategy=strategy, **options)
    opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)
    outs = [[] for _ in range(world)]
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            inputs, target = batch(case, rank, step)
            out = emb(**inputs)
            outs[rank].append(out.detach().clone())
            ((head(pooled(out, kind)).squeeze(1) - target).pow(2).sum()).backward()
        for p in head.parameters():
            p.grad /= world  # DistributedDataParallel averages the dense gradients; the table's add up
        opt.step()
    return outs, emb.weight.to_tensor().detach()


MODULE_CASES = [(2, c, "mod") for c in CASES] + [(3, "bag_sum_weights", "div"), (3, "max_norm", "div")]
SHARDS, STEPS = 5, 3


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory):
    jobs = {
        (world, case, strategy): (
            world,
            "dist_module_workers:module_train",
            {"case": case, "shards": SHARDS, "strategy": strategy, "steps": STEPS},
        )
        for world, case, strategy in MODULE_CASES
    }
    return batched(lambda: tmp_path_factory.mktemp("modules"), jobs)


@pytest.mark.parametrize("world, case, strategy", MODULE_CASES)
def test_every_module_option_matches_a_single_process(module_runs, world, case, strategy) -> None:
    shards, steps = SHARDS, STEPS
    results = module_runs((world, case, strategy))
    outs, table = single_process(world, case, shards, strategy, steps)
    for rank, r in enumerate(results):
        for got, want in zip(r["outs"], outs[rank], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        # Forward: split sizes, ids, rows; backward: gradients. Nothing else per step.
        assert all(c == {"all_to_all": 4} for c in r["calls"]), r["calls"]
        if CASES[case][1].get("sparse"):
            assert r["sparse_grads"]
    parts = {s: t for r in results for s, t in r["shards"].items()}
    layout = shardvar.Layout.balanced(strategy, ROWS, shards)
    torch.testing.assert_close(layout.join([parts[s] for s in range(shards)]), table, atol=1e-6, rtol=0)


def test_a_rank_that_dies_before_construction_is_named(tmp_path) -> None:
    results = run_ranks(3, "dist_module_workers:dies_before_construction", tmp_path, expect_exit={2: 19})
    for r in results[:2]:
        assert r["error"] and "rank(s) [2] never reached it" in r["error"], r
