"""The optional native kernels of hot paths against the torch code they stand in for: the row-wise
Adagrad update (``optim/_kernel.py``) and the stable sort of ids (``variables/_native_sort.py``)."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
import shardvar._native as native
from shardvar import ShardvarIndexError, optim
from shardvar.optim import _kernel
from shardvar.optim._optimizers import RowWiseAdagrad, RowWiseAdam
from shardvar.variables import _native_sort
from shardvar.variables._distinct import sort_stable

ADAGRAD = _kernel.adagrad_rule(0.1, 1e-10, 0.0)


def _required(found, source, stem, abi, flags):
    """The kernel, or a skip where it cannot be (no compiler, SHARDVAR_NATIVE=0); a compiler that is here
    but did not give one fails the test, saying why."""
    if found is None:
        if native.compiler_command() is None or not native.enabled():
            pytest.skip("no native kernel here (no C compiler, or SHARDVAR_NATIVE=0)")
        native.build(source, stem, abi, flags)  # raises why
        raise AssertionError("the kernel builds, yet did not load")
    return found


@pytest.fixture(scope="module")
def rowwise():
    return _required(_kernel.rowwise(), _kernel.SOURCE, "rowwise", _kernel._ABI, _kernel.FLAGS)


@pytest.fixture(scope="module")
def sorter():
    return _required(_native_sort.sorter(), _native_sort.SOURCE, "sort", _native_sort._ABI, ("-O3",))


def _table(rows: int, dim: int, pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose rows lie ``pad`` floats apart beyond ``dim``, and accumulators in a strided column."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, dim + pad, generator=g)[:, :dim]
    acc = torch.rand(rows, 3, generator=g)[:, 1]
    return weight, acc


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40), dim=st.integers(1, 70), pad=st.integers(0, 3), decay=st.sampled_from([0.0, 0.05]),
    data=st.data(),
)  # fmt: skip
def test_rowwise_adagrad_equals_the_torch_rule(rowwise, rows, dim, pad, decay, data):
    picked = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    ids = torch.tensor(picked, dtype=torch.int64)
    weight, acc = _table(rows, dim, pad, seed=rows * 100 + dim)
    grad = torch.randn(len(picked), dim, generator=torch.Generator().manual_seed(dim))
    group = {"lr": 0.1, "eps": 1e-10, "weight_decay": decay}
    w, s = weight.index_select(0, ids), {"sum": acc.index_select(0, ids)}
    RowWiseAdagrad.update(w, s, grad, 1, group, True)
    expected_w, expected_acc = weight.clone(), acc.clone()
    expected_w[ids], expected_acc[ids] = w, s["sum"]
    assert rowwise.rows(_kernel.adagrad_rule(0.1, 1e-10, decay), weight, acc, ids, grad)
    torch.testing.assert_close(weight, expected_w, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(acc, expected_acc, rtol=2e-6, atol=1e-7)
    others = torch.ones(rows, dtype=torch.bool)
    others[ids] = False
    assert torch.equal(weight[others], expected_w[others]) and torch.equal(acc[others], expected_acc[others])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40), dim=st.integers(1, 70), pad=st.integers(0, 3), decay=st.sampled_from([0.0, 0.05]),
    betas=st.sampled_from([(0.9, 0.999), (0.3, 0.5)]), step=st.sampled_from([1, 7]), data=st.data(),
)  # fmt: skip
def test_rowwise_adam_equals_the_torch_rule(rowwise, rows, dim, pad, decay, betas, step, data):
    """Both forms of torch's lerp (a weight 1 - beta1 under and over 0.5), bias corrections at two steps."""
    picked = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    ids = torch.tensor(picked, dtype=torch.int64)
    weight, acc = _table(rows, dim, pad, seed=rows * 100 + dim)
    moment = torch.randn(rows, dim + pad, generator=torch.Generator().manual_seed(3))[:, :dim]
    grad = torch.randn(len(picked), dim, generator=torch.Generator().manual_seed(dim))
    group = {"lr": 0.1, "eps": 1e-8, "weight_decay": decay, "betas": betas}
    w, s = weight.index_select(0, ids), {"exp_avg": moment.index_select(0, ids), "exp_avg_sq": acc.index_select(0, ids)}
    RowWiseAdam.update(w, s, grad, step, group, True)
    expected = weight.clone(), moment.clone(), acc.clone()
    expected[0][ids], expected[1][ids], expected[2][ids] = w, s["exp_avg"], s["exp_avg_sq"]
    rule = _kernel.adam_rule(moment, 0.1, betas, 1e-8, decay, step)
    assert rowwise.rows(rule, weight, acc, ids, grad)
    for got, want in zip((weight, moment, acc), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


def test_adam_takes_only_a_first_moment_of_the_tables_rows(rowwise):
    weight, acc = _table(10, 4, 0, seed=6)
    assert _kernel.adam_rule(torch.zeros(10, 4).double(), 0.1, (0.9, 0.99), 1e-8, 0.0, 1) is None
    assert _kernel.adam_rule(torch.zeros(1, 4).expand(10, 4), 0.1, (0.9, 0.99), 1e-8, 0.0, 1) is None
    rule = _kernel.adam_rule(torch.zeros(9, 4), 0.1, (0.9, 0.99), 1e-8, 0.0, 1)  # not the table's shape
    assert not rowwise.rows(rule, weight, acc, torch.tensor([1]), torch.ones(1, 4))


def test_a_row_outside_the_table_changes_nothing(rowwise):
    weight, acc = _table(10, 4, 0, seed=1)
    before = weight.clone(), acc.clone()
    for bad in (10, -1):
        with pytest.raises(ShardvarIndexError, match=rf"row {bad} is outside the table's 10 rows"):
            rowwise.rows(ADAGRAD, weight, acc, torch.tensor([2, bad, 3]), torch.ones(3, 4))
    assert torch.equal(weight, before[0]) and torch.equal(acc, before[1])


@pytest.mark.parametrize(
    "what", ["float64 rows", "int32 ids", "strided columns", "gradient of another width", "expanded rows", "one acc"]
)
def test_tensors_the_kernel_does_not_take_are_left_to_torch(rowwise, what):
    weight, acc = _table(10, 4, 0, seed=2)
    ids, grad = torch.tensor([1, 5]), torch.ones(2, 4)
    if what == "float64 rows":
        weight = weight.double()
    elif what == "int32 ids":
        ids = ids.int()
    elif what == "strided columns":
        weight = torch.randn(4, 10).t()
    elif what == "expanded rows":  # every row one memory: an update of one would change all
        weight = torch.randn(1, 4).expand(10, 4)
    elif what == "one acc":
        acc = torch.rand(1).expand(10)
    else:
        grad = torch.ones(2, 3)
    before = weight.clone(), acc.clone()
    assert not rowwise.rows(ADAGRAD, weight, acc, ids, grad)
    assert torch.equal(weight, before[0]) and torch.equal(acc, before[1])


def test_the_update_counts_as_an_inplace_change_for_autograd(rowwise):
    weight, acc = _table(10, 4, 0, seed=3)
    x = torch.ones(10, 4, requires_grad=True)
    loss = (x * weight).sum()  # saves the weight for backward
    rowwise.rows(ADAGRAD, weight, acc, torch.tensor([0]), torch.ones(1, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _trained(sparse: bool, fused: bool, rule: type = optim.RowWiseAdagrad) -> torch.Tensor:
    torch.manual_seed(0)
    bag = shardvar.ShardedEmbeddingBag(50, 6, partitioner=shardvar.fixed_size_partitioner(3), sparse=sparse)
    opt = rule(bag, lr=0.1)  # no decay: a dense step decays rows no id touched
    if fused:
        optim.fuse(opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, 50, (24,), generator=g)
        bag(ids, torch.arange(0, 24, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return bag.weight.to_tensor().detach()


@pytest.mark.parametrize("rule", [optim.RowWiseAdagrad, optim.RowWiseAdam])
def test_sparse_and_fused_steps_agree_bit_for_bit_and_dense_to_rounding(rule):
    """The sparse and fused paths update with the same arithmetic (the kernel's, or torch's without it); a
    dense gradient is summed in another order, so the dense step agrees to rounding (Adagrad's: a dense
    Adam step moves rows no id touched, as torch.optim.Adam does)."""
    sparse = _trained(True, False, rule)
    assert torch.equal(_trained(True, True, rule), sparse)
    if rule is optim.RowWiseAdagrad:
        torch.testing.assert_close(_trained(False, False, rule), sparse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", [optim.RowWiseAdagrad, optim.RowWiseAdam])
def test_without_the_kernel_the_torch_rule_trains_the_same_to_rounding(rowwise, monkeypatch, rule):
    with_kernel = _trained(True, True, rule)
    monkeypatch.setattr(_kernel, "_loaded", {"kernel": None})
    torch.testing.assert_close(_trained(True, True, rule), with_kernel, rtol=1e-5, atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(
    bound=st.sampled_from([1, 2, 7, 2048, 2049, 1 << 18, (1 << 31) - 1, 1 << 33]),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**16),
)
def test_the_native_sort_equals_torchs_stable_sort(sorter, bound, dtype, n, seed):
    if dtype == torch.int32 and bound > torch.iinfo(torch.int32).max:
        bound = torch.iinfo(torch.int32).max
    g = torch.Generator().manual_seed(seed)
    few = torch.randint(0, min(bound, 5), (n,), generator=g)  # many repeats: stability shows
    keys = torch.where(torch.rand(n, generator=g) < 0.5, few, torch.randint(0, bound, (n,), generator=g)).to(dtype)
    narrow = torch.int32 if bound <= torch.iinfo(torch.int32).max else dtype
    got_keys, got_order = sort_stable(keys, bound)
    want_keys, want_order = torch.sort(keys.to(narrow), stable=True)
    assert got_keys.dtype == narrow and torch.equal(got_keys, want_keys) and torch.equal(got_order, want_order)


@pytest.mark.parametrize("bad", [-1, 100])
def test_the_native_sort_refuses_a_key_outside_its_bound(sorter, bad):
    with pytest.raises(ShardvarIndexError, match=rf"id {bad} is outside \[0, 100\)"):
        sorter.sort(torch.tensor([3, bad, 5]), 100, torch.int32)


def test_without_the_kernel_torch_sorts(monkeypatch):
    monkeypatch.setattr(_native_sort, "_loaded", {"kernel": None})
    keys = torch.tensor([5, 1, 5, 0, 1])
    got = sort_stable(keys, 6)
    assert got[0].tolist() == [0, 1, 1, 5, 5] and got[1].tolist() == [3, 1, 4, 0, 2]


def _sequential_sums(ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct row of the sum bags, and the sum of its bags' gradients added in the order of the ids."""
    bag = torch.repeat_interleave(torch.arange(offsets.numel()), torch.diff(offsets, append=torch.tensor([ids.numel()])))
    sums: dict[int, torch.Tensor] = {}
    for i, row in enumerate(ids.tolist()):
        sums[row] = sums.get(row, torch.zeros(grad.shape[1])) + grad[bag[i]]
    rows = torch.tensor(list(sums), dtype=torch.int64)
    return rows, torch.stack(list(sums.values())) if sums else torch.zeros(0, grad.shape[1])


@settings(max_examples=50, deadline=None)
@given(
    rows=st.sampled_from([1, 5, 300, 1 << 20]), dim=st.integers(1, 20),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=30), chunk_rows=st.sampled_from([1, 3, 1 << 20]),
    wide=st.booleans(), seed=st.integers(0, 2**16), adam=st.booleans(),
)  # fmt: skip
def test_sum_bags_update_equals_summing_then_the_row_update(rowwise, rows, dim, lengths, chunk_rows, wide, seed, adam):
    """No sort, sums in a hash table's slots, a chunk of rows at a time: the same bits as summing each row's
    bags in the order of the ids, then the row update."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    dtype = torch.int64 if wide else torch.int32
    hot = torch.randint(0, rows, (4,), generator=g)  # repeats within and across bags
    ids = torch.where(torch.rand(n, generator=g) < 0.5, hot[torch.randint(0, 4, (n,), generator=g)],
                      torch.randint(0, rows, (n,), generator=g)).to(dtype)  # fmt: skip
    offsets = (torch.tensor([0, *lengths[:-1]]).cumsum(0)).to(dtype)
    grad = torch.randn(len(lengths), dim, generator=g)
    weight, acc = _table(rows, dim, 1, seed) if rows <= 2048 else (torch.randn(rows, dim), torch.rand(rows))
    moment = torch.randn(rows, dim)
    expected = weight.clone(), acc.clone(), moment.clone()

    def rule(m: torch.Tensor) -> _kernel.Rule:
        return _kernel.adam_rule(m, 0.1, (0.9, 0.99), 1e-8, 0.0, 3) if adam else _kernel.adagrad_rule(0.1, 1e-10, 0.0)

    distinct, sums = _sequential_sums(ids.long(), offsets.long(), grad)
    assert rowwise.rows(rule(expected[2]), expected[0], expected[1], distinct, sums)
    with pytest.MonkeyPatch.context() as patch:  # sums made a chunk of rows at a time
        patch.setattr(_kernel, "CHUNK_BYTES", chunk_rows * 4 * dim)
        rowwise.bags(rule(moment), weight, acc, ids, offsets, grad)()
    assert all(torch.equal(a, b) for a, b in zip((weight, acc, moment), expected, strict=True))


@pytest.mark.parametrize("bad", ["id past the table", "negative id", "offsets not from 0", "offsets decreasing"])
def test_sum_bags_update_refuses_bad_input_and_changes_nothing(rowwise, bad):
    weight, acc = _table(10, 4, 0, seed=5)
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 3])
    error, match = ShardvarIndexError, "is outside the table's 10 rows"
    if bad == "id past the table":
        ids[2] = 10
    elif bad == "negative id":
        ids[0] = -3
    else:
        offsets = torch.tensor([1, 2, 3]) if bad == "offsets not from 0" else torch.tensor([0, 3, 2])
        error, match = shardvar.ShardvarValueError, "offsets must start at 0 and not decrease"
    before = weight.clone(), acc.clone()
    job = rowwise.bags(ADAGRAD, weight, acc, ids, offsets, torch.ones(3, 4))
    with pytest.raises(error, match=match):
        job()
    assert torch.equal(weight, before[0]) and torch.equal(acc, before[1])


def test_jobs_run_on_several_threads_and_a_failure_is_raised_after_all_ended(monkeypatch):
    import threading

    from shardvar._threads import run_all

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    seen, done = set(), []

    def job(k: int):
        def run() -> None:
            seen.add(threading.get_ident())
            time.sleep(0.02)
            done.append(k)
            if k == 1:
                raise ShardvarIndexError("job 1 failed")

        return run

    with pytest.raises(ShardvarIndexError, match="job 1 failed"):
        run_all([job(k) for k in range(6)])
    assert sorted(done) == list(range(6)) and len(seen) > 1


def test_kernels_take_only_plain_cpu_tensors_with_storage():
    """A torch.func transform's wrapper, a meta tensor or a subclass has no data pointer to hand over."""
    seen = []
    torch.vmap(lambda x: seen.append(native.on_cpu_memory(x)) or x)(torch.ones(2, 3))
    assert seen == [False] and native.on_cpu_memory(torch.ones(2), torch.nn.Parameter(torch.ones(2)))
    assert not native.on_cpu_memory(torch.ones(2, device="meta"))
    assert not native.on_cpu_memory(torch.ones(2).as_subclass(torch.nn.Buffer))


@pytest.mark.parametrize("table", ["collection", "tiered bag"])
def test_a_fused_sum_bags_backward_takes_the_one_pass_update(rowwise, monkeypatch, tmp_path, table):
    """The sum bags of a collection and of a tiered table give their gradient whole to the kernel (no
    sort, no sum per row in torch), and train as the row path does, bit for bit."""
    from helpers import tiered_bag, train_bags

    calls = []
    real = _kernel.RowWise._run_bags
    monkeypatch.setattr(_kernel.RowWise, "_run_bags", lambda self, *a: calls.append(1) or real(self, *a))

    def trained(whole: bool, folder) -> torch.Tensor:
        folder.mkdir()
        if not whole:
            monkeypatch.setattr(_kernel.RowWise, "bags", lambda *a: None)
        if table == "tiered bag":
            module = tiered_bag(folder)
            optim.fuse(optim.RowWiseAdagrad(module, lr=0.1))
            train_bags(module, 6, seed=2)
            return module.tier.peek(torch.arange(50))[0]
        torch.manual_seed(0)
        module = shardvar.EmbeddingBagCollection({"a": shardvar.TableConfig(50, 4, 2, "mod")}, sparse=True)
        optim.fuse(optim.RowWiseAdagrad(module, lr=0.1))
        g = torch.Generator().manual_seed(2)
        for _ in range(6):
            ids = {"a": (torch.rand(8, generator=g) ** 2 * 50).long()}
            module(ids, {"a": torch.tensor([0, 3, 5])})["a"].square().sum().backward()
        return module.embedding_bags["a"].weight.to_tensor().detach()

    whole = trained(True, tmp_path / "whole")
    assert len(calls) == 6
    assert torch.equal(trained(False, tmp_path / "rows"), whole) and len(calls) == 6


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_jobs_run_in_a_forked_child_after_the_parent_used_helper_threads(monkeypatch):
    """A child forked after the pool started has none of its threads: it must make its own, not wait forever."""
    from shardvar._threads import run_all

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    done: list[int] = []
    run_all([lambda: done.append(1), lambda: done.append(2)])  # the parent's pool now exists
    with warnings.catch_warnings():  # Python 3.12 warns of fork in a process with threads: that is the case here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if both jobs ran
        try:
            seen: list[int] = []
            run_all([lambda: seen.append(1), lambda: seen.append(2)])
            os._exit(0 if sorted(seen) == [1, 2] else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's jobs never ran")


def test_every_row_without_an_index_equals_every_row_by_index(rowwise):
    """A dense step passes no row index (rows None): the same bits as the rows listed one by one."""
    weight, acc = _table(30, 5, 2, seed=7)
    grad = torch.randn(30, 5, generator=torch.Generator().manual_seed(8))
    listed = weight.clone(), acc.clone()
    assert rowwise.rows(ADAGRAD, listed[0], listed[1], torch.arange(30), grad)
    assert rowwise.rows(ADAGRAD, weight, acc, None, grad)
    assert torch.equal(weight, listed[0]) and torch.equal(acc, listed[1])
    assert not rowwise.rows(ADAGRAD, weight, acc, None, grad[:29])  # a gradient row per table row, or torch's
