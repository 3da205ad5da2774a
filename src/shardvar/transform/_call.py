"""partitioned_call and StatefulPartitionedCall: run a function partitioned across devices.

Inputs are split into partitions (along an axis by a layout, or given already split), the
function runs on each partition on its device concurrently, and the outputs are aggregated.
A stateful call keeps per-partition tensors across calls and commits a call's new state only
when every partition succeeded, so a failure never leaves some partitions updated.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .._errors import ShardvarError, ShardvarTypeError, ShardvarValueError
from .._validate import check_choice, check_devices, check_int
from ..layout import Layout

__all__ = ["PartitionError", "partitioned_call", "StatefulPartitionedCall"]

Aggregate = str | Callable[[list[Any]], Any]
AGGREGATES = ("concat", "sum", "mean", "list")


class PartitionError(ShardvarError, RuntimeError):
    """The function failed on one or more partitions; the message names them."""


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _split(inputs: Any, axis: int | None, partitions: int, strategy: str) -> tuple[list[tuple], list[Layout]]:
    if axis is None:  # already split: one entry (a tensor or a tuple of tensors) per partition
        if not isinstance(inputs, Sequence) or not inputs:
            raise ShardvarTypeError(
                f"with axis=None, inputs must be a non-empty list with one entry per partition; got {inputs!r:.80}"
            )
        return [_as_tuple(x) for x in inputs], []
    tensors = _as_tuple(inputs)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ShardvarTypeError(f"inputs must be a tensor or a tuple of tensors to split along axis {axis}")
    sizes = {t.shape[axis] if t.dim() > axis else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        raise ShardvarValueError(
            f"every input must have the same size along axis {axis}; got shapes {[list(t.shape) for t in tensors]}"
        )
    layout = Layout.balanced(strategy, sizes.pop(), partitions, axis)
    split = [layout.split(t) for t in tensors]
    return [tuple(pieces[s] for pieces in split) for s in range(partitions)], [layout]


def _check_tout(outputs: list[tuple], tout: Sequence[torch.dtype] | None) -> None:
    if tout is None:
        return
    for p, outs in enumerate(outputs):
        if len(outs) != len(tout):
            raise ShardvarTypeError(f"partition {p} returned {len(outs)} outputs; Tout declares {len(tout)}")
        for i, (o, want) in enumerate(zip(outs, tout, strict=True)):
            if not isinstance(o, torch.Tensor) or o.dtype != want:
                got = o.dtype if isinstance(o, torch.Tensor) else type(o).__name__
                raise ShardvarTypeError(f"output {i} of partition {p} is {got}; Tout declares {want}")


def _check_aggregate(how: Any, tout: Any) -> Aggregate:
    """``aggregate`` and ``Tout`` checked before any partition runs."""
    if tout is not None and (
        isinstance(tout, (str, torch.dtype))
        or not isinstance(tout, Sequence)
        or not all(isinstance(d, torch.dtype) for d in tout)
    ):
        raise ShardvarTypeError(f"Tout must be a list of torch dtypes, one per output; got {tout!r:.80}")
    return how if callable(how) else check_choice(how, "aggregate", AGGREGATES)


def _shapes(outputs: list[tuple]) -> list[list]:
    return [[list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in o] for o in outputs]


def _check_combinable(outputs: list[tuple], how: str, layouts: list[Layout]) -> None:
    """The partitions' outputs can be combined by ``how`` output by output (checked before combining)."""
    if len({len(o) for o in outputs}) > 1:
        raise ShardvarValueError(
            f"the partitions returned different numbers of outputs {[len(o) for o in outputs]}; "
            f"aggregate={how!r} combines them output by output"
        )
    axis = layouts[0].axis if layouts else 0
    for i in range(len(outputs[0])):
        column = [o[i] for o in outputs]
        if not all(isinstance(t, torch.Tensor) for t in column):
            raise ShardvarTypeError(f"aggregate={how!r} needs tensors; got outputs {_shapes(outputs)} by partition")
        if how == "concat":
            rest = {(*t.shape[:axis], *t.shape[axis + 1 :]) if t.dim() > axis else None for t in column}
            fits, expected = None not in rest and len(rest) == 1, f"one shape except along axis {axis}"
        else:
            fits, expected = len({tuple(t.shape) for t in column}) == 1, "one shape"
        if not fits:
            raise ShardvarValueError(
                f"output {i} of the partitions cannot be combined with aggregate={how!r}: shapes "
                f"{[list(t.shape) for t in column]} by partition; expected {expected}"
            )


def _aggregate(outputs: list[tuple], how: Aggregate, layouts: list[Layout], device: torch.device) -> Any:
    if callable(how):
        try:
            return how([o if len(o) > 1 else o[0] for o in outputs])
        except Exception as e:  # the user's combiner: its failure, named with what it was given
            raise ShardvarValueError(
                f"aggregate {getattr(how, '__name__', how)!r} failed on the partitions' outputs "
                f"{_shapes(outputs)}: {type(e).__name__}: {e}"
            ) from e
    if how == "list":
        return [o if len(o) > 1 else o[0] for o in outputs]
    _check_combinable(outputs, how, layouts)
    results = []
    for i in range(len(outputs[0])):
        column = [o[i].to(device) for o in outputs]
        if how == "sum":
            results.append(torch.stack(column).sum(0))
        elif how == "mean":
            results.append(torch.stack(column).mean(0))
        else:
            results.append(layouts[0].join(column) if layouts else torch.cat(column))
    return results[0] if len(results) == 1 else tuple(results)


def _run(fn: Callable, parts: list[tuple], devices: list[torch.device], extra: list[Any] | None) -> list[Any]:
    def one(p: int) -> Any:
        args = tuple(x.to(devices[p]) if isinstance(x, torch.Tensor) else x for x in parts[p])
        return fn(*args, extra[p]) if extra is not None else fn(*args)

    with ThreadPoolExecutor(max_workers=min(len(parts), os.cpu_count() or 1)) as pool:
        futures = [pool.submit(one, p) for p in range(len(parts))]
    errors = [(p, f.exception()) for p, f in enumerate(futures) if f.exception() is not None]
    if errors:
        p, first = errors[0]
        which = ", ".join(f"{q} ({devices[q]})" for q, _ in errors)
        raise PartitionError(f"partition(s) {which} failed; partition {p}: {type(first).__name__}: {first}") from first
    return [f.result() for f in futures]


def _devices(
    devices: Sequence[Any] | None, partitions: int | None, inputs: Any, axis: int | None
) -> list[torch.device]:
    if partitions is not None:
        partitions = check_int(partitions, "num_partitions", minimum=1)
    if devices is not None:
        if isinstance(devices, Sequence) and not isinstance(devices, str) and not devices:
            raise ShardvarValueError(f"devices must be a non-empty list of devices; got {devices!r:.80}")
        devices = check_devices(devices)
    given = len(inputs) if axis is None and isinstance(inputs, Sequence) else 1  # bad inputs: refused by _split
    n = partitions or (len(devices) if devices else given)
    if devices is None:
        return [torch.device("cpu")] * n
    return [devices[p % len(devices)] for p in range(n)]


def partitioned_call(
    fn: Callable[..., Any],
    inputs: Any,
    *,
    axis: int | None = 0,
    num_partitions: int | None = None,
    devices: Sequence[torch.device | str] | None = None,
    partition_strategy: str = "div",
    aggregate: Aggregate = "concat",
    Tout: Sequence[torch.dtype] | None = None,
) -> Any:
    """Split ``inputs``, run ``fn`` on each partition on its device concurrently, aggregate.

    >>> partitioned_call(lambda x: x * 2, torch.arange(6.), num_partitions=3)
    tensor([ 0.,  2.,  4.,  6.,  8., 10.])
    >>> partitioned_call(lambda x: x.sum(0, keepdim=True), torch.ones(4, 2), num_partitions=2, aggregate="sum")
    tensor([[4., 4.]])
    """
    aggregate = _check_aggregate(aggregate, Tout)
    devs = _devices(devices, num_partitions, inputs, axis)
    parts, layouts = _split(inputs, axis, len(devs), partition_strategy)
    if len(parts) != len(devs):
        raise ShardvarValueError(f"{len(parts)} partitions of inputs but {len(devs)} devices")
    outputs = [_as_tuple(o) for o in _run(fn, parts, devs, None)]
    _check_tout(outputs, Tout)
    return _aggregate(outputs, aggregate, layouts, devs[0])


def _check_state(state: Any) -> None:
    if isinstance(state, Mapping) or not isinstance(state, Sequence) or not state:
        raise ShardvarValueError(f"state must be a non-empty list with one dict per partition; got {state!r:.80}")
    for p, partition in enumerate(state):
        if not isinstance(partition, Mapping):
            raise ShardvarTypeError(f"state of partition {p} must be a dict of name -> tensor; got {partition!r:.60}")
        for name, value in partition.items():
            if not isinstance(name, str) or not _STATE_NAME.match(name):
                raise ShardvarValueError(
                    f"state names must be letters, digits, '_', '-' or '.'; got {name!r} in partition {p}"
                )
            if not isinstance(value, torch.Tensor):
                raise ShardvarTypeError(f"state {name!r} of partition {p} must be a tensor; got {type(value).__name__}")


_STATE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class StatefulPartitionedCall:
    """A partitioned call whose partitions keep state (tensors on their devices) across calls.

    ``fn(*partition_inputs, state)`` gets a copy of its partition's state (a dict of tensors),
    may change it in place or return a new one as ``(outputs, new_state)``; new states are
    committed only if every partition succeeds.

    >>> counter = StatefulPartitionedCall(
    ...     lambda x, st: (x + st["total"], {"total": st["total"] + x.sum()}),
    ...     [{"total": torch.tensor(0.)}, {"total": torch.tensor(100.)}])
    >>> counter(torch.ones(4))
    tensor([  1.,   1., 101., 101.])
    >>> counter(torch.ones(4))
    tensor([  3.,   3., 103., 103.])
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        state: Sequence[Mapping[str, torch.Tensor]],
        *,
        devices: Sequence[torch.device | str] | None = None,
        axis: int | None = 0,
        partition_strategy: str = "div",
        aggregate: Aggregate = "concat",
        Tout: Sequence[torch.dtype] | None = None,
    ) -> None:
        _check_state(state)
        aggregate = _check_aggregate(aggregate, Tout)
        self.fn, self.axis, self.partition_strategy, self.aggregate, self.Tout = (
            fn,
            axis,
            partition_strategy,
            aggregate,
            Tout,
        )
        self.devices = _devices(devices, len(state), None, 0)
        # Own copies: partitions given the same tensor (``[state] * n``) must not alias each other.
        self.state = [{k: v.detach().to(self.devices[p], copy=True) for k, v in s.items()} for p, s in enumerate(state)]

    def __call__(self, inputs: Any) -> Any:
        parts, layouts = _split(inputs, self.axis, len(self.state), self.partition_strategy)
        copies = [{k: v.clone() for k, v in s.items()} for s in self.state]
        results = _run(self.fn, parts, self.devices, copies)
        outputs, new_states = [], []
        for p, r in enumerate(results):
            if isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], Mapping):
                outs, st = r
            else:
                outs, st = r, copies[p]
            outputs.append(_as_tuple(outs))
            new_states.append(dict(st))
        _check_tout(outputs, self.Tout)
        for p, st in enumerate(new_states):
            if set(st) != set(self.state[p]):
                raise ShardvarValueError(
                    f"partition {p} changed its state's names from {sorted(self.state[p])} to {sorted(st)}"
                )
        result = _aggregate(outputs, self.aggregate, layouts, self.devices[0])
        self.state = new_states  # every partition and the aggregation succeeded: commit all at once
        return result

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"partition{p}.{k}": v for p, s in enumerate(self.state) for k, v in s.items()}

    def save(self, path: str | os.PathLike) -> None:
        """Save every partition's state in the checkpoint format."""
        from ..checkpoint import save

        save(self.state_dict(), path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore every partition's state (checked first: all or nothing)."""
        from ..checkpoint import load

        load(self.state_dict(), path)
