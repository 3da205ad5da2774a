"""Distributed tables quantized rank by rank (2 gloo processes), served equal to one process."""

from __future__ import annotations

import torch

import shardvar
from dist_quantized_workers import DIM, ROWS, batch
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
