"""What a state dict holds, as named logical variables, and the one rule that names parameters.

``state_dict`` values may be sharded objects, tensors, nn.Modules and torch.optim optimizers.
A sharded object (``layout``, ``shape``, ``dtype``, ``local_shards()``: a ShardedVariable, a
distributed one) is one logical variable; a module contributes each ``sharded_variables()`` of
its submodules (ShardedEmbedding, DistributedEmbedding, ...) as one logical variable and its other
state_dict entries as tensors. Optimizers are resolved against the parameters so named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import CheckpointError, ShardvarTypeError
from .._validate import check_has_values
from ..nn import sharded_parameters
from ..variables import ShardsView

__all__ = ["State", "as_shards_view", "resolve", "param_names"]


# A logical variable is recorded as a ShardsView (its layout and the shards of it this process
# holds, by shard index): the record the variables layer already has for optimizer slots.
def as_shards_view(value: Any) -> ShardsView | None:
    """A sharded object's view for the checkpoint, or None when ``value`` is not one."""
    if isinstance(value, torch.Tensor) or not callable(getattr(value, "local_shards", None)):
        return None
    if not all(hasattr(value, a) for a in ("layout", "shape", "dtype")):
        return None
    packed, stream = getattr(value, "packed", None), getattr(value, "stream", None)
    return ShardsView(value.layout, tuple(value.shape), value.dtype, dict(value.local_shards()), packed, stream)


@dataclass
class State:
    variables: dict[str, ShardsView | torch.Tensor] = field(default_factory=dict)
    # id(param) -> (logical name, shard index, variable)
    shard_of: dict[int, tuple[str, int, ShardsView]] = field(default_factory=dict)
    param_name: dict[int, str] = field(default_factory=dict)  # id(param) -> logical name
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    # shardvar.optim's optimizers (their state is among the variables): their param groups' options
    table_optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    # what each variable is, as the manifest records it (_manifest.ROLES): a module's embedding tables
    # (those its modules name in ``embedding_tables``) "table", its other state "other"; a tensor or
    # sharded object given by itself is left unknown (absent)
    roles: dict[str, str] = field(default_factory=dict)

    def add_variable(self, name: str, value: ShardsView | torch.Tensor) -> None:
        if name in self.variables:
            raise CheckpointError(f"two objects of the state dict are both named {name!r}; rename one")
        for t in value.shards.values() if isinstance(value, ShardsView) else [value]:
            check_has_values(t, f"{name!r}")  # meta: nothing to save, nowhere to load; refused before any file
        self.variables[name] = value
        if isinstance(value, ShardsView):
            for s, shard in value.shards.items():
                self.shard_of[id(shard)] = (name, s, value)
        else:
            self.param_name[id(value)] = name


def _tables_of(module: nn.Module) -> tuple[str, ...]:
    """The names of a module's own variables that are embedding tables: an ``nn.Embedding(Bag)``'s weight
    (a sharded one's too), or those a module names in ``embedding_tables`` (packed tables, collections)."""
    default = ("weight",) if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) else ()
    return tuple(getattr(module, "embedding_tables", default))


def _add_module(state: State, key: str, module: nn.Module) -> None:
    first = len(state.variables)
    tables: set[str] = set()
    for mod_name, sub in module.named_modules():
        tables |= {f"{key}/{mod_name}.{n}" if mod_name else f"{key}/{n}" for n in _tables_of(sub)}
        found = sharded_parameters(sub, recurse=False)  # sharded modules' tables and partitioned parameters
        for local, value in found.items():
            partial = as_shards_view(value)
            if partial is None:
                raise ShardvarTypeError(f"{type(sub).__name__}.sharded_variables()[{local!r}] is not a sharded object")
            state.add_variable(f"{key}/{mod_name}.{local}" if mod_name else f"{key}/{local}", partial)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in state.shard_of or f"{key}/{name}" in state.variables:
            continue  # a sharded variable's shards, or its logical form (saved once, as a sharded variable)
        if not isinstance(tensor, torch.Tensor):
            raise ShardvarTypeError(f"state_dict entry {key}/{name} of the module is a {type(tensor).__name__}")
        state.add_variable(f"{key}/{name}", tensor)
    for name in list(state.variables)[first:]:
        state.roles[name] = "table" if name in tables else "other"


def resolve(state_dict: dict[str, Any]) -> State:
    """Name every logical variable of ``state_dict``; optimizers are resolved after modules."""
    if not isinstance(state_dict, dict):
        raise ShardvarTypeError(f"state_dict must be a dict of name -> object; got {type(state_dict).__name__}")
    state = State()
    for key, obj in state_dict.items():
        if not isinstance(key, str) or not key or "/" in key or key.startswith("#"):
            raise ShardvarTypeError(
                f"state_dict keys must be non-empty strings without '/', not starting with '#'; got {key!r}"
            )
        if isinstance(obj, torch.Tensor):
            state.add_variable(key, obj)
        elif as_shards_view(obj) is not None:
            state.add_variable(key, as_shards_view(obj))
        elif isinstance(obj, nn.Module):
            _add_module(state, key, obj)
        elif callable(getattr(obj, "sharded_variables", None)):  # shardvar.optim's optimizers: state per table
            for name, value in obj.sharded_variables().items():
                partial = as_shards_view(value)
                state.add_variable(f"{key}/{name}", partial if partial is not None else value)
                state.roles[f"{key}/{name}"] = "other"  # an optimizer's state
            if isinstance(obj, torch.optim.Optimizer):
                state.table_optimizers[key] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            state.optimizers[key] = obj
        else:
            raise ShardvarTypeError(
                f"state_dict[{key!r}] is a {type(obj).__name__}; "
                "expected a ShardedVariable, tensor, nn.Module or optimizer"
            )
    return state


def notify(state_dict: dict[str, Any], event: str) -> None:
    """Call ``checkpoint_hook(event)`` on every object of ``state_dict`` (and submodule) that has one.

    ``"before_save"`` runs before anything is resolved, ``"after_load"`` after every value and
    optimizer state is written (a dynamic table then rebuilds its id index and re-places ids).
    On every process of a distributed save or load, so a hook may run collectives.
    """
    for obj in state_dict.values() if isinstance(state_dict, dict) else ():
        members = obj.modules() if isinstance(obj, nn.Module) else [obj]
        for member in members:
            hook = getattr(member, "checkpoint_hook", None)
            if callable(hook):
                hook(event)


def param_names(state: State, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The name of every parameter of every param group, the one rule for saving and loading.

    A parameter is named by the logical variable it is (a shard of a sharded variable: the
    variable's name); one the state dict does not name gets ``#<group>.<index>``, its position.
    """
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        names = []
        for i, p in enumerate(group["params"]):
            owner = state.shard_of.get(id(p))
            names.append(owner[0] if owner else state.param_name.get(id(p), f"#{g}.{i}"))
        groups.append(names)
    return groups
