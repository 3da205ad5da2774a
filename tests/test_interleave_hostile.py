"""Hostile cases of mod tables laid row by row by a fused optimizer (variables._relayout): a backward
pending across ``fuse`` or ``remove``, tensors that view the rows, fusing again. Each is checked
against the same training without fusing."""

from __future__ import annotations

import copy

import pytest
import torch

import shardvar
from shardvar import optim as so
from shardvar.variables._plan import RowOrder

ROWS, DIM, SHARDS = 64, 4, 8
IDS = torch.randint(0, ROWS, (6, 4), generator=torch.Generator().manual_seed(1))


def _table(cls: type, sparse: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(ROWS, DIM, SHARDS, "mod", sparse=sparse)


def _loss(model: torch.nn.Module) -> torch.Tensor:
    out = model(IDS)
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()


def _weight(model: torch.nn.Module) -> torch.Tensor:
    return model.weight.to_tensor().detach().clone()


CASES = [(cls, sparse) for cls in (shardvar.ShardedEmbeddingBag, shardvar.ShardedEmbedding) for sparse in (True, False)]


@pytest.mark.parametrize(("cls", "sparse"), CASES)
def test_a_backward_pending_across_fuse_trains_as_without_fusing(cls, sparse) -> None:
    plain, fused = _table(cls, sparse), _table(cls, sparse)
    plain_opt = so.RowWiseAdagrad(plain, lr=0.1)
    _loss(plain).backward()
    plain_opt.step()
    loss = _loss(fused)  # its gradient rows are the slab's rows as they lie now (shards back to back)
    fused_opt = so.RowWiseAdagrad(fused, lr=0.1)
    handle = so.fuse(fused_opt)
    assert not fused.store.interleaved  # the pending backward keeps the rows put
    loss.backward()
    torch.testing.assert_close(_weight(fused), _weight(plain), atol=1e-6, rtol=0)
    handle.remove()
    handle = so.fuse(fused_opt)  # nothing pending now: laid row by row
    assert fused.store.interleaved
    handle.remove()


@pytest.mark.parametrize(("cls", "sparse"), CASES)
def test_a_backward_pending_across_remove_trains_as_without_fusing(cls, sparse) -> None:
    plain, fused = _table(cls, sparse), _table(cls, sparse)
    plain_opt, fused_opt = so.RowWiseAdagrad(plain, lr=0.1), so.RowWiseAdagrad(fused, lr=0.1)
    handle = so.fuse(fused_opt)
    assert fused.store.interleaved
    loss = _loss(fused)
    with pytest.warns(UserWarning, match="stays laid row by row"):
        handle.remove()  # the rows stay row by row until the pending backward has run
    loss.backward()
    fused_opt.step()
    _loss(plain).backward()
    plain_opt.step()
    torch.testing.assert_close(_weight(fused), _weight(plain), atol=1e-6, rtol=0)
    for name, value in plain_opt.state_dict()["state"].items():
        torch.testing.assert_close(fused_opt.state_dict()["state"][name], value, atol=1e-6, rtol=0)
    so.fuse(fused_opt).remove()  # a later handle lays them back to back
    assert not fused.store.interleaved and all(p.is_contiguous() for p in fused.weight.variables)


def test_remove_lays_shards_back_to_back_in_new_memory_when_a_view_holds_theirs() -> None:
    model = shardvar.ShardedEmbeddingBag(4096, DIM, SHARDS, "mod", sparse=True)
    opt = so.RowWiseAdagrad(model, lr=0.1)
    handle = so.fuse(opt)
    assert model.store.interleaved
    held = model.weight.variables[1].detach()  # the user's view of shard 1
    values, table = held.clone(), _weight(model)
    handle.remove()
    assert torch.equal(held, values) and torch.equal(_weight(model), table)  # nothing scrambled
    assert not model.store.interleaved and all(p.is_contiguous() for p in model.weight.variables)
    torch_opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)  # needs contiguous shards
    model(torch.arange(0, 4096, 2), torch.arange(0, 2048, 8)).sum().backward()
    torch_opt.step()
    after = _weight(model)
    assert not torch.equal(table[::2], after[::2]) and torch.equal(table[1::2], after[1::2])


@pytest.mark.parametrize("hold", ["fuse", "remove"])
def test_a_view_of_the_optimizer_state_held_across_fuse_or_remove_keeps_its_values(hold) -> None:
    model = _table(shardvar.ShardedEmbeddingBag, True)
    opt = so.Adam(model, lr=0.1)
    _loss(model).backward()
    opt.step()
    handle = so.fuse(opt) if hold == "remove" else None
    views = opt.sharded_variables()  # views of the state tensors, shard by shard
    before = {k: v.join().clone() for k, v in views.items() if not isinstance(v, torch.Tensor)}
    handle = so.fuse(opt) if handle is None else handle.remove()
    for k, v in before.items():
        assert torch.equal(views[k].join(), v), k
    if handle is not None:
        handle.remove()


def _collection_run(fused: bool, compiled: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = shardvar.EmbeddingBagCollection(
        {"a": shardvar.TableConfig(64, DIM, 8, "mod"), "e": shardvar.TableConfig(96, DIM, 4, "mod")}, sparse=True
    )
    call = torch.compile(model, backend="eager") if compiled else model
    opt = so.RowWiseAdagrad(model, lr=0.1)
    g = torch.Generator().manual_seed(1)
    offsets = dict.fromkeys("ae", torch.arange(0, 24, 4))
    handle = so.fuse(opt) if fused else None
    for i in range(3):
        ids = {"a": torch.randint(0, 64, (24,), generator=g), "e": torch.randint(0, 96, (24,), generator=g)}
        loss = sum((v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in call(ids, offsets).values())
        if handle is not None and i == 1:  # the rows this lookup handed its sink move back before backward
            handle.remove()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if handle is not None and i == 1:
            handle = so.fuse(opt)
    if handle is not None:
        handle.remove()
    return [t.weight.to_tensor().detach() for t in model.embedding_bags.values()]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's own compile stack
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # dynamo probing tensors
def test_a_compiled_backward_pending_across_remove_updates_the_rows_it_read() -> None:
    for want, got in zip(_collection_run(False, False), _collection_run(True, True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's own compile stack
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # dynamo probing tensors
def test_a_compiled_backward_pending_across_fuse_splits_its_gradient_by_the_rows_it_read() -> None:
    plain, fused = _table(shardvar.ShardedEmbeddingBag, False), _table(shardvar.ShardedEmbeddingBag, False)
    plain_opt = so.RowWiseAdagrad(plain, lr=0.1)
    _loss(plain).backward()
    plain_opt.step()
    loss = _loss(torch.compile(fused, backend="eager"))
    handle = so.fuse(so.RowWiseAdagrad(fused, lr=0.1))  # nothing in a compiled graph keeps the rows put
    loss.backward()
    torch.testing.assert_close(_weight(fused), _weight(plain), atol=1e-6, rtol=0)
    handle.remove()


def test_a_model_pickles_with_a_backward_pending_and_a_fused_copy_updates_only_itself(tmp_path) -> None:
    model = _table(shardvar.ShardedEmbeddingBag, True)
    loss = _loss(model)  # its backward's token is this process's, not the file's
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(_weight(loaded), _weight(model))
    loss.backward()
    collection = shardvar.EmbeddingBagCollection({"a": shardvar.TableConfig(ROWS, DIM, SHARDS, "mod")}, sparse=True)
    handle = so.fuse(so.RowWiseAdagrad(collection, lr=0.1))
    copied = copy.deepcopy(collection)
    before = collection.embedding_bags["a"].weight.to_tensor().detach().clone()
    copied({"a": torch.arange(0, ROWS, 2)}, {"a": torch.arange(0, ROWS // 2, 8)})["a"].sum().backward()
    assert torch.equal(collection.embedding_bags["a"].weight.to_tensor(), before)  # not the copy's update
    assert all(p.grad is not None for p in copied.parameters())  # the copy's gradients are its own
    handle.remove()


def test_a_graph_kept_for_a_second_backward_gives_the_same_gradient_twice() -> None:
    model = shardvar.EmbeddingBagCollection(
        {"a": shardvar.TableConfig(64, DIM, 8, "mod"), "e": shardvar.TableConfig(96, DIM, 4, "mod")}, sparse=True
    )
    ids = {"a": torch.randint(0, 64, (24,)), "e": torch.randint(0, 96, (24,))}
    loss = sum(v.pow(2).sum() for v in model(ids, dict.fromkeys("ae", torch.arange(0, 24, 4))).values())
    loss.backward(retain_graph=True)
    first = [p.grad.to_dense().clone() for p in model.parameters()]
    loss.backward()  # the backward's token went with the first; its split did not
    assert all(torch.allclose(p.grad.to_dense(), 2 * g) for p, g in zip(model.parameters(), first, strict=True))


@pytest.mark.parametrize("sparse", [True, False])
def test_shards_moved_one_by_one_under_a_fused_optimizer_keep_their_rows_and_state_in_step(sparse) -> None:
    def run(fused: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        configs = {"a": shardvar.TableConfig(64, DIM, 8, "mod"), "e": shardvar.TableConfig(96, DIM, 4, "mod")}
        model = shardvar.EmbeddingBagCollection(configs, sparse=sparse)
        opt = so.RowWiseAdam(model, lr=0.05)
        handle = so.fuse(opt) if fused else None
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            ids = {"a": torch.randint(0, 64, (24,), generator=g), "e": torch.randint(0, 96, (24,), generator=g)}
            out = model(ids, dict.fromkeys("ae", torch.arange(0, 24, 4)))
            sum((v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in out.values()).backward()
            opt.step()
            opt.zero_grad()
            if i == 1:  # each shard into memory of its own, not through module._apply: the group would adopt
                for p in model.parameters():  # them back to back, the state staying row by row
                    p.data = p.data.clone()
        if handle is not None:
            assert all(t.store.row_order is RowOrder.LOGICAL for t in model.embedding_bags.values())
            handle.remove()
        return [t.weight.to_tensor().detach() for t in model.embedding_bags.values()] + list(
            opt.state_dict()["state"].values()
        )

    for want, got in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
