"""``convert``: a TensorFlow checkpoint into a shardvar checkpoint, streamed in one pass per table.

Each table is read once, in order, in 8 MiB chunks a thread reads ahead while the checkpoint
writer writes the previous ones into every target shard at its offset (``_stream``): memory
stays at a few chunk buffers, never a shard or a table, in div and mod layouts alike. Everything
is checked before ``out`` is touched; a checksum that fails while writing removes what was
written, and a directory the conversion created, like a failed ``save``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._deprecation import renamed
from .._errors import CheckpointError
from .._validate import check_bool, check_int
from ..checkpoint import MANIFEST, Entry, OptimizerRecord, Progress, check_dtypes, slot_name, write
from ..layout import Layout, get_strategy
from ..variables import to_layout
from ._bundle import DTYPES
from ._graph import GRAPH_KEY, short_name
from ._reader import TFCheckpoint, TFVariable
from ._slots import STEP_NAMES, TorchOptimizer, optimizer_spec
from ._stream import stream_rows, streams

__all__ = ["Conversion", "convert"]

NameMap = Mapping[str, str] | Callable[[str], "str | None"] | None


@dataclass
class Conversion:
    """What ``convert`` wrote: TensorFlow name -> shardvar name, for variables and for slots, and what it left."""

    variables: dict[str, str] = field(default_factory=dict)
    slots: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # TensorFlow name -> why it was not converted


def _targets(reader: TFCheckpoint, mapping: NameMap, slot_keys: set[str], result: Conversion) -> dict[str, str]:
    """TensorFlow key -> shardvar name of every variable to convert (slots go with their variables)."""
    chosen: dict[str, str] = {}
    if isinstance(mapping, Mapping):
        for name, target in mapping.items():
            chosen[reader.variable(name).name] = target  # an unknown name raises here, naming close ones
    elif mapping is not None and not callable(mapping):
        raise CheckpointError(f"mapping must be a dict or a callable of TF name -> shardvar name; got {mapping!r:.80}")
    for key, v in sorted(reader.variables.items()):
        if key in chosen or key == GRAPH_KEY or key in slot_keys:
            continue
        target = mapping(short_name(key)) if callable(mapping) else None if mapping is not None else short_name(key)
        if target is None:
            result.skipped[key] = "not in the mapping"
        elif v.dtype_code not in DTYPES:
            result.skipped[key] = f"a {v.dtype_name} variable: not a tensor of numbers"
        else:
            chosen[key] = target
    seen: dict[str, str] = {}
    for key, target in chosen.items():
        if not isinstance(target, str) or not target or target.startswith("#"):
            raise CheckpointError(f"the mapping gives {key!r} the name {target!r}; expected a non-empty name")
        if target in seen:
            raise CheckpointError(f"the mapping names both {seen[target]!r} and {key!r} {target!r}")
        seen[target] = key
    return chosen


def _layout(
    reader: TFCheckpoint, v: TFVariable, name: str, partitioner: Any | Mapping[str, Any], strategy: Any
) -> Layout | None:
    if not v.shape:
        return None
    spec = partitioner.get(name, 1) if isinstance(partitioner, Mapping) else partitioner
    s = strategy.get(name, "div") if isinstance(strategy, Mapping) else strategy
    get_strategy(s)  # an unknown strategy named as such, whatever the partitioner
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = check_int(spec, f"partitioner of {name!r} (a shard count)", minimum=1)
    layout = to_layout(spec, v.shape, reader.dtype(v), s)
    if layout.axis != 0:
        raise CheckpointError(f"{name!r} would be split along axis {layout.axis}; tables convert by rows (axis 0)")
    return layout


def _entry(reader: TFCheckpoint, v: TFVariable, name: str, layout: Layout | None) -> Entry:
    reader.check(v)  # coverage, extents and dtype, before anything is written
    dtype = reader.dtype(v)
    if layout is None:
        return Entry(name, dtype, (), None, {0: ()}, lambda s: _verified(reader, v, reader.read_rows(v, 0, 1)))
    last = layout.num_shards - 1

    def produce(shard: int) -> torch.Tensor:
        start, step, count = layout.shard_progression(shard)
        rows = reader.read_rows(v, start, start + step * count, step)
        return _verified(reader, v, rows) if shard == last else rows

    shapes = dict(enumerate(layout.shard_shapes(v.shape)))
    stream = (lambda: stream_rows(reader, v, layout)) if streams(layout) and all(v.shape[1:]) else None  # rows of bytes
    return Entry(name, dtype, v.shape, layout, shapes, produce, stream=stream)


def _verified(reader: TFCheckpoint, v: TFVariable, rows: torch.Tensor) -> torch.Tensor:
    reader.verify(v)  # the last shard: every byte of v has passed its crc32c before the commit
    return rows


def _step(reader: TFCheckpoint, optimizers: set[str], step: int | None) -> int:
    if step is not None:
        return check_int(step, "step", minimum=0)
    for pattern in STEP_NAMES:
        for opt in sorted(optimizers) or [""]:
            name = pattern.format(optimizer=opt)
            with contextlib.suppress(CheckpointError):
                value = reader.load(name)
                if value.dim() == 0 and not value.is_floating_point():
                    return int(value)
    raise CheckpointError(
        f"{reader.prefix} records no step count (no optimizer 'iter', no 'global_step'); pass step=N to convert"
    )


def _slot_entries(
    reader: TFCheckpoint, spec: TorchOptimizer, key: str, chosen: dict[str, str], layouts: dict, result: Conversion
) -> tuple[list[Entry], dict]:
    entries = []
    record = OptimizerRecord(spec.class_name, [{"params": sorted(chosen.values())}])
    for slot in reader.slots():
        state = spec.states.get(slot.name)
        if slot.variable not in chosen:
            result.skipped[slot.key] = "a slot of a variable not converted"
        elif state is None:
            result.skipped[slot.key] = f"slot {slot.name!r} has no {spec.cls.__name__} state of the same meaning"
        else:
            target = chosen[slot.variable]
            name = slot_name(key, target, state)
            if name in result.slots.values():
                raise CheckpointError(
                    f"two optimizers' slots of {slot.variable!r} would both be {name!r} ({slot.key!r} and another); "
                    "map the variable into one optimizer at a time"
                )
            entries.append(_entry(reader, reader.variables[slot.key], name, layouts[target]))
            record.add(target, state)
            result.slots[slot.key] = name
    optimizers = {s.optimizer for s in reader.slots() if s.key in result.slots}
    if spec.counts_steps and record.slots:
        result.step = _step(reader, optimizers, result.step)
        tensor = torch.tensor(float(result.step))
        for target in list(record.slots):
            entries.append(
                Entry(slot_name(key, target, "step"), torch.float32, (), None, {0: ()}, lambda s: tensor, True)
            )
            record.add(target, "step")
    return entries, record.to_json()


@renamed(num_shards="partitioner", strategy="partition_strategy")
def convert(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    mapping: NameMap = None,
    *,
    partitioner: Any | Mapping[str, Any] = 1,
    partition_strategy: str | Mapping[str, str] = "div",
    optimizer: str | None = None,
    optimizer_key: str = "opt",
    step: int | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Conversion:
    """Write TensorFlow checkpoint ``ckpt`` as a shardvar checkpoint at ``out``, without TensorFlow.

    ``mapping`` (TF name -> shardvar name, as a dict of the variables to take, or a callable of
    each short name returning a name or None to skip; default: every numeric variable under its
    short name) names the variables as ``shardvar.load`` will look them up, e.g.
    ``{"emb": "model/weight"}`` for ``load({"model": ShardedEmbedding(...)}, out)``. Each table is
    split by ``partitioner`` (a shard count or a partitioner, as the modules' ``partitioner=``) in
    ``partition_strategy`` (each one value, or a dict by shardvar name).
    ``optimizer="adam" | "adagrad" | "momentum"`` also writes the variables' slots as the state of
    ``torch.optim.Adam`` / ``Adagrad`` / ``SGD(momentum=...)`` under ``optimizer_key`` with the step
    count (``step``, else the checkpoint's ``iter`` or ``global_step``). Returns what was written
    and, in ``skipped``, everything that was not and why.

    >>> import tempfile, shardvar.tf
    >>> done = shardvar.tf.convert("tests/data/tf/saver_v1", tempfile.mkdtemp(), {"emb": "emb"}, partitioner=2)
    >>> done.variables
    {'emb': 'emb'}
    """
    check_bool(overwrite, "overwrite")
    directory = Path(out)
    if (directory / MANIFEST).exists() and not overwrite:
        raise CheckpointError(f"{directory} already holds a checkpoint; pass overwrite=True (--force) to replace it")
    reader = TFCheckpoint(ckpt)
    result = Conversion(step=step)
    slot_keys = {s.key for s in reader.slots()}
    chosen = _targets(reader, mapping, slot_keys, result)
    for per_table in (partitioner, partition_strategy):
        unknown = sorted(set(per_table) - set(chosen.values())) if isinstance(per_table, Mapping) else []
        if unknown:
            raise CheckpointError(f"layouts are given for {unknown}, which the mapping does not produce")
    layouts = {t: _layout(reader, reader.variables[k], t, partitioner, partition_strategy) for k, t in chosen.items()}
    entries = [_entry(reader, reader.variables[k], t, layouts[t]) for k, t in chosen.items()]
    extra: dict = {"optimizers": {}}
    if optimizer is not None:
        spec = optimizer_spec(optimizer)
        if not isinstance(optimizer_key, str) or not optimizer_key or "/" in optimizer_key:
            raise CheckpointError(f"optimizer_key must be a name without '/'; got {optimizer_key!r}")
        more, extra["optimizers"][optimizer_key] = _slot_entries(reader, spec, optimizer_key, chosen, layouts, result)
        entries += more
    else:
        result.skipped.update({k: "an optimizer slot (pass optimizer= to convert it)" for k in sorted(slot_keys)})
    check_dtypes(entries)
    result.variables = dict(chosen)
    _write(directory, entries, extra, progress)
    return result


def _write(directory: Path, entries: list[Entry], extra: dict, progress: Progress | None) -> None:
    created = not directory.exists()
    try:
        write(directory, entries, extra, progress)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty, as a failed write leaves it
        raise
