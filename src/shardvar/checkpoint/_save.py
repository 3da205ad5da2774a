"""save: ShardedVariables, tensors, modules and optimizers as logical variables, atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._errors import CheckpointError, CheckpointIOError, ShardvarError
from .._validate import check_bool, check_int
from ..variables import ShardsView
from ._async import AsyncSave, stage, start, wait_for_previous
from ._delta import Delta, delta_entries, find_changes, remember
from ._optim import group_options, optimizer_info, optimizer_state
from ._quantize import PACKED
from ._state import notify, resolve
from ._write import Coordinator, Entry, Progress, agree, check_dtypes, entry_of, write

__all__ = ["save", "AsyncSave"]

_LOCAL = Coordinator()  # this process's saves (the distributed layer passes its own)


def _plan_save(state_dict: dict[str, Any]) -> tuple[list[Entry], dict]:
    state = resolve(state_dict)
    entries = [entry_of(name, value) for name, value in state.variables.items()]
    for e in entries:
        e.role = state.roles.get(e.name)
    extra: dict[str, Any] = {"optimizers": {}}
    packed = {n: v.packed for n, v in state.variables.items() if isinstance(v, ShardsView) and v.packed is not None}
    if packed:
        extra[PACKED] = packed
    for key, optimizer in state.optimizers.items():
        slots = [entry_of(n, v) for n, v in optimizer_state(state, key, optimizer).items()]
        for e in slots:
            e.role = "other"
        entries += slots
        extra["optimizers"][key] = optimizer_info(state, key, optimizer)
    if state.table_optimizers:  # their state is among the variables; their groups' options here
        extra["table_optimizers"] = {key: group_options(key, opt) for key, opt in state.table_optimizers.items()}
    check_dtypes(entries)
    return entries, extra


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    progress: Progress | None = None,
    keep_spare: bool = True,
    coordinator: Coordinator | None = None,
    asynchronous: bool = False,
    staging_bytes: int | None = None,
    delta_of: str | os.PathLike | None = None,
) -> AsyncSave | None:
    """Save ShardedVariables, tensors, modules and optimizers as logical variables under ``path``.

    The previous save's data files are kept as ``spare-*`` files (up to this checkpoint's size)
    and overwritten in place by the next save, which is several times faster than allocating new
    files on thin-provisioned disks; ``keep_spare=False`` deletes them instead.

    With ``asynchronous=True`` the save copies what it writes (at most ``staging_bytes``, when
    given) and returns an :class:`AsyncSave` at once; training may change the variables while it
    writes in the background. ``handle.wait()`` returns once it is committed, or raises its error.
    The staging buffers are kept for the saver's next asynchronous save
    (``shardvar.checkpoint.release_staging()`` frees them).

    With ``delta_of=base`` (a checkpoint, itself possibly a delta) only the rows that differ from
    ``base`` are written for variables split by rows (optimizer state included); ``load`` follows
    the chain, verifying every link, and ``compact`` folds it into one checkpoint.

    >>> import tempfile, torch
    >>> from shardvar import ShardedVariable, load
    >>> v = ShardedVariable([torch.zeros(2, 3), torch.ones(2, 3)])
    >>> d = tempfile.mkdtemp()
    >>> save({"v": v}, d)
    >>> w = ShardedVariable([torch.empty(1, 3) for _ in range(4)], partition_strategy="mod")
    >>> load({"v": w}, d)
    >>> w.to_tensor()[:, 0].tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint path {directory} exists and is not a directory")
    check_bool(keep_spare, "keep_spare")
    check_bool(asynchronous, "asynchronous")
    if staging_bytes is not None:
        check_int(staging_bytes, "staging_bytes", minimum=0)
    if delta_of is not None and not isinstance(delta_of, (str, os.PathLike)):
        raise CheckpointError(f"delta_of must be the path of a checkpoint; got {type(delta_of).__name__}")
    coordinator = coordinator or _LOCAL
    key = getattr(coordinator, "key", coordinator)
    wait_for_previous(key)  # one save per coordinator at a time
    if isinstance(state_dict, dict):
        notify(state_dict, "before_save")
    entries, extra, delta = _planned(state_dict, directory, delta_of, coordinator)
    if not asynchronous:
        save_id = write(directory, entries, extra, progress, keep_spare, coordinator)
        if delta is not None:
            remember(save_id, delta.fingerprints)
        return None
    return _start_async(directory, entries, extra, delta, progress, keep_spare, coordinator, staging_bytes)


def _start_async(
    directory: Path,
    entries: list[Entry],
    extra: dict[str, Any],
    delta: Delta | None,
    progress: Progress | None,
    keep_spare: bool,
    coordinator: Coordinator,
    staging_bytes: int | None,
) -> AsyncSave:
    key = getattr(coordinator, "key", coordinator)
    error, staged = None, []
    try:
        staged = stage(entries, staging_bytes, key)
    except ShardvarError as e:
        error = e
    agree(coordinator, error)  # every rank staged its part (or all raise)

    def run() -> None:
        save_id = write(directory, staged, extra, progress, keep_spare, coordinator)
        if delta is not None:
            remember(save_id, delta.fingerprints)

    return start(key, directory, run)


def _planned(
    state_dict: dict[str, Any], directory: Path, delta_of: str | os.PathLike | None, coordinator: Coordinator
) -> tuple[list[Entry], dict[str, Any], Delta | None]:
    entries: list[Entry] = []
    extra: dict[str, Any] = {}
    error, delta = None, None
    try:
        entries, extra = _plan_save(state_dict)
        if delta_of is not None:
            delta = find_changes(entries, delta_of, directory)
    except ShardvarError as e:
        error = e
    except OSError as e:
        error = CheckpointIOError(f"reading the base checkpoint {delta_of} failed: {e}")
    agree(coordinator, error)  # every rank reaches this point, also one whose state failed to plan
    if delta is not None:
        entries, extra["delta"] = delta_entries(delta, coordinator)
    if coordinator.world > 1:  # replicated values (plain tensors) are written once, by the first rank holding each
        held = coordinator.gather([e.name for e in entries if e.replicated])
        first: dict[str, int] = {}
        for rank, names in enumerate(held):
            for name in names:
                first.setdefault(name, rank)
        entries = [e for e in entries if not e.replicated or first[e.name] == coordinator.rank]
    return entries, extra, delta
