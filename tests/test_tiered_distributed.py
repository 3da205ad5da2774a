"""Distributed tiered tables (``storage=`` on the distributed twins): each rank keeps its shards in its own file.

One launch of 2 gloo ranks (``dist_tiered_workers.cases``) trains each table against the same table held
in RAM (a cache of a few rows: rows leave it every step) and runs the refusals and checkpoints; the
tests check what each rank returned, bitwise.
"""

from __future__ import annotations

import pytest
import torch

import shardvar
from dist_tiered_workers import DIM, ROWS, SHARDS
from distributed import run_ranks
from shardvar import optim
from shardvar.tiered import cache_bytes_for

LAYOUT = shardvar.Layout.balanced("mod", ROWS, SHARDS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiered_distributed")
    return run_ranks(2, "dist_tiered_workers:cases", path / "w", path=str(path)), path


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _joined(parts: list[dict[int, torch.Tensor]]) -> torch.Tensor:
    shards = {s: t for part in parts for s, t in part.items()}
    return LAYOUT.join([shards[s] for s in range(SHARDS)])


@pytest.mark.parametrize(
    "path, rank, name",
    [("/d/emb.rows", 1, "emb.rank1.rows"), ("/d/emb", 0, "emb.rank0"), ("/d/emb.{rank}.rows", 3, "emb.3.rows")],
)
def test_each_rank_gets_its_own_file(tmp_path, path, rank, name):
    spec = shardvar.Tiered(tmp_path / path.rpartition("/")[2], cache_bytes=64)
    mine = spec.for_rank(rank)
    assert mine.path.name == name and mine.path.parent == tmp_path and mine.cache_bytes == spec.cache_bytes
    with pytest.raises(shardvar.ShardvarValueError, match="rank must be >= 0"):
        spec.for_rank(-1)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("rows", [10, 1000, 10**6])
def test_a_planned_placement_never_replicates_a_tiered_table(tmp_path, world, rows):
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=64)
    tables = {"t": shardvar.TableConfig(rows, 8, storage=storage), "ram": shardvar.TableConfig(rows, 8)}
    plan = shardvar.distributed.plan_collection(tables, world)
    assert plan["t"] != "replicate" and (rows > 10 or plan["ram"] == "replicate")


def test_a_tiered_bag_trains_as_the_bag_in_ram_bitwise(ranks):
    results, path = ranks
    for rank, r in enumerate(results):
        bag = r["bag"]
        assert _equal(*bag["start"]) and sorted(bag["start"][1]) == [rank, rank + 2]  # its own shards only
        assert all(torch.equal(a, b) for a, b in zip(*bag["outs"], strict=True))
        assert _equal(*bag["weights"]) and _equal(*bag["state"])
        stats = bag["stats"]
        assert stats["capacity_rows"] == 4 and stats["evictions"] >= 4 and stats["written_back"] >= 8
        assert bag["file"] == str(path / "bag" / f"t.rank{rank}.rows")
        assert f"rank={rank}/2, owned=[{rank}, {rank + 2}], storage=Tiered(" in bag["repr"]


def test_a_collection_with_a_tiered_table_trains_as_in_ram_bitwise(ranks):
    results, path = ranks
    for r in results:
        c = r["collection"]
        for ref, tiered in zip(*c["outs"], strict=True):
            assert _equal(ref, tiered)
        assert _equal(*c["state"]) and "embedding_bags.big.weight" in c["names"]
        ref, tiered = c["weights"]
        assert _equal(ref["embedding_bags.small.weight"], tiered["embedding_bags.small.weight"])
        assert _equal(ref["embedding_bags.big.weight"], c["big"])
        assert c["stats"]["evictions"] > 0
    # the distributed tiered collection's checkpoint restores a local collection held in RAM
    configs = {
        "big": shardvar.TableConfig(ROWS, DIM, 3, mode="sum"),
        "small": shardvar.TableConfig(12, DIM, mode="sum"),
    }
    local = shardvar.EmbeddingBagCollection(configs, sparse=True)
    opt = optim.RowWiseAdagrad(local, lr=0.1)
    shardvar.load({"model": local, "opt": opt}, path / "collection" / "collection")
    big = _joined([r["collection"]["big"] for r in results])
    assert torch.equal(local.embedding_bags["big"].weight.to_tensor(), big)


def test_bad_input_on_one_rank_is_refused_by_every_rank_and_changes_nothing(ranks):
    results, _ = ranks
    for r in results:
        bad_id, too_many = r["bad"]["cases"]
        assert bad_id["error"] == "ShardvarIndexError: rank 1: ids must be in [0, 30); got 35 at position 2"
        assert _equal(bad_id["before"][0], bad_id["after"][0]) and _equal(bad_id["before"][1], bad_id["after"][1])
        assert bad_id["before"][2] == bad_id["after"][2]  # not even the cache was asked
        assert (
            too_many["error"].startswith("ShardvarValueError: rank ")
            and "the row cache holds 4 rows" in (too_many["error"])
        )
        assert _equal(too_many["before"][0], too_many["after"][0]) and _equal(
            too_many["before"][1], too_many["after"][1]
        )


def test_what_a_local_tiered_table_refuses_every_rank_refuses(ranks):
    results, _ = ranks
    for rank, r in enumerate(results):
        found = r["refusals"]
        assert found["max_norm"].endswith("max_norm is not supported by a tiered table; got max_norm=1.0")
        assert "weight is not materialised" in found["weight"] and "does not load a state dict" in found["state_dict"]
        assert "initialised once" in found["reset"]
        for name in ("torch_sgd", "unfused"):  # refused in backward, agreed: every rank names the same rank
            assert found[name].startswith("ShardvarTypeError: rank 0: a tiered table trains only through"), name
            assert "no fused optimizer holds this table" in found[name]
        assert found["unchanged"]
        assert "placement 'replicate': a tiered table is split over ranks" in found["replicate"]
        assert found["busy"].startswith("BackingFileError: rank 1: backing file") and "busy.rank1.rows" in found["busy"]
        assert found["named"] == f"named.{rank}.rows"
    assert results[0]["refusals"]["left"] == ["busy.rank1.rows"]  # rank 0 removed the file it had made


def test_checkpoints_go_from_tiered_to_ram_and_back(ranks):
    results, path = ranks
    for r in results:
        c = r["ckpt"]
        assert _equal(c["saved"][0], c["into_ram"][0]) and _equal(c["saved"][1], c["into_ram"][1])
        assert _equal(c["ram"][0], c["back"][0]) and _equal(c["ram"][1], c["back"][1])
    # a local table in RAM (another layout) restores from the distributed tiered checkpoint, optimizer too
    local = shardvar.ShardedEmbeddingBag(ROWS, DIM, 3, mode="sum", sparse=True)
    opt = optim.RowWiseAdagrad(local, lr=0.1)
    shardvar.load({"model": local, "opt": opt}, path / "ckpt" / "from_tiered")
    assert torch.equal(local.weight.to_tensor(), _joined([r["ckpt"]["saved"][0] for r in results]))
    state = [{int(k.rpartition("@")[2]): v for k, v in r["ckpt"]["saved"][1].items() if "@" in k} for r in results]
    assert torch.equal(opt.tables[0].slot_variable("sum").join(), _joined(state))


@pytest.mark.parametrize("cls", [shardvar.DistributedEmbedding, shardvar.distributed.DistributedEmbeddingBag])
def test_one_rank_holding_every_shard_still_serves_them_from_its_file(tmp_path, one_rank, cls):
    cache = cache_bytes_for(5, DIM, rows=ROWS, state_width=1, read_ahead=0.0)  # RowWiseAdagrad: one sum a row
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache, read_ahead=0.0)
    ref, tiered = (cls(ROWS, DIM, 3, sparse=True, storage=s) for s in (None, storage))
    for m in (ref, tiered):
        optim.fuse(optim.RowWiseAdagrad(m, lr=0.1))
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, ROWS, (2, 2), generator=g)
        outs = [m(ids) if cls is shardvar.DistributedEmbedding else m(ids, None) for m in (ref, tiered)]
        assert torch.equal(*outs)
        for out in outs:
            out.square().sum().backward()
    assert torch.equal(ref.weight.to_tensor(), tiered.sharded_variables()["weight"].join())
    assert tiered.cache_stats()["evictions"] > 0 and [p.name for p in tmp_path.iterdir()] == ["t.rank0.rows"]
    with pytest.raises(shardvar.ShardvarTypeError, match=r"reads no rows ahead.*Prefetcher local tables only"):
        tiered.cache  # noqa: B018


def test_one_rank_sequence_collection_with_a_tiered_table_trains_as_in_ram(tmp_path, one_rank):
    def tables(tiered: bool) -> dict:
        cache = cache_bytes_for(4, DIM, rows=ROWS, state_width=1, read_ahead=0.0)  # a batch: 4 ids
        storage = {"storage": shardvar.Tiered(tmp_path / "big.rows", cache_bytes=cache, read_ahead=0.0)} if tiered else {}
        return {"big": shardvar.TableConfig(ROWS, DIM, 3, "mod", **storage), "small": shardvar.TableConfig(10, DIM)}

    cls = shardvar.distributed.DistributedEmbeddingCollection
    ref, tiered = cls(tables(False), sparse=True), cls(tables(True), sparse=True)
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, ROWS, (4,), generator=g)
        inputs = ({"big": ids, "small": ids % 10}, {"big": torch.tensor([0, 2]), "small": torch.tensor([0, 1])})
        outs = [m(*inputs) for m in (ref, tiered)]
        assert all(torch.equal(outs[0][k].values, outs[1][k].values) for k in outs[0])
        for out in outs:
            sum(v.values.square().sum() for v in out.values()).backward()
    big = tiered.embeddings["big"]
    assert torch.equal(
        ref.sharded_variables()["embeddings.big.weight"].to_tensor(), big.sharded_variables()["weight"].join()
    )
    assert sorted(t.name for t in opts[1].tables) == sorted(t.name for t in opts[0].tables)
    assert _equal(opts[0].sharded_variables()["embeddings.big.weight/sum"].local_shards(),
                  opts[1].sharded_variables()["embeddings.big.weight/sum"].local_shards())  # fmt: skip
    assert big.cache_stats()["evictions"] > 0
