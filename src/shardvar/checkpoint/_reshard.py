"""Reading shards of a checkpoint without loading it, and rewriting it into another layout."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._deprecation import renamed
from .._errors import CheckpointError
from .._validate import check_bool, check_int
from ..layout import Layout, get_strategy
from ..variables import to_layout
from ._chain import Chain
from ._manifest import MANIFEST
from ._restore import _check_file
from ._write import Entry, Progress, write

__all__ = ["compact", "read_shard", "read_shards", "reshard"]


def read_shard(path: str | os.PathLike, name: str, layout: Layout | None = None, shard: int = 0) -> torch.Tensor:
    """One shard of variable ``name`` in ``layout`` (default: the whole variable), as a new tensor.

    Reads only the chunks that shard needs: memory is bounded by the shard, not the variable.
    """
    return read_shards(path, name, layout, [shard])[0]


def read_shards(
    path: str | os.PathLike, name: str, layout: Layout | None = None, shards: list[int] | None = None
) -> list[torch.Tensor]:
    """Shards of variable ``name`` in ``layout`` (default: all of them) as new tensors; each chunk is read once.

    A delta checkpoint is read through its chain: the base's rows with every later change applied.
    """
    if layout is not None and not isinstance(layout, Layout):
        raise CheckpointError(f"layout must be a shardvar.Layout or None; got {layout!r:.60}")
    count = layout.num_shards if layout else 1
    wanted = list(range(count)) if shards is None else [check_int(s, "shard", minimum=0) for s in shards]
    if any(s >= count for s in wanted):
        raise CheckpointError(f"shards must be in [0, {count}); got {wanted}")
    with Chain.open(path) as chain:
        entry, link, _ = chain.source(name)
        if layout is not None:
            layout.check_shape(entry.shape)
        for piece in entry.pieces:
            _check_file(link.files, entry, piece)  # declared sizes must fit the real files before allocating
        return chain.read(name, layout, wanted)


def _target(entry: Entry, partitioner: Any, partition_strategy: str) -> Layout:
    """The layout ``partitioner`` gives the saved sharded ``entry``: a shard count splits its saved axis."""
    if isinstance(partitioner, int):  # checked >= 1 by reshard; at most one shard per row
        rows = entry.shape[entry.layout.axis]
        return Layout.balanced(partition_strategy, rows, min(partitioner, max(rows, 1)), entry.layout.axis)
    return to_layout(partitioner, entry.shape, entry.dtype, partition_strategy)


def _rewritten(chain: Chain, name: str, partitioner: Any, partition_strategy: str) -> Entry:
    """``name`` as an entry to write: split by ``partitioner`` in ``partition_strategy`` (None: as saved)."""
    entry, link, _ = chain.source(name)
    if entry.layout is None:
        layout, shapes = None, {0: entry.shape}
    else:
        layout = entry.layout if partitioner is None else _target(entry, partitioner, partition_strategy)
        shapes = dict(enumerate(layout.shard_shapes(entry.shape)))
    for piece in entry.pieces:
        _check_file(link.files, entry, piece)
    read = lambda s: chain.read(name, layout, [s])[0]  # noqa: E731
    return Entry(entry.name, entry.dtype, entry.shape, layout, shapes, read, role=entry.role)


def _rewrite(
    src: Path, dst: Path, partitioner: Any, partition_strategy: str, progress: Progress | None, overwrite: bool
) -> None:
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"this writes a new checkpoint; src and dst are both {src}")
    if (dst / MANIFEST).exists() and not check_bool(overwrite, "overwrite"):
        raise CheckpointError(f"{dst} already holds a checkpoint; pass overwrite=True (--force) to replace it")
    with Chain.open(src) as chain:
        if any(link.directory.resolve() == dst.resolve() for link in chain.links):
            raise CheckpointError(f"{dst} is a link of the chain being read; write the new checkpoint elsewhere")
        entries = [_rewritten(chain, n, partitioner, partition_strategy) for n in sorted(chain.names())]
        extra = {k: v for k, v in json.loads(json.dumps(chain.extra)).items() if k != "delta"}
        write(dst, entries, extra, progress)


@renamed(num_shards="partitioner", strategy="partition_strategy")
def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    partitioner: Any,
    partition_strategy: str = "div",
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> None:
    """Rewrite checkpoint ``src`` into ``dst`` with every sharded variable split by ``partitioner``.

    ``partitioner`` is a shard count (each variable split along its saved axis, at most one shard
    per row) or, as the modules' ``partitioner=``, a partitioner, PartitionerConfig or "1,4,1"
    string applied to each variable's shape and dtype; ``partition_strategy`` is "div" or "mod".

    Each target shard is restored from ``src`` and written before the next is read, so memory
    stays bounded by the largest target shard; ``src`` is only read. An existing checkpoint at
    ``dst`` is replaced only with ``overwrite=True``. A delta ``src`` is read through its chain.
    """
    if isinstance(partitioner, int) or partitioner is None:
        partitioner = check_int(partitioner, "partitioner (a shard count)", minimum=1)
    get_strategy(partition_strategy)  # refuse an unknown strategy before reading anything
    _rewrite(Path(src), Path(dst), partitioner, partition_strategy, progress, overwrite)


def compact(
    src: str | os.PathLike, dst: str | os.PathLike, *, progress: Progress | None = None, overwrite: bool = False
) -> None:
    """Fold the chain ending at ``src`` (a base and its deltas) into one full checkpoint at ``dst``.

    Every variable keeps its saved layout; memory stays bounded by the largest shard.
    """
    _rewrite(Path(src), Path(dst), None, "div", progress, overwrite)
