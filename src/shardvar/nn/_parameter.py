"""Any parameter of any module stored as shards: ``shard_parameter`` and ``sharded_parameters``.

The parameter becomes a ``torch.nn.utils.parametrize`` parametrization whose originals are the
shard Parameters themselves (one slab per device, from a :class:`ShardStore`), so autograd and
optimizers see the shards while ``module.<name>`` is the logical tensor: with one slab in
logical order (div along axis 0, or every mod shard on one device) a view of the slab whose
gradient lands in the shards, otherwise one copy per forward. Passing a ShardedVariable as the
layout ties the parameter to that variable's shard Parameters (one set of shards, many users).
``state_dict()`` speaks the unsharded module's keys, in its order (see ``_state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_choice
from ..layout import Layout
from ..variables import ShardedVariable, ShardStore, attribute_variables, to_layout
from ._state_dict import FORMS, register_logical_hooks

__all__ = ["ShardsParametrization", "shard_parameter", "sharded_parameters", "set_state_dict_form"]


class ShardsParametrization(nn.Module):
    """The logical tensor from its shards (forward); assigning a tensor writes into the shards."""

    def __init__(self, layout: Layout, store: ShardStore | None = None) -> None:
        super().__init__()
        self.layout = layout
        self.store = store
        self._adopting = False  # registering: the shards already hold the values

    def forward(self, *shards: torch.Tensor) -> torch.Tensor:
        store = self.store
        if store is not None and all(a is b for a, b in zip(shards, store.local_shards().values(), strict=True)):
            return ShardedVariable.from_store(store).logical(copy=False)
        return self.layout.join(shards)  # other tensors stand in for the shards (torch.func.functional_call)

    def right_inverse(self, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.store is None:
            return tuple(part.clone() for part in self.layout.split(value))
        if not self._adopting:
            ShardedVariable.from_store(self.store).assign(value)  # checked before any shard is written
        return tuple(self.store.local_shards().values())  # parametrize then sets each shard to itself

    def extra_repr(self) -> str:
        return f"layout={self.layout}"


@dataclass
class _Owner:
    """What a module with sharded parameters keeps: its unsharded state_dict order and its form."""

    order: list[str]
    form: str = "logical"


def _variable(module: nn.Module, name: str) -> ShardedVariable:
    plist = module.parametrizations[name]
    par: ShardsParametrization = plist[0]
    originals = {s: getattr(plist, f"original{s}") for s in range(par.layout.num_shards)}
    if any(par.store.local_shards()[s] is not t for s, t in originals.items()):
        par.store = ShardStore(par.layout, par.store.shape, originals)  # a shard Parameter was replaced
    return ShardedVariable.from_store(par.store, name=name)


def _own(module: nn.Module) -> dict[str, ShardedVariable]:
    plists = getattr(module, "parametrizations", None) or {}
    return {n: _variable(module, n) for n, p in plists.items() if isinstance(p[0], ShardsParametrization)}


def _check_target(module: Any, name: Any) -> torch.Tensor:
    if not isinstance(module, nn.Module):
        raise ShardvarTypeError(f"module must be an nn.Module; got {type(module).__name__}")
    if not isinstance(name, str) or "." in name:
        raise ShardvarValueError(
            f"name must be a parameter of the module itself, without dots; got {name!r} "
            "(pass the submodule that owns it)"
        )
    if parametrize.is_parametrized(module, name):
        raise ShardvarValueError(f"{type(module).__name__}.{name} is already partitioned (parametrized)")
    param = module._parameters.get(name)
    if not isinstance(param, nn.Parameter):
        raise ShardvarValueError(
            f"{type(module).__name__} has no parameter {name!r}; expected one of {sorted(module._parameters)}"
        )
    if param.dim() == 0:
        raise ShardvarValueError(f"{type(module).__name__}.{name} is 0-d: a 0-d parameter cannot be partitioned")
    return param


def _tied_store(variable: ShardedVariable, param: torch.Tensor, what: str) -> ShardStore:
    store = variable.store
    if tuple(store.shape) != tuple(param.shape) or store.dtype != param.dtype:
        raise ShardvarValueError(
            f"cannot tie {what} of shape {list(param.shape)} and dtype {param.dtype} to a variable of shape "
            f"{list(store.shape)} and dtype {store.dtype}"
        )
    if not store.is_complete:
        raise ShardvarValueError(f"cannot tie {what} to a distributed variable (it holds only this rank's shards)")
    for s, t in store.local_shards().items():
        if not isinstance(t, nn.Parameter):
            raise ShardvarTypeError(f"shard {s} of the variable tied to {what} is not an nn.Parameter")
    return store


def _register_placeholder(module: nn.Module, name: str, variable: ShardedVariable) -> None:
    """A new name for a variable's shards: a shape-only (meta) parameter that the shards replace at once."""
    if name in module._parameters or "." in name or not name.isidentifier():
        return  # an existing parameter (tied to the variable) or a bad name (refused by _check_target)
    if hasattr(module, name):
        raise ShardvarValueError(f"{type(module).__name__} already has an attribute {name!r} that is not a parameter")
    shards = variable.store.local_shards().values()
    if not all(isinstance(t, nn.Parameter) for t in shards):
        raise ShardvarTypeError(
            f"the shards of the variable registered as {type(module).__name__}.{name} must be nn.Parameters; build "
            "it from Parameters, or call shard_parameter on an existing parameter of the module"
        )
    grad = any(t.requires_grad for t in shards)
    meta = torch.empty(tuple(variable.shape), dtype=variable.dtype, device="meta")
    module.register_parameter(name, nn.Parameter(meta, requires_grad=grad))


def shard_parameter(
    module: nn.Module,
    name: str,
    layout: Any,
    devices: Sequence[torch.device | str] | None = None,
) -> ShardedVariable:
    """Store ``module.<name>`` as shards; returns the ShardedVariable over them.

    ``layout`` is a Layout, partitioner, PartitionerConfig, ``"1,4"`` string or shard count; or
    a ShardedVariable, whose shard Parameters the parameter then shares (a tie: its values win).
    With a ShardedVariable, ``name`` may also be new: the variable's shards then become the
    parameter ``module.<name>``, read as a plain tensor (``module.v = variable`` instead keeps the
    variable itself as a submodule: its shards are ``v.shard_<i>``, its state_dict key ``v``).

    >>> fc = nn.Linear(4, 6)
    >>> v = shard_parameter(fc, "weight", "1,2")
    >>> [tuple(t.shape) for t in v.variables], list(fc.state_dict())
    ([(6, 2), (6, 2)], ['weight', 'bias'])
    """
    if isinstance(layout, ShardedVariable) and isinstance(module, nn.Module) and isinstance(name, str):
        _register_placeholder(module, name, layout)
    param = _check_target(module, name)
    what = f"{type(module).__name__}.{name}"
    if isinstance(layout, ShardedVariable):
        store = _tied_store(layout, param, what)
    else:
        resolved = to_layout(layout, tuple(param.shape), param.dtype)
        store = ShardStore.allocate(
            resolved, param.shape, param.dtype, devices=devices, values=param.detach(), requires_grad=True
        )
        for t in store.local_shards().values():
            t.requires_grad_(param.requires_grad)
    owner = module.__dict__.get("_shardvar_owner")
    if owner is None:
        owner = _Owner(list(module.state_dict(keep_vars=True)))  # the unsharded key order, before any change
    par = ShardsParametrization(store.layout, store)
    par._adopting = True
    parametrize.register_parametrization(module, name, par, unsafe=True)
    par._adopting = False
    plist = module.parametrizations[name]
    for s, t in store.local_shards().items():
        plist.register_parameter(f"original{s}", t)  # the store's own Parameters (shared when tied)
    if "_shardvar_owner" not in module.__dict__:
        module._shardvar_owner = owner
        register_logical_hooks(module, _parametrized_state)
    return ShardedVariable.from_store(store, name=name)


def sharded_parameters(module: nn.Module, *, recurse: bool = True) -> dict[str, Any]:
    """Every sharded parameter of ``module`` by qualified name (``recurse=False``: its own only).

    Sharded modules (``sharded_variables()``) and parameters stored by :func:`shard_parameter`
    alike; the checkpoint saves each as one logical variable.

    >>> model = nn.Sequential(nn.Linear(4, 6))
    >>> _ = shard_parameter(model[0], "weight", 3)
    >>> {k: v.layout.num_shards for k, v in sharded_parameters(model).items()}
    {'0.weight': 3}
    """
    out: dict[str, Any] = {}
    for path, sub in module.named_modules() if recurse else [("", module)]:
        found = dict(sub.sharded_variables()) if callable(getattr(sub, "sharded_variables", None)) else {}
        found.update(_own(sub))
        found.update(attribute_variables(sub))  # ShardedVariables assigned as attributes
        out.update({f"{path}.{n}" if path else n: v for n, v in found.items()})
    return out


def set_state_dict_form(module: nn.Module, form: str) -> None:
    """``"logical"`` (default: each sharded parameter under its own key) or ``"sharded"`` (one key per
    shard), for ``module`` and every submodule; ``load_state_dict`` accepts either form regardless."""
    check_choice(form, "form", FORMS)
    for sub in module.modules():
        if callable(getattr(sub, "set_state_dict_form", None)):
            sub.set_state_dict_form(form)
        if "_shardvar_owner" in sub.__dict__:
            sub._shardvar_owner.form = form


def _shard_keys(variable: ShardedVariable) -> dict[int, str]:
    return {s: f"parametrizations.{variable.name}.original{s}" for s in range(variable.layout.num_shards)}


def _parametrized_state(module: nn.Module) -> tuple[str, list[str], dict]:
    owner: _Owner = module._shardvar_owner
    return owner.form, owner.order, {name: (v, _shard_keys(v)) for name, v in _own(module).items()}
