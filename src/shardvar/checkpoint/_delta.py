"""Delta saves: only the rows that changed since a base checkpoint.

Which rows changed is decided by content, not by watching writes: every row gets a 64-bit
fingerprint (a multiply-add hash of its bytes, computed in torch), and a row is saved when its
fingerprint differs from the base's. So any change counts (an optimizer step, a user's write,
a dense Adam moving every row) and nothing is missed. The fingerprints of what a save wrote are
kept in memory for the next delta; without them (a new process), the base's rows are read back
once to fingerprint them.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from ..layout import Layout
from ..variables import ShardsView
from ._chain import Chain, apply_rows
from ._restore import restore_shards
from ._write import Coordinator, Entry, entry_of

__all__ = ["Delta", "delta_entries", "find_changes", "fingerprints", "remember"]

_CHUNK_BYTES = 64 << 20
_CACHE: OrderedDict[str, dict[tuple[str, int], torch.Tensor]] = OrderedDict()  # save id -> fingerprints
_MULTIPLIERS: dict[int, torch.Tensor] = {}


def _multipliers(words: int) -> torch.Tensor:
    if words not in _MULTIPLIERS:
        g = torch.Generator().manual_seed(0x5EED + words)
        _MULTIPLIERS[words] = torch.randint(-(2**62), 2**62, (words,), generator=g, dtype=torch.int64) | 1
    return _MULTIPLIERS[words]


def fingerprints(t: torch.Tensor) -> torch.Tensor:
    """One int64 per row of ``t`` (rows along dim 0) that changes whenever a byte of the row does."""
    rows = t.shape[0]
    row_bytes = t[0].numel() * t.element_size() if rows else 0
    out = torch.empty(rows, dtype=torch.int64)
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    for a in range(0, rows, step):
        block = t[a : a + step].detach().to("cpu").contiguous().reshape(-1, row_bytes // t.element_size() or 1)
        raw = block.view(torch.uint8).reshape(block.shape[0], -1)
        pad = (-raw.shape[1]) % 4
        if pad:
            raw = torch.nn.functional.pad(raw, (0, pad))
        words = raw.view(torch.int32).to(torch.int64)  # int64 products wrap around: a ring hash
        length = words.shape[1] * 0x9E3779B97F4A7C15 % 2**63  # rows of other widths never compare equal
        out[a : a + step] = (words * _multipliers(words.shape[1])).sum(1) ^ length
    return out


def _key(name: str, layout: Layout, shard: int) -> tuple[str, str, int]:
    return name, json.dumps(layout.to_json(), sort_keys=True), shard


def remember(save_id: str, found: dict[tuple[str, str, int], torch.Tensor]) -> None:
    """Keep the fingerprints of what save ``save_id`` wrote (the last two saves)."""
    _CACHE[save_id] = found
    while len(_CACHE) > 2:
        _CACHE.popitem(last=False)


def _base_fingerprints(chain: Chain, name: str, layout: Layout, shard: int) -> torch.Tensor:
    cached = _CACHE.get(chain.newest.manifest.save_id, {}).get(_key(name, layout, shard))
    if cached is not None:
        return cached
    entry, link, later = chain.source(name)
    rows = restore_shards(link.files, entry, layout, [shard])[0]
    for change in chain.changes(later, entry):
        apply_rows({shard: rows}, layout, change)
    return fingerprints(rows)


def _rows_of(entry: Entry, chain: Chain, names: set[str]) -> tuple[torch.Tensor, torch.Tensor, dict] | None:
    """(changed ids, their rows, fingerprints now) of this process's shards, or None to save whole."""
    layout = entry.layout
    if entry.replicated or layout is None or layout.axis != 0 or entry.name not in names:
        return None
    base, _, _ = chain.source(entry.name)
    if base.shape != entry.shape or base.dtype != entry.dtype:
        return None
    ids, rows, now = [], [], {}
    for s in entry.shard_shapes:
        shard = entry.produce(s)
        fp = fingerprints(shard)
        now[_key(entry.name, layout, s)] = fp
        changed = torch.nonzero(fp != _base_fingerprints(chain, entry.name, layout, s)).squeeze(1)
        ids.append(layout.shard_ids(s).index_select(0, changed))
        rows.append(shard.detach().index_select(0, changed.to(shard.device)).cpu())
    return torch.cat(ids), torch.cat(rows), now


@dataclass
class Delta:
    """What a delta save writes beside its unchanged entries: this process's changed rows, per variable."""

    kept: list[Entry]  # written whole
    changed: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (logical row ids, their rows)
    base: dict[str, str]  # the base's path (relative to the delta), save id and manifest checksum
    fingerprints: dict[tuple[str, str, int], torch.Tensor]  # of every row now, for the next delta


def find_changes(entries: list[Entry], base: str | os.PathLike, directory: Path) -> Delta:
    """The rows of ``entries`` (this process's shards) that differ from checkpoint ``base``; reads only."""
    with Chain.open(base) as chain:
        if any(link.directory.resolve() == directory.resolve() for link in chain.links):
            raise CheckpointError(f"a delta cannot be saved into {directory}, which is part of its own chain")
        names = chain.names()
        delta = Delta([], {}, {}, {})
        for e in entries:
            found = _rows_of(e, chain, names)
            if found is None:
                delta.kept.append(e)
            else:
                delta.changed[e.name] = found[:2]
                delta.fingerprints.update(found[2])
        link = chain.newest
        delta.base = {"path": os.path.relpath(link.directory.resolve(), directory.resolve()),
                      "save_id": link.manifest.save_id, "checksum": link.manifest.checksum}  # fmt: skip
    return delta


def delta_entries(delta: Delta, coordinator: Coordinator) -> tuple[list[Entry], dict[str, Any]]:
    """Entries of the delta (every process calls this: the changed-row counts are gathered) and its record."""
    counts = coordinator.gather({name: int(ids.numel()) for name, (ids, _) in delta.changed.items()})
    entries = list(delta.kept)
    for name, (ids, values) in delta.changed.items():
        layout = Layout.explicit([c[name] for c in counts])  # shard r: the rows rank r changed
        rank = coordinator.rank
        entries.append(entry_of(f"{name}#rows", ShardsView(layout, (layout.num_rows,), torch.int64, {rank: ids})))
        shape = (layout.num_rows, *values.shape[1:])
        entries.append(entry_of(f"{name}#values", ShardsView(layout, shape, values.dtype, {rank: values})))
    rows = {name: {"rows": f"{name}#rows", "values": f"{name}#values"} for name in delta.changed}
    return entries, {"base": delta.base, "rows": rows}
