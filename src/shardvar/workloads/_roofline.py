"""The roofline: each hot path's bytes per second as a fraction of the machine's bandwidth (issue 37).

The byte model, defined here and nowhere else. A path's bytes are what its work must move,
counted from its inputs and outputs, not from what its kernels happen to do:

* every id (and every bag offset) is read once: ``ids.numel() * ids.element_size()``;
* every gathered row is counted once per id, ``ids.numel() * row_bytes``: re-reads of hot rows
  count, as that is the work the path does (a Zipf batch reads its hottest rows many times);
  a backward gathers the output's gradient row once per id, a ``scatter_add`` its source rows;
* every output byte is written once: a lookup's ``[n, dim]``, a bag's ``[bags, dim]``, and a
  backward's gradient, one row per distinct id (the gradient that an update needs, summed once);
* an update (an optimizer step, a ``scatter_add``) reads and writes each distinct row and its
  optimizer state once: ``2 * distinct * (row_bytes + state_row_bytes)``; a fused step's
  gradient goes straight into its update, so it writes no gradient rows;
* a checkpoint moves each byte it saves or restores once, to or from the disk.

The denominator of a memory-bound path is the best copy bandwidth measured in the same run with
torch's huge-page switch on (a copy of ``N`` bytes moves ``2 N``: each byte read and written);
a checkpoint's is the disk's best sequential write (with ``fsync``) or read rate, measured on the
same directory. A path at 1.0 moves its bytes as fast as a copy does; the goal is 0.5 or more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import load, save
from ..layout import Layout
from ..nn import EmbeddingBagCollection, ShardedEmbedding, ShardedEmbeddingBag, TableConfig
from ..optim import RowWiseAdagrad, RowWiseAdam, fuse
from ..quantized import quantize, row_format
from ..variables import shard_tensor
from ._roofline_probes import drop_cache
from ._timing import zipf_ids

__all__ = [
    "GOAL",
    "QUICK",
    "Case",
    "Sizes",
    "Traffic",
    "backward_bytes",
    "cases",
    "checkpoint_bytes",
    "gather_bytes",
    "scatter_bytes",
    "update_bytes",
]

GOAL = 0.5  # fraction of the bandwidth every path should reach (issue 37)


@dataclass(frozen=True)
class Traffic:
    """Bytes a path must move, by kind (see the module's byte model); ``total`` is their sum."""

    ids: int = 0  # ids and offsets read
    gathered: int = 0  # rows read, once per id
    written: int = 0  # outputs (and gradients) written
    update: int = 0  # distinct rows and their state, read and written back
    disk: int = 0  # bytes to or from the disk

    @property
    def total(self) -> int:
        return self.ids + self.gathered + self.written + self.update + self.disk

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return self.ids, self.gathered, self.written, self.update, self.disk


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _distinct(ids: torch.Tensor) -> int:
    return int(torch.unique(ids).numel())


def gather_bytes(ids: torch.Tensor, row_bytes: int, out_bytes: int, offsets: torch.Tensor | None = None) -> Traffic:
    """A lookup or a bag: ids (and offsets) read, a row per id gathered, ``out_bytes`` written.

    >>> gather_bytes(torch.tensor([0, 1, 1]), row_bytes=16, out_bytes=48).total  # 24 + 48 + 48
    120
    """
    read = _nbytes(ids) + (0 if offsets is None else _nbytes(offsets))
    return Traffic(ids=read, gathered=ids.numel() * row_bytes, written=out_bytes)


def backward_bytes(ids: torch.Tensor, grad_row_bytes: int, *, fused: bool = False) -> Traffic:
    """A bag's backward: the output's gradient row gathered per id; a gradient row per distinct id written.

    ``fused``: the gradient goes straight into the optimizer's update, nothing is written.
    The ids were counted by the forward.
    """
    written = 0 if fused else _distinct(ids) * grad_row_bytes
    return Traffic(gathered=ids.numel() * grad_row_bytes, written=written)


def update_bytes(ids: torch.Tensor, row_bytes: int, state_row_bytes: int = 0) -> Traffic:
    """An update: each distinct row and its state read and written back once.

    >>> update_bytes(torch.tensor([0, 1, 1]), row_bytes=16, state_row_bytes=4).total  # 2 x 2 x (16 + 4)
    80
    """
    return Traffic(update=2 * _distinct(ids) * (row_bytes + state_row_bytes))


def scatter_bytes(ids: torch.Tensor, row_bytes: int) -> Traffic:
    """``scatter_add``: ids read, a source row per id read, each distinct target row read and written."""
    return Traffic(ids=_nbytes(ids), gathered=ids.numel() * row_bytes) + update_bytes(ids, row_bytes)


def checkpoint_bytes(nbytes: int) -> Traffic:
    """A checkpoint save or restore: ``nbytes`` to or from the disk."""
    return Traffic(disk=nbytes)


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes; the defaults are the issue's (``QUICK``: tiny, a check that it runs)."""

    dim: int = 64
    rows: int = 1 << 20  # lookup, scatter_add, bag and quantized tables
    ids: int = 1 << 20  # lookup and scatter_add ids
    bags: int = 1 << 14
    bag_size: int = 16
    tables: int = 8  # the fused steps' collection
    table_rows: int = 1 << 18
    batch: int = 4096  # collection and quantized bags
    per_bag: int = 20
    shards: int = 8
    checkpoint_mib: float = 256.0
    bandwidth_mib: float = 256.0  # each array of the bandwidth probes


QUICK = Sizes(dim=16, rows=1 << 12, ids=1 << 12, bags=1 << 7, bag_size=8, tables=2, table_rows=1 << 10, batch=64,
              per_bag=4, checkpoint_mib=1.0, bandwidth_mib=4.0)  # fmt: skip


@dataclass
class Case:
    """One path: its call, its bytes, what bounds it, and torch's plain op on the same work (if any)."""

    name: str
    fn: Callable[[], object]
    traffic: Traffic
    bound: str = "memory"  # "memory", "disk write" or "disk read"
    baseline: Callable[[], object] | None = None
    prepare: Callable[[], object] | None = None  # run untimed before each timed call (single_call only)
    single_call: bool = False  # long calls: one per round, timed whole


def _no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    return torch.no_grad()(fn)


def _lookup_cases(s: Sizes, _: Path) -> Iterator[Case]:
    table, ids = torch.randn(s.rows, s.dim), zipf_ids(s.ids, s.rows)
    emb = ShardedEmbedding.from_pretrained(table, partitioner=s.shards)
    row = s.dim * 4
    name = f"large lookup {s.rows} x {s.dim}, {s.ids} ids ({s.shards} div)"
    yield Case(name, _no_grad(lambda: emb(ids)), gather_bytes(ids, row, ids.numel() * row),
               baseline=lambda: F.embedding(ids, table))  # fmt: skip
    mine = shard_tensor(table.clone(), Layout.mod(s.rows, s.shards))
    target, updates = table.clone(), torch.randn(s.ids, s.dim)
    yield Case(f"scatter_add {s.ids} rows ({s.shards} mod)", lambda: mine.scatter_add(ids, updates),
               scatter_bytes(ids, row), baseline=lambda: target.index_add_(0, ids, updates))  # fmt: skip


def _bag_cases(s: Sizes, _: Path) -> Iterator[Case]:
    n = s.bags * s.bag_size
    ids, offsets = zipf_ids(n, s.rows), torch.arange(0, n, s.bag_size)
    plain = nn.EmbeddingBag(s.rows, s.dim, mode="sum", sparse=True)
    mine = ShardedEmbeddingBag.from_pretrained(
        plain.weight.detach(), freeze=False, mode="sum", partitioner=s.shards, sparse=True
    )
    row, grad = s.dim * 4, torch.randn(s.bags, s.dim)
    forward = gather_bytes(ids, row, s.bags * row, offsets)
    label = f"bag {s.rows} x {s.dim}, {s.bags} bags x {s.bag_size} ids ({s.shards} div)"
    yield Case(f"{label}: forward", _no_grad(lambda: mine(ids, offsets)), forward,
               baseline=_no_grad(lambda: plain(ids, offsets)))  # fmt: skip

    def step(m: nn.Module) -> Callable[[], None]:
        def go() -> None:
            m(ids, offsets).backward(grad)
            for p in m.parameters():
                p.grad = None

        return go

    yield Case(f"{label}: forward+backward (sparse)", step(mine), forward + backward_bytes(ids, row),
               baseline=step(plain))  # fmt: skip


def _quantized_cases(s: Sizes, _: Path) -> Iterator[Case]:
    table = torch.randn(s.rows, s.dim)
    ids = zipf_ids(s.batch * s.per_bag, s.rows, seed=1).reshape(s.batch, s.per_bag)
    bag = ShardedEmbeddingBag.from_pretrained(table, partitioner=s.shards, partition_strategy="mod", mode="sum")
    for name, dtype in (("int8", torch.quint8), ("int4", torch.quint4x2)):
        q = quantize(bag, dtype)
        traffic = gather_bytes(ids, row_format(dtype).row_bytes(s.dim), s.batch * s.dim * 4)
        label = f"quantized bag {name}, {s.rows} x {s.dim}, {s.batch} x {s.per_bag} ids ({s.shards} mod)"
        yield Case(label, torch.inference_mode()(lambda q=q: q(ids)), traffic)


def _fused_cases(s: Sizes, _: Path) -> Iterator[Case]:
    names = [f"t{i}" for i in range(s.tables)]
    ids = {k: zipf_ids(s.batch * s.per_bag, s.table_rows, seed=i) for i, k in enumerate(names)}
    offsets = torch.arange(s.batch) * s.per_bag
    grads = [torch.randn(s.batch, s.dim)] * s.tables
    plain_opts = {"Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01), "Adam": lambda p: torch.optim.SparseAdam(p)}
    for opt, ours in (("Adagrad", RowWiseAdagrad), ("Adam", RowWiseAdam)):
        configs = {k: TableConfig(s.table_rows, s.dim, s.shards, "mod") for k in names}
        model = EmbeddingBagCollection(configs, sparse=True)
        optimizer = ours(model, lr=0.01)
        fuse(optimizer)
        plain = nn.ModuleDict({k: nn.EmbeddingBag(s.table_rows, s.dim, mode="sum", sparse=True) for k in names})
        plain_opt = plain_opts[opt](list(plain.parameters()))

        def step(forward: Callable[[], list[torch.Tensor]], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
            def go() -> None:
                torch.autograd.backward(forward(), grads)
                optimizer.step()  # the fused one has nothing left to do, as a training loop calls it anyway
                optimizer.zero_grad()

            return go

        mine = step(lambda m=model: list(m(ids, dict.fromkeys(names, offsets)).values()), optimizer)
        mine()  # the optimizer's state exists from the first step
        row = s.dim * 4
        state_row = optimizer.state_bytes // (s.tables * s.table_rows)
        traffic = Traffic()
        for k in names:
            traffic += gather_bytes(ids[k], row, s.batch * row, offsets) + backward_bytes(ids[k], row, fused=True)
            traffic += update_bytes(ids[k], row, state_row)
        label = f"fused RowWise{opt} step, {s.tables} x {s.table_rows} x {s.dim}, {s.batch} x {s.per_bag} Zipf ids"
        baseline = step(lambda p=plain: [p[k](ids[k], offsets) for k in names], plain_opt)
        yield Case(f"{label} ({s.shards} mod)", mine, traffic, baseline=baseline)


def _checkpoint_cases(s: Sizes, directory: Path) -> Iterator[Case]:
    rows = max(s.shards, int(s.checkpoint_mib * 2**20) // (s.dim * 4))
    v = shard_tensor(torch.randn(rows, s.dim), Layout.div(rows, s.shards))
    target = shard_tensor(torch.zeros(rows, s.dim), Layout.div(rows, s.shards))
    path = directory / "roofline-checkpoint"
    save({"t": v}, path)  # the first save makes the files; later ones overwrite the spares
    load({"t": target}, path)
    if not torch.equal(target.to_tensor(), v.to_tensor()):
        raise AssertionError("the roofline's checkpoint restore does not equal what it saved")
    nbytes = rows * s.dim * 4
    label = f"checkpoint {nbytes / 2**20:.0f} MiB ({s.shards} div shards)"
    yield Case(f"{label}: save", lambda: save({"t": v}, path), checkpoint_bytes(nbytes), "disk write",
               single_call=True)  # fmt: skip
    yield Case(f"{label}: restore", lambda: load({"t": target}, path), checkpoint_bytes(nbytes),
               "disk read", prepare=lambda: drop_cache(path), single_call=True)  # fmt: skip


_BUILDERS = (_lookup_cases, _bag_cases, _fused_cases, _quantized_cases, _checkpoint_cases)


def cases(sizes: Sizes, directory: Path) -> Iterator[Case]:
    """Every path, built one group at a time (a group is freed before the next is built)."""
    for build in _BUILDERS:
        yield from build(sizes, directory)
