"""load: fill objects from a checkpoint, each in its own layout, all or nothing.

A load holds the directory's lock shared (so no save changes or deletes files under it),
checks every target against the manifest and every byte it needs against its checksum before
writing any target, and restores each target shard in its own layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import tiered
from .._errors import CheckpointError, CheckpointIOError, ShardvarError
from .._validate import check_int
from ..layout import Layout
from ..variables import ShardsView
from ._chain import Chain, RowChanges, apply_rows
from ._manifest import Manifest, VariableEntry
from ._optim import OptimizerRecord, check_group_count, check_optimizer, restored_groups, slot_name
from ._quantize import check_packed
from ._restore import Files, _check_file, restore_into, restore_shards, verify_shards
from ._state import State, notify, param_names, resolve
from ._window import restore_windows
from ._write import Coordinator, Progress, agree

__all__ = ["load", "STAGING_BYTES", "lookup"]

STAGING_BYTES = 256 << 20


@dataclass(eq=False)
class _Target:
    entry: VariableEntry
    layout: Layout | None  # None: restore the whole variable
    dests: list[tuple[int, torch.Tensor | None]]  # (shard, tensor to fill, or None for a new one)
    files: Files  # of the checkpoint (in a chain: the link) holding ``entry``
    changes: list[RowChanges]  # row changes of later deltas, read and verified, applied in order

    def patch(self, outs: dict[int, torch.Tensor]) -> None:
        for change in self.changes:
            apply_rows(outs, self.layout, change)


def _source(chain: Chain, name: str) -> tuple[VariableEntry, Files, list[RowChanges]]:
    entry, link, later = chain.source(name)
    return entry, link.files, chain.changes(later, entry)


def lookup(manifest: Manifest, name: str, directory: Path) -> VariableEntry:
    entry = manifest.variables.get(name)
    if entry is None:
        near = [n for n in manifest.variables if n.split("/")[0] == name.split("/")[0]][:5]
        raise CheckpointError(f"variable {name!r} is not in the checkpoint {directory}; it holds e.g. {near}")
    return entry


def _match(entry: VariableEntry, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if entry.shape != shape or entry.dtype != dtype:
        raise CheckpointError(
            f"variable {entry.name!r} was saved as {entry.dtype} {list(entry.shape)}; "
            f"the target is {dtype} {list(shape)}"
        )


def _optimizer_targets(
    chain: Chain, state: State, key: str, optimizer: torch.optim.Optimizer, partial_ok: bool
) -> tuple[list[_Target], dict[int, dict[str, Any]], list[dict[str, Any]]]:
    raw = chain.extra.get("optimizers", {}).get(key)
    if raw is None:
        raise CheckpointError(f"optimizer {key!r} is not in the checkpoint")
    saved = OptimizerRecord.from_json(raw, key)
    check_optimizer(saved, state, key, optimizer, partial_ok)
    names = [n for group in param_names(state, optimizer) for n in group]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    targets, slots = [], {}
    for i, (p, name) in enumerate(zip(params, names, strict=True)):
        owner = state.shard_of.get(id(p))
        for slot in sorted(saved.slots.get(name, ())):
            scalar = saved.scalar(name, slot, _MISSING)
            if scalar is not _MISSING:
                slots.setdefault(i, {})[slot] = scalar
                continue
            entry, files, changes = _source(chain, slot_name(key, name, slot))
            if owner is not None and entry.shape == tuple(owner[2].shape):
                target = _Target(entry, owner[2].layout, [(owner[1], None)], files, changes)
            else:
                target = _Target(entry, None, [(0, None)], files, changes)
            targets.append(target)
            slots.setdefault(i, {})[slot] = target
    return targets, slots, saved.param_groups


_MISSING = object()


def _plan_load(chain: Chain, state: State, partial_ok: bool) -> tuple[list[_Target], dict]:
    targets = []
    for name, value in state.variables.items():
        entry, files, changes = _source(chain, name)
        check_packed(chain.extra, entry, value.packed if isinstance(value, ShardsView) else None)
        _match(entry, value.dtype, tuple(value.shape))
        if isinstance(value, ShardsView):
            targets.append(_Target(entry, value.layout, sorted(value.shards.items()), files, changes))
        else:
            targets.append(_Target(entry, None, [(0, value)], files, changes))
    optimizer_plans = {}
    for key, optimizer in state.optimizers.items():
        more, slots, groups = _optimizer_targets(chain, state, key, optimizer, partial_ok)
        targets += more
        optimizer_plans[key] = (slots, groups)
    for key, optimizer in state.table_optimizers.items():
        saved = (chain.extra.get("table_optimizers") or {}).get(key)
        if saved is not None:  # (checkpoints before options were saved: the optimizer keeps its own)
            check_group_count(key, optimizer, saved)
            optimizer_plans[key] = (None, saved)
    return targets, optimizer_plans


def _fillable(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is not None and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def _stage(targets: list[_Target], staging_bytes: int, progress: Progress | None) -> dict:
    """Read (into new tensors) or verify everything the writes will need; write nothing."""
    for t in targets:
        for piece in t.entry.pieces:
            _check_file(t.files, t.entry, piece)  # sizes agree with the manifest before any allocation
    staged: dict[int, list[torch.Tensor]] = {}
    total, done = sum(t.entry.nbytes for t in targets), 0
    small = total <= staging_bytes or all(d is None for t in targets for _, d in t.dests)
    for i, t in enumerate(targets):
        shards = [s for s, _ in t.dests]
        if small or any(d is None for _, d in t.dests):
            staged[i] = restore_shards(t.files, t.entry, t.layout, shards)
            t.patch(dict(zip(shards, staged[i], strict=True)))
            done += t.entry.nbytes
            if progress:
                progress(done, total)
        else:
            verify_shards(t.files, t.entry, t.layout, shards)
    return staged


def _write_targets(targets: list[_Target], staged: dict, progress: Progress | None) -> None:
    total = sum(t.entry.nbytes for t in targets)
    done = sum(t.entry.nbytes for i, t in enumerate(targets) if i in staged)
    with torch.no_grad():
        for i, t in enumerate(targets):
            if i not in staged:
                direct = {s: d.detach() for s, d in t.dests if _fillable(d, t.entry.dtype)}
                if direct:  # straight from the files into the target's memory (verified, and locked)
                    restore_into(t.files, t.entry, t.layout, direct, verify=False)
                    t.patch(direct)
            report = _within(done, t.entry.nbytes, total, progress) if i not in staged else None
            for k, (s, dest) in enumerate(t.dests):
                if dest is None or (i not in staged and _fillable(dest, t.entry.dtype)):
                    continue
                if i in staged:
                    dest.copy_(staged[i][k].reshape(dest.shape))
                else:
                    _write_windows(t, s, dest, report)
            if i not in staged and progress:
                done += t.entry.nbytes
                progress(done, total)


def _within(done: int, nbytes: int, total: int, progress: Progress | None) -> Any:
    """``report(bytes)`` for the windows of one target: progress within its ``nbytes``."""
    if progress is None:
        return None
    written = [0]

    def report(n: int) -> None:
        written[0] += n
        progress(done + min(written[0], nbytes), total)

    return report


def _write_windows(t: _Target, shard: int, dest: torch.Tensor, report: Any = None) -> None:
    """Fill ``dest`` (one it cannot be read into directly) a bounded window of rows at a time."""
    for part, rows in restore_windows(t.files, t.entry, t.layout, shard, dest):
        part.copy_(rows.reshape(part.shape))
        if report is not None:
            report(rows.nbytes)
    if t.changes:  # later deltas' rows, written over the windows
        t.patch({shard: dest})


def _apply_optimizers(state: State, plans: dict, targets: list[_Target], staged: dict) -> None:
    index = {id(t): i for i, t in enumerate(targets)}
    for key, optimizer in state.optimizers.items():
        slots, saved_groups = plans[key]
        new_state = {
            i: {slot: staged[index[id(v)]][0] if isinstance(v, _Target) else v for slot, v in by_slot.items()}
            for i, by_slot in slots.items()
        }
        groups = restored_groups(optimizer.state_dict()["param_groups"], saved_groups)
        optimizer.load_state_dict({"state": new_state, "param_groups": groups})
    for key, optimizer in state.table_optimizers.items():
        if key in plans:  # the state went in with the variables: the options now
            restored = restored_groups(optimizer.param_groups, plans[key][1])
            for group, saved in zip(optimizer.param_groups, restored, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})


def _as_checkpoint_error(e: Exception, directory: Path) -> ShardvarError:
    if isinstance(e, ShardvarError):
        return e
    if isinstance(e, OSError):
        return CheckpointIOError(f"reading {directory} failed: {e}")
    return CheckpointError(f"loading {directory} failed ({type(e).__name__}: {e}); nothing was changed")


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    staging_bytes: int = STAGING_BYTES,
    progress: Progress | None = None,
    coordinator: Coordinator | None = None,
) -> None:
    """Fill the objects of ``state_dict`` from the checkpoint at ``path``, each in its own layout.

    Everything is checked (names, shapes, dtypes, files, the optimizer's class and parameters,
    and the checksum of every byte needed) before any target is written, so a failing load
    leaves every object as it was. Targets up to ``staging_bytes`` in total are read once into
    staging tensors; larger ones are verified in a first pass and then restored shard by shard
    (a shard that cannot be read into directly, such as a tiered table's file, a bounded window
    of rows at a time), so memory stays bounded by the largest shard. A save to the same
    directory waits until the load is done.
    """
    directory = Path(path)
    coordinator = coordinator or Coordinator()
    error, targets, staged, plans, state, chain = None, [], {}, {}, State(), Chain()
    # a tiered table's rows are written into a new file, which replaces its backing file only once
    # every window is written (``shardvar.tiered.loading``): a failure leaves the table as it was
    with tiered.loading() as tiers:
        try:
            try:
                check_int(staging_bytes, "staging_bytes", minimum=0)
                state = resolve(state_dict)
                chain = Chain.open(directory)  # every link locked shared, and verified against the next
                targets, plans = _plan_load(chain, state, partial_ok=coordinator.world > 1)
                staged = _stage(targets, staging_bytes, progress)
                tiers.prepare()  # the tiers' new files hold their rows as they are now
            except Exception as e:
                error = _as_checkpoint_error(e, directory)
            agree(coordinator, error)  # every process checked its part: write only if all can
            try:
                _write_targets(targets, staged, progress)
                tiers.commit()
            except BaseException:
                # written in part (an I/O error after every check passed): what holds copies of the
                # targets (a dynamic table's index) must follow what was written; a tiered table's
                # file was not written (its new file is dropped), so its cache stays
                notify(state_dict, "after_load")
                raise
        finally:
            chain.close()
    _apply_optimizers(state, plans, targets, staged)
    notify(state_dict, "after_load")
