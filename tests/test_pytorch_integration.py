"""Sharded modules under PyTorch's own machinery: compile, torch.func, DDP, deepcopy, dtypes, loading."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import shardvar
from distributed import run_ranks

LAYOUTS = [(4, "div"), (3, "mod"), (1, "div")]


def twins(cls, parts: int, strategy: str, **kwargs):
    torch.manual_seed(0)
    ref = (nn.Embedding if cls is shardvar.ShardedEmbedding else nn.EmbeddingBag)(40, 6, **kwargs)
    sharded = cls.from_pretrained(
        ref.weight.detach().clone(), freeze=False, partitioner=parts, partition_strategy=strategy, **kwargs
    )
    return ref, sharded


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's own compile stack
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # dynamo probing tensors
def test_torch_compile_forward_and_backward() -> None:
    ids = torch.tensor([[1, 39, 39], [0, 7, 20]])
    for cls, kwargs in ((shardvar.ShardedEmbedding, {}), (shardvar.ShardedEmbeddingBag, {"mode": "sum"})):
        for parts, strategy in LAYOUTS[:2]:
            ref, sharded = twins(cls, parts, strategy, **kwargs)
            compiled = torch.compile(lambda x, m=sharded: m(x).pow(2).sum())
            loss = compiled(ids)
            loss.backward()
            want = ref(ids).pow(2).sum()
            want.backward()
            torch.testing.assert_close(loss, want)
            torch.testing.assert_close(sharded.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("parts, strategy", LAYOUTS)
def test_torch_func_grad_vmap_and_double_backward(parts, strategy) -> None:
    ref, sharded = twins(shardvar.ShardedEmbedding, parts, strategy)
    ids = torch.tensor([[1, 5, 5], [39, 0, 2]])
    params = dict(sharded.named_parameters())
    grads = grad(lambda p: functional_call(sharded, p, (ids,)).pow(2).sum())(params)
    want = grad(lambda w: functional_call(ref, {"weight": w}, (ids,)).pow(2).sum())(ref.weight)
    layout = shardvar.Layout.balanced(strategy, 40, parts)
    torch.testing.assert_close(layout.join([grads[f"shard_{s}"] for s in range(parts)]), want)
    torch.testing.assert_close(vmap(sharded)(ids), ref(ids))
    (g,) = torch.autograd.grad(sharded(ids).pow(2).sum(), [sharded.weight.variables[0]], create_graph=True)
    g.sum().backward()  # double backward, as F.embedding's
    assert sharded.weight.variables[0].grad is not None


def test_ddp_with_sparse_gradients_trains_as_nn_embedding(tmp_path) -> None:
    for r in run_ranks(2, "dist_module_workers:ddp_sparse", tmp_path):
        torch.testing.assert_close(r["sharded"], r["plain"])


def test_deepcopy_dtype_and_device_moves() -> None:
    _, sharded = twins(shardvar.ShardedEmbedding, 3, "mod")
    model = nn.Sequential(sharded, nn.Linear(6, 2))
    ids = torch.tensor([[1, 2], [39, 0]])
    out = model(ids)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(ids), out)
    with torch.no_grad():
        clone[0].weight.variables[0].add_(1)
    torch.testing.assert_close(model(ids), out)  # the copy owns its own shards
    double = copy.deepcopy(model).to(torch.float64)
    assert double[0].weight.dtype == torch.float64 and double[0].store.full_slab is not None
    torch.testing.assert_close(double(ids).float(), out)
    assert copy.deepcopy(model).half()[0](ids).dtype == torch.float16


@pytest.mark.parametrize("form", ["logical", "sharded"])
def test_state_dicts_load_with_weights_only(form) -> None:
    _, sharded = twins(shardvar.ShardedEmbeddingBag, 3, "mod", mode="sum")
    sharded.set_state_dict_form(form)
    buffer = io.BytesIO()
    torch.save(sharded.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    other = shardvar.ShardedEmbeddingBag(40, 6, partitioner=3, partition_strategy="mod", mode="sum")
    other.load_state_dict(state)
    torch.testing.assert_close(other.weight.to_tensor(), sharded.weight.to_tensor())


def test_zero_d_ids_and_dtype_mismatches() -> None:
    ref, sharded = twins(shardvar.ShardedEmbedding, 3, "mod")
    torch.testing.assert_close(sharded(torch.tensor(7)), ref(torch.tensor(7)))
    v = sharded.weight
    torch.testing.assert_close(shardvar.embedding_lookup(v, 7), ref.weight[7])
    torch.testing.assert_close(v.sparse_read(torch.tensor(7)), ref.weight[7])
    with pytest.raises(TypeError, match="same dtype"):
        shardvar.ShardedVariable([torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float64)])
    with pytest.raises(TypeError, match=r"per_sample_weights must have the table's dtype torch\.float32"):
        shardvar.ShardedEmbeddingBag(10, 2, mode="sum")(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2).double())
    ids = torch.sparse_coo_tensor([[0, 0], [0, 1]], [1, 2], (1, 2), check_invariants=True)
    weights = torch.sparse_coo_tensor(
        [[0, 0], [0, 1]], torch.ones(2, dtype=torch.float64), (1, 2), check_invariants=True
    )
    # sp_weights follow TensorFlow's rule (any float dtype, cast to the one pooled in), not per_sample_weights's
    got = shardvar.embedding_lookup_sparse(v, ids, weights)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, shardvar.embedding_lookup_sparse(v, ids, weights.float()))
