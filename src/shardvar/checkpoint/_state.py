"""What a state dict holds, as named logical variables.

``state_dict`` values may be ShardedVariables, tensors, nn.Modules and torch.optim optimizers.
A module's sharded parameters (any submodule with a ``sharded_variables()`` or
``distributed_variables()`` method, such as ShardedEmbedding or DistributedEmbedding) become one
logical variable each; an optimizer's slot tensors for a sharded parameter (Adam's exp_avg, ...)
become one logical variable with the parameter's layout, so they reshard with it.

A sharded variable is seen through :class:`Partial`: its layout and the shards this process
holds (all of them for a ShardedVariable, this rank's for a distributed one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarTypeError
from ..layout import Layout
from ..variables import ShardedVariable

__all__ = ["Partial", "State", "as_partial", "resolve", "optimizer_param_names"]


@dataclass
class Partial:
    """A logical variable's layout and the shards of it this process holds, by shard index."""

    layout: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: dict[int, torch.Tensor]


def as_partial(value: Any) -> Partial | None:
    """A ShardedVariable, or anything with ``layout``, ``shape``, ``dtype`` and ``local_shards()``."""
    if isinstance(value, ShardedVariable):
        return Partial(value.layout, tuple(value.shape), value.dtype, value.local_shards())
    if all(hasattr(value, a) for a in ("layout", "shape", "dtype", "local_shards")):
        return Partial(value.layout, tuple(value.shape), value.dtype, value.local_shards())
    return None


@dataclass
class State:
    variables: dict[str, Partial | torch.Tensor] = field(default_factory=dict)
    # id(param) -> (logical name, shard index, variable)
    shard_of: dict[int, tuple[str, int, Partial]] = field(default_factory=dict)
    param_name: dict[int, str] = field(default_factory=dict)  # id(param) -> logical name
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)


def _add_module(state: State, key: str, module: nn.Module) -> None:
    for mod_name, sub in module.named_modules():
        found = {}
        for method in ("sharded_variables", "distributed_variables"):
            if hasattr(sub, method):
                found.update(getattr(sub, method)())
        for local, value in found.items():
            name = f"{key}/{mod_name}.{local}" if mod_name else f"{key}/{local}"
            variable = as_partial(value)
            state.variables[name] = variable
            for s, shard in variable.shards.items():
                state.shard_of[id(shard)] = (name, s, variable)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in state.shard_of or f"{key}/{name}" in state.variables:
            continue  # a sharded variable's shards, or its logical form (saved once, as a sharded variable)
        state.variables[f"{key}/{name}"] = tensor
        state.param_name[id(tensor)] = f"{key}/{name}"


def resolve(state_dict: dict[str, Any]) -> State:
    """Name every logical variable of ``state_dict``; optimizers are resolved after modules."""
    if not isinstance(state_dict, dict):
        raise ShardvarTypeError(f"state_dict must be a dict of name -> object; got {type(state_dict).__name__}")
    state = State()
    for key, obj in state_dict.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ShardvarTypeError(f"state_dict keys must be non-empty strings without '/'; got {key!r}")
        if isinstance(obj, torch.Tensor):
            state.variables[key] = obj
        elif as_partial(obj) is not None:
            state.variables[key] = as_partial(obj)
        elif isinstance(obj, nn.Module):
            _add_module(state, key, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            state.optimizers[key] = obj
        else:
            raise ShardvarTypeError(
                f"state_dict[{key!r}] is a {type(obj).__name__}; "
                "expected a ShardedVariable, tensor, nn.Module or optimizer"
            )
    return state


def optimizer_param_names(state: State, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Logical parameter names of each param group (a sharded parameter appears once)."""
    groups = []
    index = 0
    for group in optimizer.param_groups:
        names: list[str] = []
        for p in group["params"]:
            if id(p) in state.shard_of:
                name = state.shard_of[id(p)][0]
            else:
                name = state.param_name.get(id(p), f"param{index}")
            if name not in names:
                names.append(name)
            index += 1
        groups.append(names)
    return groups
