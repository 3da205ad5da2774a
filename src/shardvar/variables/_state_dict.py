"""The logical state_dict form shared by every sharded module and sharded parameter.

A sharded parameter is saved under its own name (``weight``) as the whole logical tensor, as the
unsharded module saves it, and loads from that key or from its per-shard keys. The per-shard
form (one entry per shard, for tables too large to materialise) is opt-in. These helpers are the
one implementation; ShardedEmbedding(Bag), ShardedLinear, ``shard_parameter`` and a ShardedVariable
held as a module attribute all use them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from .._errors import ShardvarValueError
from ._sharded_variable import FORMS, ShardedVariable
from ._spread import local

__all__ = ["FORMS", "save_logical", "load_logical", "reorder", "check_not_assign", "register_logical_hooks"]


def save_logical(state: dict, prefix: str, name: str, variable: ShardedVariable, shard_keys: Sequence[str]) -> None:
    """Replace the per-shard entries ``shard_keys`` of ``state`` by ``name``: the logical tensor.

    No copy where the layout allows one (a div slab is already the table). A distributed
    variable's shards are left as they are: the whole tensor lives on no single rank.
    """
    if not local(variable.store):  # also on a rank that holds every shard: the ranks read together
        return
    for key in shard_keys:
        state.pop(prefix + key, None)
    state[prefix + name] = variable.logical(copy=False).detach()


def check_not_assign(local_metadata: Mapping, prefix: str, name: str) -> None:
    """``load_state_dict(assign=True)`` would replace shard Parameters by slices: refuse it, clearly."""
    if local_metadata.get("assign_to_params_buffers", False):
        raise ShardvarValueError(
            f"load_state_dict(assign=True) cannot replace the shards of the sharded parameter {prefix}{name}; "
            "load without assign=True: the values are copied into the shards"
        )


def load_logical(
    state: dict,
    prefix: str,
    name: str,
    variable: ShardedVariable,
    shard_keys: Mapping[int, str],
    missing_keys: list,
    error_msgs: list,
) -> None:
    """Turn ``name`` (the logical tensor) in ``state`` into the per-shard entries the shards load.

    Per-shard entries already in ``state`` load as they are. Without either form, ``name`` is
    reported missing (and the shards are left unchanged); a tensor of another shape is reported
    as a size mismatch, as ``nn.Module.load_state_dict`` words it.
    """
    shards = variable.local_shards()
    keep = {prefix + key: shards[s] for s, key in shard_keys.items()}  # loading a shard into itself: a no-op
    value = state.pop(prefix + name, None)
    if value is None:
        if not any(key in state for key in keep):
            missing_keys.append(prefix + name)
            state.update(keep)
        return
    shape = list(variable.shape)
    if not isinstance(value, torch.Tensor) or list(value.shape) != shape:
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        error_msgs.append(
            f"size mismatch for {prefix}{name}: copying a param with shape {got} from checkpoint, "
            f"the shape in current model is {shape}."
        )
        state.update(keep)
        return
    parts = variable.layout.split(value)
    state.update({prefix + key: parts[s] for s, key in shard_keys.items()})


def reorder(state: dict, prefix: str, order: Sequence[str]) -> None:
    """Put the entries under ``prefix`` in the unsharded module's key order ``order`` (local names).

    A module's entries (its own and its children's) are the last ones added when its hook runs,
    so they are taken out and put back in that order; names not in ``order`` keep theirs, after.
    """
    keys = [k for k in state if k.startswith(prefix)]
    rank = {prefix + n: i for i, n in enumerate(order)}
    entries = {k: state.pop(k) for k in keys}
    for key in sorted(keys, key=lambda k: rank.get(k, len(order))):
        state[key] = entries[key]


# module -> (its state_dict form, its unsharded key order or None, {name: (variable, {shard: its key})})
LogicalState = Callable[
    [nn.Module], tuple[str, Sequence[str] | None, dict[str, tuple[ShardedVariable, dict[int, str]]]]
]


def register_logical_hooks(module: nn.Module, state: LogicalState) -> None:
    """Make ``module``'s state_dict speak the logical form of the variables ``state(module)`` names.

    The hooks are module-level functions bound with ``functools.partial`` to a module-level
    ``state``, so a module pickles and deep-copies with them.
    """
    module._register_state_dict_hook(functools.partial(_save_hook, state))
    module._register_load_state_dict_pre_hook(functools.partial(_load_hook, state), with_module=True)


def _save_hook(state: LogicalState, module: nn.Module, out: dict, prefix: str, local_metadata: dict) -> None:
    form, order, variables = state(module)
    if form != "logical":
        return
    for name, (variable, keys) in variables.items():
        if getattr(variable, "state_dict_form", "logical") == "logical":  # a variable may ask for per-shard keys itself
            save_logical(out, prefix, name, variable, list(keys.values()))
    if order is not None:
        reorder(out, prefix, order)


def _load_hook(
    state: LogicalState,
    module: nn.Module,
    incoming: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    for name, (variable, keys) in state(module)[2].items():
        check_not_assign(local_metadata, prefix, name)  # new Parameters would untie every other user
        load_logical(incoming, prefix, name, variable, keys, missing_keys, error_msgs)
