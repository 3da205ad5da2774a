"""save, load, read_shard and reshard: checkpoints of logical variables.

A save writes its data files under fresh names, fsyncs them, then atomically replaces
``manifest.json`` (the commit point) and only afterwards deletes the previous save's files: a
crash at any moment leaves the old or the new checkpoint, complete. A load checks every target
against the manifest before writing any, and restores each target shard in its own layout.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import ShardvarError, ShardvarTypeError
from ..layout import Layout, get_strategy
from ._manifest import MANIFEST, CheckpointError, Manifest, Piece, VariableEntry
from ._restore import Files, _check_file, _restore, restore_shard, restore_shards, verify_shards
from ._safetensors import FileWriter
from ._state import Partial, State, optimizer_param_names, resolve

__all__ = ["save", "load", "read_shard", "read_shards", "reshard", "Progress"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
FILE_BYTES = 1 << 30  # roll over to a new data file past this size
STAGING_BYTES = 256 << 20
_OURS = re.compile(
    r"^(data-[0-9a-f]+-(r\d+-)?\d+\.safetensors|manifest\.json\.tmp-[0-9a-f]+|spare-[0-9a-f]+\.safetensors)$"
)
_SPARE = re.compile(r"^spare-[0-9a-f]+\.safetensors$")
_JSON = (int, float, bool, str, type(None))


def _json_value(v: Any) -> Any:
    if isinstance(v, _JSON):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, _JSON) for x in v):
        return list(v)
    return None


@dataclass
class _Entry:
    """One logical variable to write: its layout, and the shards this process writes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None
    shard_shapes: dict[int, tuple[int, ...]]  # shard index -> shape, for the shards written here
    produce: Callable[[int], torch.Tensor]
    replicated: bool = False  # a plain tensor every process holds whole: rank 0 writes it


def _entry_of(name: str, value: Partial | torch.Tensor) -> _Entry:
    if isinstance(value, Partial):
        shards = value.shards
        shapes = {s: tuple(t.shape) for s, t in sorted(shards.items())}
        return _Entry(name, value.dtype, value.shape, value.layout, shapes, lambda s: shards[s])
    layout = Layout("div", (value.shape[0],)) if value.dim() else None
    return _Entry(name, value.dtype, tuple(value.shape), layout, {0: tuple(value.shape)}, lambda s: value, True)


def _optimizer_entries(state: State, key: str, optimizer: torch.optim.Optimizer) -> tuple[list[_Entry], dict]:
    entries: dict[str, Partial | torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    sharded_slots: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        param_state = optimizer.state.get(p, {})
        owner = state.shard_of.get(id(p))
        for slot, value in param_state.items():
            if owner is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
                sharded_slots.setdefault((owner[0], slot), {})[owner[1]] = value
                continue
            name = owner[0] if owner else state.param_name.get(id(p))
            if name is None:
                continue
            if isinstance(value, torch.Tensor):
                entries.setdefault(f"{key}/{name}/{slot}", value.detach())
            elif _json_value(value) is not None or value is None:
                scalars.setdefault(f"{name}/{slot}", _json_value(value))
    for (name, slot), by_shard in sharded_slots.items():
        variable = state.variables[name]
        # A shard the optimizer never stepped has no slot yet: it holds zeros, as fresh state does.
        slots = {s: by_shard.get(s, torch.zeros_like(shard)).detach() for s, shard in variable.shards.items()}
        entries[f"{key}/{name}/{slot}"] = Partial(variable.layout, variable.shape, variable.dtype, slots)
    groups = [
        {**{k: _json_value(v) for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(optimizer.param_groups, optimizer_param_names(state, optimizer), strict=True)
    ]
    return [_entry_of(n, v) for n, v in entries.items()], {"param_groups": groups, "scalars": scalars}


class Coordinator:
    """How the processes taking part in one save or load agree; this one is a single process.

    The distributed layer supplies one over a process group (``shardvar.distributed``).
    """

    rank, world = 0, 1

    def common_save_id(self) -> str:
        return uuid.uuid4().hex[:16]

    def gather(self, obj: Any) -> list[Any]:
        """Everyone's ``obj``, in rank order (on every rank)."""
        return [obj]

    def barrier(self) -> None:
        return None


def _agree(coordinator: Coordinator, error: BaseException | None) -> None:
    """Raise on every process if any one failed (the failing one raises its own error)."""
    verdicts = coordinator.gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if failed:
        raise CheckpointError("; ".join(f"rank {r} failed: {v}" for r, v in failed))


def _write_files(
    directory: Path, entries: list[_Entry], save_id: str, tag: str, progress: Progress | None, reuse_spares: bool
) -> dict[str, list[tuple[int, Piece]]]:
    """Write this process's shards of ``entries`` into new data files; return (shard, piece) per variable."""
    total = sum(math_prod(shape) * e.dtype.itemsize for e in entries for shape in e.shard_shapes.values())
    files: list[list[tuple[_Entry, int]]] = [[]]
    size = 0
    for e in entries:
        for s, shape in e.shard_shapes.items():
            nbytes = math_prod(shape) * e.dtype.itemsize
            if size and size + nbytes > FILE_BYTES:
                files.append([])
                size = 0
            files[-1].append((e, s))
            size += nbytes
    pieces: dict[str, list[tuple[int, Piece]]] = {e.name: [] for e in entries}
    done = 0
    spares = sorted((p for p in directory.iterdir() if _SPARE.match(p.name)), key=lambda p: p.stat().st_size)
    for k, members in enumerate(files):
        if not members:
            continue
        file_name = f"data-{save_id}-{tag}{k:05d}.safetensors"
        reuse = reuse_spares and bool(spares)
        if reuse:
            os.replace(spares.pop(), directory / file_name)  # a spare is referenced by no manifest
        writer = FileWriter(
            str(directory / file_name), [(f"{e.name}#{s}", e.shard_shapes[s], e.dtype) for e, s in members], reuse=reuse
        )
        for e, s in members:
            stored = writer.write(f"{e.name}#{s}", e.produce(s))
            start, step, count = e.layout.shard_progression(s) if e.layout else (0, 1, 1)
            piece = Piece(
                file_name, stored.key, start, step, count, stored.shape, stored.chunk_rows, stored.crc32, stored.begin
            )
            pieces[e.name].append((s, piece))
            done += math_prod(stored.shape) * e.dtype.itemsize
            if progress:
                progress(done, total)
        writer.close()
    return pieces


def _write(
    directory: Path,
    entries: list[_Entry],
    extra: dict,
    progress: Progress | None,
    keep_spare: bool = True,
    coordinator: Coordinator | None = None,
) -> None:
    """Write ``entries`` as a new save in ``directory`` (each process its own shards) and commit it."""
    coordinator = coordinator or Coordinator()
    single = coordinator.world == 1
    save_id = coordinator.common_save_id()
    error, written = None, {}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tag = "" if single else f"r{coordinator.rank:05d}-"
        written = _write_files(directory, entries, save_id, tag, progress, reuse_spares=single)
    except (OSError, ValueError) as e:
        error = e
    meta = {e.name: (e.dtype, e.shape, e.layout) for e in entries}
    everyone = coordinator.gather(None if error else (meta, written))
    if error is not None:
        raise error
    failed = [r for r, x in enumerate(everyone) if x is None]
    if failed:
        raise CheckpointError(f"the save to {directory} failed on rank(s) {failed}; the previous checkpoint is intact")
    if coordinator.rank == 0:
        variables = {}
        for name in dict.fromkeys(n for m, _ in everyone for n in m):
            dtype, shape, layout = next(m[name] for m, _ in everyone if name in m)
            found = sorted(((s, p) for _, w in everyone for s, p in w.get(name, [])), key=lambda sp: sp[0])
            expected = list(range(layout.num_shards if layout else 1))
            if [s for s, _ in found] != expected:
                raise CheckpointError(
                    f"variable {name!r}: the processes wrote shards {[s for s, _ in found]}; "
                    f"expected each of {expected}"
                )
            variables[name] = VariableEntry(name, dtype, shape, layout, tuple(p for _, p in found))
        _commit(directory, Manifest(variables, extra, save_id), save_id, keep_spare and single)
    coordinator.barrier()


def math_prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(directory: Path, manifest: Manifest, save_id: str, keep_spare: bool = True) -> None:
    _fsync_dir(directory)  # the data files' names are durable before the manifest names them
    tmp = directory / f"{MANIFEST}.tmp-{save_id}"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)
    keep = manifest.files()
    budget = sum((directory / name).stat().st_size for name in keep)
    spare_bytes = 0
    for path in sorted(directory.iterdir(), key=lambda p: not _SPARE.match(p.name)):
        if not _OURS.match(path.name) or path.name in keep:
            continue
        # The previous save's files (or a crashed save's) become spare space for the next save,
        # up to the size of this checkpoint; the rest is deleted.
        size = path.stat().st_size
        if keep_spare and path.name.endswith(".safetensors") and spare_bytes + size <= budget:
            spare_bytes += size
            if not _SPARE.match(path.name):
                os.replace(path, directory / f"spare-{uuid.uuid4().hex[:16]}.safetensors")
        else:
            path.unlink(missing_ok=True)


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

    >>> import tempfile
    >>> from shardvar import ShardedVariable
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
    state = resolve(state_dict)
    entries = [_entry_of(name, value) for name, value in state.variables.items()]
    extra: dict[str, Any] = {"optimizers": {}}
    for key, optimizer in state.optimizers.items():
        more, info = _optimizer_entries(state, key, optimizer)
        entries += more
        extra["optimizers"][key] = info
    if coordinator.rank != 0:  # replicated values (plain tensors) are written once, by rank 0
        entries = [e for e in entries if not e.replicated]
    _write(directory, entries, extra, progress, keep_spare, coordinator)


@dataclass(eq=False)
class _Target:
    entry: VariableEntry
    layout: Layout | None  # None: restore the whole variable
    dests: list[tuple[int, torch.Tensor | None]]  # (shard, tensor to fill, or None for a new one)


def _lookup(manifest: Manifest, name: str, directory: Path) -> VariableEntry:
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


def _plan(manifest: Manifest, state: State, directory: Path) -> tuple[list[_Target], dict]:
    targets = []
    for name, value in state.variables.items():
        entry = _lookup(manifest, name, directory)
        _match(entry, value.dtype, tuple(value.shape))
        if isinstance(value, Partial):
            targets.append(_Target(entry, value.layout, sorted(value.shards.items())))
        else:
            targets.append(_Target(entry, None, [(0, value)]))
    optimizer_plans = {}
    saved_optimizers = manifest.extra.get("optimizers", {})
    for key, optimizer in state.optimizers.items():
        if key not in saved_optimizers:
            raise CheckpointError(f"optimizer {key!r} is not in the checkpoint {directory}")
        saved = saved_optimizers[key]
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(
                f"optimizer {key!r} has {len(optimizer.param_groups)} param groups; "
                f"the checkpoint has {len(saved['param_groups'])}"
            )
        slots: dict[int, dict[str, Any]] = {}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            owner = state.shard_of.get(id(p))
            pname = owner[0] if owner else state.param_name.get(id(p), f"param{i}")
            prefix = f"{key}/{pname}/"
            for var_name, entry in manifest.variables.items():
                if not var_name.startswith(prefix):
                    continue
                slot = var_name[len(prefix) :]
                if owner is not None and entry.shape == tuple(owner[2].shape):
                    target = _Target(entry, owner[2].layout, [(owner[1], None)])
                else:
                    target = _Target(entry, None, [(0, None)])
                targets.append(target)
                slots.setdefault(i, {})[slot] = target
            for name, value in saved.get("scalars", {}).items():
                if name.startswith(f"{pname}/"):
                    slots.setdefault(i, {})[name[len(pname) + 1 :]] = value
        optimizer_plans[key] = (slots, saved["param_groups"])
    return targets, optimizer_plans


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    staging_bytes: int = STAGING_BYTES,
    progress: Progress | None = None,
    coordinator: Coordinator | None = None,
) -> None:
    """Fill the objects of ``state_dict`` from the checkpoint at ``path``, each in its own layout.

    Everything is checked (names, shapes, dtypes, files, and the checksums of every byte needed)
    before any target is written, so a failing load leaves every object as it was. Targets up to
    ``staging_bytes`` in total are read once into staging tensors; larger ones are verified in a
    first pass and then restored shard by shard, so memory stays bounded by the largest shard.
    """
    directory = Path(path)
    coordinator = coordinator or Coordinator()
    state = resolve(state_dict)
    with Files(directory) as files:
        staged: dict[int, list[torch.Tensor]] = {}
        done, error = 0, None
        try:
            manifest = Manifest.read(directory)
            targets, optimizer_plans = _plan(manifest, state, directory)
            for t in targets:
                for piece in t.entry.pieces:
                    _check_file(files, t.entry, piece)
            total = sum(t.entry.nbytes for t in targets)
            fresh_only = all(d is None for t in targets for _, d in t.dests)
            if total <= staging_bytes or fresh_only:
                for i, t in enumerate(targets):
                    staged[i] = restore_shards(files, t.entry, t.layout, [s for s, _ in t.dests])
                    done += t.entry.nbytes
                    if progress:
                        progress(done, total)
            else:
                for i, t in enumerate(targets):
                    if any(d is None for _, d in t.dests):
                        staged[i] = restore_shards(files, t.entry, t.layout, [s for s, _ in t.dests])
                    else:
                        verify_shards(files, t.entry, t.layout, [s for s, _ in t.dests])
        except (ShardvarError, OSError) as e:
            error = e
        _agree(coordinator, error)  # every process checked its part: write only if all can
        # Everything needed has been read and verified: write the targets.
        with torch.no_grad():
            for i, t in enumerate(targets):
                if i not in staged:
                    direct = {s: d.detach() for s, d in t.dests if _fillable(d, t.entry.dtype)}
                    if direct:  # straight from the files into the target's memory (verified above)
                        _restore(files, t.entry, t.layout, direct, verify=False)
                for k, (s, dest) in enumerate(t.dests):
                    if dest is None or (i not in staged and _fillable(dest, t.entry.dtype)):
                        continue
                    value = staged[i][k] if i in staged else restore_shard(files, t.entry, t.layout, s)
                    dest.copy_(value.reshape(dest.shape))
                if i not in staged and progress:
                    done += t.entry.nbytes
                    progress(done, total)
    for key, optimizer in state.optimizers.items():
        slots, saved_groups = optimizer_plans[key]
        new_state = {}
        for i, by_slot in slots.items():
            new_state[i] = {}
            for slot, value in by_slot.items():
                if isinstance(value, _Target):
                    value = staged[targets.index(value)][0]
                new_state[i][slot] = value
        groups = []
        for current, saved in zip(optimizer.state_dict()["param_groups"], saved_groups, strict=True):
            merged = {**current, **{k: v for k, v in saved.items() if k != "params" and v is not None}}
            if isinstance(current.get("betas"), tuple) and "betas" in saved:
                merged["betas"] = tuple(saved["betas"])
            merged["params"] = current["params"]
            groups.append(merged)
        optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def _fillable(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is not None and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def read_shard(path: str | os.PathLike, name: str, layout: Layout | None = None, shard: int = 0) -> torch.Tensor:
    """One shard of variable ``name`` in ``layout`` (default: the whole variable), as a new tensor.

    Reads only the chunks that shard needs: memory is bounded by the shard, not the variable.
    """
    directory = Path(path)
    manifest = Manifest.read(directory)
    entry = _lookup(manifest, name, directory)
    if layout is not None:
        layout.check_shape(entry.shape)
    with Files(directory) as files:
        return restore_shard(files, entry, layout, shard)


def read_shards(
    path: str | os.PathLike, name: str, layout: Layout | None = None, shards: list[int] | None = None
) -> list[torch.Tensor]:
    """Shards of variable ``name`` in ``layout`` (default: all of them) as new tensors; each chunk is read once."""
    directory = Path(path)
    manifest = Manifest.read(directory)
    entry = _lookup(manifest, name, directory)
    if layout is not None:
        layout.check_shape(entry.shape)
    wanted = list(range(layout.num_shards if layout else 1)) if shards is None else list(shards)
    with Files(directory) as files:
        return restore_shards(files, entry, layout, wanted)


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    num_shards: int,
    strategy: str = "div",
    *,
    progress: Progress | None = None,
) -> None:
    """Rewrite checkpoint ``src`` into ``dst`` with every variable in ``num_shards`` shards.

    Each target shard is restored from ``src`` and written before the next is read, so memory
    stays bounded by the largest target shard; ``src`` is only read.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ShardvarTypeError(f"num_shards must be an int >= 1; got {num_shards!r}")
    get_strategy(strategy)  # refuse an unknown strategy before reading anything
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"reshard writes a new checkpoint; src and dst are both {src}")
    manifest = Manifest.read(src)
    entries = []
    files = Files(src)
    for entry in manifest.variables.values():
        if entry.layout is None:
            layout = None
            shapes = {0: entry.shape}
        else:
            rows = entry.shape[entry.layout.axis]
            n = min(num_shards, max(rows, 1))
            layout = Layout(strategy, get_strategy(strategy).sizes(rows, n), entry.layout.axis)
            shapes = dict(enumerate(layout.shard_shapes(entry.shape)))
        entries.append(
            _Entry(
                entry.name,
                entry.dtype,
                entry.shape,
                layout,
                shapes,
                lambda s, e=entry, lay=layout: restore_shard(files, e, lay, s),
            )
        )
    try:
        _write(dst, entries, json.loads(json.dumps(manifest.extra)), progress)
    finally:
        files.close()
