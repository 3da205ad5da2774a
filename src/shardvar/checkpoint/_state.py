"""What a state dict holds, as named logical variables.

``state_dict`` values may be ShardedVariables, tensors, nn.Modules and torch.optim optimizers.
A module's sharded parameters (any submodule with a ``sharded_variables()`` method, such as
ShardedEmbedding) become one logical variable each; an optimizer's slot tensors for a sharded
parameter (Adam's exp_avg, ...) become one logical variable with the parameter's layout, so they
reshard with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarTypeError
from ..variables import ShardedVariable

__all__ = ["State", "resolve", "optimizer_param_names"]


@dataclass
class State:
    variables: dict[str, ShardedVariable | torch.Tensor] = field(default_factory=dict)
    shard_of: dict[int, tuple[str, int, ShardedVariable]] = field(
        default_factory=dict
    )  # id(param) -> (name, shard, var)
    param_name: dict[int, str] = field(default_factory=dict)  # id(param) -> logical name
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)


def _add_module(state: State, key: str, module: nn.Module) -> None:
    for mod_name, sub in module.named_modules():
        if not hasattr(sub, "sharded_variables"):
            continue
        for local, variable in sub.sharded_variables().items():
            name = f"{key}/{mod_name}.{local}" if mod_name else f"{key}/{local}"
            state.variables[name] = variable
            for s, shard in enumerate(variable.variables):
                state.shard_of[id(shard)] = (name, s, variable)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in state.shard_of:
            continue
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
        if isinstance(obj, ShardedVariable | torch.Tensor):
            state.variables[key] = obj
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
