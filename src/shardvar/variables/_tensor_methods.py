"""The tensor methods and operators of a ShardedVariable: what people type on a variable.

Reads (``.to``, ``.cpu``, ``.float``, ``.T``, ``.tolist``, ``.clone``...) give plain tensors of
the logical value. Writes (``.copy_``, ``.fill_``, ``.normal_``, ``v += 1``...) write through to
every shard or raise: nothing acts on a hidden copy. Operators go through ``__torch_function__``,
so they run shard by shard where they can.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from .._pages import zeros_like
from .._validate import check_device, check_has_values
from ._distinct import sparse_rows
from ._spread import local
from ._torch_function import inplace, torch_function
from ._update import check_writable
from ._values import check_local

__all__ = ["TensorMethods"]

_T = torch.Tensor
# Deterministic elementwise writes with plain-number arguments run on each shard in place.
_SHARD_LOCAL = {"zero_", "fill_", "add_", "sub_", "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_"}
_INPLACE = [
    "add_", "sub_", "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_", "zero_", "fill_", "copy_", "normal_",
    "uniform_", "exponential_", "random_", "bernoulli_", "cauchy_", "log_normal_", "geometric_", "erfinv_", "exp_",
    "log_", "sqrt_", "abs_", "neg_", "pow_", "masked_fill_", "index_fill_", "addcmul_", "addcdiv_", "lerp_",
    "sign_", "round_", "floor_", "ceil_", "trunc_", "sigmoid_", "tanh_", "relu_", "renorm_", "fmod_",
    "remainder_", "nan_to_num_", "square_", "reciprocal_", "log1p_", "expm1_",
]  # fmt: skip
_OPERATORS = [
    "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod", "rmod",
    "pow", "rpow", "matmul", "rmatmul", "and", "rand", "or", "ror", "xor", "rxor", "eq", "ne", "lt", "le", "gt",
    "ge", "neg", "pos", "abs", "invert",
]  # fmt: skip
_AUGMENTED = {"iadd": "add_", "isub": "sub_", "imul": "mul_", "itruediv": "div_", "ipow": "pow_"}
_READS = ["sum", "mean", "amax", "amin", "max", "min", "norm", "matmul", "mm", "abs", "exp", "sqrt", "sigmoid"]


def _numbers(args: tuple, kwargs: dict) -> bool:
    return all(isinstance(a, (int, float, bool)) for a in (*args, *kwargs.values()))


def _inplace_method(name: str):
    method = getattr(_T, name)

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                check_has_values(a, f"the argument of {name}")  # a meta value has nothing to write
        if name in _SHARD_LOCAL and _numbers(args, kwargs):
            shards = check_local(self.store, name)
            check_writable(shards)
            try:
                with torch.no_grad():
                    for t in shards:  # same dtype and shape rules on every shard: fails on the first or none
                        method(t, *args, **kwargs)
            except (RuntimeError, TypeError) as e:
                raise ShardvarValueError(f"{name} failed on the variable ({e}); nothing was written") from e
            return self
        return inplace(method, (self, *args), kwargs)

    apply.__name__ = apply.__qualname__ = name
    apply.__doc__ = f"``Tensor.{name}`` written through to every shard (all or none)."
    return apply


class TensorMethods:
    """Mixin: tensor methods over ``self.store`` and ``self.to_tensor()``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return torch_function(func, args, kwargs)

    # -- reads: plain tensors of the logical value ----------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = args[0] if args else None
        if first is not None and not isinstance(first, (str, torch.device, torch.dtype, torch.Tensor, int)):
            raise ShardvarTypeError(f".to() takes a device, dtype or tensor; got {first!r:.60}")
        device = kwargs.get("device", first if isinstance(first, (str, torch.device)) else None)
        if device is not None:
            check_device(device)  # "nonsense" or "cuda:9": shardvar's error before anything is read
        try:
            return self.to_tensor().to(*args, **kwargs)
        except TypeError as e:
            raise ShardvarTypeError(
                f".to() takes a device, dtype or tensor; got {args!r:.60}, {kwargs!r:.60} ({e})"
            ) from None

    def cpu(self) -> torch.Tensor:
        return self.to_tensor().cpu()

    def cuda(self, device: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        check_device(torch.device("cuda", device) if isinstance(device, int) else device or "cuda")
        return self.to_tensor().cuda(device, *args, **kwargs)

    def float(self) -> torch.Tensor:
        return self.to_tensor().float()

    def double(self) -> torch.Tensor:
        return self.to_tensor().double()

    def half(self) -> torch.Tensor:
        return self.to_tensor().half()

    # As Tensor's, not nn.Module's (a ShardedVariable is also a module): these read, never convert.
    def bfloat16(self) -> torch.Tensor:
        return self.to_tensor().bfloat16()

    def type(self, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        return self.variables[0].type() if dtype is None else self.to_tensor().type(dtype, *args, **kwargs)

    def detach(self) -> torch.Tensor:
        return self.logical(copy=False).detach()

    def clone(self) -> torch.Tensor:
        return self.to_tensor()

    def tolist(self) -> Any:
        return self._concrete().tolist()

    def new(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.variables[0].detach().new(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Factories (new_empty, new_zeros, ...) depend only on dtype and device: any shard makes them.
        if name.startswith("new_") and hasattr(torch.Tensor, name):
            return getattr(self.variables[0].detach(), name)
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}; for the logical tensor use .to_tensor()"
        )

    @property
    def T(self) -> torch.Tensor:
        return self.to_tensor().T

    @property
    def mT(self) -> torch.Tensor:
        return self.to_tensor().mT

    def view_as(self, other: torch.Tensor) -> Any:
        if tuple(other.shape) == tuple(self.shape):
            return self  # a write through the "view" still reaches every shard
        raise ShardvarTypeError(
            f"a ShardedVariable of shape {list(self.shape)} cannot be viewed as shape {list(other.shape)}; "
            "use to_tensor() for a tensor to reshape"
        )

    @property
    def data(self) -> Any:
        """The variable itself: ``v.data.normal_()`` writes through, as on a tensor's ``.data``."""
        return self

    @data.setter
    def data(self, value: Any) -> None:
        # ``emb.weight.data = w`` overwrites the table (every shard, or none when w does not fit).
        self.assign(value)

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        for t in self.variables:
            t.requires_grad_(requires_grad)
        return self

    @property
    def grad(self) -> torch.Tensor | None:
        """The logical gradient (joined from the shards' dense or sparse gradients); None if no shard has one."""
        store = self.store
        grads = {s: t.grad for s, t in store.local_shards().items()}
        if not local(store) or all(g is None for g in grads.values()):
            return None
        if any(g is not None and g.is_sparse for g in grads.values()):
            index, values = [], []
            for s, g in grads.items():
                if g is not None:
                    g = g.to_sparse() if not g.is_sparse else g.coalesce()
                    index.append(store.layout.global_ids(torch.full_like(g.indices()[0], s), g.indices()[0]))
                    values.append(g.values())
            return sparse_rows(torch.cat(index), torch.cat(values), store.shape[0])
        parts = [g if g is not None else zeros_like(store.local_shards()[s]) for s, g in grads.items()]
        return store.layout.join(parts)

    # -- sizes and iteration, as for a tensor ----------------------------------------------------
    def ndimension(self) -> int:
        return len(self.shape)

    def nelement(self) -> int:
        return self.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.dtype.is_complex

    @property
    def is_sparse(self) -> bool:
        return False

    @property
    def is_meta(self) -> bool:
        return any(t.is_meta for t in self.variables)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def layout_type(self) -> torch.layout:
        """torch's ``Tensor.layout`` (strided); ``layout`` is the shard layout."""
        return torch.strided

    def __len__(self) -> int:
        """The number of rows along dim 0, as for a tensor (the shards are ``.variables``)."""
        return self.shape[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.to_tensor())

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """The logical tensor by DLPack: ``torch.as_tensor(v)`` and ``torch.tensor(v)`` give it."""
        return self.logical(copy=False).detach().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.logical(copy=False).detach().__dlpack_device__()


for _name in _INPLACE:
    setattr(TensorMethods, _name, _inplace_method(_name))
for _name in _OPERATORS:
    setattr(
        TensorMethods,
        f"__{_name}__",
        (lambda m: lambda self, *other: torch_function(m, (self, *other), {}))(getattr(_T, f"__{_name}__")),
    )
for _name, _method in _AUGMENTED.items():
    setattr(TensorMethods, f"__{_name}__", getattr(TensorMethods, _method))
for _name in _READS:
    setattr(
        TensorMethods,
        _name,
        (lambda m: lambda self, *args, **kwargs: torch_function(m, (self, *args), kwargs))(getattr(_T, _name)),
    )
