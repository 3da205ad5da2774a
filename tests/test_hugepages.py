"""Huge pages: shardvar's large buffers are advised for them, results do not change, entry points set torch's switch."""

from __future__ import annotations

import ast
import copy
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardvar
from conftest import ROOT
from shardvar import _pages
from shardvar.nn import ShardedEmbedding
from shardvar.variables._gather import embedding

MADVISE = _pages.huge_pages_mode() == "madvise"
needs_madvise = pytest.mark.skipif(not MADVISE, reason="transparent huge pages are not in madvise mode here")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address`` (``hg``: advised for huge pages)."""
    inside, flags = False, set()
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = set(line.split()[1:])
    return flags


@pytest.mark.parametrize("shape", [(3, 4), (0, 8), (5 << 18, 3), (1 << 20, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_buffers_are_torch_tensors_like_torch_empty_and_zeros(shape, dtype) -> None:
    a, z = _pages.empty(shape, dtype=dtype), _pages.zeros(shape, dtype=dtype)
    ref = torch.empty(shape, dtype=dtype)
    for t in (a, z):
        assert (t.shape, t.dtype, t.stride(), t.storage_offset(), t.device) == (
            ref.shape,
            ref.dtype,
            ref.stride(),
            0,
            ref.device,
        )
        assert t.untyped_storage().nbytes() == ref.untyped_storage().nbytes()  # no rounding in torch's accounting
        assert type(t) is torch.Tensor and t._base is None
    assert torch.equal(z, torch.zeros(shape, dtype=dtype))
    wide = torch.empty(shape[::-1], dtype=dtype).t()  # transposed: empty_like keeps its strides, as torch's does
    assert _pages.empty_like(wide).stride() == torch.empty_like(wide).stride()
    assert torch.equal(_pages.zeros_like(wide), torch.zeros_like(wide))


def test_only_whole_huge_pages_inside_a_large_cpu_tensor_are_advised(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(_pages, "_madvise", lambda: lambda start, length, advice: calls.append((start, length)))
    big = torch.empty(3 * _pages.HUGE_PAGE + 12345, dtype=torch.uint8)
    for t in (big, big[777:], big[: _pages.HUGE_PAGE + 5], big[_pages.HUGE_PAGE - 5 : 2 * _pages.HUGE_PAGE + 5]):
        calls.clear()
        assert _pages.advise(t) is t
        first = -(-t.data_ptr() // _pages.HUGE_PAGE) * _pages.HUGE_PAGE  # whole pages inside t: [first, last)
        last = (t.data_ptr() + t.numel()) // _pages.HUGE_PAGE * _pages.HUGE_PAGE
        assert calls == ([(first, last - first)] if last > first else [])
    calls.clear()
    _pages.empty(1000)  # small: torch.empty as it is
    _pages.empty(1 << 22, dtype=torch.uint8, device="meta")  # not CPU memory
    assert calls == []


def test_without_transparent_huge_pages_buffers_are_plain_allocations(monkeypatch, tmp_path) -> None:
    mode = tmp_path / "enabled"
    try:
        for text, expected in (("always madvise [never]\n", "never"), ("[always] madvise never\n", "always")):
            mode.write_text(text)
            monkeypatch.setattr(_pages, "_MODE_FILE", mode)
            _pages.huge_pages_mode.cache_clear()
            _pages._madvise.cache_clear()
            assert _pages.huge_pages_mode() == expected
            assert _pages._madvise() is None  # "never" ignores advice, "always" needs none
            assert torch.equal(_pages.zeros((1 << 20, 2)), torch.zeros(1 << 20, 2))
        monkeypatch.setattr(sys, "platform", "darwin")
        _pages.huge_pages_mode.cache_clear()
        assert _pages.huge_pages_mode() == "never"
    finally:
        monkeypatch.undo()
        _pages.huge_pages_mode.cache_clear()
        _pages._madvise.cache_clear()


@needs_madvise
def test_a_large_buffer_is_advised_before_its_first_touch() -> None:
    t = _pages.empty(3 * _pages.HUGE_PAGE, dtype=torch.uint8)
    inner = -(-t.data_ptr() // _pages.HUGE_PAGE) * _pages.HUGE_PAGE
    assert "hg" in _vm_flags(inner)
    assert int(t.fill_(7).sum()) == 7 * t.numel()


def test_sharded_results_checkpoints_and_copies_are_unchanged(tmp_path) -> None:
    torch.manual_seed(0)
    plain = nn.Embedding(16384, 64)  # 4 MiB: the slab holds whole huge pages
    emb = ShardedEmbedding.from_pretrained(plain.weight, freeze=False, partitioner=4, partition_strategy="div")
    slab = emb.store.full_slab
    if MADVISE:
        assert "hg" in _vm_flags(-(-slab.data_ptr() // _pages.HUGE_PAGE) * _pages.HUGE_PAGE)
    assert slab.untyped_storage().nbytes() == 16384 * 64 * 4
    ids = torch.randint(0, 16384, (4096,))
    assert torch.equal(emb(ids), F.embedding(ids, plain.weight))
    emb(ids).sum().backward()
    plain(ids).sum().backward()
    assert torch.equal(torch.cat([p.grad for p in emb.parameters()]), plain.weight.grad)
    with torch.no_grad():
        emb.store.local_shards()[0][5] = 3.0  # a shard is a view of the slab: the lookup sees the write
    assert bool((emb(torch.tensor([5])) == 3.0).all())
    expected = emb.weight.to_tensor().detach().clone()
    buf = io.BytesIO()
    torch.save(emb.state_dict(), buf)
    buf.seek(0)
    assert torch.equal(copy.deepcopy(emb).weight.to_tensor(), expected)
    other = ShardedEmbedding(16384, 64, partitioner=3, partition_strategy="mod")
    other.load_state_dict(torch.load(buf))
    assert torch.equal(other.weight.to_tensor(), expected)
    shardvar.save({"emb": emb}, tmp_path / "ck")
    back = ShardedEmbedding(16384, 64, partitioner=2, partition_strategy="mod")
    shardvar.load({"emb": back}, tmp_path / "ck")
    assert torch.equal(back.weight.to_tensor(), expected)


_PROBE = """
import sys
from shardvar.cli import main
from shardvar._pages import torch_advises
sys.argv = ["shardvar", "plan", "--shape", "10,3"]
main()
print("torch huge pages:", torch_advises())
"""


@pytest.mark.parametrize(("user", "expected"), [(None, True), ("0", False)])
def test_the_cli_turns_torch_switch_on_unless_the_user_set_it(user, expected) -> None:
    # Also proves that importing shardvar allocates nothing: torch reads the switch at its first allocation.
    env = {k: v for k, v in os.environ.items() if k != _pages.SWITCH}
    if user is not None:
        env[_pages.SWITCH] = user
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"torch huge pages: {expected}" in out.stdout


def test_use_huge_pages_keeps_the_users_setting(monkeypatch) -> None:
    monkeypatch.delenv(_pages.SWITCH, raising=False)
    assert _pages.use_huge_pages() and os.environ[_pages.SWITCH] == "1"
    monkeypatch.setenv(_pages.SWITCH, "0")
    assert not _pages.use_huge_pages() and os.environ[_pages.SWITCH] == "0"
    monkeypatch.setenv(_pages.SWITCH, "yes")  # torch reads it with atoi: not a number is off
    assert not _pages.use_huge_pages()


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_set_the_switch_before_anything_else(example) -> None:
    main = next(n for n in ast.parse(example.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    first = ast.unparse(main.body[0])
    assert first == "os.environ.setdefault('THP_MEM_ALLOC_ENABLE', '1')", first


def test_bench_reports_both_settings_from_a_child_process_each(tmp_path) -> None:
    path = tmp_path / "bench.json"
    args = ["--only", "lookup", "--rows", "1024", "--ids", "1024", "--repeats", "1", "--json", str(path)]
    out = subprocess.run([sys.executable, "-m", "shardvar", "bench", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "huge pages off / on" in out.stdout and "on / off" in out.stdout
    results = json.loads(path.read_text())["results"]
    names = [r["benchmark"] for r in results]
    assert [r["huge_pages"] for r in results] == ["off"] * 4 + ["on"] * 4 and names[:4] == names[4:]
    assert all(r["ratio"] > 0 for r in results)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_a_large_lookup_writes_huge_pages_and_equals_f_embedding(sparse, padding_idx, scale_grad_by_freq) -> None:
    torch.manual_seed(0)
    weight = torch.randn(4096, 64, requires_grad=True)
    ids = torch.randint(0, 4096, (1 << 17,))  # a 32 MiB output: a fresh mapping, whole huge pages inside it
    ids[::7] = 3
    out = embedding(ids, weight, padding_idx, None, 2.0, scale_grad_by_freq, sparse)
    ref = F.embedding(ids, weight, padding_idx, None, 2.0, scale_grad_by_freq, sparse)
    assert torch.equal(out, ref)
    if MADVISE and not (sparse and scale_grad_by_freq):
        assert type(out.grad_fn).__name__ == "HugePageGatherBackward"
        assert "hg" in _vm_flags(-(-out.data_ptr() // _pages.HUGE_PAGE) * _pages.HUGE_PAGE)
    grad = torch.randn_like(ref)
    if sparse and scale_grad_by_freq:  # torch has no such backward: the same error from both
        for result in (out, ref):
            with pytest.raises(RuntimeError, match="scale_grad_by_freq not supported with sparse"):
                torch.autograd.grad(result, weight, grad)
        return
    (got,) = torch.autograd.grad(out, weight, grad)
    (want,) = torch.autograd.grad(ref, weight, grad)
    assert got.is_sparse == want.is_sparse == sparse
    torch.testing.assert_close(got.to_dense(), want.to_dense())


def test_small_lookups_and_max_norm_stay_torch_own() -> None:
    weight = torch.randn(100, 8, requires_grad=True)
    ids = torch.randint(0, 100, (64,))
    assert type(embedding(ids, weight, None, None, 2.0, False, False).grad_fn).__name__ == "EmbeddingBackward0"
    mid = torch.randint(0, 4096, (1 << 14,))  # 4 MiB: heap memory torch reuses, no advice to give
    mid_weight = torch.randn(4096, 64, requires_grad=True)
    assert type(embedding(mid, mid_weight, None, None, 2.0, False, False).grad_fn).__name__ == "EmbeddingBackward0"
    big = torch.randint(0, 100, (1 << 17,))
    with torch.no_grad():
        assert torch.equal(embedding(big, weight, None, 1.0, 2.0, False, False), F.embedding(big, weight, max_norm=1.0))


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_a_sparse_gradient_split_by_shard_is_coalesced_huge_page_backed_and_unchanged(strategy) -> None:
    torch.manual_seed(0)
    plain = nn.Embedding(1 << 17, 64, sparse=True)
    emb = ShardedEmbedding.from_pretrained(
        plain.weight, freeze=False, sparse=True, partitioner=4, partition_strategy=strategy
    )
    # ~7 MiB of distinct gradient rows: whole 2 MiB pages inside wherever the buffer starts
    ids = torch.randint(0, 1 << 17, (1 << 15,))
    emb(ids).pow(2).sum().backward()
    plain(ids).pow(2).sum().backward()
    grads = [p.grad for p in emb.parameters()]
    assert all(g.is_sparse for g in grads)
    for g in grads:  # coalesced: distinct rows, ascending (torch's AccumulateGrad drops the flag itself)
        assert torch.equal(g._indices()[0], g._indices()[0].unique())
    values = grads[0]._values()
    if MADVISE:  # every shard's values are views of one buffer of summed rows
        assert "hg" in _vm_flags(-(-values.data_ptr() // _pages.HUGE_PAGE) * _pages.HUGE_PAGE)
    whole = emb.store.layout.join([g.to_dense() for g in grads])
    torch.testing.assert_close(whole, plain.weight.grad.to_dense(), rtol=0, atol=0)
