"""DistributedDynamicEmbedding over real gloo processes: equal to one process, checkpoints across world sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardvar
from dist_dynamic_workers import CAPACITY, DIM, POOL, batch
from distributed import run_ranks
from shardvar.dynamic import CountAdmission, DynamicEmbedding, IdInitializer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _one_process(
    emb: DynamicEmbedding, opt: torch.optim.Optimizer, world: int, steps: range
) -> list[list[torch.Tensor]]:
    """One process training on every rank's batch: per step, each rank's slice of the output."""
    outs = []
    for step in steps:
        parts = [batch(r, step) for r in range(world)]
        opt.zero_grad()
        out = emb(torch.cat([ids for ids, _ in parts]))
        ((out - torch.cat([t for _, t in parts])) ** 2).sum().backward()
        opt.step()
        outs.append(list(out.detach().split(10)))
    return outs


def _local(world: int, admission: int | None) -> tuple[DynamicEmbedding, torch.optim.Optimizer]:
    emb = DynamicEmbedding(DIM, CAPACITY, world, admission=CountAdmission(admission) if admission else None)
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    emb.attach_optimizer(opt)
    return emb, opt


def test_two_processes_train_as_a_fixed_table_over_remapped_ids(tmp_path: Path) -> None:
    results = run_ranks(2, "dist_dynamic_workers:train", tmp_path, steps=20)
    id_map = torch.cat([batch(r, s)[0] for r in range(2) for s in range(20)]).unique()
    ref = torch.nn.Embedding(id_map.numel(), DIM)
    with torch.no_grad():
        ref.weight.copy_(IdInitializer()(id_map, DIM, torch.float32))
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(20):
        parts = [batch(r, step) for r in range(2)]
        opt.zero_grad()
        out = ref(torch.searchsorted(id_map, torch.cat([ids for ids, _ in parts])))
        ((out - torch.cat([t for _, t in parts])) ** 2).sum().backward()
        opt.step()
        for r in range(2):
            torch.testing.assert_close(
                results[r]["outs"][step], out.detach()[10 * r : 10 * r + 10], atol=1e-5, rtol=1e-5
            )
    for r in range(2):
        assert torch.equal(results[r]["keys"], id_map)
        torch.testing.assert_close(results[r]["rows"], ref.weight.detach(), atol=1e-5, rtol=1e-5)
        assert len(set(results[r]["calls"])) == 1  # a constant number of all_to_alls per step


def test_checkpoint_of_two_processes_restores_on_one_and_three(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    saved = run_ranks(2, "dist_dynamic_workers:train", tmp_path / "a", steps=5, admission=2, path=str(path))
    local, local_opt = _local(2, admission=2)
    for step_outs, step in zip(_one_process(local, local_opt, 2, range(5)), range(5), strict=True):
        for r in range(2):
            torch.testing.assert_close(saved[r]["outs"][step], step_outs[r], atol=1e-5, rtol=1e-5)
    restored = run_ranks(3, "dist_dynamic_workers:restore", tmp_path / "b", path=str(path), admission=2)
    for shards in (1, 3):
        one, one_opt = _local(shards, admission=2)
        shardvar.load({"emb": one, "opt": one_opt}, path)
        rows, keys = one.to_fixed()
        assert torch.equal(keys, saved[0]["keys"]) and torch.equal(rows, saved[0]["rows"])
        one.eval()
        for r in range(3):
            assert torch.equal(restored[r]["keys"], keys) and torch.equal(restored[r]["rows"], rows)
            assert torch.equal(restored[r]["lookup"], one(POOL))
            assert torch.equal(restored[r]["contains"], one.contains(POOL))
        one.train()
        if shards == 3:  # training goes on identically: ids, rows and Adam state all moved to their owners
            for step_outs, step in zip(_one_process(one, one_opt, 3, range(5, 8)), range(3), strict=True):
                for r in range(3):
                    torch.testing.assert_close(restored[r]["outs"][step], step_outs[r], atol=1e-5, rtol=1e-5)
            asked = torch.cat([POOL[r * 7 : r * 7 + 20] for r in range(3)])
            evicted = one.evict(asked)
            assert torch.equal(torch.cat([r["evicted"] for r in restored]).unique(), evicted.sort().values)
            assert all(torch.equal(r["after"], one.contains(POOL)) for r in restored)
