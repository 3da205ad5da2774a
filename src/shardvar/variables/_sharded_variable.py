"""ShardedVariable: one logical variable made of shards, usable as a tensor.

The class holds the shards and the layout only; indexing, assignment, scatter updates and
lookups live in their own modules (``_indexing``, ``_update``, ``_lookup``). It is an ``nn.Module``
whose shards are its parameters (``shard_<i>``; plain tensors are buffers), so a variable assigned
as an attribute of a module is registered by torch's own ``__setattr__`` rule for submodules
(see ``_module`` for its logical state_dict key).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from .._deprecation import renamed
from .._errors import ShardvarDTypeError, ShardvarTypeError, ShardvarValueError
from .._validate import check_choice, check_device, check_has_values, normalise_axis
from ..layout import Layout
from . import _indexing, _torch_ops, _update, _values  # noqa: F401 (_torch_ops registers handlers)
from ._store import ShardStore
from ._tensor_methods import TensorMethods

__all__ = ["FORMS", "ShardedVariable"]

FORMS = ("logical", "sharded")  # state_dict forms of a sharded thing: one logical key, or one key per shard


def _check_shards(shards: object, axis: int) -> tuple[list[torch.Tensor], int]:
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards:
        raise ShardvarTypeError(f"shards must be a non-empty list of tensors; got {shards!r:.200}")
    for i, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise ShardvarTypeError(f"shards must be tensors; got {type(s).__name__} at position {i}")
    dtypes = [s.dtype for s in shards]
    if len(set(dtypes)) > 1:
        raise ShardvarDTypeError(f"all shards must have the same dtype; got {[str(d) for d in dtypes]}")
    ndims = {s.dim() for s in shards}
    if len(ndims) > 1 or 0 in ndims:
        raise ShardvarValueError(
            f"shards must have the same number (>= 1) of dimensions; got shapes {[list(s.shape) for s in shards]}"
        )
    axis = normalise_axis(axis, shards[0].dim())
    rest = {(*s.shape[:axis], *s.shape[axis + 1 :]) for s in shards}
    if len(rest) > 1:
        raise ShardvarValueError(
            f"shards must have the same shape except along axis {axis}; got {[list(s.shape) for s in shards]}"
        )
    return list(shards), axis


# What nn.Module.__init__ creates: built on first use (see ShardedVariable.__getattr__).
_MODULE_STATE = frozenset(vars(nn.Module()))


class ShardedVariable(TensorMethods, nn.Module):
    """A logical tensor stored as shards split along one axis by a layout.

    Shards on one device that share their memory with no other tensor are moved into one
    allocation (the tensor objects keep their identity and values), so lookups and scatter
    updates over them run as one kernel.

    >>> v = ShardedVariable([torch.arange(6.).reshape(3, 2), torch.arange(6., 10.).reshape(2, 2)])
    >>> v.shape, v.layout
    (torch.Size([5, 2]), Layout(strategy='div', sizes=(3, 2), axis=0))
    >>> v[1:4:2]
    tensor([[2., 3.],
            [6., 7.]])
    >>> (v + 1).sum()
    tensor(55.)

    As an attribute of a module it is one of its submodules, like any ``nn.Module``:
    ``parameters()``, ``.to()``, optimizers and ``state_dict()`` (one logical key) see its shards.
    """

    state_dict_form: str = "logical"  # as a module attribute: one key (the logical tensor) or one per shard

    @renamed(strategy="partition_strategy")
    def __init__(
        self, shards: Sequence[torch.Tensor], partition_strategy: str = "div", axis: int = 0, name: str | None = None
    ):
        shards, axis = _check_shards(shards, axis)
        layout = Layout(partition_strategy, tuple(s.shape[axis] for s in shards), axis)
        first = shards[0]
        shape = (*first.shape[:axis], layout.num_rows, *first.shape[axis + 1 :])
        self._store = ShardStore(layout, shape, dict(enumerate(shards)))
        self.name = name

    @classmethod
    def from_store(cls, store: ShardStore, name: str | None = None) -> ShardedVariable:
        """The variable over an existing store (its shards are shared, not copied)."""
        v = cls.__new__(cls)
        # Straight into __dict__: a new variable has no module state to register into yet, and
        # nn.Module.__setattr__ costs ~10x this whole call (views like module.weight are made often).
        v.__dict__["_shard_store"], v.__dict__["name"] = store, name
        return v

    # -- the nn.Module side ---------------------------------------------------------------------
    # Variables are made on hot paths (``module.weight``, parametrization forwards) and most never
    # meet torch's module machinery, so nn.Module's state (hook dicts, the shard registrations) is
    # built the first time something reads it, rather than ~70 us on every variable made.
    @property
    def _store(self) -> ShardStore:
        return self.__dict__["_shard_store"]

    @_store.setter
    def _store(self, store: ShardStore) -> None:
        self.__dict__["_shard_store"] = store
        if "_parameters" in self.__dict__:
            self._register_shards()

    def _register_shards(self) -> None:
        for table in (self._parameters, self._buffers):
            for key in [k for k in table if k.startswith("shard_")]:
                del table[key]
        store = self.__dict__.get("_shard_store")  # None while a subclass is still being built
        for s, t in (store.local_shards() if store is not None else {}).items():
            if isinstance(t, nn.Parameter):
                self.register_parameter(f"shard_{s}", t)
            else:
                self.register_buffer(f"shard_{s}", t)

    def __getattr__(self, name: str) -> Any:
        if name in _MODULE_STATE and "_parameters" not in self.__dict__:
            nn.Module.__init__(self)
            self._register_shards()
            return getattr(self, name)
        try:
            return nn.Module.__getattr__(self, name)  # a registered shard (``shard_0``)
        except AttributeError:
            return TensorMethods.__getattr__(self, name)

    def _registered(self) -> dict[int, torch.Tensor]:
        found = {**self._parameters, **self._buffers}
        return {int(k[6:]): t for k, t in found.items() if k.startswith("shard_") and t is not None}

    def _apply(self, fn: Any, recurse: bool = True) -> ShardedVariable:
        # module.to()/.double()/...: torch converts the registered shards (in place, or as new
        # tensors: buffers always, parameters under torch.__future__'s flags); the store follows.
        super()._apply(fn, recurse)
        store, shards = self._store, self._registered()
        if any(store.local_shards().get(s) is not t for s, t in shards.items()):
            store = self._store = store.with_shards(shards)
        store.refresh()
        return self

    def set_state_dict_form(self, form: str) -> None:
        """``"logical"`` (default: as a module attribute ``v``, one key, the whole tensor) or ``"sharded"``."""
        self.state_dict_form = check_choice(form, "form", FORMS)

    # -- what it is -----------------------------------------------------------------------------
    @property
    def store(self) -> ShardStore:
        """The shard store behind this variable (its slabs rebuilt if a shard's memory moved)."""
        return self._store.refresh()

    @property
    def layout(self) -> Layout:
        return self._store.layout

    @property
    def variables(self) -> list[torch.Tensor]:
        """The shard tensors held here, in shard order (the same objects, not copies)."""
        return list(self._store.local_shards().values())

    @property
    def shard_indices(self) -> list[int]:
        """The index of each shard held here, in the order of :attr:`variables`."""
        return list(self._store.local_shards())

    def local_shards(self) -> dict[int, torch.Tensor]:
        """The checkpoint protocol: the shards held by this process, by shard index.

        Code reading shards spells it ``dict(zip(v.shard_indices, v.variables))``; this method is
        what checkpoints, optimizer slots and quantized tables all implement (torch's ShardedTensor name).
        """
        return self._store.local_shards()

    @property
    def shape(self) -> torch.Size:
        return self._store.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._store.dtype

    @property
    def device(self) -> torch.device:
        """The first shard's device, where materialised results go."""
        return self._store.groups[0].device if self._store.groups else torch.device("cpu")

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.variables]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def requires_grad(self) -> bool:
        return any(s.requires_grad for s in self.variables)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        devices = sorted({str(d) for d in self.devices})
        name = f"name={self.name!r}, " if self.name else ""
        return (
            f"{type(self).__name__}({name}shape={list(self.shape)}, dtype={self.dtype}, "
            f"layout={self.layout}, devices={devices})"
        )

    # -- materialising --------------------------------------------------------------------------
    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole logical tensor, a new one (differentiable with respect to the shards)."""
        device = None if device is None else check_device(device)
        whole = _values.materialise(self.store)
        return whole if device is None else whole.to(device)

    read_value = to_tensor

    def logical(self, copy: bool = True) -> torch.Tensor:
        """The logical tensor; with ``copy=False`` a view of the shards where the layout allows one.

        A div variable whose shards are one slab is already the table: no copy is made, and
        writes to the result write the shards. Otherwise (mod, several slabs) it is a new tensor.
        """
        return _values.materialise(self.store, copy=copy)

    def _concrete(self) -> torch.Tensor:
        """The logical tensor, for Python and numpy values (a meta variable has none)."""
        return check_has_values(self.to_tensor(), f"{type(self).__name__} {self.name or ''}".rstrip())

    def numpy(self) -> np.ndarray:
        return self._concrete().detach().cpu().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    # -- acting as a tensor ---------------------------------------------------------------------
    def __bool__(self) -> bool:
        return bool(self._concrete())

    def __float__(self) -> float:
        return float(self._concrete())

    def __int__(self) -> int:
        return int(self._concrete())

    __hash__ = object.__hash__

    def __getitem__(self, key: Any) -> torch.Tensor:
        return _indexing.getitem(self.store, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _indexing.setitem(self.store, key, value)

    # -- writes and sparse reads ----------------------------------------------------------------
    def assign(self, value: Any) -> ShardedVariable:
        """Overwrite the whole variable with ``value`` (broadcast to its shape)."""
        _update.assign(self.store, value, "assign")
        return self

    def assign_add(self, value: Any) -> ShardedVariable:
        _update.assign(self.store, value, "assign_add")
        return self

    def assign_sub(self, value: Any) -> ShardedVariable:
        _update.assign(self.store, value, "assign_sub")
        return self

    def sparse_read(self, indices: Any) -> torch.Tensor:
        """Rows ``indices`` (any shape), in the order asked: shape ``indices.shape + row_shape``."""
        return _update.sparse_read(self.store, indices)

    def scatter_update(self, indices: Any, updates: Any) -> ShardedVariable:
        """Overwrite rows ``indices`` with ``updates``; for a duplicated id the last update wins."""
        _update.scatter(self.store, "scatter_update", indices, updates)
        return self

    def batch_scatter_update(self, indices: Any, updates: Any) -> ShardedVariable:
        """``scatter_update`` with optional batch dimensions before the sharded axis."""
        _update.batch_scatter_update(self.store, indices, updates)
        return self


def _scatter_method(op: str, doc: str):
    def method(self: ShardedVariable, indices: Any, updates: Any) -> ShardedVariable:
        _update.scatter(self.store, op, indices, updates)
        return self

    method.__name__ = method.__qualname__ = op
    method.__doc__ = doc
    return method


for _op, _doc in {
    "scatter_add": "Add ``updates`` to rows ``indices`` (duplicates accumulate).",
    "scatter_sub": "Subtract ``updates`` from rows ``indices`` (duplicates accumulate).",
    "scatter_mul": "Multiply rows ``indices`` by ``updates`` (duplicates multiply).",
    "scatter_div": "Divide rows ``indices`` by ``updates`` (duplicates divide by each; integers by zero raise).",
    "scatter_min": "Rows ``indices`` become the minimum of themselves and ``updates``.",
    "scatter_max": "Rows ``indices`` become the maximum of themselves and ``updates``.",
}.items():
    setattr(ShardedVariable, _op, _scatter_method(_op, _doc))
