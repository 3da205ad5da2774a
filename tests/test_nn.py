"""ShardedEmbedding and ShardedEmbeddingBag against nn.Embedding and nn.EmbeddingBag."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from helpers import grad_of

LAYOUTS = [(1, "div"), (3, "div"), (4, "mod"), (7, "mod"), (shardvar.PartitionerConfig([2, 1]), "div"), ("5,1", "mod")]


def pair(cls_ref, cls_sharded, partitioner, strategy, **kwargs):
    torch.manual_seed(0)
    ref = cls_ref(20, 4, **kwargs)
    sharded = cls_sharded.from_pretrained(
        ref.weight, freeze=False, partitioner=partitioner, partition_strategy=strategy, **kwargs
    )
    return ref, sharded


@pytest.mark.parametrize("partitioner, strategy", LAYOUTS)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"padding_idx": 3}, {"padding_idx": -1}, {"scale_grad_by_freq": True}, {"sparse": True}, {"max_norm": 1.0}],
)
def test_embedding_matches_nn_embedding(partitioner, strategy, kwargs) -> None:
    ref, sharded = pair(nn.Embedding, shardvar.ShardedEmbedding, partitioner, strategy, **kwargs)
    ids = torch.tensor([[0, 3, 19, 3], [7, 7, 7, 12]])
    out_ref, out = ref(ids), sharded(ids)
    torch.testing.assert_close(out, out_ref)
    (out_ref * torch.arange(4.0)).sum().backward()
    (out * torch.arange(4.0)).sum().backward()
    ref_grad = ref.weight.grad.to_dense() if ref.weight.grad.is_sparse else ref.weight.grad
    torch.testing.assert_close(grad_of(sharded), ref_grad)
    torch.testing.assert_close(sharded.weight.to_tensor(), ref.weight.detach())  # max_norm renormed the same rows


def test_gradients_reach_exactly_the_shards_read() -> None:
    emb = shardvar.ShardedEmbedding(20, 4, partitioner=4, sparse=True)
    emb(torch.tensor([0, 1, 16])).sum().backward()
    nnz = [p.grad.coalesce().values().shape[0] for p in emb.weight.variables]
    assert nnz == [2, 0, 0, 1]
    dense = shardvar.ShardedEmbedding(20, 4, partitioner=4, partition_strategy="mod")
    dense(torch.tensor([4, 8])).sum().backward()
    touched = [bool(p.grad.abs().sum() > 0) for p in dense.weight.variables]
    assert touched == [True, False, False, False]


BAG_OPTIONS = [{}, {"padding_idx": 2}, {"sparse": True}, {"include_last_offset": True}, {"max_norm": 0.5}]


@pytest.mark.parametrize("partitioner, strategy", LAYOUTS)
@pytest.mark.parametrize(
    "mode, kwargs",
    # nn.EmbeddingBag refuses sparse gradients with mode='max' (shardvar allows them: tested below).
    [(m, k) for m in ("sum", "mean", "max") for k in BAG_OPTIONS if not (m == "max" and k.get("sparse"))],
)
def test_embedding_bag_matches_nn_embedding_bag(partitioner, strategy, mode, kwargs) -> None:
    ref, sharded = pair(nn.EmbeddingBag, shardvar.ShardedEmbeddingBag, partitioner, strategy, mode=mode, **kwargs)
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 19])
    offsets = torch.tensor([0, 2, 2, 5, 9]) if kwargs.get("include_last_offset") else torch.tensor([0, 2, 2, 5])
    out_ref, out = ref(ids, offsets), sharded(ids, offsets)
    torch.testing.assert_close(out, out_ref)
    (out_ref.sin()).sum().backward()
    (out.sin()).sum().backward()
    ref_grad = ref.weight.grad.to_dense() if ref.weight.grad.is_sparse else ref.weight.grad
    torch.testing.assert_close(grad_of(sharded), ref_grad)
    fixed = torch.tensor([[1, 2, 3], [4, 4, 19]])
    torch.testing.assert_close(sharded(fixed), ref(fixed))


def test_max_bags_with_sparse_gradients_equal_dense_ones() -> None:
    torch.manual_seed(0)
    dense = shardvar.ShardedEmbeddingBag(20, 4, partitioner=3, mode="max")
    sparse = shardvar.ShardedEmbeddingBag.from_pretrained(
        dense.weight.to_tensor(), freeze=False, partitioner=3, mode="max", sparse=True
    )
    ids, offsets = torch.tensor([1, 2, 4, 19, 4]), torch.tensor([0, 3])
    dense(ids, offsets).sum().backward()
    sparse(ids, offsets).sum().backward()
    assert all(p.grad.is_sparse for p in sparse.weight.variables)
    torch.testing.assert_close(grad_of(sparse), grad_of(dense))


def test_embedding_bag_per_sample_weights() -> None:
    ref, sharded = pair(nn.EmbeddingBag, shardvar.ShardedEmbeddingBag, 3, "mod", mode="sum")
    ids, offsets, w = torch.tensor([1, 2, 4, 5]), torch.tensor([0, 1]), torch.tensor([0.5, 2.0, -1.0, 3.0])
    torch.testing.assert_close(sharded(ids, offsets, w), ref(ids, offsets, w))


def test_modules_work_with_state_dict_and_optimizers() -> None:
    emb = shardvar.ShardedEmbedding(10, 2, partitioner=shardvar.FixedShardsPartitioner(3))
    # Issue 12: the logical key by default, as nn.Embedding; the per-shard form on request.
    assert list(emb.state_dict()) == ["weight"]
    emb.set_state_dict_form("sharded")
    assert list(emb.state_dict()) == ["shard_0", "shard_1", "shard_2"]
    clone = shardvar.ShardedEmbedding(10, 2, partitioner=3)
    clone.load_state_dict(emb.state_dict())
    torch.testing.assert_close(clone.weight.to_tensor(), emb.weight.to_tensor())
    assert "layout=div[4, 3, 3]@axis0" in repr(emb)


def test_initial_values_do_not_depend_on_the_layout() -> None:
    values = []
    for partitioner, strategy in LAYOUTS:
        torch.manual_seed(3)
        values.append(
            shardvar.ShardedEmbedding(20, 4, partitioner=partitioner, partition_strategy=strategy).weight.to_tensor()
        )
    torch.manual_seed(3)
    values.append(nn.Embedding(20, 4).weight)
    for v in values[1:]:
        torch.testing.assert_close(v, values[0])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: shardvar.ShardedEmbedding(10, 2, partitioner=0), ValueError, "number of shards must be >= 1; got 0"),
        (lambda: shardvar.ShardedEmbedding(10, 2, partitioner="1,2"), ValueError, "split by rows"),
        (
            lambda: shardvar.ShardedEmbedding(10, 2, partitioner=2, padding_idx=10),
            ValueError,
            "padding_idx must be within",
        ),
        (lambda: shardvar.ShardedEmbedding(10, 2, partitioner=2.5), TypeError, "shard count, partitioner"),
        (lambda: shardvar.ShardedEmbedding(10, 2, partition_strategy="hash"), ValueError, "unknown partition strategy"),
        (lambda: shardvar.ShardedEmbedding(10, 2)(torch.tensor([10])), IndexError, r"ids must be in \[0, 10\); got 10"),
        (lambda: shardvar.ShardedEmbedding(10, 2)(torch.tensor([1.0])), TypeError, "integer tensor"),
        (lambda: shardvar.ShardedEmbeddingBag(10, 2, mode="median"), ValueError, "mode must be"),
        (
            lambda: shardvar.ShardedEmbeddingBag(10, 2)(torch.tensor([1, 2]), torch.tensor([1])),
            ValueError,
            "start at 0",
        ),
        (lambda: shardvar.ShardedEmbeddingBag(10, 2)(torch.tensor([1, 2])), ValueError, "1-D with offsets"),
        (
            lambda: shardvar.ShardedEmbeddingBag(10, 2, partitioner=2)(torch.tensor([1, 10, -1]), torch.tensor([0])),
            IndexError,
            r"ids must be in \[0, 10\); got 10 at position 1",
        ),
        (
            lambda: shardvar.ShardedEmbeddingBag(10, 2, mode="mean")(
                torch.tensor([1]), torch.tensor([0]), torch.ones(1)
            ),
            ValueError,
            "only supported with mode='sum'",
        ),
    ],
)
def test_bad_input(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()
