"""Optimizer state in a checkpoint: saved under the parameters' logical names, restored only whole.

Every slot tensor shaped like a sharded parameter becomes one logical variable with that
parameter's layout (so Adam's moments reshard with the table); other tensors are saved whole and
JSON values go to the manifest. Loading checks, before anything is written, that the optimizer
is of the saved class and holds exactly the saved parameters (by the names ``param_names``
gives); anything unmatched is an error, never a silent loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._errors import CheckpointError
from ._state import Partial, State, param_names

__all__ = [
    "optimizer_state",
    "optimizer_info",
    "merge_infos",
    "check_optimizer",
    "group_options",
    "check_group_count",
    "restored_groups",
]

_SCALARS = (int, float, bool, str, type(None))


def _json(value: Any, what: str) -> Any:
    """``value`` as JSON, or an error: nothing is saved that could not be restored."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"{what} is {value}; a checkpoint stores finite numbers only")
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_json(v, what) for v in value]
    raise CheckpointError(f"{what} is a {type(value).__name__}, which a checkpoint cannot store as JSON")


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def optimizer_state(state: State, key: str, optimizer: torch.optim.Optimizer) -> dict[str, Partial | torch.Tensor]:
    """The optimizer's slot tensors as logical variables named ``<key>/<param name>/<slot>``."""
    names = param_names(state, optimizer)
    tensors: dict[str, Partial | torch.Tensor] = {}
    sharded: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            owner = state.shard_of.get(id(p))
            for slot, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                if owner is not None and value.shape == p.shape:
                    sharded.setdefault((names[g][i], slot), {})[owner[1]] = value.detach()
                else:
                    tensors.setdefault(f"{key}/{names[g][i]}/{slot}", value.detach())
    for (name, slot), by_shard in sharded.items():
        variable = state.variables[name]
        # A shard the optimizer never stepped has no slot yet: it holds zeros, as fresh state does.
        slots = {s: by_shard.get(s, torch.zeros_like(t)).detach() for s, t in variable.shards.items()}
        tensors[f"{key}/{name}/{slot}"] = Partial(variable.layout, variable.shape, variable.dtype, slots)
    return tensors


def optimizer_info(state: State, key: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The manifest's record of an optimizer: class, hyper-parameters, parameters and their slots."""
    names = param_names(state, optimizer)
    groups, slots, scalars = [], {}, {}
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: _json(v, f"option {k!r} of param group {g} of {key!r}") for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(dict.fromkeys(names[g]))})
        for i, p in enumerate(group["params"]):
            for slot, value in optimizer.state.get(p, {}).items():
                slots.setdefault(names[g][i], set()).add(slot)
                if not isinstance(value, torch.Tensor):
                    scalars[f"{names[g][i]}/{slot}"] = _json(value, f"state {slot!r} of {names[g][i]!r} in {key!r}")
    return {
        "class": _class_name(optimizer),
        "param_groups": groups,
        "slots": {name: sorted(s) for name, s in slots.items()},
        "scalars": scalars,
    }


def merge_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from every rank's (each rank's optimizer holds its own shards of the tables)."""
    merged = {**infos[0], "param_groups": [dict(g) for g in infos[0]["param_groups"]], "slots": {}, "scalars": {}}
    for info in infos:
        for group, theirs in zip(merged["param_groups"], info["param_groups"], strict=True):
            group["params"] = list(dict.fromkeys([*group["params"], *theirs["params"]]))
        for name, slots in info["slots"].items():
            merged["slots"][name] = sorted({*merged["slots"].get(name, []), *slots})
        merged["scalars"].update(info["scalars"])
    return merged


def check_optimizer(saved: Any, state: State, key: str, optimizer: torch.optim.Optimizer, partial_ok: bool) -> None:
    """Raise unless ``optimizer`` can take the saved state whole (``partial_ok``: a rank's own part)."""
    if not isinstance(saved, dict) or not {"class", "param_groups", "slots", "scalars"} <= set(saved):
        raise CheckpointError(f"the checkpoint's record of optimizer {key!r} is malformed")
    if saved["class"] != _class_name(optimizer):
        raise CheckpointError(
            f"optimizer {key!r} was saved as {saved['class']}; the target is {_class_name(optimizer)}: "
            "load it into an optimizer of the same class"
        )
    names = param_names(state, optimizer)
    if len(saved["param_groups"]) != len(names):
        raise CheckpointError(
            f"optimizer {key!r} has {len(names)} param groups; the checkpoint has {len(saved['param_groups'])}"
        )
    for g, (group, mine) in enumerate(zip(saved["param_groups"], names, strict=True)):
        theirs, ours = list(group.get("params", [])), list(dict.fromkeys(mine))
        missing = [n for n in theirs if n not in ours]
        extra = [n for n in ours if n not in theirs]
        if extra or (missing and not partial_ok):
            raise CheckpointError(
                f"optimizer {key!r}, param group {g}: the checkpoint holds state for {theirs[:6]} but this optimizer's "
                f"parameters are {ours[:6]} (missing here: {missing[:6]}, unknown to the checkpoint: {extra[:6]}); "
                "load the model in the same call so parameters are named alike"
            )


def group_options(key: str, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's options (lr, betas...; not its parameters), as the manifest stores them."""
    return [
        {k: _json(v, f"option {k!r} of param group {g} of {key!r}") for k, v in group.items() if k != "params"}
        for g, group in enumerate(optimizer.param_groups)
    ]


def check_group_count(key: str, optimizer: torch.optim.Optimizer, saved: list[Any]) -> None:
    """Raise unless the optimizer has as many param groups as the checkpoint saved options for."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"optimizer {key!r} has {len(optimizer.param_groups)} param groups; the checkpoint has {len(saved)}: "
            "build it with the same groups"
        )


def restored_groups(current_groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups with the saved options over their own (tuples as their own: JSON has none)."""
    groups = []
    for current, theirs in zip(current_groups, saved, strict=True):
        merged = {**current, **{k: v for k, v in theirs.items() if k != "params" and v is not None}}
        for k, v in current.items():
            if isinstance(v, tuple) and k in theirs:  # Adam's betas
                merged[k] = tuple(theirs[k])
        merged["params"] = current["params"]
        groups.append(merged)
    return groups
