"""Chains of checkpoints: a full checkpoint and the deltas saved on top of it, read as one.

A delta's manifest names its base (path, save id and manifest checksum) and, for each variable
it changed row by row, the variables holding the changed rows' ids and values. Opening a chain
verifies every link (the base a delta names must be the checkpoint found there, byte for byte);
a variable is then read from the newest link holding it whole, with the row changes of every
later delta applied in order.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from ..layout import Layout
from ._files import DirectoryLock
from ._manifest import MANIFEST, Manifest, VariableEntry
from ._restore import Files, _check_file, restore_shards

__all__ = ["checkpoint_directory", "Chain", "Link", "RowChanges", "apply_rows", "MAX_LINKS"]

MAX_LINKS = 64  # a chain longer than this is compacted, not followed


@dataclass
class Link:
    """One checkpoint of a chain: its directory, verified manifest and open files."""

    directory: Path
    manifest: Manifest
    files: Files


@dataclass
class RowChanges:
    """Rows of a variable a delta replaced: ids ``rows`` (logical, along axis 0) get ``values``."""

    rows: torch.Tensor
    values: torch.Tensor


@dataclass
class Chain:
    """A checkpoint and the deltas on top of it, oldest first; a context manager holding shared locks."""

    links: list[Link] = field(default_factory=list)
    _locks: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _read_changes: dict[str, list[RowChanges]] = field(default_factory=dict)  # per variable, read once

    @classmethod
    def open(cls, path: str | os.PathLike) -> Chain:
        chain = cls()
        try:
            directory = checkpoint_directory(path)
            for _ in range(MAX_LINKS + 1):
                chain._locks.enter_context(DirectoryLock(directory, exclusive=False))
                manifest = Manifest.read(directory)
                files = chain._locks.enter_context(Files(directory))
                chain.links.insert(0, Link(directory, manifest, files))
                base = _base_of(manifest, directory)
                if base is None:
                    return chain
                directory = _check_link(base, directory)
            raise CheckpointError(f"{path} is a chain of more than {MAX_LINKS} deltas; compact it")
        except BaseException:
            chain.close()
            raise

    @property
    def newest(self) -> Link:
        return self.links[-1]

    @property
    def extra(self) -> dict[str, Any]:
        return self.newest.manifest.extra

    def names(self) -> set[str]:
        found = set()
        for link in self.links:
            found |= set(link.manifest.variables) | set(_deltas(link.manifest))
        return {n for n in found if "#" not in n}

    def source(self, name: str) -> tuple[VariableEntry, Link, list[tuple[Link, dict]]]:
        """The entry of ``name`` in the newest link holding it whole, and the later links' row changes."""
        later = []
        for link in reversed(self.links):
            spec = _deltas(link.manifest).get(name)
            if spec is not None:
                later.insert(0, (link, spec))
                continue
            if name in link.manifest.variables:
                return link.manifest.variables[name], link, later
        near = sorted(self.names())[:5]
        raise CheckpointError(
            f"variable {name!r} is not in the checkpoint {self.newest.directory}; it holds e.g. {near}"
        )

    def changes(self, later: list[tuple[Link, dict]], entry: VariableEntry) -> list[RowChanges]:
        """Read and verify (now, before anything is written) every row change of ``later``."""
        out = []
        for link, spec in later:
            rows_entry = link.manifest.variables[spec["rows"]]
            values_entry = link.manifest.variables[spec["values"]]
            if values_entry.dtype != entry.dtype or tuple(values_entry.shape[1:]) != tuple(entry.shape[1:]):
                raise CheckpointError(f"delta {link.directory} changes {entry.name!r} with rows of another shape")
            for e in (rows_entry, values_entry):
                for piece in e.pieces:
                    _check_file(link.files, e, piece)
            rows = restore_shards(link.files, rows_entry, None, [0])[0]
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= entry.shape[0]):
                raise CheckpointError(
                    f"delta {link.directory} changes rows of {entry.name!r} outside [0, {entry.shape[0]})"
                )
            out.append(RowChanges(rows, restore_shards(link.files, values_entry, None, [0])[0]))
        return out

    def read(self, name: str, layout: Layout | None, shards: list[int]) -> list[torch.Tensor]:
        """Shards ``shards`` of variable ``name`` in ``layout`` (None: whole), deltas applied, as new tensors."""
        entry, link, later = self.source(name)
        if name not in self._read_changes:
            self._read_changes[name] = self.changes(later, entry)
        changes = self._read_changes[name]
        out = restore_shards(link.files, entry, layout, shards)
        for change in changes:
            apply_rows(dict(zip(shards, out, strict=True)), layout, change)
        return out

    def close(self) -> None:
        self._locks.close()

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checkpoint_directory(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names (the directory, or its manifest.json)."""
    directory = Path(path)
    if directory.name == MANIFEST and directory.is_file():
        directory = directory.parent
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory")
    return directory


def _deltas(manifest: Manifest) -> dict[str, dict]:
    return (manifest.extra.get("delta") or {}).get("rows", {})


def _base_of(manifest: Manifest, directory: Path) -> dict | None:
    delta = manifest.extra.get("delta")
    if delta is None:
        return None
    base = delta.get("base") if isinstance(delta, dict) else None
    keys = {"path", "save_id", "checksum"}
    rows = delta.get("rows") if isinstance(delta, dict) else None
    if not isinstance(base, dict) or set(base) != keys or not all(isinstance(base[k], str) for k in keys):
        raise CheckpointError(f"{directory} is a delta whose base record is malformed")
    if not isinstance(rows, dict) or not all(
        isinstance(v, dict) and set(v) == {"rows", "values"} and all(x in manifest.variables for x in v.values())
        for v in rows.values()
    ):
        raise CheckpointError(f"{directory} is a delta whose row changes name variables it does not hold")
    return base


def _check_link(base: dict, directory: Path) -> Path:
    path = (directory / base["path"]).resolve()
    try:
        found = Manifest.read(path)
    except CheckpointError as e:
        raise CheckpointError(f"the delta at {directory} names base {path}, which cannot be read: {e}") from None
    if found.save_id != base["save_id"] or found.checksum != base["checksum"]:
        raise CheckpointError(
            f"the delta at {directory} was saved on base {base['save_id']} at {path}, but {path} now holds "
            f"save {found.save_id}: this link of the chain is broken"
        )
    return path


def apply_rows(outs: dict[int, torch.Tensor], layout: Layout | None, change: RowChanges) -> None:
    """Write ``change`` into the target shards ``outs`` (laid out by ``layout``; None: whole)."""
    rows, values = change.rows, change.values
    if layout is None:
        for out in outs.values():
            out.index_copy_(0, rows.to(out.device), values.to(out.device, out.dtype))
        return
    if layout.axis != 0:
        for s, out in outs.items():
            part = values.index_select(layout.axis, layout.shard_ids(s))
            out.index_copy_(0, rows.to(out.device), part.to(out.device, out.dtype))
        return
    for s, pos, local in layout.split_ids(rows):
        if s in outs:
            out = outs[s]
            out.index_copy_(0, local.to(out.device), values.index_select(0, pos).to(out.device, out.dtype))
