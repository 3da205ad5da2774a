"""Every read of rows from a variable whose shards are on the meta device (a model being planned) gives a meta
result of the shape and dtype the same read of real shards gives, as torch does for a meta tensor."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import shardvar
from shardvar import ShardedVariable, ShardvarDeviceError

IDS = torch.tensor([[1, 9], [5, 0]])
FLAT = torch.tensor([1, 9, 5, 0, 6])
SP = torch.sparse_coo_tensor([[0, 0, 1, 3], [0, 1, 0, 0]], [1, 9, 5, 7], (4, 2), check_invariants=True)
SP_WEIGHTS = torch.sparse_coo_tensor([[0, 0, 1, 3], [0, 1, 0, 0]], [0.5, 2.0, 1.0, -1.0], (4, 2), check_invariants=True)
OFFSETS = torch.tensor([0, 2, 2])

# Stores of meta shards, laid out every way a store holds them: one slab, shards apart, rows of a
# mod layout, views into one allocation, a row shape of rank 2.
STORES: dict[str, Callable[[torch.device | str], ShardedVariable]] = {
    "slab": lambda d: shardvar.shard_tensor(torch.ones(10, 4, device=d), shardvar.Layout.balanced("div", 10, 3)),
    "apart": lambda d: ShardedVariable([torch.ones(4, 4, device=d), torch.ones(3, 4, device=d), torch.ones(3, 4, device=d)]),
    "mod": lambda d: shardvar.shard_tensor(torch.ones(10, 4, device=d), shardvar.Layout.balanced("mod", 10, 4)),
    "views": lambda d: (lambda t: ShardedVariable([t[6:10], t[3:6], t[0:3]]))(torch.ones(10, 4, device=d)),
    "rank 3": lambda d: ShardedVariable([torch.ones(5, 2, 2, device=d), torch.ones(5, 2, 2, device=d)]),
    "module": lambda d: shardvar.ShardedEmbedding(10, 4, partitioner=3, device=d).weight,
}  # fmt: skip

READS: dict[str, Callable[[ShardedVariable], torch.Tensor]] = {
    "getitem ids": lambda v: v[IDS],
    "getitem int": lambda v: v[3],
    "getitem slice": lambda v: v[2:7:2],
    "getitem list": lambda v: v[[4, 1]],
    "sparse_read": lambda v: v.sparse_read(FLAT),
    "to_tensor": lambda v: v.to_tensor(),
    "F.embedding": lambda v: F.embedding(IDS, v),
    "index_select": lambda v: torch.index_select(v, 0, FLAT),
    "embedding_lookup": lambda v: shardvar.embedding_lookup(v, IDS),
    "embedding_lookup max_norm": lambda v: shardvar.embedding_lookup(v, FLAT, max_norm=1.0),
    "embedding_lookup_sparse": lambda v: shardvar.embedding_lookup_sparse(v, SP, combiner="sqrtn"),
    "embedding_lookup_sparse weights": lambda v: shardvar.embedding_lookup_sparse(v, SP, SP_WEIGHTS),
    "safe_embedding_lookup_sparse": lambda v: shardvar.safe_embedding_lookup_sparse(v, SP, SP_WEIGHTS),
    "safe_embedding_lookup_sparse default": lambda v: shardvar.safe_embedding_lookup_sparse(v, SP, default_id=2),
    "embedding_bag": lambda v: shardvar.embedding_bag(v, FLAT, OFFSETS, mode="sum"),
    "embedding_bag max": lambda v: shardvar.embedding_bag(v, FLAT, OFFSETS, mode="max", padding_idx=0),
    "embedding_bag max_norm": lambda v: shardvar.embedding_bag(v, IDS, max_norm=1.0),
}


@pytest.mark.filterwarnings("ignore::shardvar.ShardvarMaterializeWarning")
@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("read", sorted(READS))
def test_every_read_of_meta_shards_gives_a_meta_result_shaped_as_the_real_one(store: str, read: str) -> None:
    try:
        real = READS[read](STORES[store]("cpu"))
    except RuntimeError:  # a read torch does not define for this table (F.embedding of a rank-3 weight)
        with pytest.raises((RuntimeError, AssertionError)):  # torch's meta kernels assert what its CPU ones raise
            READS[read](STORES[store]("meta"))
        return
    meta = READS[read](STORES[store]("meta"))
    assert meta.device.type == "meta"
    assert (meta.shape, meta.dtype) == (real.shape, real.dtype)


@pytest.mark.filterwarnings("ignore::shardvar.ShardvarMaterializeWarning")
@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_of_shards_some_on_meta_is_refused_naming_them(read: str) -> None:
    v = ShardedVariable([torch.ones(4, 4), torch.empty(3, 4, device="meta"), torch.ones(3, 4)])
    with pytest.raises(ShardvarDeviceError, match=r"shard 1 .*on the meta device"):
        READS[read](v)
