"""``scatter_rows`` and ``fill_at`` (``tiered/_native.py``): the native row copy a cache's slots and a mapped file's
records move through, and the flag setter of its per-slot arrays, against ``index_copy_`` and ``index_fill_`` (their
fallbacks and references)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar.tiered._native as native_module
from shardvar.tiered._native import copy_rows, fill_at, move_fields, scatter_rows
from test_tiered_native import kernel  # noqa: F401 (a fixture: skips where no kernel can be had)

DTYPES = [torch.uint8, torch.float32, torch.int64]


@st.composite
def _case(draw):
    """A table (maybe a column slice of records, as a layout's split gives), distinct rows, and source rows (maybe
    a slice of a wider array too)."""
    dtype = draw(st.sampled_from(DTYPES))
    rows, width = draw(st.integers(1, 40)), draw(st.integers(1, 9))
    pad_dst, pad_src = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    index = draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dst = torch.randint(0, 100, (rows, width + pad_dst), generator=g).to(dtype)[:, pad_dst:]
    src = torch.randint(0, 100, (len(index), width + pad_src), generator=g).to(dtype)[:, :width]
    return dst, torch.tensor(index, dtype=torch.int64), src


@settings(max_examples=80, deadline=None)
@given(_case())
def test_the_kernel_copies_what_index_copy_does(kernel, case):  # noqa: F811
    dst, index, src = case
    expected = dst.clone().index_copy_(0, index, src)
    scatter_rows(dst, index, src)
    assert torch.equal(dst, expected)


def test_an_index_out_of_range_raises_as_torch_does_and_copies_nothing(kernel):  # noqa: F811
    dst, src = torch.zeros((4, 3)), torch.ones((3, 3))
    for bad in ([0, 1, 4], [-1, 0, 1]):
        with pytest.raises(IndexError, match=f"index {bad[2] if bad[2] == 4 else -1} is out of bounds"):
            scatter_rows(dst, torch.tensor(bad), src)
        assert torch.equal(dst, torch.zeros((4, 3)))


@pytest.mark.parametrize("why", ["no kernel", "grad", "dtype", "strided rows", "int32 index"])
def test_what_the_kernel_cannot_take_goes_to_torch(monkeypatch, why):
    """Each case reaches ``index_copy_`` (spied on): the same result, or torch's own error."""
    dst, index, src = torch.zeros((5, 4)), torch.tensor([3, 0]), torch.arange(8.0).view(2, 4)
    if why == "no kernel":
        monkeypatch.setattr(native_module, "kernel", lambda: None)
    elif why == "grad":
        src.requires_grad_(True)
    elif why == "dtype":
        src = src.double()
    elif why == "strided rows":
        dst = torch.zeros((4, 5)).t()
    else:
        index = index.int()
    calls = []
    original = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: calls.append(1) or original(self, *a))
    if why == "dtype":  # index_copy_'s own error
        with pytest.raises(RuntimeError):
            scatter_rows(dst, index, src)
    else:
        expected = torch.zeros(dst.shape).index_copy_(0, index.long(), src.detach())
        scatter_rows(dst, index, src)
        assert torch.equal(dst, expected)
    assert calls


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([torch.bool, torch.int32, torch.int64, torch.float32]),
    st.integers(1, 50),
    st.lists(st.integers(0, 10**6), max_size=80),
    st.integers(-5, 5),
    st.booleans(),
)
def test_fill_at_sets_what_index_fill_does(kernel, dtype, length, raw, value, native):  # noqa: F811
    """Repeats included (every one writes the same value)."""
    dst = torch.arange(length).remainder(3).to(dtype)
    index = torch.tensor([i % length for i in raw], dtype=torch.int64)
    value = bool(value > 0) if dtype == torch.bool else value
    expected = dst.clone().index_fill_(0, index, value)
    if not native:
        index = index.int()  # (torch's path, given any integer index)
    fill_at(dst, index, value)
    assert torch.equal(dst, expected)


def test_fill_at_refuses_an_index_out_of_range_and_sets_nothing(kernel):  # noqa: F811
    dst = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(IndexError, match="index 4 is out of bounds"):
        fill_at(dst, torch.tensor([0, 4]), 7)
    assert not bool(dst.any())


@settings(max_examples=60, deadline=None)
@given(_case(), st.randoms(use_true_random=False))
def test_copy_rows_from_chosen_source_rows_as_index_select_then_index_copy_(kernel, case, rnd):  # noqa: F811
    dst, index, src = case
    if src.shape[0] == 0:
        return
    source = torch.tensor([rnd.randrange(src.shape[0]) for _ in range(index.numel())], dtype=torch.int64)
    expected = dst.clone().index_copy_(0, index, src.index_select(0, source))
    copy_rows(dst, index, src, source)
    assert torch.equal(dst, expected)
    with pytest.raises(IndexError, match=f"index {src.shape[0]} is out of bounds for dimension 0 with size"):
        copy_rows(dst, index[:1], src, torch.tensor([src.shape[0]])) if index.numel() else copy_rows(
            dst, torch.tensor([0]), src, torch.tensor([src.shape[0]])
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _records_and_slots(seed: int):
    g = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 255, (30, 24), dtype=torch.uint8, generator=g)  # 4 float32 values, a float32 at 16
    values, state = torch.randn((12, 4), generator=g), torch.randn((12, 1), generator=g)
    places, slots = torch.randperm(30, generator=g)[:9], torch.randperm(12, generator=g)[:9]
    return records, values, state, places, slots


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.booleans())
def test_move_fields_moves_each_field_as_copy_rows_does(kernel, seed, write):  # noqa: F811
    """One pass of the kernel and a ``copy_rows`` a field (the fallback) move the same bytes, both ways."""
    results = []
    for native in (True, False):
        records, values, state, places, slots = _records_and_slots(seed)
        with pytest.MonkeyPatch.context() as m:
            if not native:
                m.setattr(native_module, "kernel", lambda: None)
            move_fields(records, places, slots, [(values, 0), (state, 16)], write=write)
        results.append((records, values, state))
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*results, strict=True))  # (random bytes: NaNs too)
    records, values, state, places, slots = _records_and_slots(seed)
    if write:
        move_fields(records, places, slots, [(values, 0), (state, 16)], write=True)
        assert torch.equal(records[places, :16], _bits(values[slots]))
    else:
        move_fields(records, places, slots, [(values, 0), (state, 16)], write=False)
        assert torch.equal(_bits(state[slots]), records[places, 16:20])


def test_move_fields_refuses_a_place_or_slot_out_of_range_and_moves_nothing(kernel):  # noqa: F811
    records, values, _, places, slots = _records_and_slots(1)
    before = (records.clone(), values.clone())
    with pytest.raises(IndexError, match="record 30 is out of bounds"):
        move_fields(records, torch.cat([places[:3], torch.tensor([30])]), slots[:4], [(values, 0)], write=True)
    with pytest.raises(IndexError, match="index 12 is out of bounds"):
        move_fields(records, places[:2], torch.tensor([0, 12]), [(values, 0)], write=False)
    assert torch.equal(records, before[0]) and torch.equal(values, before[1])
