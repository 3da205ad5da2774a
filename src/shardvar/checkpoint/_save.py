"""save: ShardedVariables, tensors, modules and optimizers as logical variables, atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._errors import CheckpointError, ShardvarError
from .._validate import check_bool
from ._optim import optimizer_info, optimizer_state
from ._state import resolve
from ._write import Coordinator, Entry, Progress, agree, check_dtypes, entry_of, write

__all__ = ["save"]


def _plan_save(state_dict: dict[str, Any]) -> tuple[list[Entry], dict]:
    state = resolve(state_dict)
    entries = [entry_of(name, value) for name, value in state.variables.items()]
    extra: dict[str, Any] = {"optimizers": {}}
    for key, optimizer in state.optimizers.items():
        entries += [entry_of(n, v) for n, v in optimizer_state(state, key, optimizer).items()]
        extra["optimizers"][key] = optimizer_info(state, key, optimizer)
    check_dtypes(entries)
    return entries, extra


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    progress: Progress | None = None,
    keep_spare: bool = True,
    coordinator: Coordinator | None = None,
) -> None:
    """Save ShardedVariables, tensors, modules and optimizers as logical variables under ``path``.

    The previous save's data files are kept as ``spare-*`` files (up to this checkpoint's size)
    and overwritten in place by the next save, which is several times faster than allocating new
    files on thin-provisioned disks; ``keep_spare=False`` deletes them instead.

    >>> import tempfile, torch
    >>> from shardvar import ShardedVariable, load
    >>> v = ShardedVariable([torch.zeros(2, 3), torch.ones(2, 3)])
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save({"table": v}, d)
    ...     w = ShardedVariable([torch.empty(3, 3), torch.empty(1, 3)])   # another layout
    ...     load({"table": w}, d)
    ...     w.to_tensor()[:, 0].tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint path {directory} exists and is not a directory")
    coordinator = coordinator or Coordinator()
    check_bool(keep_spare, "keep_spare")
    entries: list[Entry] = []
    extra: dict[str, Any] = {}
    error = None
    try:
        entries, extra = _plan_save(state_dict)
    except ShardvarError as e:
        error = e
    agree(coordinator, error)  # every rank reaches this point, also one whose state failed to plan
    if coordinator.rank != 0:  # replicated values (plain tensors) are written once, by rank 0
        entries = [e for e in entries if not e.replicated]
    write(directory, entries, extra, progress, keep_spare, coordinator)
