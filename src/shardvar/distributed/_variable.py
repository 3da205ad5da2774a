"""DistributedShardedVariable: a ShardedVariable whose shards are owned by the ranks of a group.

It is the local variable with a communicator: its store holds this rank's shards (consecutive
pieces of one local slab, filled with the values the same initializer gives a single process)
and an :class:`Exchange` that fetches the others' rows. Every rank creates it with the same
shape, layout and placement (checked collectively, before anything is allocated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._errors import ShardvarDistributedError, ShardvarValueError
from .._validate import check_int_sequence, check_shape
from ..layout import Layout
from ..variables import RowInitializer, ShardedVariable, ShardStore, functional, to_layout
from ._comm import DEFAULT_TIMEOUT, Comm
from ._exchange import Exchange

__all__ = ["DistributedShardedVariable", "distributed_store", "round_robin"]


def round_robin(num_shards: int, world: int) -> tuple[int, ...]:
    """Shard s on rank s % world."""
    return tuple(s % world for s in range(num_shards))


def _placement(placement: Sequence[int] | None, layout: Layout, world: int) -> tuple[int, ...]:
    n = layout.num_shards
    if placement is None:
        return round_robin(n, world)
    ranks = check_int_sequence(placement, "placement", 0)
    if len(ranks) != n or any(r >= world for r in ranks):
        raise ShardvarValueError(
            f"placement must give a rank in [0, {world}) for each of the {n} shards; got {list(placement)}"
        )
    return ranks


def _values_problem(values: Any, shape: torch.Size) -> str | None:
    """What is wrong with the initial ``values`` a rank was given (None: nothing, or none given)."""
    if values is None:
        return None
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        got = f"{values.dtype} tensor" if isinstance(values, torch.Tensor) else type(values).__name__
        return f"the initial values must be a floating point tensor; got {got}"
    if values.shape != shape:
        return f"the initial values have shape {list(values.shape)}; expected {list(shape)}"
    return None


def _agree(
    comm: Comm, shape: torch.Size, dtype: torch.dtype, layout: Layout, placement: tuple, name: Any, values: Any
) -> None:
    problem = _values_problem(values, shape)
    mine = (tuple(shape), str(dtype), layout, placement, values is not None, problem)
    everyone = comm.all_gather_object(mine, "the variable's shape, dtype, layout, placement and initial values")
    refused = [(r, o[5]) for r, o in enumerate(everyone) if o[5] is not None]
    if refused:  # every rank raises it, so none goes on alone into the lookups' collectives
        rank, why = refused[0]
        raise ShardvarValueError(f"distributed variable {name or ''!s}: on rank {rank}, {why}")
    if any(other != mine for other in everyone):
        described = "; ".join(
            f"rank {r}: shape {list(o[0])} {o[1]} {o[2]} placement {list(o[3])}"
            + ("" if o[4] else ", no initial values")
            for r, o in enumerate(everyone)
        )
        raise ShardvarDistributedError(f"ranks disagree about distributed variable {name or ''!s}: {described}")


def distributed_store(
    shape: Sequence[int],
    partitioner: Any = None,
    *,
    partition_strategy: str = "div",
    dtype: torch.dtype = torch.float32,
    initializer: RowInitializer | None = None,
    placement: Sequence[int] | None = None,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    requires_grad: bool = True,
    name: str | None = None,
    held: bool = True,
    values: torch.Tensor | None = None,
) -> ShardStore:
    """This rank's shards of a variable spread over ``group``, with the exchange for the rest. Collective.

    ``values``: the whole logical variable (the same on every rank), whose owned shards this rank
    keeps, in place of the ``initializer``'s rows (a module's ``_weight``, ``from_pretrained``).

    ``held=False``: no shard in RAM here (a tiered table's rank keeps its own in a file, and its
    exchange serves them from there); the store then holds the layout and the exchange only.
    """
    comm = Comm(group, timeout)
    shape = torch.Size(check_shape(shape))
    layout = to_layout(comm.world if partitioner is None else partitioner, shape, dtype, partition_strategy)
    if layout.axis != 0:
        raise ShardvarValueError(f"distributed variables are split by rows (axis 0); got {layout}")
    ranks = _placement(placement, layout, comm.world)
    _agree(comm, shape, dtype, layout, ranks, name, values)
    init = initializer or RowInitializer()
    row_shape = tuple(shape[1:])
    parts = None if values is None else layout.split(values.detach().to(dtype))
    store = ShardStore.allocate(
        layout,
        shape,
        dtype,
        devices=[comm.device] * layout.num_shards,
        owned=[s for s in range(layout.num_shards) if ranks[s] == comm.rank and held],
        values=lambda s: init.rows(layout.shard_ids(s), row_shape, dtype) if parts is None else parts[s],
        requires_grad=requires_grad,
    )
    return store.attach(exchange=Exchange(comm, ranks, requires_grad))


class DistributedShardedVariable(ShardedVariable):
    """Shards of one logical ``[rows, ...]`` variable spread over the ranks of a process group.

    Create it on every rank with the same arguments (a collective call). Lookups (``lookup``,
    ``v[ids]``, ``sparse_read``, ``to_tensor``) are collective: every rank calls them.
    """

    def __init__(self, shape: Sequence[int], partitioner: Any = None, *, name: str | None = None, **kwargs: Any):
        self._store = distributed_store(shape, partitioner, name=name, **kwargs)
        self.name = name

    @property
    def comm(self) -> Comm:
        return self._store.exchange.comm

    @property
    def placement(self) -> tuple[int, ...]:
        return self._store.exchange.placement

    @property
    def owned(self) -> list[int]:
        """The shard indices this rank holds."""
        return sorted(self._store.local_shards())

    @property
    def local_bytes(self) -> int:
        return self._store.nbytes

    def lookup(self, ids: Any) -> torch.Tensor:
        """Rows ``ids`` (any shape): shape ``ids.shape + row_shape``. Collective: every rank calls it."""
        return functional.gather(self.store, ids)

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole logical value on every rank (collective; for inspection and tests)."""
        with torch.no_grad():
            return super().to_tensor(device).detach()

    def __repr__(self) -> str:
        return (
            f"DistributedShardedVariable(shape={list(self.shape)}, dtype={self.dtype}, layout={self.layout}, "
            f"rank={self.comm.rank}/{self.comm.world}, owned={self.owned})"
        )
