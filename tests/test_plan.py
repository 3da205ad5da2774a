"""The slab plan: every map between logical ids, slab rows and (shard, row), against brute force."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar.layout import Layout, mod_sizes
from shardvar.variables import ShardStore
from shardvar.variables._plan import GroupPlan, RowOrder, SlabPlan, storage_ids

CPU = torch.device("cpu")
SRC = Path(shardvar.__file__).parent


@st.composite
def groups(draw: st.DrawFn) -> GroupPlan:
    """A group of runs in any member order: a shard on its own (rows back to back), or the m shards of a
    mod table laid row by row."""
    runs = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 4)), min_size=1, max_size=5))
    starts, steps, sizes, row = [], [], [], 0
    for rows, m in runs:
        rows = max(rows, m) if m > 1 else rows
        for j, size in enumerate(mod_sizes(rows, m) if m > 1 else (rows,)):
            starts.append(row + j)
            steps.append(m)
            sizes.append(size)
        row += rows
    members = draw(st.permutations(range(len(sizes))))
    return GroupPlan(CPU, tuple(members), tuple(starts), tuple(steps), tuple(sizes), True)


def _owner(plan: GroupPlan) -> dict[int, tuple[int, int]]:
    """Group row -> (member position, local row), by walking every member's rows."""
    out = {}
    for k, (start, step, size) in enumerate(zip(plan.starts, plan.steps, plan.sizes, strict=True)):
        for i in range(size):
            assert start + step * i not in out  # the runs tile the rows once
            out[start + step * i] = (k, i)
    assert sorted(out) == list(range(plan.rows))
    return out


@settings(max_examples=80, deadline=None)
@given(plan=groups(), data=st.data())
def test_group_plan_maps_rows_as_brute_force(plan: GroupPlan, data: st.DataObject) -> None:
    owner = _owner(plan)
    picked = data.draw(st.lists(st.sampled_from(sorted(owner)), max_size=40)) if owner else []
    rows = torch.tensor(picked, dtype=torch.int64)
    member, local = plan.locate(rows)
    assert list(zip(member.tolist(), local.tolist(), strict=True)) == [owner[r] for r in picked]
    want = [plan.firsts[owner[r][0]] + owner[r][1] for r in picked]
    assert plan.member_major(rows).tolist() == want
    assert plan.interleaved == any(s > 1 for s in plan.steps)
    everything = torch.arange(plan.rows)
    for k, size in enumerate(plan.sizes):
        mine = [r for r in range(plan.rows) if owner[r][0] == k]
        assert everything[plan.member_slice(k)].tolist() == mine
        assert plan.member_rows(k, CPU).tolist() == mine
        assert plan.to_group(k, torch.arange(size)).tolist() == mine
        assert plan.to_member_major(k, torch.arange(size)).tolist() == list(
            range(plan.firsts[k], plan.firsts[k] + size)
        )
    keys = torch.tensor(sorted(set(want)), dtype=torch.int64)
    counts, local = plan.cut(keys)
    holder = [next(k for k, s in enumerate(plan.sizes) if plan.firsts[k] <= key < plan.firsts[k] + s) for key in keys]
    assert counts == [holder.count(k) for k in range(len(plan.sizes))]
    assert local.tolist() == [int(key) - plan.firsts[k] for key, k in zip(keys, holder, strict=True)]


@st.composite
def complete_plans(draw: st.DrawFn) -> tuple[Layout, SlabPlan, list[int]]:
    """A complete store's plan (every shard in one group, in any order, mod tables maybe row by row) and
    the logical id each of its slab rows holds."""
    n = draw(st.integers(1, 5))
    rows = draw(st.integers(0, 30))
    layout = draw(st.sampled_from([Layout.div(rows, n), Layout.mod(rows, n)]))
    interleaved = layout.strategy == "mod" and n > 1 and rows >= n and draw(st.booleans())
    members = tuple(range(n)) if interleaved else tuple(draw(st.permutations(range(n))))
    sizes = tuple(layout.sizes[s] for s in members)
    if interleaved:
        starts, steps = tuple(range(n)), (n,) * n
    else:
        starts, steps = tuple(sum(sizes[:k]) for k in range(n)), (1,) * n
    plan = SlabPlan(layout, (GroupPlan(CPU, members, starts, steps, sizes, True),))
    held = [-1] * rows
    for s, start, step in zip(members, starts, steps, strict=True):
        for i, x in enumerate(layout.shard_ids(s).tolist()):
            held[start + step * i] = x
    return layout, plan, held


@settings(max_examples=120, deadline=None)
@given(case=complete_plans(), data=st.data())
def test_slab_plan_routes_ids_as_brute_force(case: tuple[Layout, SlabPlan, list[int]], data: st.DataObject) -> None:
    layout, plan, held = case
    ids = torch.tensor(data.draw(st.lists(st.integers(0, max(layout.num_rows - 1, 0)), max_size=30))
                       if layout.num_rows else [], dtype=torch.int64)  # fmt: skip
    group, row = plan.route(ids)
    assert group.tolist() == [0] * ids.numel()
    assert [held[r] for r in row.tolist()] == ids.tolist()
    assert torch.equal(plan.slab_rows(ids), row)
    logical = held == list(range(layout.num_rows))
    assert (plan.order is RowOrder.LOGICAL) == logical
    back_to_back = plan.groups[0].members == tuple(range(layout.num_shards)) and not plan.groups[0].interleaved
    if not logical:
        assert plan.order is (RowOrder.STORAGE if back_to_back else RowOrder.RUNS)


def test_a_plan_without_a_full_slab_has_no_order_and_routes_to_its_groups() -> None:
    layout = Layout.mod(7, 3)
    lone = [GroupPlan(CPU, (s,), (0,), (1,), (layout.sizes[s],), False) for s in (2, 0)]
    plan = SlabPlan(layout, tuple(lone))
    assert plan.order is None
    group, row = plan.route(torch.arange(7))
    assert group.tolist() == [1, -1, 0, 1, -1, 0, 1] and row.tolist() == [0, 0, 0, 1, 1, 1, 2]
    one = SlabPlan(layout, (GroupPlan(CPU, (0, 1), (0, 3), (1, 1), (3, 2), True),))  # shard 2 held elsewhere
    assert one.order is None


@pytest.mark.parametrize("layout", [Layout.mod(12, 4), Layout.div(12, 4), Layout.mod(9, 3)])
def test_storage_ids_inverts_storage_rows(layout: Layout) -> None:
    ids = torch.arange(layout.num_rows)
    assert torch.equal(storage_ids(layout, layout.strategy.storage_rows(layout.sizes, ids)), ids)


def test_row_orders_carry_their_behaviour() -> None:
    """Each order maps ids itself and says whether its rows lie as a table kept so reads them; none is a
    string (``RowOrder.LOGICAL != "logical"``), so no caller compares names."""
    layout = Layout.mod(6, 2)
    back_to_back = SlabPlan(layout, (GroupPlan(CPU, (0, 1), (0, 3), (1, 1), (3, 3), True),))
    ids = torch.tensor([5, 0, 3])
    assert RowOrder.LOGICAL.slab_rows(back_to_back, ids) is ids
    assert RowOrder.STORAGE.slab_rows(back_to_back, ids).tolist() == [5, 0, 4]
    assert RowOrder.RUNS.slab_rows(back_to_back, ids).tolist() == [5, 0, 4]  # found by each shard's run
    kept = {(o, i): o.as_kept(i) for o in RowOrder for i in (False, True)}
    assert kept == {
        (RowOrder.LOGICAL, False): True, (RowOrder.LOGICAL, True): True,
        (RowOrder.STORAGE, False): True, (RowOrder.STORAGE, True): False,
        (RowOrder.RUNS, False): False, (RowOrder.RUNS, True): False,
    }  # fmt: skip
    assert all(o != o.value and not isinstance(o, str) for o in RowOrder)


def test_no_row_order_is_compared_with_a_string() -> None:
    """Callers ask the order (``RowOrder`` members carry behaviour); none compares it with a name."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            ordered = any(isinstance(x, ast.Attribute) and x.attr in ("row_order", "_order", "order") for x in sides)
            if ordered and any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


def test_a_store_plans_once_per_rebuild_and_pickles_its_plan() -> None:
    store = ShardStore.allocate(Layout.mod(10, 3), (10, 2), torch.float32)
    plan = store.plan
    store.refresh()
    assert store.plan is plan  # nothing moved: no new plan
    store.route(torch.arange(10))
    again = pickle.loads(pickle.dumps(store))
    assert again.plan.order is RowOrder.STORAGE and again.plan.groups == plan.groups
    assert torch.equal(again.slab_rows(torch.arange(10)), store.slab_rows(torch.arange(10)))
    shard = store.local_shards()[1]
    shard.data = shard.data.clone()  # its memory moved: the store plans again
    assert store.refresh().plan is not plan
