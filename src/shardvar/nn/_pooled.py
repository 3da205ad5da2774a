"""A sparse pooled group looked up table by table, each kernel over its table's rows of the group's
allocation (sum and mean bags).

Nothing is shifted into the allocation's rows: each table's ids and offsets go to its kernel as
they are (a table serving several features gets their bags end to end: its rows are read once),
so the forward's work is the kernels and the checks. On the CPU the kernel refuses an id outside
the rows it is given before it writes anything, so a table whose ids are its rows (one shard, div
shards, or mod shards a fused optimizer laid row by row) leaves its ids to the kernel (as
``embedding_bag`` over a whole slab does): a pass over every id saved, and a bad id then gets the
error the checks give it. The ids of the other tables (mod tables of shards back to back) are
range-checked and moved to their storage rows (a copy to 32 bits and three passes each) in one
buffer kept between calls, before any kernel reads them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from typing import Any

import torch

from ..layout import check_ids
from ..variables import Part, ShardStore, SlabSplit, sparse_bags
from ._pack import buffer, checked_features, refused

__all__ = ["sparse_pooled"]


def _by_table(present: list[str], table_of: Mapping[str, str]) -> list[tuple[str, list[int]]]:
    """Each table of ``present`` (its features together) and its features' positions."""
    return [(t, [i for i, _ in run]) for t, run in itertools.groupby(enumerate(present), lambda x: table_of[x[1]])]


def _joined(ids: list[torch.Tensor], offsets: list[torch.Tensor], weights: list[Any], dtype: torch.dtype) -> tuple:
    """One table's features' bags end to end: (ids, offsets, weights or None)."""
    if len(ids) == 1:
        return ids[0], offsets[0], weights[0]
    before = itertools.accumulate((x.numel() for x in ids[:-1]), initial=0)
    joined = torch.cat([off + shift for off, shift in zip(offsets, before, strict=True)])
    scale = None
    if any(w is not None for w in weights):  # weight 1 is exactly an unweighted sum
        scale = torch.cat([w if w is not None else torch.ones_like(x, dtype=dtype) for x, w in zip(ids, weights)])  # noqa: B905
    return torch.cat(ids), joined, scale


def _moved(store: ShardStore, layouts: list[Any], ids: list[torch.Tensor], check: bool, fault: Any) -> list:
    """Storage rows of each table's ``ids`` (its ``layout``'s), checked first where ``check`` (``fault()``
    raises the error of a bad one), in pieces of one buffer kept by the store's recycler on the CPU
    (no fresh pages to fault in per call): 32-bit where the rows fit, each table's ids copied in
    once and moved there in place (half the bytes of every pass; the scratch is one table's)."""
    if not ids:
        return []
    sizes = [x.numel() for x in ids]
    narrow = max(x.num_rows for x in layouts) <= torch.iinfo(torch.int32).max
    index = torch.int32 if narrow else torch.int64
    rows = buffer(store.recycler, "table rows", sum(sizes), index, ids[0].device).split(sizes)
    scratch = buffer(store.recycler, "table scratch", max(sizes), index, ids[0].device) if narrow else None
    for layout, x in zip(layouts, ids, strict=True):
        if check and x.numel():
            low, high = (int(v) for v in torch.aminmax(x))
            if low < 0 or high >= layout.num_rows:
                fault()  # names the first bad id, in the order of the features' checks
                check_ids(x, layout.num_rows)
    if not narrow:
        return [layout.strategy.storage_rows_into(layout.sizes, x, out) for layout, x, out in zip(layouts, ids, rows)]  # noqa: B905
    moved = []
    for layout, x, out in zip(layouts, ids, rows, strict=True):
        out.copy_(x)  # checked: in the table's rows, which fit
        moved.append(layout.strategy.storage_rows_into(layout.sizes, out, out, scratch[: out.numel()]))
    return moved


def _params(store: ShardStore, tables: list[Any], parts: list[Part]) -> list[torch.Tensor]:
    """The shards the lookup's gradient reaches: none without autograd; where a fused optimizer takes
    every present table's rows (their sinks), the first shard of each of the group's ``tables``
    (the group's shards are theirs in order), whose hook marks the table updated in this backward
    (no gradient is left for any shard); else all of them."""
    shards = list(store.local_shards().values())
    if not (torch.is_grad_enabled() and any(p.requires_grad for p in shards)):
        return []
    if all(p.sink is not None for p in parts):
        firsts = [shards[k] for k in itertools.accumulate((t.layout.num_shards for t in tables[:-1]), initial=0)]
        if any(p.requires_grad for p in firsts):
            return firsts
    return shards


def sparse_pooled(
    tables: Mapping[str, Any],
    names: list[str],
    present: list[str],
    table_of: Mapping[str, str],
    starts: Mapping[str, int],
    store: ShardStore,
    inputs: tuple[dict, dict, dict],
) -> dict[str, torch.Tensor]:
    """The bags of ``present`` (sorted by table, in the row order of the group of ``names``), everything
    checked first."""
    num_rows = [tables[table_of[f]].layout.num_rows for f in present]
    cpu = store.full_slab.is_cpu and not torch.compiler.is_compiling()
    checked = checked_features(present, num_rows, store.dtype, inputs, [cpu] * len(present))
    by_table = _by_table(present, table_of)
    parts, rows, offsets, scale = [], [], [], []
    for t, at in by_table:
        ids, offs, w = _joined([checked[i].ids for i in at], [checked[i].offsets for i in at],
                               [checked[i].weights for i in at], store.dtype)  # fmt: skip
        rows.append(ids)
        offsets.append(offs)
        scale.append(w)
        parts.append(Part(starts[t], starts[t] + tables[t].num_embeddings, tables[t].store.sink))
    layouts = [tables[t].layout for t, _ in by_table]
    away = [k for k, (t, _) in enumerate(by_table) if not tables[t].store.logical_slab]  # rows not the ids
    fault = functools.partial(refused, present, num_rows, store.dtype, inputs)
    for k, moved in zip(away, _moved(store, [layouts[k] for k in away], [rows[k] for k in away], cpu, fault)):  # noqa: B905
        rows[k], offsets[k] = moved, offsets[k].to(moved.dtype)  # the kernel's ids and offsets: one dtype
    shards = _params(store, [tables[n] for n in names], parts)
    try:
        mode = tables[table_of[present[0]]].mode
        split = SlabSplit(store)  # its backward maps the rows as they lie now
        pooled = sparse_bags(store.full_slab, mode, parts, (rows, offsets, scale), shards, split)
    except (RuntimeError, IndexError):
        if cpu:
            refused(present, num_rows, store.dtype, inputs)  # a bad id left to the kernel: its own error
        raise
    counts = [c.offsets.numel() for c in checked]
    out = {}
    for (_, at), bags in zip(by_table, pooled, strict=True):
        out.update(zip([present[i] for i in at], bags.split([counts[i] for i in at]) if len(at) > 1 else [bags]))  # noqa: B905
    return out
