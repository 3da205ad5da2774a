"""Distributed variables over real processes (gloo on loopback) against the single-process ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import shardvar
from dist_workers import DIM, ROWS, batch
from distributed import batched, run_ranks
from shardvar.variables import RowInitializer


def single_process_reference(world: int, strategy: str, shards: int, steps: int, seed: int):
    torch.manual_seed(seed)
    head = nn.Linear(DIM, 1)
    table = RowInitializer(seed)((ROWS, DIM))
    emb = shardvar.ShardedEmbedding.from_pretrained(
        table, freeze=False, partitioner=shards, partition_strategy=strategy
    )
    opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
    firsts = None
    for step in range(steps):
        opt.zero_grad()
        outs = []
        for rank in range(world):
            ids, target = batch(rank, step, seed)
            rows = emb(ids)
            outs.append(rows.detach().clone())
            ((head(rows.mean(1)).squeeze(1) - target).pow(2).sum()).backward()
        for p in head.parameters():
            p.grad /= world  # DistributedDataParallel averages the dense gradients; the table's add up
        opt.step()
        firsts = firsts or outs
    return firsts, emb.weight.to_tensor().detach(), head


LOOKUP_CASES = [(2, "div", 5), (2, "mod", 4), (3, "mod", 5), (3, "div", 3)]
STEPS, SEED = 10, 3


OPTIM_CASES = [("RowWiseAdagrad", True, True), ("Adam", False, False), ("SGD", True, False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Where the batched workers that write checkpoints write them."""
    return {name: tmp_path_factory.mktemp(name) for name in ("collection", "sparse", "async")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dirs):
    """The workers that end cleanly, run together: one group of processes per world size for the module."""
    jobs = {
        **{
            ("lookup", world, strategy, shards): (
                world,
                "train",
                {"strategy": strategy, "shards": shards, "steps": STEPS, "seed": SEED},
            )
            for world, strategy, shards in LOOKUP_CASES
        },
        **{
            ("optim", *case): (
                2,
                "dist_optim_workers:train_table",
                dict(zip(("name", "sparse", "fused"), case, strict=True)),
            )
            for case in OPTIM_CASES
        },
        "collection": (2, "dist_collection_workers:train_collection", {"path": str(dirs["collection"])}),
        "sparse": (2, "dist_collection_workers:train_sparse_replicated", {"path": str(dirs["sparse"])}),
        "async": (2, "dist_checkpoint_workers:async_then_delta", {"path": str(dirs["async"])}),
    }
    return batched(lambda: tmp_path_factory.mktemp("ranks"), jobs)


@pytest.mark.parametrize("world, strategy, shards", LOOKUP_CASES)
def test_lookup_and_training_match_a_single_process(runs, world, strategy, shards) -> None:
    steps, seed = STEPS, SEED
    results = runs(("lookup", world, strategy, shards))
    firsts, table, head = single_process_reference(world, strategy, shards, steps, seed)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["first"], firsts[rank], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["head"]["weight"], head.weight.detach(), atol=1e-6, rtol=0)
    layout = getattr(shardvar.Layout, strategy)(ROWS, shards)
    assembled = {s: t for r in results for s, t in r["shards"].items()}
    assert sorted(assembled) == list(range(shards))
    logical = shardvar.ShardedVariable([assembled[s] for s in range(shards)], partition_strategy=strategy).to_tensor()
    torch.testing.assert_close(logical, table, atol=1e-6, rtol=0)
    for r in results:
        # Each rank holds only its shards' bytes, never the whole table.
        assert r["local_bytes"] == sum(layout.sizes[s] for s in r["owned"]) * DIM * 4 < ROWS * DIM * 4
        # Forward: split sizes, ids, rows; backward: gradients. Nothing else per step.
        assert all(c == {"all_to_all": 4} for c in r["calls"]), r["calls"]


def test_ids_out_of_range_on_one_rank_fail_on_every_rank(tmp_path) -> None:
    results = run_ranks(3, "bad_ids", tmp_path)
    for r in results:  # the refusing rank's own error, naming it, on every rank
        assert r["error"] == "rank 1: ids must be in [0, 30); got 35 at position 2", r


def test_mismatched_layouts_fail_on_every_rank(tmp_path) -> None:
    results = run_ranks(2, "mismatched", tmp_path)
    for r in results:
        assert r["error"] and "ranks disagree" in r["error"] and "rank 1:" in r["error"], r


def test_a_dead_rank_makes_the_others_raise_within_the_timeout(tmp_path) -> None:
    timeout = 8.0
    results = run_ranks(3, "dead_rank", tmp_path, expect_exit={2: 17}, collective_timeout=timeout)
    for r in results[:2]:
        assert r["error"] and "another rank probably died" in r["error"], r
        assert r["seconds"] <= timeout + 10, r


def test_a_hung_rank_makes_the_others_raise_after_the_timeout(tmp_path) -> None:
    timeout = 4.0
    results = run_ranks(3, "hung_rank", tmp_path, expect_exit={2: 18}, collective_timeout=timeout)
    for r in results[:2]:
        assert r["error"] and "4 s timeout" in r["error"], r
        assert timeout - 1 <= r["seconds"] <= timeout + 10, r


def assemble(results: list[dict], key: str, layout: shardvar.Layout) -> torch.Tensor:
    parts = {s: t for r in results for s, t in r[key].items()}
    return shardvar.ShardedVariable(
        [parts[s] for s in range(layout.num_shards)], partition_strategy=layout.strategy
    ).to_tensor()


def test_checkpoints_move_between_world_sizes(tmp_path) -> None:
    saved = run_ranks(2, "ckpt_train_save", tmp_path / "w2", path=str(tmp_path / "a"), shards=4, strategy="div")
    weights = assemble(saved, "shards", shardvar.Layout.div(ROWS, 4))
    moments = assemble(saved, "exp_avg", shardvar.Layout.div(ROWS, 4))
    # 2 ranks -> a single process, into another shard count and strategy, Adam's moments included.
    model = nn.Module()
    model.emb = shardvar.ShardedEmbedding(ROWS, DIM, partitioner=5, partition_strategy="mod")
    model.head = nn.Linear(DIM, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    shardvar.load({"model": model, "opt": opt}, tmp_path / "a")
    torch.testing.assert_close(model.emb.weight.to_tensor().detach(), weights, atol=0, rtol=0)
    single_moments = shardvar.ShardedVariable(
        [opt.state[p]["exp_avg"] for p in model.emb.weight.variables], partition_strategy="mod"
    ).to_tensor()
    torch.testing.assert_close(single_moments, moments, atol=0, rtol=0)
    torch.testing.assert_close(model.head.weight, saved[0]["head"], atol=0, rtol=0)
    assert opt.param_groups[0]["lr"] == 0.05
    # The single process saves what it loaded, for the way back.
    shardvar.save({"model": model, "opt": opt}, tmp_path / "b")
    # 2 ranks -> 3 ranks, 6 mod shards; and back: 3 ranks restore the single process's into 3 div shards.
    jobs = [("ckpt_load", {"path": str(tmp_path / "a"), "shards": 6, "strategy": "mod"}),
            ("ckpt_load", {"path": str(tmp_path / "b"), "shards": 3, "strategy": "div"})]  # fmt: skip
    loaded, back = zip(*(r["jobs"] for r in run_ranks(3, "many", tmp_path / "w3", jobs=jobs)), strict=True)
    torch.testing.assert_close(assemble(loaded, "shards", shardvar.Layout.mod(ROWS, 6)), weights, atol=0, rtol=0)
    torch.testing.assert_close(assemble(loaded, "exp_avg", shardvar.Layout.mod(ROWS, 6)), moments, atol=0, rtol=0)
    assert all(r["step"] == 3.0 and r["lr"] == 0.05 for r in loaded)
    torch.testing.assert_close(assemble(back, "shards", shardvar.Layout.div(ROWS, 3)), weights, atol=0, rtol=0)
    torch.testing.assert_close(assemble(back, "exp_avg", shardvar.Layout.div(ROWS, 3)), moments, atol=0, rtol=0)


def test_async_saves_overlap_training_and_deltas_chain_across_ranks(runs, dirs) -> None:
    results, tmp_path = runs("async"), dirs["async"]
    assert all(r["blocked"] for r in results)  # training ran while the writers were held
    layout = shardvar.Layout.mod(ROWS, 4)
    for name, state in (("full", "snapshot"), ("delta", "final")):
        weights = assemble([r[state] for r in results], "shards", layout)
        moments = assemble([r[state] for r in results], "exp_avg", layout)
        model = nn.Module()
        model.emb = shardvar.ShardedEmbedding(ROWS, DIM, partitioner=3, partition_strategy="div")
        model.head = nn.Linear(DIM, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1.0)
        shardvar.load({"model": model, "opt": opt}, tmp_path / name)
        torch.testing.assert_close(model.emb.weight.to_tensor().detach(), weights, atol=0, rtol=0)
        got = shardvar.ShardedVariable([opt.state[p]["exp_avg"] for p in model.emb.weight.variables]).to_tensor()
        torch.testing.assert_close(got, moments, atol=0, rtol=0)
    assert "delta" in shardvar.checkpoint.Manifest.read(tmp_path / "delta").extra


@pytest.mark.parametrize(("name", "sparse", "fused"), OPTIM_CASES)
def test_table_optimizers_on_two_processes_equal_one(runs, name, sparse, fused) -> None:
    from dist_optim_workers import OPTIMIZERS

    results = runs(("optim", name, sparse, fused))
    got = assemble(results, "shards", shardvar.Layout.mod(ROWS, 4))
    table = nn.Embedding.from_pretrained(RowInitializer(3)((ROWS, DIM)), freeze=False, sparse=sparse)
    opt = OPTIMIZERS[name](table)
    for step in range(5):
        loss = sum(table(batch(rank, step, 11)[0]).pow(2).sum() for rank in range(2))
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(got, table.weight.detach(), atol=1e-5, rtol=0)


def test_a_collection_of_tables_trains_as_one_process_in_one_exchange_per_group(runs, dirs) -> None:
    from dist_collection_workers import TABLES, batch

    results, tmp_path = runs("collection"), dirs["collection"]
    r = results[0]
    assert r["groups"] == 2 and all(n == r["groups"] * r["one_table"] for n in r["per_step"])  # not 5 tables' worth
    plain = nn.ModuleDict(
        {k: nn.EmbeddingBag(c.num_embeddings, c.embedding_dim, mode=c.mode) for k, c in TABLES.items()}
    )
    shardvar.load({"model": nn.ModuleDict({"embedding_bags": plain})}, tmp_path / "init")  # tables into plain bags
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(4):
        loss = 0
        for rank in range(2):
            out = {k: plain[k](ids) for k, ids in batch(rank, step).items()}
            loss = loss + sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(out.values()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    final = nn.ModuleDict({k: nn.EmbeddingBag(c.num_embeddings, c.embedding_dim) for k, c in TABLES.items()})
    shardvar.load({"model": nn.ModuleDict({"embedding_bags": final})}, tmp_path / "final")
    for k in TABLES:
        torch.testing.assert_close(final[k].weight, plain[k].weight, atol=1e-5, rtol=0)
    local = shardvar.EmbeddingBagCollection(
        {k: shardvar.TableConfig(c.num_embeddings, c.embedding_dim, 2, "mod") for k, c in TABLES.items()}
    )
    shardvar.load({"model": local}, tmp_path / "final")  # the local collection names its tables alike
    torch.testing.assert_close(local.embedding_bags["d"].weight.to_tensor(), plain["d"].weight, atol=1e-5, rtol=0)


def test_replicated_tables_with_sparse_gradients_train_as_one_process(runs, dirs) -> None:
    from dist_collection_workers import SPARSE_TABLES

    results, tmp_path = runs("sparse"), dirs["sparse"]
    assert torch.equal(results[0]["replica"], results[1]["replica"])  # the copies stay identical
    plain = nn.ModuleDict(
        {k: nn.EmbeddingBag(c.num_embeddings, c.embedding_dim, sparse=True) for k, c in SPARSE_TABLES.items()}
    )
    shardvar.load({"model": nn.ModuleDict({"embedding_bags": plain})}, tmp_path / "init")
    opt = torch.optim.SparseAdam(list(plain.parameters()), lr=0.05)
    for step in range(4):
        loss = 0
        for rank in range(2):  # rank 1 reads only the first half of each table: rows touched by one rank
            g = torch.Generator().manual_seed(100 * step + rank)
            feats = {
                k: torch.randint(0, c.num_embeddings // (1 + rank), (3, 2), generator=g)
                for k, c in SPARSE_TABLES.items()
            }
            loss = loss + sum(plain[k](ids).pow(2).sum() for k, ids in feats.items())
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(results[0]["replica"], plain["r"].weight.detach(), atol=1e-5, rtol=0)
