"""Workers for tests/test_quantized_distributed.py: each rank quantizes its own shards and serves from them."""

from __future__ import annotations

import torch

import shardvar
from shardvar import TableConfig
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


# A distributed collection and its quantized twin: features named otherwise than their tables, several
# features per table, tables split by rows, whole on a rank, and replicated.
COLLECTION = {
    "users": TableConfig(30, 4, 3, "mod", feature_names=["query_user", "candidate_user"]),
    "products": TableConfig(20, 4, 2, "div", mode="mean", feature_names=["item"]),
    "ads": TableConfig(11, 6, feature_names=["ad", "seen_ad"]),
    "ctx": TableConfig(7, 4, feature_names=["context"]),
}
COLLECTION_PLACEMENT = {"ads": "table", "ctx": "replicate"}


def collection_batch(rank: int) -> tuple[dict, dict]:
    """(ids by feature, weights for the features of sum tables), in an order other than the configs'."""
    g = torch.Generator().manual_seed(10 + rank)
    rows = {f: c.num_embeddings for c in COLLECTION.values() for f in c.feature_names}
    ids = {f: torch.randint(0, n, (3, 2), generator=g) for f, n in reversed(rows.items())}
    summed = [f for c in COLLECTION.values() if c.mode == "sum" for f in c.feature_names]
    return ids, {f: torch.rand(3, 2, generator=g) for f in summed}


def _calls(module: torch.nn.Module, run) -> tuple[object, dict]:
    exchanges = [m.store.exchange for m in module.modules() if hasattr(m, "store")]
    comms = {id(e.comm): e.comm for e in exchanges if e is not None}  # a replicated table has none
    before = [dict(c.calls) for c in comms.values()]
    out = run()
    calls: dict = {}
    for c, b in zip(comms.values(), before, strict=True):
        for k, n in c.calls.items():
            if n - b.get(k, 0):
                calls[k] = calls.get(k, 0) + n - b.get(k, 0)
    return out, calls


def _error(call) -> tuple[str, str] | None:
    try:
        call()
    except shardvar.ShardvarError as e:
        return type(e).__name__, str(e)
    return None


def _bad_inputs(rank: int) -> dict:
    """Inputs every rank gets wrong alike (the collection checks ids on each rank as it packs them, before
    any exchange: a bad id on one rank only leaves the others in the exchange, float or quantized)."""
    ids, _ = collection_batch(rank)
    return {
        "unknown": ({**ids, "nope": torch.tensor([[1]])},),
        "missing": ({f: v for f, v in ids.items() if f != "item"},),
        "bad_id": ({**ids, "query_user": torch.tensor([[1, 30]])},),
        "mean_weights": (ids, None, {"item": torch.ones(3, 2)}),
        "stray_offsets": (ids, {"nope": torch.tensor([0])}),
    }


def quantized_collections(rank: int, world: int, dtypes: list[str]) -> dict:
    from shardvar.distributed import DistributedEmbeddingBagCollection, DistributedEmbeddingCollection

    init = RowInitializer(5)
    pooled = DistributedEmbeddingBagCollection(COLLECTION, placement=COLLECTION_PLACEMENT, initializer=init)
    rows = {n: TableConfig(c.num_embeddings, c.embedding_dim, c.partitioner, c.partition_strategy,
                           feature_names=c.feature_names) for n, c in COLLECTION.items()}  # fmt: skip
    sequence = DistributedEmbeddingCollection(rows, placement=COLLECTION_PLACEMENT, initializer=init)
    ids, weights = collection_batch(rank)
    out: dict = {"float_calls": _calls(pooled, lambda: pooled(ids, per_sample_weights=weights))[1]}
    for dtype in dtypes:
        q = shardvar.quantize(pooled, getattr(torch, dtype))
        qs = shardvar.quantize(sequence, getattr(torch, dtype))
        bags, calls = _calls(q, lambda q=q: q(ids, per_sample_weights=weights))
        seq = qs(ids)
        errors = {
            k: (_error(lambda a=a: pooled(*a)), _error(lambda a=a, q=q: q(*a))) for k, a in _bad_inputs(rank).items()
        }
        out[dtype] = {
            "type": type(q).__name__,
            "bags": bags,
            "rows": {f: (r.values, r.lengths) for f, r in seq.items()},
            "calls": calls,
            "errors": errors,
            "nbytes": q.nbytes,
            "save_error": _error(lambda q=q: shardvar.distributed.save({"q": q}, "/nonexistent/never-written")),
        }
    return out
