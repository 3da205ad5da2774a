"""Optimizer state in a checkpoint: saved under the parameters' logical names, restored only whole.

Every slot tensor shaped like a sharded parameter becomes one logical variable with that
parameter's layout (so Adam's moments reshard with the table); other tensors are saved whole and
JSON values go to the manifest. Loading checks, before anything is written, that the optimizer
is of the saved class and holds exactly the saved parameters (by the names ``param_names``
gives); anything unmatched is an error, never a silent loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import CheckpointError
from ..variables import ShardsView
from ._state import State, param_names

__all__ = [
    "OptimizerRecord",
    "slot_name",
    "split_slot_name",
    "optimizer_state",
    "optimizer_info",
    "merge_infos",
    "check_optimizer",
    "group_options",
    "check_group_count",
    "restored_groups",
]

_SCALARS = (int, float, bool, str, type(None))


def slot_name(key: str, param: str, slot: str) -> str:
    """The checkpoint variable holding state ``slot`` of parameter ``param`` of optimizer ``key``.

    The one naming rule: saving, loading and ``shardvar.tf.convert`` all call it. A key and a
    state key hold no '/', so :func:`split_slot_name` reads any parameter name back.

    >>> slot_name("opt", "model/weight", "exp_avg")
    'opt/model/weight/exp_avg'
    """
    return f"{key}/{param}/{slot}"


def split_slot_name(name: str) -> tuple[str, str, str] | None:
    """``(key, param, slot)`` of a name :func:`slot_name` makes; None for a name it cannot make."""
    key, _, rest = name.partition("/")
    param, _, slot = rest.rpartition("/")
    return (key, param, slot) if key and param and slot else None


@dataclass
class OptimizerRecord:
    """The manifest's record of one optimizer: what a load needs to rebuild its state, before reading any.

    Its JSON form (``extra["optimizers"][key]``) is ``{"class", "param_groups", "slots", "scalars"}``;
    tensor state lives in the variables :func:`slot_name` names, other state here, under
    ``"<param>/<slot>"``.
    """

    cls: str  # module.qualname of the optimizer's class
    param_groups: list[dict[str, Any]]  # each group's options and its parameters' names ("params")
    slots: dict[str, set[str]] = field(default_factory=dict)  # parameter name -> its state keys
    scalars: dict[str, Any] = field(default_factory=dict)  # "<param>/<slot>" -> a JSON state value

    def add(self, param: str, slot: str, scalar: Any = None, *, tensor: bool = True) -> None:
        """Record state ``slot`` of ``param``: a tensor (saved as a variable) or, ``tensor=False``, ``scalar``."""
        self.slots.setdefault(param, set()).add(slot)
        if not tensor:
            self.scalars[f"{param}/{slot}"] = scalar

    def scalar(self, param: str, slot: str, missing: Any) -> Any:
        """The saved value of non-tensor state ``slot`` of ``param``; ``missing`` when it is a tensor."""
        return self.scalars.get(f"{param}/{slot}", missing)

    def to_json(self) -> dict[str, Any]:
        slots = {name: sorted(s) for name, s in self.slots.items()}
        return {"class": self.cls, "param_groups": self.param_groups, "slots": slots, "scalars": dict(self.scalars)}

    @classmethod
    def from_json(cls, raw: Any, key: str) -> OptimizerRecord:
        """The record of optimizer ``key`` a manifest holds; CheckpointError when it is malformed."""
        ok = isinstance(raw, dict) and {"class", "param_groups", "slots", "scalars"} <= set(raw)
        ok = ok and isinstance(raw["class"], str) and isinstance(raw["param_groups"], list)
        ok = ok and all(isinstance(g, dict) and isinstance(g.get("params", []), list) for g in raw["param_groups"])
        ok = ok and isinstance(raw["slots"], dict) and isinstance(raw["scalars"], dict)
        if not ok or not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in raw["slots"].values()):
            raise CheckpointError(f"the checkpoint's record of optimizer {key!r} is malformed")
        slots = {name: set(v) for name, v in raw["slots"].items()}
        return cls(raw["class"], [dict(g) for g in raw["param_groups"]], slots, dict(raw["scalars"]))

    @classmethod
    def merge(cls, records: list[OptimizerRecord]) -> OptimizerRecord:
        """One record from every rank's (each rank's optimizer holds its own shards of the tables)."""
        merged = cls(records[0].cls, [dict(g) for g in records[0].param_groups])
        for record in records:
            for group, theirs in zip(merged.param_groups, record.param_groups, strict=True):
                group["params"] = list(dict.fromkeys([*group.get("params", []), *theirs.get("params", [])]))
            for name, slots in record.slots.items():
                merged.slots.setdefault(name, set()).update(slots)
            merged.scalars.update(record.scalars)
        return merged


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


def optimizer_state(state: State, key: str, optimizer: torch.optim.Optimizer) -> dict[str, ShardsView | torch.Tensor]:
    """The optimizer's slot tensors as logical variables named ``<key>/<param name>/<slot>``."""
    names = param_names(state, optimizer)
    tensors: dict[str, ShardsView | torch.Tensor] = {}
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
                    tensors.setdefault(slot_name(key, names[g][i], slot), value.detach())
    for (name, slot), by_shard in sharded.items():
        variable = state.variables[name]
        # A shard the optimizer never stepped has no slot yet: it holds zeros, as fresh state does.
        slots = {s: by_shard.get(s, torch.zeros_like(t)).detach() for s, t in variable.shards.items()}
        tensors[slot_name(key, name, slot)] = ShardsView(variable.layout, variable.shape, variable.dtype, slots)
    return tensors


def optimizer_info(state: State, key: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The manifest's record of an optimizer (:class:`OptimizerRecord`), as JSON."""
    names = param_names(state, optimizer)
    record = OptimizerRecord(_class_name(optimizer), [])
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: _json(v, f"option {k!r} of param group {g} of {key!r}") for k, v in group.items() if k != "params"}
        record.param_groups.append({**hyper, "params": list(dict.fromkeys(names[g]))})
        for i, p in enumerate(group["params"]):
            for slot, value in optimizer.state.get(p, {}).items():
                tensor = isinstance(value, torch.Tensor)
                scalar = None if tensor else _json(value, f"state {slot!r} of {names[g][i]!r} in {key!r}")
                record.add(names[g][i], slot, scalar, tensor=tensor)
    return record.to_json()


def merge_infos(infos: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One record of optimizer ``key`` from every rank's, as JSON."""
    return OptimizerRecord.merge([OptimizerRecord.from_json(info, key) for info in infos]).to_json()


def check_optimizer(
    saved: OptimizerRecord, state: State, key: str, optimizer: torch.optim.Optimizer, partial_ok: bool
) -> None:
    """Raise unless ``optimizer`` can take the saved state whole (``partial_ok``: a rank's own part)."""
    if saved.cls != _class_name(optimizer):
        raise CheckpointError(
            f"optimizer {key!r} was saved as {saved.cls}; the target is {_class_name(optimizer)}: "
            "load it into an optimizer of the same class"
        )
    names = param_names(state, optimizer)
    if len(saved.param_groups) != len(names):
        raise CheckpointError(
            f"optimizer {key!r} has {len(names)} param groups; the checkpoint has {len(saved.param_groups)}"
        )
    for g, (group, mine) in enumerate(zip(saved.param_groups, names, strict=True)):
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
