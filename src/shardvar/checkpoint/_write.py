"""Writing a save: data files under fresh names, the manifest as the commit point, then clean-up.

A crash at any moment leaves the old or the new checkpoint, complete. A save that fails (disk
full, a rank that failed) removes every file it wrote, so the previous checkpoint stays intact
and the next save that fits succeeds. Files of earlier saves become ``spare-*`` files that the
next save overwrites in place, and only regular files named like ours are ever touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, CheckpointIOError, ShardvarError
from ..layout import Layout
from ..variables import ShardsView
from ._files import DirectoryLock, create_new, fsync_dir, reopen_spare
from ._manifest import MANIFEST, Manifest, Piece, VariableEntry
from ._optim import merge_infos
from ._safetensors import DTYPE_CODES, FileWriter, StoredTensor

__all__ = ["Entry", "Coordinator", "Progress", "agree", "entry_of", "check_dtypes", "write"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
FILE_BYTES = 1 << 30  # roll over to a new data file past this size
_DATA_NAME, _SPARE_NAME = r"data-[0-9a-f]+-(r\d+-)?\d+\.safetensors", r"spare-[0-9a-f]+\.safetensors"
_OURS = re.compile(rf"^({_DATA_NAME}|manifest\.json\.tmp-[0-9a-f]+|{_SPARE_NAME})$")
_SPARE = re.compile(rf"^{_SPARE_NAME}$")
_DATA = re.compile(rf"^{_DATA_NAME}$")


@dataclass
class Entry:
    """One logical variable to write: its layout, and the shards this process writes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Any  # a Layout, or None for a 0-d tensor
    shard_shapes: dict[int, tuple[int, ...]]  # shard index -> shape, for the shards written here
    produce: Callable[[int], torch.Tensor]
    replicated: bool = False  # a plain tensor every process holds whole: rank 0 writes it
    # Instead of ``produce``: (shard, first local row, rows) pieces feeding all shards in one pass
    # (each shard's rows in order); the shards then share one data file.
    stream: Callable[[], Iterable[tuple[int, int, torch.Tensor]]] | None = None
    role: str | None = None  # the manifest's role (_manifest.ROLES), None: unknown

    @property
    def nbytes(self) -> int:
        return sum(self.dtype.itemsize * _prod(s) for s in self.shard_shapes.values())


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def entry_of(name: str, value: ShardsView | torch.Tensor) -> Entry:
    if isinstance(value, ShardsView):
        shards = value.shards
        shapes = {s: tuple(t.shape) for s, t in sorted(shards.items())}
        return Entry(name, value.dtype, value.shape, value.layout, shapes, lambda s: shards[s], stream=value.stream)
    layout = Layout("div", (value.shape[0],)) if value.dim() else None
    return Entry(name, value.dtype, tuple(value.shape), layout, {0: tuple(value.shape)}, lambda s: value, True)


def check_dtypes(entries: list[Entry]) -> None:
    """Refuse, before any file is touched, a dtype the safetensors format has no name for."""
    for e in entries:
        if e.dtype not in DTYPE_CODES:
            known = sorted(str(d).removeprefix("torch.") for d in DTYPE_CODES)
            raise CheckpointError(
                f"variable {e.name!r} has dtype {e.dtype}, which a checkpoint cannot store; known: {known}"
            )


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


def agree(coordinator: Coordinator, error: BaseException | None) -> None:
    """Raise on every process if any one failed (the failing one raises its own error)."""
    verdicts = coordinator.gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if failed:
        raise CheckpointError("; ".join(f"rank {r} failed: {v}" for r, v in failed))


def _layout_files(entries: list[Entry]) -> list[list[tuple[Entry, int]]]:
    files: list[list[tuple[Entry, int]]] = [[]]
    size = 0
    for e in entries:
        units = [list(e.shard_shapes)] if e.stream is not None else [[s] for s in e.shard_shapes]
        for unit in units:
            nbytes = sum(_prod(e.shard_shapes[s]) for s in unit) * e.dtype.itemsize
            if size and size + nbytes > FILE_BYTES:
                files.append([])
                size = 0
            files[-1].extend((e, s) for s in unit)
            size += nbytes
    return [f for f in files if f]


def _reusable(directory: Path) -> list[Path]:
    """Files a save may overwrite in place, smallest first: spares, and data files no manifest names.

    A data file the manifest does not name is a killed save's (a save that fails removes its own,
    and the directory's lock keeps out every other writer); reusing it reclaims its space, where
    it would otherwise stay behind as a spare. A manifest that cannot be read names nothing
    certain, so then only spares are reused.
    """
    try:
        named = Manifest.read(directory).files() if (directory / MANIFEST).exists() else set()
    except CheckpointError:
        named = None
    with os.scandir(directory) as it:
        found = [(e.stat(follow_symlinks=False).st_size, Path(e.path)) for e in it
                 if (_SPARE.match(e.name) or (named is not None and _DATA.match(e.name) and e.name not in named))
                 and e.is_file(follow_symlinks=False)]  # fmt: skip
    return [p for _, p in sorted(found)]


def _open_target(directory: Path, name: str, spares: list[Path], written: list[Path]) -> Any:
    path = directory / name
    while spares:
        spare = spares.pop()
        os.replace(spare, path)  # a spare is referenced by no manifest
        written.append(path)
        f = reopen_spare(path)
        if f is not None:
            return f
        path.unlink(missing_ok=True)
        written.pop()
    f = create_new(path)
    written.append(path)
    return f


def _write_files(
    directory: Path, entries: list[Entry], save_id: str, tag: str, progress: Progress | None, reuse: bool
) -> dict[str, list[tuple[int, Piece]]]:
    """Write this process's shards into new data files; on any failure remove every file written."""
    total = sum(e.nbytes for e in entries)
    pieces: dict[str, list[tuple[int, Piece]]] = {e.name: [] for e in entries}
    written: list[Path] = []
    spares = _reusable(directory) if reuse else []
    done = 0

    def report(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, total)

    try:
        for k, members in enumerate(_layout_files(entries)):
            file_name = f"data-{save_id}-{tag}{k:05d}.safetensors"
            f = _open_target(directory, file_name, spares, written)
            writer = FileWriter(f, [(f"{e.name}#{s}", e.shard_shapes[s], e.dtype) for e, s in members])
            try:
                for e, s in members:
                    if e.stream is not None and s != next(iter(e.shard_shapes)):
                        continue  # written with the entry's first shard
                    for shard, stored in _write_shards(writer, e, s, report):
                        start, step, count = e.layout.shard_progression(shard) if e.layout else (0, 1, 1)
                        piece = Piece(file_name, stored.key, start, step, count, stored.shape, stored.chunk_rows,
                                      stored.sums, stored.begin, stored.checksum)  # fmt: skip
                        pieces[e.name].append((shard, piece))
            except BaseException:
                writer.abort()
                raise
            writer.close()
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return pieces


def _write_shards(
    writer: FileWriter, e: Entry, s: int, report: Callable[[int], None]
) -> list[tuple[int, StoredTensor]]:
    """Shard ``s`` of ``e``, or all its shards at once when ``e`` streams."""
    if e.stream is None:
        stored = writer.write(f"{e.name}#{s}", e.produce(s))
        report(e.dtype.itemsize * _prod(stored.shape))
        return [(s, stored)]
    shards = list(e.shard_shapes)
    index = {shard: i for i, shard in enumerate(shards)}
    source = e.stream()
    try:
        pieces = ((index[shard], row, rows) for shard, row, rows in source)
        stored = writer.write_stream([f"{e.name}#{shard}" for shard in shards], pieces, report)
    finally:
        getattr(source, "close", lambda: None)()  # a generator reading ahead stops now, even on failure
    return list(zip(shards, stored, strict=True))


def _cleanup(directory: Path, keep: set[str], keep_spare: bool) -> None:
    """Turn earlier saves' files into spares (up to this checkpoint's size) and delete the rest."""
    budget = sum((directory / name).stat().st_size for name in keep)
    spare_bytes = 0
    with os.scandir(directory) as it:
        ours = [e for e in it if _OURS.match(e.name) and e.name not in keep]
    for e in sorted(ours, key=lambda e: not _SPARE.match(e.name)):
        with contextlib.suppress(OSError):  # best effort: the checkpoint is already committed
            size = e.stat(follow_symlinks=False).st_size
            regular = e.is_file(follow_symlinks=False)
            if keep_spare and regular and e.name.endswith(".safetensors") and spare_bytes + size <= budget:
                spare_bytes += size
                if not _SPARE.match(e.name):
                    os.replace(e.path, directory / f"spare-{uuid.uuid4().hex[:16]}.safetensors")
            else:
                os.unlink(e.path)  # a link is removed, never what it points to


def _commit(directory: Path, manifest: Manifest, save_id: str, keep_spare: bool) -> None:
    fsync_dir(directory)  # the data files' names are durable before the manifest names them
    tmp = directory / f"{MANIFEST}.tmp-{save_id}"
    try:
        with create_new(tmp) as f:
            f.write(manifest.to_json().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    _cleanup(directory, manifest.files(), keep_spare)


def _manifest(everyone: list[Any], save_id: str) -> Manifest:
    variables = {}
    for name in dict.fromkeys(n for m, _, _ in everyone for n in m):
        dtype, shape, layout, role = next(m[name] for m, _, _ in everyone if name in m)
        found = sorted(((s, p) for _, w, _ in everyone for s, p in w.get(name, [])), key=lambda sp: sp[0])
        expected = list(range(layout.num_shards if layout else 1))
        if [s for s, _ in found] != expected:
            raise CheckpointError(
                f"variable {name!r}: the processes wrote shards {[s for s, _ in found]}; expected each of {expected}"
            )
        variables[name] = VariableEntry(name, dtype, shape, layout, tuple(p for _, p in found), role)
    extras = [x for _, _, x in everyone]
    optimizers = {k: merge_infos([x["optimizers"][k] for x in extras], k) for k in extras[0].get("optimizers", {})}
    return Manifest(variables, {**extras[0], "optimizers": optimizers}, save_id)


def write(
    directory: Path,
    entries: list[Entry],
    extra: dict,
    progress: Progress | None,
    keep_spare: bool = True,
    coordinator: Coordinator | None = None,
) -> str:
    """Write ``entries`` as a new save in ``directory`` (each process its own shards), commit it, return its id."""
    coordinator = coordinator or Coordinator()
    single = coordinator.world == 1
    lock = DirectoryLock(directory, exclusive=True) if coordinator.rank == 0 else contextlib.nullcontext()
    error: BaseException | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock.__enter__()
    except (ShardvarError, OSError) as e:
        error = e if isinstance(e, ShardvarError) else CheckpointIOError(f"cannot save to {directory}: {e}")
        lock = contextlib.nullcontext()
    try:
        agree(coordinator, error)
        return _write_and_commit(directory, entries, extra, progress, keep_spare and single, coordinator)
    finally:
        lock.__exit__(None, None, None)


def _write_and_commit(
    directory: Path, entries: list[Entry], extra: dict, progress: Progress | None, keep_spare: bool, c: Coordinator
) -> str:
    save_id = c.common_save_id()
    error, written = None, {}
    try:
        tag = "" if c.world == 1 else f"r{c.rank:05d}-"
        written = _write_files(directory, entries, save_id, tag, progress, reuse=keep_spare)
    except Exception as e:  # every rank must reach the gather below, whatever failed here
        error = (
            e
            if isinstance(e, ShardvarError)
            else CheckpointIOError(
                f"saving to {directory} failed ({type(e).__name__}: {e}); the files it wrote were removed and the "
                "previous checkpoint is intact"
            )
        )
    meta = {e.name: (e.dtype, e.shape, e.layout, e.role) for e in entries}
    everyone = c.gather(None if error else (meta, written, extra))
    if error is not None:
        raise error
    failed = [r for r, x in enumerate(everyone) if x is None]
    if failed:
        raise CheckpointError(f"the save to {directory} failed on rank(s) {failed}; the previous checkpoint is intact")
    commit_error = None
    if c.rank == 0:
        try:
            _commit(directory, _manifest(everyone, save_id), save_id, keep_spare)
        except Exception as e:
            commit_error = (
                e
                if isinstance(e, ShardvarError)
                else CheckpointIOError(
                    f"committing the save to {directory} failed ({type(e).__name__}: {e}); the previous one is intact"
                )
            )
    agree(c, commit_error)  # every rank learns whether the save committed
    return save_id
