"""A sparse ShardedEmbeddingBag's gradient: one coalesced row per distinct id in each shard, equal to torch's.

A sum or mean bag with ``sparse=True`` over a local slab sums each distinct row's gradient at once
(``variables._bag_grad.slab_bags``) instead of taking torch's row-per-id gradient and sorting and
summing it again; the other options (max bags, a padding row, max_norm, scale_grad_by_freq,
include_last_offset) keep torch's op. Either way the values are torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar

ROWS, DIM = 23, 3


def _bags(lengths: list[int], seed: int, index: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (sum(lengths),), generator=g).to(index)
    return ids, torch.tensor([0, *lengths[:-1]]).cumsum(0).to(index)


def _per_shard(module: shardvar.ShardedEmbeddingBag) -> torch.Tensor:
    """The shards' sparse gradients as one dense logical gradient (each shard's rows checked distinct and
    ascending: coalesced, though torch's AccumulateGrad drops the flag)."""
    grads = {}
    for s, p in module.store.local_shards().items():
        rows = p.grad._indices()[0]
        assert p.grad.is_sparse and bool((rows[1:] > rows[:-1]).all()), (s, rows)
        grads[s] = p.grad.to_dense()
    return module.layout.join([grads[s] for s in sorted(grads)])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=9),
    shards=st.integers(1, 5),
    strategy=st.sampled_from(["div", "mod"]),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    fixed=st.booleans(),
    index=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 10_000),
)
def test_sparse_bags_give_each_shard_torchs_gradient_coalesced(
    lengths, shards, strategy, mode, weighted, fixed, index, seed
) -> None:
    ids, offsets = _bags(lengths, seed, index)
    if fixed and lengths[0]:  # 2-D input: every bag the first one's length (torch takes no [bags, 0])
        shape = (len(lengths), lengths[0])
        ids, offsets = torch.randint(0, ROWS, shape, generator=torch.Generator().manual_seed(seed)).to(index), None
    weighted = weighted and mode == "sum"
    g = torch.Generator().manual_seed(seed + 1)
    psw = torch.rand(ids.shape, generator=g, dtype=torch.float32) if weighted else None
    table = torch.randn(ROWS, DIM, generator=g)
    mine = shardvar.ShardedEmbeddingBag.from_pretrained(
        table, freeze=False, mode=mode, partitioner=shards, partition_strategy=strategy, sparse=True
    )
    plain = torch.nn.Parameter(table.clone())
    grad_out = torch.randn(len(lengths), DIM, generator=g)
    got = mine(ids, offsets, per_sample_weights=psw)
    want = F.embedding_bag(ids, plain, offsets, mode=mode, sparse=True, per_sample_weights=psw)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same kernel over the same rows
    got.backward(grad_out)
    want.backward(grad_out)
    torch.testing.assert_close(_per_shard(mine), plain.grad.to_dense(), atol=1e-6, rtol=1e-6)
    nnz = sum(p.grad._nnz() for p in mine.parameters())
    assert nnz == ids.unique().numel()  # one row per distinct id, no per-id copies


def test_learned_per_sample_weights_get_torchs_gradient() -> None:
    ids, offsets = _bags([3, 0, 4, 2], 7, torch.int64)
    table = torch.randn(ROWS, DIM)
    mine = shardvar.ShardedEmbeddingBag.from_pretrained(table, freeze=False, mode="sum", partitioner=3, sparse=True)
    psw = torch.rand(ids.shape, requires_grad=True)
    mine(ids, offsets, per_sample_weights=psw).pow(2).sum().backward()
    theirs = psw.detach().clone().requires_grad_()
    F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=theirs).pow(2).sum().backward()
    torch.testing.assert_close(psw.grad, theirs.grad)


@pytest.mark.parametrize(
    "options",
    [{"mode": "max"}, {"padding_idx": 4}, {"max_norm": 0.5}, {"scale_grad_by_freq": True}, {"mode": "sum"}],
    ids=["max", "padding", "max_norm", "scale_grad_by_freq", "include_last_offset"],
)
def test_options_the_row_sum_leaves_out_keep_torchs_gradient(options: dict) -> None:
    last = options == {"mode": "sum"}  # the include_last_offset case
    ids, offsets = _bags([2, 3, 1], 3, torch.int64)
    if last:
        offsets = torch.cat([offsets, offsets.new_tensor([ids.numel()])])
    table = torch.randn(ROWS, DIM)
    kwargs = {"mode": "mean", **options, "include_last_offset": last}
    mine = shardvar.ShardedEmbeddingBag.from_pretrained(table, freeze=False, partitioner=2, sparse=True, **kwargs)
    dense = options.get("mode") == "max"  # torch has no sparse gradient for max bags
    plain = torch.nn.EmbeddingBag.from_pretrained(table.clone(), freeze=False, sparse=not dense, **kwargs)
    if "scale_grad_by_freq" in options:  # as torch's sparse bag: refused in backward
        with pytest.raises(RuntimeError, match="scale_grad_by_freq not supported with sparse gradients"):
            mine(ids, offsets).pow(2).sum().backward()
        return
    mine(ids, offsets).pow(2).sum().backward()
    plain(ids, offsets).pow(2).sum().backward()
    torch.testing.assert_close(_per_shard(mine), plain.weight.grad.to_dense(), atol=1e-6, rtol=1e-6)
