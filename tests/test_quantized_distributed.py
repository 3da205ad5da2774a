"""Distributed tables quantized rank by rank (2 gloo processes), served equal to one process."""

from __future__ import annotations

import itertools

import torch

import shardvar
from dist_quantized_workers import COLLECTION, COLLECTION_PLACEMENT, DIM, ROWS, batch, collection_batch
from distributed import run_ranks
from shardvar.variables import RowInitializer


def test_each_rank_quantizes_its_shards_and_serves_from_them(tmp_path) -> None:
    shards, strategy, path = 5, "mod", tmp_path / "ckpt"
    dtypes = ["quint8", "quint4x2", "float16"]
    results = run_ranks(
        2, "dist_quantized_workers:quantized_serve", tmp_path / "out",
        dtypes=dtypes, shards=shards, strategy=strategy, path=str(path),
    )  # fmt: skip
    for dtype in dtypes:
        _check(dtype, shards, strategy, [r["served"][dtype] for r in results], [r["float_owned"] for r in results])
    loaded = shardvar.quantize(shardvar.ShardedEmbeddingBag(ROWS, DIM, 2, mode="sum", padding_idx=0), torch.quint8)
    shardvar.load({"bag": loaded}, path)  # the ranks' shards, saved as one packed table
    assert torch.equal(loaded.dequantize(), _reference("quint8", shards, strategy)[0].dequantize())


def _reference(dtype: str, shards: int, strategy: str):
    table = RowInitializer(4)((ROWS, DIM))
    table[0] = 0  # the padding row, as the distributed module initialises it
    local = shardvar.ShardedEmbeddingBag.from_pretrained(
        table, partitioner=shards, partition_strategy=strategy, mode="sum", padding_idx=0
    )
    reference = shardvar.quantize(local, getattr(torch, dtype))
    emb = shardvar.ShardedEmbedding.from_pretrained(RowInitializer(4)((ROWS, DIM)), partitioner=shards)
    return reference, shardvar.quantize(emb, getattr(torch, dtype))


def _check(dtype: str, shards: int, strategy: str, results: list[dict], float_owned: list) -> None:
    reference, rows_reference = _reference(dtype, shards, strategy)
    for rank, r in enumerate(results):
        assert r["owned"] == float_owned[rank] == [s for s in range(shards) if s % 2 == rank]
        torch.testing.assert_close(r["out"], reference(**batch(rank)), atol=1e-6, rtol=0)
        torch.testing.assert_close(r["rows"], rows_reference(batch(rank)["input"].reshape(3, 4)), atol=0, rtol=0)
        assert r["calls"] == {"all_to_all": 3}  # split sizes, ids, packed rows: bytes, not floats
        assert r["bad_id_error"] == f"rank 1: ids must be in [0, {ROWS}); got {ROWS} at position 1", r
    assert sum(r["nbytes"] for r in results) == reference.nbytes


def _initial(tables: dict) -> dict[str, torch.Tensor]:
    """The tables a distributed collection starts from with RowInitializer(5): end to end, by logical row."""
    first = dict(zip(tables, itertools.accumulate([0, *(c.num_embeddings for c in tables.values())]), strict=False))
    return {
        t: RowInitializer(5).rows(first[t] + torch.arange(c.num_embeddings), (c.embedding_dim,))
        for t, c in tables.items()
    }


def test_a_distributed_collection_quantized_rank_by_rank_serves_as_the_local_twin(tmp_path) -> None:
    dtypes = ["quint8", "quint4x2", "float16"]
    results = run_ranks(2, "dist_quantized_workers:quantized_collections", tmp_path / "out", dtypes=dtypes)
    local = shardvar.EmbeddingBagCollection(COLLECTION)
    local.load_state_dict({f"embedding_bags.{t}.weight": w for t, w in _initial(COLLECTION).items()})
    sequence = shardvar.EmbeddingCollection(
        {n: shardvar.TableConfig(c.num_embeddings, c.embedding_dim, feature_names=c.feature_names)
         for n, c in COLLECTION.items()}
    )  # fmt: skip
    sequence.load_state_dict({f"embeddings.{t}.weight": w for t, w in _initial(COLLECTION).items()})
    for dtype in dtypes:
        q, qs = shardvar.quantize(local, getattr(torch, dtype)), shardvar.quantize(sequence, getattr(torch, dtype))
        for rank, r in enumerate(results):
            got = r[dtype]
            assert got["type"] == "QuantizedDistributedEmbeddingBagCollection"
            ids, weights = collection_batch(rank)
            want = q(ids, per_sample_weights=weights)
            assert list(got["bags"]) == list(want) == list(ids)  # the features in the order given
            for f in want:
                torch.testing.assert_close(got["bags"][f], want[f], atol=1e-6, rtol=0)
            for f, rows in qs(ids).items():
                torch.testing.assert_close(got["rows"][f][0], rows.values, atol=0, rtol=0)
                assert torch.equal(got["rows"][f][1], rows.lengths)
            assert got["calls"] == r["float_calls"]  # the float collection's exchange: as many collectives
            for kind, (float_error, quantized_error) in got["errors"].items():
                assert float_error is not None and quantized_error == float_error, kind
            assert "not checkpointed: save the float collection and quantize the checkpoint" in got["save_error"][1]
        assert sum(r[dtype]["nbytes"] for r in results) == q.nbytes + sum(
            t.nbytes for n, t in q.embedding_bags.items() if COLLECTION_PLACEMENT.get(n) == "replicate"
        )  # every rank's shards once, the replicated table on each rank
