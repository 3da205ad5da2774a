"""DynamicEmbedding(Bag) against fixed tables over the remapped ids, admission, optimizer state, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from shardvar import ShardvarTypeError, ShardvarValueError
from shardvar.dynamic import CountAdmission, DynamicEmbedding, DynamicEmbeddingBag, IdInitializer, ProbabilityAdmission

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's Adagrad, sparse


def _stream(steps: int, batch: int, distinct: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(-(2**63), 2**63 - 1, (distinct,), generator=g)
    return [pool[torch.randint(0, distinct, (batch,), generator=g)] for _ in range(steps)]


def _reference(stream: list[torch.Tensor], dim: int, sparse: bool) -> tuple[nn.Embedding, torch.Tensor]:
    """nn.Embedding over the stream's ids remapped to 0..n-1, rows initialised as the dynamic table's."""
    id_map = torch.cat(stream).unique()
    ref = nn.Embedding(id_map.numel(), dim, sparse=sparse)
    with torch.no_grad():
        ref.weight.copy_(IdInitializer()(id_map, dim, torch.float32))
    return ref, id_map


OPTIMIZERS = {
    "sgd_momentum": (False, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "adam": (False, lambda p: torch.optim.Adam(p, lr=0.01)),
    "sparse_adagrad": (True, lambda p: torch.optim.Adagrad(p, lr=0.1)),
}


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_trains_as_a_fixed_table_over_remapped_ids(num_shards: int, opt: str) -> None:
    sparse, make = OPTIMIZERS[opt]
    stream = _stream(20, 64, 200)
    dyn = DynamicEmbedding(8, 256, num_shards, sparse=sparse)
    ref, id_map = _reference(stream, 8, sparse)
    target = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    opt_d, opt_r = make(dyn.parameters()), make(ref.parameters())
    for ids in stream:
        out_d, out_r = dyn(ids), ref(torch.searchsorted(id_map, ids))
        torch.testing.assert_close(out_d, out_r, atol=1e-5, rtol=1e-5)
        for out, o in ((out_d, opt_d), (out_r, opt_r)):
            o.zero_grad()
            ((out - target) ** 2).sum().backward()
            o.step()
    rows, keys = dyn.to_fixed()
    assert torch.equal(keys, id_map)
    torch.testing.assert_close(rows, ref.weight.detach(), atol=1e-5, rtol=1e-5)


def test_rows_depend_on_the_id_alone() -> None:
    ids = torch.tensor([3, -(2**63), 2**63 - 1, 17, 99])
    first = DynamicEmbedding(6, 32, 1)(ids)
    for shards, order in ((3, [4, 3, 2, 1, 0]), (5, [2, 0, 4, 1, 3])):
        other = DynamicEmbedding(6, 32, shards)
        perm = torch.tensor(order)
        assert torch.equal(other(ids[perm]), first[perm])
    assert torch.equal(DynamicEmbedding(6, 32)(["a", "b"]), DynamicEmbedding(6, 32)(torch.tensor(_hashes("a", "b"))))


def _hashes(*strings: str) -> list[int]:
    return shardvar.dynamic.hash_strings(list(strings)).tolist()


def test_eval_reads_default_for_unknown_ids_and_changes_nothing() -> None:
    emb = DynamicEmbedding(4, 8, default=torch.full((4,), 7.0))
    emb(torch.tensor([1, 2]))
    emb.eval()
    before = (emb.slots.meta.clone(), emb.table.weight.to_tensor().clone())
    out = emb(torch.tensor([1, 5]))
    assert torch.equal(out[1], torch.full((4,), 7.0)) and not torch.equal(out[0], out[1])
    assert torch.equal(emb.slots.meta, before[0]) and torch.equal(emb.table.weight.to_tensor(), before[1])


def test_count_admission_reads_default_without_gradient_until_admitted() -> None:
    emb = DynamicEmbedding(4, 16, admission=CountAdmission(3, width=64))
    for step in range(3):
        out = emb(torch.tensor([10, 11, 11]))
        held = emb.contains(torch.tensor([10, 11]))
        assert held.tolist() == [step >= 2, step >= 1]
        if step == 0:  # nothing admitted: default rows, no path for a gradient
            assert torch.equal(out, torch.zeros(3, 4)) and not out.requires_grad
        if step == 1:  # 11 admitted (seen 3 times), 10 not: only 11's row gets a gradient
            out.sum().backward()
            grad = emb.table.weight.variables[0].grad
            assert grad[int(emb.slots.find(torch.tensor([11]))[0])].eq(2).all() and int(grad.ne(0).any(1).sum()) == 1


def test_probability_admission_is_the_same_for_any_shard_count() -> None:
    stream = _stream(5, 50, 100, seed=3)
    held = []
    for shards in (1, 3):
        emb = DynamicEmbedding(4, 200, shards, admission=ProbabilityAdmission(0.3))
        for ids in stream:
            emb(ids)
        held.append(emb.held_ids())
    assert torch.equal(held[0], held[1]) and 0 < held[0].numel() < 100


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_equals_embedding_bag_over_remapped_ids(mode: str) -> None:
    stream = _stream(4, 30, 40, seed=5)
    dyn = DynamicEmbeddingBag(5, 64, 2, mode=mode)
    ref, id_map = _reference(stream, 5, False)
    bag = nn.EmbeddingBag.from_pretrained(ref.weight.detach().clone(), freeze=False, mode=mode)
    offsets = torch.tensor([0, 4, 4, 17])
    weights = torch.rand(30) if mode == "sum" else None
    for ids in stream:
        out_d = dyn(ids, offsets, per_sample_weights=weights)
        out_r = bag(torch.searchsorted(id_map, ids), offsets, per_sample_weights=weights)
        torch.testing.assert_close(out_d, out_r)
        out_d.sum().backward()
        out_r.sum().backward()
    keys = dyn.held_ids()
    grads = torch.cat([p.grad for p in dyn.table.weight.variables])[dyn.slots.find(keys)[0]]
    torch.testing.assert_close(grads, bag.weight.grad[torch.searchsorted(id_map, keys)])


def test_bag_with_unadmitted_ids_reads_default_rows() -> None:
    dyn = DynamicEmbeddingBag(3, 16, mode="sum", admission=CountAdmission(2, width=64), default=torch.ones(3))
    out = dyn(torch.tensor([[1, 2], [3, 4]]))
    assert torch.equal(out, torch.full((2, 3), 2.0))


def test_attached_optimizer_gives_reused_rows_fresh_state() -> None:
    emb = DynamicEmbedding(4, 2, eviction="lru")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach_optimizer(opt)
    for ids in ([1, 2], [1, 3]):  # 3 evicts 2 (least recently seen) and takes its row
        opt.zero_grad()
        emb(torch.tensor(ids)).sum().backward()
        opt.step()
    slot = int(emb.slots.find(torch.tensor([3]))[0])
    state = opt.state[emb.table.weight.variables[0]]
    # the row's moments hold only the one step of id 3: a fresh row's first step
    fresh_m = 0.1 * torch.ones(4)  # (1 - beta1) * grad, grad = 1
    torch.testing.assert_close(state["exp_avg"][slot], fresh_m)
    with pytest.raises(ShardvarValueError, match="already attached"):
        emb.attach_optimizer(opt)


def test_without_attach_a_reused_row_keeps_stale_state() -> None:
    emb = DynamicEmbedding(4, 2)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    for ids in ([1, 2], [1, 3]):
        opt.zero_grad()
        emb(torch.tensor(ids)).sum().backward()
        opt.step()
    slot = int(emb.slots.find(torch.tensor([3]))[0])
    assert not torch.allclose(opt.state[emb.table.weight.variables[0]]["momentum_buffer"][slot], torch.ones(4))


@pytest.mark.parametrize("attach", [True, False])
def test_row_wise_optimizer_state_of_a_reused_row(attach: bool) -> None:
    emb = DynamicEmbedding(4, 2, sparse=True)
    opt = shardvar.optim.RowWiseAdagrad(emb, lr=0.1)
    if attach:
        emb.attach_optimizer(opt)
    for ids in ([1, 2], [1, 3]):  # 3 evicts 2 and takes its row
        opt.zero_grad()
        emb(torch.tensor(ids)).sum().backward()
        opt.step()
    (name,) = [k for k in opt.sharded_variables() if k.endswith("/sum")]
    accumulator = opt.sharded_variables()[name].join()
    slot = int(emb.slots.find(torch.tensor([3]))[0])
    # one step of a gradient of ones: mean square 1; without attach the row keeps id 2's step too
    assert float(accumulator[slot]) == (1.0 if attach else 2.0)


def test_to_fixed_as_module_looks_up_the_same_rows() -> None:
    emb = DynamicEmbedding(4, 32, 3)
    ids = torch.tensor([9, -4, 1 << 40, 9])
    out = emb(ids)
    fixed, id_map = emb.to_fixed(as_module=True)
    assert isinstance(fixed, shardvar.ShardedEmbedding)
    torch.testing.assert_close(fixed(torch.searchsorted(id_map, ids)), out)


def test_bad_input_raises_and_changes_nothing() -> None:
    emb = DynamicEmbeddingBag(4, 8, mode="mean")
    emb(torch.tensor([1, 2]), torch.tensor([0]))
    meta = emb.slots.meta.clone()
    with pytest.raises(ShardvarValueError, match="offsets"):
        emb(torch.tensor([7, 8]), torch.tensor([1]))
    with pytest.raises(ShardvarTypeError, match="integer"):
        emb(torch.tensor([1.5]), torch.tensor([0]))
    assert torch.equal(emb.slots.meta, meta)
    with pytest.raises(ShardvarValueError, match="partitioner=3 shards exceeds capacity=2"):
        DynamicEmbedding(4, 2, 3)
    with pytest.raises(ShardvarTypeError, match="eviction"):
        DynamicEmbedding(4, 2, eviction="fifo")
    with pytest.raises(ShardvarTypeError, match="admission"):
        DynamicEmbedding(4, 2, admission=3)
    with pytest.raises(ShardvarValueError, match="default"):
        DynamicEmbedding(4, 2, default=torch.zeros(3))
    with pytest.raises(ShardvarValueError, match="exactly one"):
        emb.evict()
    with pytest.raises(ShardvarValueError, match="probability"):
        ProbabilityAdmission(1.5)


def test_double_and_load_state_dict_keep_ids() -> None:
    emb = DynamicEmbedding(4, 16, 2)
    ids = torch.tensor([5, 6, 7])
    out = emb(ids)
    emb.eval()
    other = DynamicEmbedding(4, 16, 2).eval()
    other.load_state_dict(emb.state_dict())
    assert torch.equal(other(ids), out)
    assert torch.equal(emb.double()(ids), out.double())


def test_deepcopy_and_pickle_keep_ids_and_drop_optimizer_attachment(tmp_path) -> None:
    import copy

    emb = DynamicEmbedding(4, 16, 2)
    ids = torch.tensor([5, 6, 7])
    emb.attach_optimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    out = emb(ids)
    torch.save(emb, tmp_path / "m.pt")
    for other in (copy.deepcopy(emb), torch.load(tmp_path / "m.pt", weights_only=False)):
        assert other._attached == [] and torch.equal(other.eval()(ids), out)
        assert not other.contains(torch.tensor([8])).any()
