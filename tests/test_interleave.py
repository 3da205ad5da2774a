"""Mod tables a fused optimizer lays row by row in logical order, and back (variables._relayout).

Checked against the same training without fusing (shards back to back), and the rows' own
arithmetic against brute-force references.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import EmbeddingBagCollection, TableConfig
from shardvar import optim as so
from shardvar.variables._memory import as_slab
from shardvar.variables._plan import GroupPlan, RowOrder
from shardvar.variables._relayout import transpose_rows_

DIM = 4


@settings(max_examples=60, deadline=None)
@given(a=st.integers(1, 9), b=st.integers(1, 700), width=st.integers(1, 3))
def test_transpose_rows_in_place_and_back(a, b, width) -> None:
    x = torch.arange(a * b * width, dtype=torch.float32).view(a * b, width)
    before = x.clone()
    pointer = x.data_ptr()
    if not transpose_rows_(x, a, b):
        assert torch.equal(x, before)  # refused: untouched
        return
    assert x.data_ptr() == pointer
    assert torch.equal(x, before.view(a, b, width).transpose(0, 1).reshape(a * b, width))
    assert transpose_rows_(x, a, b, inverse=True)
    assert torch.equal(x, before)


def test_transpose_rows_refuses_what_a_small_buffer_cannot_do() -> None:
    x = torch.arange(8 * 1_000_003, dtype=torch.float32).view(-1, 1)  # a prime count of rows per shard
    assert not transpose_rows_(x, 8, 1_000_003)
    assert torch.equal(x[:5, 0], torch.arange(5.0))


def _runs(layout: list[tuple[int, int]], width: int = 2) -> tuple[list[torch.Tensor], list[int], list[int], list[int]]:
    """Shards over one buffer: each (rows, shards) a mod table laid row by row (shards > 1) or one shard."""
    total = sum(r for r, _ in layout)
    buf = torch.arange(total * width, dtype=torch.float32).view(total, width)
    shards, starts, steps, start = [], [], [], 0
    for rows, n in layout:
        region = buf[start : start + rows]
        for s in range(n):
            shards.append(region[s::n])
            starts.append(start + s)
            steps.append(n if n > 1 else 1)
        start += rows
    return shards, starts, steps, [x.shape[0] for x in shards]


def test_as_slab_finds_runs_of_interleaved_and_contiguous_shards() -> None:
    shards, starts, steps, _ = _runs([(16, 4), (5, 1), (9, 3), (7, 1)])
    slab, found_starts, found_steps = as_slab(shards)
    assert slab.shape == (37, 2)
    assert found_starts == tuple(starts) and found_steps == tuple(steps)
    # Uneven mod sizes tile too (10 rows over 4 shards: 3, 3, 2, 2).
    shards, starts, steps, _ = _runs([(10, 4)])
    assert as_slab(shards)[1:] == (tuple(starts), tuple(steps))


def test_as_slab_refuses_shards_that_do_not_tile() -> None:
    buf = torch.zeros(12, 2)
    assert as_slab([buf[0::2][:5], buf[1::2]]) is None  # row 10 belongs to no shard
    assert as_slab([buf[0::2], buf[1::2][:5]])[1:] == ((0, 1), (2, 2))  # 11 rows of 6 + 5: they tile
    assert as_slab([buf[0:4], buf[5:8]]) is None  # a gap
    assert as_slab([buf[0::3], buf[1::3], buf[2:5]]) is None  # a run of 3 cut short


@settings(max_examples=40, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 5)), min_size=1, max_size=5), data=st.data())
def test_locate_and_member_major_match_brute_force(layout, data) -> None:
    _, starts, steps, sizes = _runs([(max(r, n), n) for r, n in layout])
    owner = {}
    for k, (start, step, size) in enumerate(zip(starts, steps, sizes, strict=True)):
        for i in range(size):
            owner[start + step * i] = (k, i)
    rows = torch.tensor(data.draw(st.lists(st.sampled_from(sorted(owner)), max_size=40)), dtype=torch.int64)
    plan = GroupPlan(torch.device("cpu"), tuple(range(len(sizes))), tuple(starts), tuple(steps), tuple(sizes), True)
    member, local = plan.locate(rows)
    assert [(int(m), int(i)) for m, i in zip(member, local, strict=True)] == [owner[int(r)] for r in rows]
    firsts = [sum(sizes[:k]) for k in range(len(sizes))]
    want = [firsts[owner[int(r)][0]] + owner[int(r)][1] for r in rows]
    assert plan.member_major(rows).tolist() == want


def _collection(sparse: bool = True) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    configs = {
        "a": TableConfig(64, DIM, 8, "mod"),  # laid row by row when fused
        "b": TableConfig(48, DIM, 1, "mod"),  # one shard: its ids are its rows already
        "c": TableConfig(30, DIM, 4, "mod"),  # 30 rows over 4 shards: unequal, kept back to back
        "d": TableConfig(40, DIM, 4, "div"),
        "e": TableConfig(96, DIM, 4, "mod"),
    }
    return EmbeddingBagCollection(configs, sparse=sparse)


def _batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = {"a": 64, "b": 48, "c": 30, "d": 40, "e": 96}
    return [{k: torch.randint(0, r, (24,), generator=g) for k, r in rows.items()} for _ in range(n)]


def _train(model, optimizer, batches) -> None:
    offsets = dict.fromkeys("abcde", torch.arange(0, 24, 4))
    for ids in batches:
        out = model(ids, offsets)
        sum((v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in out.values()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _tables(model) -> dict[str, torch.Tensor]:
    return {k: t.weight.to_tensor().detach().clone() for k, t in model.embedding_bags.items()}


@pytest.mark.parametrize("optimizer", [so.RowWiseAdagrad, so.RowWiseAdam, so.Adam])
@pytest.mark.parametrize("sparse", [True, False])
def test_a_fused_optimizer_lays_equal_mod_tables_row_by_row_and_trains_the_same(optimizer, sparse) -> None:
    plain, fused = _collection(sparse), _collection(sparse)
    before = _tables(fused)
    plain_opt, fused_opt = optimizer(plain, lr=0.05), optimizer(fused, lr=0.05)
    handle = so.fuse(fused_opt)
    tables = fused.embedding_bags
    assert [k for k, t in tables.items() if t.store.interleaved] == ["a", "e"]
    assert tables["a"].weight.variables[1].stride() == (8 * DIM, 1) and tables["a"].store.row_order is RowOrder.LOGICAL
    assert tables["c"].store.row_order is RowOrder.STORAGE  # unequal shards stay back to back
    assert all(torch.equal(before[k], v) for k, v in _tables(fused).items())  # the same table, rows moved
    batches = _batches()
    _train(plain, plain_opt, batches)
    _train(fused, fused_opt, batches)
    for k, v in _tables(fused).items():
        torch.testing.assert_close(v, _tables(plain)[k], atol=1e-6, rtol=0)
    fused_state, plain_state = fused_opt.state_dict()["state"], plain_opt.state_dict()["state"]
    assert set(fused_state) == set(plain_state)
    for name, value in plain_state.items():  # logical state tensors, whatever the rows' order
        torch.testing.assert_close(fused_state[name], value, atol=1e-6, rtol=0)
    trained = _tables(fused)
    handle.remove()
    assert not any(t.store.interleaved for t in tables.values())
    assert all(p.is_contiguous() for t in tables.values() for p in t.weight.variables)
    assert all(torch.equal(trained[k], v) for k, v in _tables(fused).items())


def test_after_remove_torch_sparse_optimizers_update_the_shards_again() -> None:
    model = _collection()
    handle = so.fuse(so.RowWiseAdagrad(model, lr=0.1))
    _train(model, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), _batches(1))
    handle.remove()
    # torch's sparse add_ takes a slow path over strided parameters that fails past 100 rows.
    big = EmbeddingBagCollection({"t": TableConfig(4096, DIM, 8, "mod")}, sparse=True)
    h = so.fuse(so.RowWiseAdagrad(big, lr=0.1))
    h.remove()
    torch_opt = torch.optim.SparseAdam(list(big.parameters()), lr=0.01)
    before = big.embedding_bags["t"].weight.to_tensor().detach().clone()
    ids = {"t": torch.arange(0, 4096, 2)}
    big(ids, {"t": torch.arange(0, 2048, 8)})["t"].sum().backward()
    torch_opt.step()
    after = big.embedding_bags["t"].weight.to_tensor().detach()
    assert not torch.equal(before[::2], after[::2]) and torch.equal(before[1::2], after[1::2])


def test_a_table_left_out_of_the_fused_optimizer_gets_its_gradient_beside_interleaved_ones() -> None:
    plain, fused = _collection(), _collection()
    names = ["a", "e"]
    pick = lambda m: [(f"{k}", m.embedding_bags[k].weight) for k in names]  # noqa: E731
    handle = so.fuse(so.RowWiseAdagrad(pick(fused), lr=0.1))
    plain_opt = so.RowWiseAdagrad(pick(plain), lr=0.1)
    offsets = dict.fromkeys("abcde", torch.arange(0, 24, 4))
    for ids in _batches(2):
        for model in (plain, fused):
            for p in model.parameters():
                p.grad = None
            sum(v.pow(2).sum() for v in model(ids, offsets).values()).backward()
        plain_opt.step()
        for k in "bcd":  # not in the optimizer: gradients, as without fusing
            got = [p.grad.to_dense() for p in fused.embedding_bags[k].weight.variables]
            want = [p.grad.to_dense() for p in plain.embedding_bags[k].weight.variables]
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    for k in names:
        torch.testing.assert_close(_tables(fused)[k], _tables(plain)[k], atol=1e-6, rtol=0)
    handle.remove()


def test_a_fused_table_moved_by_apply_keeps_its_rows_and_state_in_order(tmp_path) -> None:
    plain, fused = _collection(), _collection()
    plain_opt, fused_opt = so.RowWiseAdagrad(plain, lr=0.1), so.RowWiseAdagrad(fused, lr=0.1)
    handle = so.fuse(fused_opt)
    batches = _batches(4)
    _train(plain, plain_opt, batches[:2])
    _train(fused, fused_opt, batches[:2])
    fused._apply(lambda t: t.clone())  # every shard into memory of its own: the collection regroups
    assert fused.embedding_bags["a"].store.row_order is RowOrder.LOGICAL
    _train(plain, plain_opt, batches[2:])
    _train(fused, fused_opt, batches[2:])
    for k, v in _tables(fused).items():
        torch.testing.assert_close(v, _tables(plain)[k], atol=1e-6, rtol=0)
    # Interleaved shards and their state are saved as logical tables: restored into 2 div shards each.
    shardvar.checkpoint.save({"model": fused, "optim": fused_opt}, tmp_path / "ckpt")
    handle.remove()
    configs = {k: TableConfig(t.num_embeddings, DIM, 2, "div") for k, t in fused.embedding_bags.items()}
    other = EmbeddingBagCollection(configs, sparse=True)
    other_opt = so.RowWiseAdagrad(other, lr=0.1)
    shardvar.checkpoint.load({"model": other, "optim": other_opt}, tmp_path / "ckpt")
    for k, v in _tables(other).items():
        assert torch.equal(v, _tables(fused)[k])
    for name, value in plain_opt.state_dict()["state"].items():
        torch.testing.assert_close(other_opt.state_dict()["state"][name], value, atol=1e-6, rtol=0)


def test_a_checkpoint_loads_into_interleaved_tables_and_state(tmp_path) -> None:
    plain = _collection()
    plain_opt = so.RowWiseAdam(plain, lr=0.05)
    _train(plain, plain_opt, _batches(2))
    shardvar.checkpoint.save({"model": plain, "optim": plain_opt}, tmp_path / "ckpt")
    fused = _collection()
    fused_opt = so.RowWiseAdam(fused, lr=0.05)
    handle = so.fuse(fused_opt)
    assert fused.embedding_bags["e"].store.interleaved
    shardvar.checkpoint.load({"model": fused, "optim": fused_opt}, tmp_path / "ckpt")
    batches = _batches(4)[2:]
    _train(plain, plain_opt, batches)
    _train(fused, fused_opt, batches)  # the loaded state drives the same updates
    for k, v in _tables(fused).items():
        torch.testing.assert_close(v, _tables(plain)[k], atol=1e-6, rtol=0)
    handle.remove()
    for name, value in plain_opt.state_dict()["state"].items():
        torch.testing.assert_close(fused_opt.state_dict()["state"][name], value, atol=1e-6, rtol=0)


def test_rows_stay_put_where_a_tensor_of_someone_else_holds_them() -> None:
    # The user's tensor the shards were cut from: its rows must not move under it.
    whole = torch.randn(64, DIM)
    before = whole.clone()
    v = shardvar.ShardedVariable([torch.randn(8, DIM, requires_grad=True) for _ in range(8)], partition_strategy="mod")
    cut = shardvar.ShardedVariable(list(whole.split(8)), partition_strategy="mod")
    assert v.store.row_order is cut.store.row_order is RowOrder.STORAGE
    h = so.fuse(so.RowWiseAdagrad([("v", v)], lr=0.1))
    assert v.store.interleaved  # its own memory (adopted): laid row by row
    h.remove()
    views = [p.requires_grad_() for p in whole.split(8)]  # leaves over the user's tensor
    table = shardvar.ShardedVariable(views, partition_strategy="mod")
    h = so.fuse(so.RowWiseAdagrad([("t", table)], lr=0.1))
    assert not table.store.interleaved and torch.equal(whole, before)
    h.remove()
    model = _collection()
    snapshot = [p.detach() for p in model.embedding_bags["a"].weight.variables]  # views of table a's shards
    h = so.fuse(so.RowWiseAdagrad(model, lr=0.1))
    assert not model.embedding_bags["a"].store.interleaved  # its memory is the whole group's: none moves
    assert not model.embedding_bags["e"].store.interleaved
    assert all(torch.equal(x, p) for x, p in zip(snapshot, model.embedding_bags["a"].weight.variables, strict=True))
    h.remove()


@pytest.mark.parametrize("sparse", [True, False])
def test_a_sequence_collection_trains_the_same_with_its_mod_tables_row_by_row(sparse) -> None:
    def run(fused: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        configs = {
            "a": TableConfig(64, DIM, 8, "mod"),
            "b": TableConfig(30, DIM, 3, "mod"),
            "c": TableConfig(50, DIM, 4),
        }
        model = shardvar.EmbeddingCollection(configs, sparse=sparse)
        opt = so.RowWiseAdam(model, lr=0.05)
        if fused:
            so.fuse(opt)
            assert [t.store.interleaved for t in model.embeddings.values()] == [True, True, False]
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            ids = {k: torch.randint(0, c.num_embeddings, (20,), generator=g) for k, c in configs.items()}
            out = model(ids, dict.fromkeys(configs, torch.arange(0, 20, 5)))
            sum(
                (x.values * torch.linspace(-1, 1, x.values.numel()).view_as(x.values)).sum() for x in out.values()
            ).backward()
            opt.step()
            opt.zero_grad()
        return {k: t.weight.to_tensor().detach() for k, t in model.embeddings.items()}

    plain, fused = run(False), run(True)
    for k, v in plain.items():
        torch.testing.assert_close(fused[k], v, atol=1e-6, rtol=0)


def test_remove_moves_viewed_rows_to_new_memory_and_warns_while_a_backward_is_pending() -> None:
    model = _collection()
    handle = so.fuse(so.RowWiseAdagrad(model, lr=0.1))
    kept = model.state_dict()  # the logical table of a table laid row by row is a view of its memory
    before = {k: v.clone() for k, v in kept.items()}
    handle.remove()  # the suite turns warnings into errors: none here
    assert not model.embedding_bags["a"].store.interleaved
    assert all(p.is_contiguous() for p in model.embedding_bags["a"].weight.variables)
    assert all(torch.equal(kept[k], v) for k, v in before.items())  # the view kept its values
    handle = so.fuse(so.RowWiseAdagrad(model, lr=0.1))
    out = model(_batches(1)[0], dict.fromkeys("abcde", torch.arange(0, 24, 4)))  # its backward maps rows as they lie
    with pytest.warns(UserWarning, match="stays laid row by row"):
        handle.remove()
    assert model.embedding_bags["a"].store.interleaved
    sum(v.sum() for v in out.values()).backward()
    so.fuse(so.RowWiseAdagrad(model, lr=0.1)).remove()  # as the warning says: fused and removed again
    assert not model.embedding_bags["a"].store.interleaved
    assert all(p.is_contiguous() for p in model.embedding_bags["a"].weight.variables)
