"""Recycled buffers: the same memory again only once no tensor made from it is alive."""

import copy
import pickle

import torch

from shardvar import ShardedVariable
from shardvar._recycle import Recycler

BIG = (1 << 16, 8)  # 2 MiB of float32: large enough to be kept


def test_memory_comes_back_only_when_nothing_holds_it() -> None:
    r = Recycler()
    first = r.take("k", BIG, torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    second = r.take("k", BIG, torch.float32, torch.device("cpu"))  # first is alive: new memory
    assert second.data_ptr() != ptr
    view = second[10:]
    del first, second
    third = r.take("k", BIG, torch.float32, torch.device("cpu"))  # the newest kept one is held by a view
    assert third.data_ptr() != view.data_ptr() - 10 * 8 * 4
    del view
    kept = third.data_ptr()
    third.fill_(3.0)
    del third
    fourth = r.take("k", (100, 8), torch.float32, torch.device("cpu"), zero=True)  # smaller: same memory
    assert fourth.data_ptr() == kept and fourth.shape == (100, 8) and not fourth.any()
    assert fourth._base is None  # a tensor of its own, not a view: autograd lets it be changed in place


def test_other_keys_dtypes_and_small_buffers_are_not_shared() -> None:
    r = Recycler()
    a = r.take("a", BIG, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    del a
    assert r.take("b", BIG, torch.float32, torch.device("cpu")).data_ptr() != ptr
    assert r.take("a", BIG, torch.float64, torch.device("cpu")).data_ptr() != ptr
    small = r.take("s", (4, 4), torch.float32, torch.device("cpu"))
    small_ptr = small.data_ptr()
    small.fill_(1.0)
    zeroed = r.take("s", (4, 4), torch.float32, torch.device("cpu"), zero=True)
    assert not zeroed.any() and small.sum() == 16 and zeroed.data_ptr() != small_ptr


def test_copies_start_empty() -> None:
    r = Recycler()
    a = r.take("k", BIG, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    del a
    for clone in (copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert clone.take("k", BIG, torch.float32, torch.device("cpu")).data_ptr() != ptr


def _loose(rows: int = 1 << 15, width: int = 32) -> ShardedVariable:
    """Mod shards that are views of two tensors: no full slab, so lookups fetch rows."""
    a, b = torch.randn(rows, width), torch.randn(rows, width)
    v = ShardedVariable([a[0::2].requires_grad_(), b[1::2].requires_grad_()], partition_strategy="mod")
    assert v.store.full_slab is None
    return v


def test_training_steps_reuse_memory_and_match_an_unsharded_table() -> None:
    v = _loose()
    table = torch.cat([v.variables[0].detach(), v.variables[1].detach()], 1).reshape(-1, 32)
    table = table[: v.shape[0]].clone().requires_grad_(True)
    ids = torch.randint(0, v.shape[0], (1 << 15,), generator=torch.Generator().manual_seed(0))
    grad_ptrs, out_ptrs = set(), set()
    for step in range(4):
        for s in v.variables:
            s.grad = None
        table.grad = None
        out = v.sparse_read(ids)
        out.mul_(step + 1)  # in place on the lookup's output, as on F.embedding's
        ref = torch.nn.functional.embedding(ids, table) * (step + 1)
        torch.testing.assert_close(out, ref)
        out_ptrs.add(out.data_ptr())
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(v.variables[0].grad, table.grad[0::2])
        torch.testing.assert_close(v.variables[1].grad, table.grad[1::2])
        grad_ptrs.add(v.variables[0].grad.data_ptr())
        del out
    assert len(grad_ptrs) <= 2 and len(out_ptrs) <= 2  # after the first step: the same memory again
    held = v.variables[0].grad  # kept by the user: the next backward must not write into it
    expected = held.clone()
    for s in v.variables:
        s.grad = None
    v.sparse_read(ids).sum().backward()
    torch.testing.assert_close(held, expected)
