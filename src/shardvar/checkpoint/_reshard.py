"""Reading shards of a checkpoint without loading it, and rewriting it into another layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .._errors import CheckpointError
from .._validate import check_bool, check_int
from ..layout import Layout, get_strategy
from ._files import DirectoryLock
from ._load import lookup
from ._manifest import MANIFEST, Manifest, VariableEntry
from ._restore import Files, _check_file, restore_shard, restore_shards
from ._write import Entry, Progress, write

__all__ = ["read_shard", "read_shards", "reshard"]


def _entry(path: str | os.PathLike, name: str, layout: Layout | None, files: Files) -> VariableEntry:
    manifest = Manifest.read(path)
    entry = lookup(manifest, name, Path(path))
    if layout is not None:
        if not isinstance(layout, Layout):
            raise CheckpointError(f"layout must be a shardvar.Layout or None; got {layout!r:.60}")
        layout.check_shape(entry.shape)
    for piece in entry.pieces:
        _check_file(files, entry, piece)  # declared sizes must fit the real files before anything is allocated
    return entry


def read_shard(path: str | os.PathLike, name: str, layout: Layout | None = None, shard: int = 0) -> torch.Tensor:
    """One shard of variable ``name`` in ``layout`` (default: the whole variable), as a new tensor.

    Reads only the chunks that shard needs: memory is bounded by the shard, not the variable.
    """
    return read_shards(path, name, layout, [shard])[0]


def read_shards(
    path: str | os.PathLike, name: str, layout: Layout | None = None, shards: list[int] | None = None
) -> list[torch.Tensor]:
    """Shards of variable ``name`` in ``layout`` (default: all of them) as new tensors; each chunk is read once."""
    directory = Path(path)
    with DirectoryLock(directory, exclusive=False), Files(directory) as files:
        entry = _entry(directory, name, layout, files)
        count = layout.num_shards if layout else 1
        wanted = list(range(count)) if shards is None else [check_int(s, "shard", minimum=0) for s in shards]
        if any(s >= count for s in wanted):
            raise CheckpointError(f"shards must be in [0, {count}); got {wanted}")
        return restore_shards(files, entry, layout, wanted)


def _resharded(entry: VariableEntry, num_shards: int, strategy: str, files: Files) -> Entry:
    if entry.layout is None:
        layout, shapes = None, {0: entry.shape}
    else:
        rows = entry.shape[entry.layout.axis]
        layout = Layout.balanced(strategy, rows, min(num_shards, max(rows, 1)), entry.layout.axis)
        shapes = dict(enumerate(layout.shard_shapes(entry.shape)))
    for piece in entry.pieces:
        _check_file(files, entry, piece)
    return Entry(entry.name, entry.dtype, entry.shape, layout, shapes, lambda s: restore_shard(files, entry, layout, s))


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    num_shards: int,
    strategy: str = "div",
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> None:
    """Rewrite checkpoint ``src`` into ``dst`` with every variable in ``num_shards`` shards.

    Each target shard is restored from ``src`` and written before the next is read, so memory
    stays bounded by the largest target shard; ``src`` is only read. An existing checkpoint at
    ``dst`` is replaced only with ``overwrite=True``.
    """
    num_shards = check_int(num_shards, "num_shards", minimum=1)
    get_strategy(strategy)  # refuse an unknown strategy before reading anything
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"reshard writes a new checkpoint; src and dst are both {src}")
    if (dst / MANIFEST).exists() and not check_bool(overwrite, "overwrite"):
        raise CheckpointError(f"{dst} already holds a checkpoint; pass overwrite=True (--force) to replace it")
    with DirectoryLock(src, exclusive=False), Files(src) as files:
        manifest = Manifest.read(src)
        entries = [_resharded(e, num_shards, strategy, files) for e in manifest.variables.values()]
        write(dst, entries, json.loads(json.dumps(manifest.extra)), progress)
