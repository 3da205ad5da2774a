"""shardvar.quantize and the inference modules, against "dequantize, then the float op"."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import EmbeddingBagCollection, ShardedEmbedding, ShardedEmbeddingBag, TableConfig, quantize
from shardvar.quantized import QuantizedEmbeddingBag, QuantizedEmbeddingBagCollection, row_format

DTYPES = [torch.quint8, torch.quint4x2, torch.float16]


def _bag(rows=40, dim=8, shards=3, strategy="mod", **kw) -> ShardedEmbeddingBag:
    torch.manual_seed(0)
    return ShardedEmbeddingBag(rows, dim, partitioner=shards, partition_strategy=strategy, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_quantize_keeps_layout_and_packs_one_slab(dtype, strategy) -> None:
    bag = _bag(strategy=strategy, mode="sum")
    q = quantize(bag, dtype)
    assert q.layout == bag.layout and q.dtype == dtype and not q.training
    shards = [getattr(q, f"shard_{s}") for s in range(3)]
    assert [t.shape[0] for t in shards] == list(bag.layout.sizes)
    slab = q.store.full_slab
    assert slab is not None  # the shards are views of one packed allocation
    assert all(t.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr() for t in shards)
    table = bag.weight.to_tensor().detach()
    fmt = row_format(dtype)
    deq = q.dequantize()
    assert deq.shape == table.shape and deq.dtype == torch.float32
    if dtype == torch.float16:
        assert torch.equal(deq, table.half().float())
    else:  # each element within half a quantization step (plus the step's own float16 rounding for 4-bit)
        step = fmt.step(q.store.full_slab)[q.store.slab_rows(torch.arange(40))]
        slack = 1e-5 if dtype == torch.quint8 else 2e-3 * table.abs().amax(1)
        assert bool(((deq - table).abs() <= (step / 2 + slack).unsqueeze(1) + 1e-6).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_count_scale_and_bias(dtype) -> None:
    q = quantize(_bag(rows=10, dim=64, shards=2), dtype)
    per_row = {torch.quint8: 64 + 8, torch.quint4x2: 32 + 4, torch.float16: 128}[dtype]
    assert q.nbytes == 10 * per_row


def test_one_kernel_call_per_table(monkeypatch) -> None:
    q = quantize(_bag(shards=5, mode="sum"), torch.quint8)
    calls = []
    kernel = q.format.bag
    q.format = dataclasses.replace(q.format, bag=lambda *a: calls.append(1) or kernel(*a))
    q(torch.randint(0, 40, (6, 4)))
    assert calls == [1]


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    strategy=st.sampled_from(["div", "mod"]),
    shards=st.integers(1, 5),
    mode=st.sampled_from(["sum", "mean", "max"]),
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    weighted=st.booleans(),
    padding=st.booleans(),
    last=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_bag_equals_dequantize_then_float_bag(dtype, strategy, shards, mode, lengths, weighted, padding, last, seed):
    torch.manual_seed(seed)
    bag = ShardedEmbeddingBag(
        23, 6, shards, strategy, mode=mode, padding_idx=3 if padding else None, include_last_offset=last
    )
    q = quantize(bag, dtype)
    ids = torch.randint(0, 23, (sum(lengths),))
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    offsets = offsets if last else offsets[:-1]
    psw = torch.rand(ids.numel()) if weighted and mode == "sum" else None
    ref = F.embedding_bag(
        ids, q.dequantize(), offsets, mode=mode, per_sample_weights=psw,
        include_last_offset=last, padding_idx=3 if padding else None,
    )  # fmt: skip
    torch.testing.assert_close(q(ids, offsets, per_sample_weights=psw), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_float_twin_within_quantization(dtype) -> None:
    bag = _bag(mode="mean", padding_idx=0)
    q = quantize(bag, dtype)
    ids = torch.randint(0, 40, (8, 5))
    tol = {torch.quint8: 0.03, torch.quint4x2: 0.5, torch.float16: 0.01}[dtype]
    torch.testing.assert_close(q(ids), bag(ids).detach(), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_dequantized(dtype) -> None:
    torch.manual_seed(0)
    emb = ShardedEmbedding(30, 4, partitioner=4, partition_strategy="mod", padding_idx=2)
    q = quantize(emb, dtype)
    ids = torch.tensor([[2, 29, 0], [7, 7, 13]])
    assert torch.equal(q(ids), q.dequantize()[ids])
    assert torch.equal(q(ids)[0, 0], torch.zeros(4))  # the padding row stays zero


def test_collection_drop_in() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection({"a": TableConfig(20, 4, 2, "mod"), "b": TableConfig(9, 4, 3, mode="mean")})
    q = quantize(ebc, torch.quint8)
    assert isinstance(q, QuantizedEmbeddingBagCollection)
    kjt = shardvar.KeyedJagged(("a", "b"), torch.tensor([1, 2, 19, 0, 8]), torch.tensor([[2, 1], [1, 1]]))
    out, ref = q(kjt), ebc(kjt)
    assert list(out) == ["a", "b"]
    for k in out:
        torch.testing.assert_close(out[k], ref[k].detach(), atol=0.05, rtol=0)
    deq = {k: b.dequantize() for k, b in q.embedding_bags.items()}
    torch.testing.assert_close(out["b"], F.embedding_bag(torch.tensor([0, 8]), deq["b"], torch.tensor([0, 1])))
    assert q.concat(out).shape == (2, 8)
    assert q.nbytes == 29 * (4 + 8)


def test_training_refused() -> None:
    q = quantize(_bag(mode="sum"), torch.quint8)
    with pytest.raises(shardvar.ShardvarError, match="inference-only"):
        q.requires_grad_()
    assert list(q.parameters()) == []
    q.train()
    with pytest.raises(shardvar.ShardvarError, match=r"inference-only.*\.eval\(\)"):
        q(torch.tensor([[1, 2]]))
    with torch.no_grad():
        assert q(torch.tensor([[1, 2]])).shape == (1, 8)
    with pytest.raises(shardvar.ShardvarTypeError, match="'weight' is quantized \\(quint8\\) and inference-only"):
        shardvar.RowWiseAdagrad(q)


def test_bad_input_refused_before_anything_changes() -> None:
    bag = _bag(dim=7)
    before = bag.weight.to_tensor().clone()
    with pytest.raises(shardvar.ShardvarValueError, match="multiple of 2"):
        quantize(bag, torch.quint4x2)
    with pytest.raises(shardvar.ShardvarDTypeError, match=r"torch\.quint8, torch\.quint4x2, torch\.float16"):
        quantize(bag, torch.int8)
    with pytest.raises(shardvar.ShardvarDTypeError, match="int64; only floating-point"):
        row_format("quint8").check(torch.int64, 8, "table")  # integer tables: see test_quantized_checkpoint
    ebc = EmbeddingBagCollection({"a": TableConfig(4, 4), "b": TableConfig(4, 3)})
    with pytest.raises(shardvar.ShardvarValueError, match="table 'b'"):
        quantize(ebc, torch.quint4x2)
    with pytest.raises(shardvar.ShardvarTypeError, match="got Linear"):
        quantize(torch.nn.Linear(2, 2), torch.quint8)
    assert torch.equal(bag.weight.to_tensor(), before)
    q = quantize(bag, torch.quint8)
    with pytest.raises(shardvar.ShardvarIndexError, match=r"\[0, 40\); got 40"):
        q(torch.tensor([[1, 40]]))
    with pytest.raises(shardvar.ShardvarValueError, match="per_sample_weights"):
        q(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))  # a mean bag, as torch refuses


def test_moved_buffers_rebuild_the_store() -> None:
    q = quantize(_bag(mode="sum"), torch.quint8)
    expected = q(torch.tensor([[3, 4]]))
    q.to(torch.device("cpu"))
    q.shard_0 = q.shard_0.clone()  # a replaced buffer: the store follows it
    assert torch.equal(q(torch.tensor([[3, 4]])), expected)


@pytest.mark.parametrize("dtype", [torch.quint8, torch.quint4x2])
def test_the_documented_row_layout(dtype) -> None:
    """docs/checkpoint-format.md: elements (4-bit: low nibble first), then scale and bias."""
    torch.manual_seed(0)
    rows = torch.randn(5, 8)
    fmt = row_format(dtype)
    packed = fmt.pack(rows)
    if dtype == torch.quint8:
        q, tail = packed[:, :8].float(), packed[:, 8:].contiguous().view(torch.float32)
    else:
        body = packed[:, :4]
        q = torch.stack([body & 15, body >> 4], dim=-1).reshape(5, 8).float()
        tail = packed[:, 4:].contiguous().view(torch.float16).float()
    assert packed.shape == (5, fmt.width(8)) and tail.shape == (5, 2)
    torch.testing.assert_close(fmt.unpack(packed), q * tail[:, :1] + tail[:, 1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(tail[:, 1], rows.min(1).values, atol=2e-3, rtol=0)  # bias: the row's minimum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["sum", "max"])
def test_a_bad_id_is_named_on_every_path(dtype, mode) -> None:
    q = quantize(_bag(mode=mode), dtype)  # 3 mod shards of a slab in logical order: the kernel's bound check
    assert q.store.logical_slab
    for bad, where in ((40, r"\(1, 0\)"), (-1, r"\(1, 0\)")):
        with pytest.raises(shardvar.ShardvarIndexError, match=rf"\[0, 40\); got {bad} at position {where}"):
            q(torch.tensor([[1, 2], [bad, 3]]))
        with pytest.raises(shardvar.ShardvarIndexError, match=rf"got {bad} at position {where}"):
            q.lookup(torch.tensor([[1, 2], [bad, 3]]))


def test_max_norm_rows_are_packed_as_the_float_lookup_leaves_them() -> None:
    torch.manual_seed(0)
    emb = ShardedEmbedding(20, 4, partitioner=2, max_norm=1.0)
    q = quantize(emb, torch.float16)
    ids = torch.arange(20)
    torch.testing.assert_close(q(ids), emb(ids).detach().half().float())  # the float lookup renormalises


def test_a_slab_in_shard_order_maps_the_ids() -> None:
    bag = _bag(mode="sum")  # 3 mod shards, here packed back to back in shard order (as a rank's shards lie)
    fmt = row_format(torch.quint8)
    slab = fmt.pack(torch.cat([p.detach() for p in bag.weight.variables]))
    q = QuantizedEmbeddingBag(40, 8, bag.layout, fmt, dict(enumerate(slab.split(list(bag.layout.sizes)))), mode="sum")
    assert q.store.full_slab is not None and not q.store.logical_slab
    ids = torch.randint(0, 40, (5, 4))
    assert torch.equal(q(ids), quantize(bag, torch.quint8)(ids))
    with pytest.raises(shardvar.ShardvarIndexError, match=r"got 40 at position \(0, 1\)"):
        q(torch.tensor([[3, 40]]))
