"""Whole workflows on CUDA give what they give on the CPU: models moved with ``.cuda()``, collections,
fused and row-wise optimizers, checkpoints that reshard, quantized and dynamic tables, and a one-rank
NCCL group.

Each scenario builds its model on the CPU from a fixed seed, moves it to ``device``, trains on inputs
made on the CPU, and returns what it computed; a test runs it on ``cuda`` and on ``cpu`` and compares.
Skipped with a reason on machines without a GPU (CI has none); run them where one is lent.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardvar
import shardvar.optim as so
from shardvar import EmbeddingBagCollection, EmbeddingCollection, KeyedJagged, TableConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

Scenario = Callable[[str], dict[str, torch.Tensor]]
WIDTHS = {"grouped": (8, 8), "apart": (8, 12)}


def same_on_both(scenario: Scenario, atol: float = 1e-5) -> dict[str, torch.Tensor]:
    on_gpu, on_cpu = scenario("cuda"), scenario("cpu")
    assert on_gpu.keys() == on_cpu.keys()
    for k in on_cpu:
        torch.testing.assert_close(on_gpu[k].cpu(), on_cpu[k], atol=atol, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    return on_gpu


def features(device: str, step: int, weighted: bool = False) -> KeyedJagged:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 5, (3, 16), generator=g)
    rows = (300, 300, 50)
    values = torch.cat([torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths.sum(1), strict=True)])
    weights = torch.rand(values.shape, generator=g).to(device) if weighted else None
    return KeyedJagged(("query", "candidate", "page"), values.to(device), lengths.to(device), weights)


def tables(grouping: str) -> dict[str, TableConfig]:
    user, page = WIDTHS[grouping]
    return {
        "user": TableConfig(300, user, 4, "mod", feature_names=("query", "candidate")),
        "page": TableConfig(50, page, 3, "div"),
    }


@pytest.mark.parametrize("sparse", [False, True])
def test_sharded_embedding_moved_with_cuda_trains_as_on_the_cpu(sparse) -> None:
    def run(device: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(shardvar.ShardedEmbedding(500, 16, 4, "mod", sparse=sparse), nn.Linear(16, 1)).to(device)
        opt = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(model[0].parameters(), lr=0.05)
        head = torch.optim.SGD(model[1].parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            ids = torch.randint(0, 500, (64, 3), generator=g).to(device)
            model(ids).pow(2).mean().backward()
            opt.step(), head.step(), opt.zero_grad(), head.zero_grad()
        assert model[0].weight.device.type == device and all(t.device.type == device for t in model[0].weight.variables)
        return {"table": model[0].weight.to_tensor().detach(), "head": model[1].weight.detach()}

    same_on_both(run)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("grouping", WIDTHS)
def test_bag_collection_with_fused_row_wise_adagrad(grouping, sparse) -> None:
    def run(device: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables(grouping), sparse=sparse).to(device)
        opt = so.RowWiseAdagrad(ebc, lr=0.1)
        so.fuse(opt)
        out = {}
        for step in range(3):
            pooled = ebc(features(device, step, weighted=step == 1))
            sum(v.pow(2).sum() for v in pooled.values()).backward()
            out.update({f"{k}@{step}": v.detach() for k, v in pooled.items()})
        out.update({k: v.detach() for k, v in ebc.state_dict().items()})
        return out

    same_on_both(run)


@pytest.mark.parametrize("grouping", WIDTHS)
def test_sequence_collection_rows_and_row_wise_adam(grouping) -> None:
    def run(device: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        ec = EmbeddingCollection(tables(grouping), sparse=True).to(device)
        opt = so.RowWiseAdam(ec, lr=0.05)
        out = {}
        for step in range(3):
            rows = ec(features(device, step))
            sum(r.values.pow(2).sum() for r in rows.values()).backward()
            opt.step()
            opt.zero_grad()
            out.update({f"{k}@{step}": r.values.detach() for k, r in rows.items()})
        return {**out, **{k: v.detach() for k, v in ec.state_dict().items()}}

    same_on_both(run)


def test_bag_collection_equals_nn_embedding_bags_on_the_gpu() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables("apart")).cuda()
    plain = {
        t: nn.EmbeddingBag.from_pretrained(ebc.embedding_bags[t].weight.to_tensor(), mode="sum")
        for t in ("user", "page")
    }
    batch = features("cuda", 0, weighted=True)
    ids, offsets, weights = batch.split()
    pooled = ebc(batch)
    for f, table in (("query", "user"), ("candidate", "user"), ("page", "page")):
        want = plain[table](ids[f], offsets[f], per_sample_weights=weights[f])
        torch.testing.assert_close(pooled[f], want)


def test_checkpoint_saved_from_the_gpu_restores_into_other_shards_on_the_gpu(tmp_path) -> None:
    torch.manual_seed(0)
    src = EmbeddingBagCollection(tables("grouped")).cuda()
    opt = so.RowWiseAdagrad(src, lr=0.1)
    sum(v.sum() for v in src(features("cuda", 0)).values()).backward()
    opt.step()
    shardvar.save({"model": src, "optim": opt}, tmp_path / "ck")
    other = {
        k: TableConfig(c.num_embeddings, c.embedding_dim, 5, "div", feature_names=c.feature_names)
        for k, c in tables("grouped").items()
    }
    dst = EmbeddingBagCollection(other).cuda()
    dst_opt = so.RowWiseAdagrad(dst, lr=0.1)
    shardvar.load({"model": dst, "optim": dst_opt}, tmp_path / "ck")
    for k, v in src.state_dict().items():
        got = dst.state_dict()[k]
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, v)
    batch = features("cuda", 1)
    for k, v in src(batch).items():
        torch.testing.assert_close(dst(batch)[k], v)


def test_variable_ops_on_a_gpu_slab() -> None:
    def run(device: str) -> dict[str, torch.Tensor]:
        table = torch.randn(200, 6, generator=torch.Generator().manual_seed(0)).to(device)
        out = {}
        for strategy in ("div", "mod"):
            v = shardvar.shard_tensor(table, shardvar.Layout.balanced(strategy, 200, 7))
            ids = torch.tensor([3, 199, 3, 0, 57, 120], device=device)
            upd = torch.arange(36.0, device=device).reshape(6, 6)
            v.scatter_update(ids[1:], upd[1:])
            v.scatter_add(ids, upd)
            v.scatter_max(ids, -upd)
            v.scatter_mul(ids, torch.full_like(upd, 0.5))
            v.assign_add(torch.ones(200, 6, device=device))
            out[f"{strategy}/value"] = v.to_tensor()
            out[f"{strategy}/sparse_read"] = v.sparse_read(ids)
            out[f"{strategy}/slice"] = v[10:150:7, 2:]
            out[f"{strategy}/lookup"] = shardvar.embedding_lookup(v, ids.reshape(2, 3), max_norm=1.0)
            with torch.sparse.check_sparse_tensor_invariants():  # explicit: torch 2.11 warns even with the argument
                index = torch.tensor([[0, 0, 1, 2], [0, 1, 0, 0]])
                sp = torch.sparse_coo_tensor(index, torch.tensor([4, 9, 199, 0]), (3, 2)).to(device)
            out[f"{strategy}/lookup_sparse"] = shardvar.embedding_lookup_sparse(v, sp, None, combiner="sqrtn")
        return out

    got = same_on_both(run)
    assert all(t.is_cuda for t in got.values())


def test_quantized_bag_on_the_gpu_equals_its_cpu_twin() -> None:
    def run(device: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        bag = shardvar.ShardedEmbeddingBag(400, 16, partitioner=4, partition_strategy="mod", mode="sum")
        q = shardvar.quantize(bag, torch.quint8).to(device)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 400, (600,), generator=g).to(device)
        offsets = torch.arange(0, 600, 6, device=device)
        return {"bags": q(ids, offsets), "deq": q.dequantize()}

    same_on_both(run, atol=1e-4)


def test_dynamic_table_on_the_gpu() -> None:
    def run(device: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        emb = shardvar.DynamicEmbedding(8, capacity=64, partitioner=2, devices=[device, device])
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(3)
        out = {}
        for step in range(4):
            keys = torch.randint(0, 10**12, (20,), generator=g).to(device)
            rows = emb(keys)
            rows.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            out[f"rows@{step}"] = rows.detach()
        return out

    same_on_both(run)


def test_partition_model_of_a_gpu_model_keeps_its_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 4)).cuda()
    ids = torch.randint(0, 256, (50, 3), device="cuda")
    want = model(ids)
    shardvar.partition_model(model, {"0.weight": 4})
    assert isinstance(model[0].weight, shardvar.ShardedVariable) and model[0].weight.is_cuda
    torch.testing.assert_close(model(ids), want)


def test_large_bag_lookup_on_the_gpu_with_huge_pages_switched_on(monkeypatch) -> None:
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # CPU-only advice: must leave GPU buffers alone
    table = torch.randn(1 << 20, 64, device="cuda")
    v = shardvar.shard_tensor(table, shardvar.Layout.balanced("mod", 1 << 20, 8))
    ids = torch.randint(0, 1 << 20, (1 << 18,), device="cuda")
    offsets = torch.arange(0, 1 << 18, 16, device="cuda")
    got = shardvar.variables.functional.embedding_bag(v.store, ids, offsets, mode="sum")
    torch.testing.assert_close(got, F.embedding_bag(ids, table, offsets, mode="sum"))


def test_a_one_rank_nccl_group_trains_a_distributed_collection(tmp_path) -> None:
    import torch.distributed as dist

    from shardvar.distributed import DistributedEmbeddingBagCollection

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        dist_ebc = DistributedEmbeddingBagCollection(tables("apart"), sparse=False)
        local = EmbeddingBagCollection(tables("apart")).cuda()
        shardvar.distributed.save({"model": dist_ebc}, tmp_path / "init")
        shardvar.load({"model": local}, tmp_path / "init")
        opts = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (dist_ebc, local)]
        for step in range(3):
            batch = features("cuda", step)
            for m, o in zip((dist_ebc, local), opts, strict=True):
                sum(v.pow(2).sum() for v in m(batch).values()).backward()
                o.step()
                o.zero_grad()
        assert all(
            t.is_cuda for bag in dist_ebc.bags for t in bag.store.local_shards().values()
        )  # NCCL's device: the GPU
        shardvar.distributed.save({"model": dist_ebc}, tmp_path / "final")
        trained = EmbeddingBagCollection(tables("apart")).cuda()
        shardvar.load({"model": trained}, tmp_path / "final")
        for k, v in local.state_dict().items():
            torch.testing.assert_close(trained.state_dict()[k], v)
    finally:
        dist.destroy_process_group()


def bad_calls() -> dict[str, Callable[[], object]]:
    """Each call reads an id outside its table, or bags past the ids: CUDA's kernels check neither."""
    torch.manual_seed(0)
    v = shardvar.shard_tensor(torch.randn(100, 4, device="cuda"), shardvar.Layout.balanced("mod", 100, 4))
    bag = shardvar.ShardedEmbeddingBag(100, 4, 4, "div", mode="sum", sparse=True).cuda()
    ebc = EmbeddingBagCollection(tables("grouped"), sparse=True).cuda()
    ec = EmbeddingCollection(tables("apart")).cuda()
    batch = features("cuda", 0)
    values = batch.values.clone()
    values[-1] = 50  # the last feature is "page", of 50 rows
    bad = KeyedJagged(batch.keys, values, batch.lengths)
    ids = torch.tensor([1, 2, 3, 4], device="cuda")
    return {
        "lookup": lambda: shardvar.embedding_lookup(v, torch.tensor([[0, 100]], device="cuda")),
        "negative": lambda: shardvar.embedding_lookup(v, torch.tensor([-1], device="cuda")),
        "bag ids": lambda: bag(torch.tensor([[5, 100]], device="cuda")),
        "bag offsets": lambda: bag(ids, torch.tensor([0, 2, 9], device="cuda")),
        "collection": lambda: ebc(bad),
        "sequence collection": lambda: ec(bad),
    }


@pytest.mark.parametrize("case", ["lookup", "negative", "bag ids", "bag offsets", "collection", "sequence collection"])
def test_bad_ids_on_the_gpu_raise_shardvar_errors_not_device_asserts(case) -> None:
    call = bad_calls()[case]
    with pytest.raises((shardvar.ShardvarIndexError, shardvar.ShardvarValueError)):
        call()
    torch.cuda.synchronize()  # a device-side assert would surface here and poison the process
