"""Workers for tests/test_quantized_distributed.py: each rank quantizes its own shards and serves from them."""

from __future__ import annotations

import torch

import shardvar
from shardvar.distributed import DistributedEmbedding, DistributedEmbeddingBag
from shardvar.variables import RowInitializer

ROWS, DIM = 40, 8


def batch(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, ROWS, (12,), generator=g)
    ids[:3] = torch.tensor([0, 0, 39])  # padding ids and duplicates on every rank
    return {"input": ids, "offsets": torch.tensor([0, 2, 2, 7]), "per_sample_weights": torch.rand(12, generator=g)}


def _serve(rank: int, bag: DistributedEmbeddingBag, emb: DistributedEmbedding, dtype: str) -> dict:
    qbag, qemb = shardvar.quantize(bag, getattr(torch, dtype)), shardvar.quantize(emb, getattr(torch, dtype))
    comm = bag.variable.comm
    before = dict(comm.calls)
    out = qbag(**batch(rank))
    calls = {k: n - before.get(k, 0) for k, n in comm.calls.items() if n - before.get(k, 0)}
    rows = qemb(batch(rank)["input"].reshape(3, 4))
    try:
        qbag(torch.tensor([1, ROWS - 1 + rank]), torch.tensor([0]))  # a bad id on rank 1 stops every rank
        error = None
    except shardvar.ShardvarIndexError as e:
        error = str(e)
    owned = sorted(qbag.store.local_shards())
    return {"out": out, "rows": rows, "calls": calls, "bad_id_error": error, "owned": owned, "nbytes": qbag.nbytes}


def quantized_serve(rank: int, world: int, dtypes: list[str], shards: int, strategy: str, path: str) -> dict:
    torch.manual_seed(0)
    bag = DistributedEmbeddingBag(ROWS, DIM, shards, strategy, initializer=RowInitializer(4), mode="sum", padding_idx=0)
    emb = DistributedEmbedding(ROWS, DIM, shards, strategy, initializer=RowInitializer(4))
    served = {dtype: _serve(rank, bag, emb, dtype) for dtype in dtypes}
    shardvar.distributed.save({"bag": shardvar.quantize(bag, torch.quint8)}, path)
    return {"served": served, "float_owned": sorted(bag.store.local_shards()), "error": None}
