"""partition_model: rewrite a model so chosen parameters become partitioned (AutoDist's VariablePartitioner).

Each chosen parameter is split once, into one set of shard Parameters, and every module that
uses it (a tied or shared parameter has several) is given those same shards: an exact
``nn.Embedding(Bag)`` split by rows becomes a ShardedEmbedding(Bag), an exact ``nn.Linear``
whose weight is split by rows becomes a (vocabulary-parallel) ShardedLinear, and any other
parameter (other axes, biases, Conv1D, subclasses) is stored as shards by ``shard_parameter``.
Every refusal is collected into one error, and every shard is allocated before anything changes.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._deprecation import deprecated_property, renamed
from .._errors import ShardvarError, ShardvarTypeError, ShardvarValueError
from .._validate import check_devices
from ..layout import Layout
from ..nn import (
    EmbeddingBagDict,
    EmbeddingBagList,
    ShardedEmbedding,
    ShardedEmbeddingBag,
    ShardedLinear,
    shard_parameter,
)
from ..variables import ShardedVariable, ShardStore
from ._spec import PartitionSpec, as_spec

__all__ = ["partition_model", "ModelPartition", "PartitionedParameter"]

_SHARDED = (ShardedEmbedding, ShardedEmbeddingBag, ShardedLinear)


@dataclass
class PartitionedParameter:
    """One parameter the transform partitioned: its old tensor, its layout and its new shards."""

    name: str
    old: nn.Parameter
    layout: Layout
    variables: list[nn.Parameter]  # the shards, in shard order (as ShardedVariable.variables)
    users: list[str] = field(default_factory=list)  # every name the parameter had (tied: several)

    shards = deprecated_property("shards", "PartitionedParameter.variables", lambda p: p.variables)


PartitionedParameter.__init__ = renamed(shards="variables")(PartitionedParameter.__init__)  # type: ignore[method-assign]


@dataclass
class ModelPartition:
    """What :func:`partition_model` changed; rebuilds optimizers to match."""

    module: nn.Module
    parameters: dict[str, PartitionedParameter] = field(default_factory=dict)

    def rebuild_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """A new optimizer of the same class and hyper-parameters over the new parameters.

        Existing state is split onto the shards (momentum buffers, Adam moments: by the layout;
        step counts and other scalars: copied), so training continues exactly.
        """
        by_old = {id(p.old): p for p in self.parameters.values()}
        groups = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                params.extend(by_old[id(p)].variables if id(p) in by_old else [p])
            groups.append({**group, "params": params})
        # defaults may hold entries the constructor does not take (AdamW: decoupled_weight_decay);
        # every group carries them anyway, so pass only what the constructor accepts.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        rebuilt = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            state = optimizer.state.get(p)
            if not state:
                continue
            if id(p) not in by_old:
                rebuilt.state[p] = state
                continue
            part = by_old[id(p)]
            for s, shard in enumerate(part.variables):
                rebuilt.state[shard] = {k: _split_state(v, p, part.layout, s, shard) for k, v in state.items()}
        return rebuilt


def _split_state(value: Any, param: torch.Tensor, layout: Layout, s: int, shard: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape != param.shape:
        return value.clone()  # step counts and other per-parameter scalars
    return layout.split(value)[s].to(shard.device).clone()


def _matches(strategy: Mapping[str, Any], names: list[str]) -> tuple[dict[str, PartitionSpec], list[str]]:
    chosen: dict[str, PartitionSpec] = {}
    problems = []
    for pattern, value in strategy.items():
        try:
            spec = as_spec(value)
        except ShardvarError as e:
            problems.append(f"{pattern}: {e}")
            continue
        hits = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            problems.append(f"{pattern}: matches no parameter")
        for n in hits:
            if n in chosen and chosen[n] != spec:
                problems.append(f"{n}: named by more than one pattern with different specs")
            chosen[n] = spec
    return chosen, problems


@dataclass
class _Plan:
    """One parameter to split: the names the strategy used, every name it has, its layout."""

    named: list[str]
    users: list[str]
    param: nn.Parameter
    layout: Layout


def _plans(module: nn.Module, strategy: Mapping[str, Any]) -> list[_Plan]:
    """One plan per distinct chosen parameter; every refusal raised together, nothing changed."""
    every = list(module.named_parameters(remove_duplicate=False))
    by_name = dict(every)
    chosen, problems = _matches(strategy, [n for n, _ in every])
    users: dict[int, list[str]] = {}
    for n, p in every:
        users.setdefault(id(p), []).append(n)
    grouped: dict[int, list[str]] = {}
    for name in (n for n, _ in every if n in chosen):  # the model's order, whatever the strategy's
        grouped.setdefault(id(by_name[name]), []).append(name)
    plans = []
    for named in grouped.values():
        param, spec = by_name[named[0]], chosen[named[0]]
        if len({chosen[n] for n in named}) > 1:
            problems.append(f"{', '.join(named)}: one tied (shared) parameter named with different specs")
            continue
        if param.dim() == 0:
            problems.append(f"{named[0]}: a 0-d parameter cannot be partitioned")
            continue
        owners = [_owner(module, n) for n in users[id(param)]]
        if any(".parametrizations." in n for n in users[id(param)]) or any(
            isinstance(o, _SHARDED) and a.startswith("shard_") for o, a in owners
        ):
            problems.append(f"{named[0]}: already partitioned")
            continue
        try:
            plans.append(_Plan(named, users[id(param)], param, spec.layout(tuple(param.shape), param.dtype)))
        except ShardvarError as e:
            problems.append(f"{named[0]}: {e}")
    if problems:
        raise ShardvarValueError("cannot partition these parameters:\n  " + "\n  ".join(problems))
    # Weights split by rows first: their modules are replaced (ShardedLinear keeps the bias Parameter),
    # so a bias partitioned too is then stored as shards on the replacement, not on the old module.
    return sorted(plans, key=lambda p: not (p.layout.axis == 0 and any(n.endswith(".weight") for n in p.users)))


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), attr


def _replacement(owner: nn.Module, attr: str, layout: Layout, is_root: bool) -> type | None:
    """The sharded module that replaces ``owner`` (exact Embedding(Bag) / Linear, weight by rows), or None."""
    if is_root or attr != "weight" or layout.axis != 0 or parametrize.is_parametrized(owner):
        return None
    return {nn.Embedding: ShardedEmbedding, nn.EmbeddingBag: ShardedEmbeddingBag, nn.Linear: ShardedLinear}.get(
        type(owner)
    )


def _check_arguments(module: Any, strategy: Any, devices: Any) -> tuple[Mapping[str, Any], dict, list | None]:
    """(strategy, placement by parameter, devices), each checked before anything is allocated or swapped."""
    if not isinstance(module, nn.Module):
        raise ShardvarTypeError(f"module must be an nn.Module; got {type(module).__name__}: {module!r:.60}")
    placement: dict[str, list[torch.device]] = {}
    if hasattr(strategy, "strategy") and hasattr(strategy, "placement"):  # a Plan
        placement = {n: check_devices(where, name=f"placement[{n!r}]") for n, where in strategy.placement.items()}
        strategy = strategy.strategy
    if not isinstance(strategy, Mapping):
        raise ShardvarTypeError(
            f"strategy must map parameter names (or glob patterns) to partitioners, or be a Plan; got {strategy!r:.60} "
            "(e.g. {'emb.weight': 4} for 4 shards)"
        )
    return strategy, placement, check_devices(devices) if devices is not None else None


def partition_model(
    module: nn.Module,
    strategy: Mapping[str, Any] | Any,
    devices: Sequence[torch.device | str] | None = None,
    *,
    collections: Sequence[str] = (),
) -> ModelPartition:
    """Partition the parameters ``strategy`` names (exact names or glob patterns), in place.

    ``collections`` names submodules that are lists or dicts of ``nn.EmbeddingBag`` (DLRM's
    ``emb_l``) or ``nn.Embedding`` (sequence features: their results are ``JaggedRows``): each
    becomes an ``EmbeddingBagList`` / ``EmbeddingBagDict`` of sharded tables (tables the strategy
    does not name get one shard), which the model still indexes as before and which, called with
    every table's ids, looks them all up in one kernel per group of alike tables.

    ``strategy`` maps names to a partitioner, PartitionerConfig, "1,4,1" string, shard count,
    Layout or PartitionSpec; or it is a :class:`~shardvar.Plan`, whose placement is then used.
    Shards go to ``devices`` round-robin (default: where the parameter is). A tied parameter is
    split once, whichever of its names the strategy uses, and all its users share the shards.

    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6))
    >>> part = partition_model(model, {"0.weight": 2, "1.weight": "1,2"})
    >>> type(model[0]).__name__, [tuple(p.shape) for p in part.parameters["1.weight"].variables]
    ('ShardedEmbedding', [(6, 2), (6, 2)])
    """
    strategy, placement, devices = _check_arguments(module, strategy, devices)
    containers = _collection_containers(module, collections)
    plans = _plans(module, strategy)
    named = {n for p in plans for n in p.users}
    rest = [f"{c}.{k}.weight" for c, bags in containers.items() for k in _keys(bags) if f"{c}.{k}.weight" not in named]
    plans += _plans(module, dict.fromkeys(rest, 1)) if rest else []
    stores = []
    for plan in plans:  # every shard allocated before anything is swapped
        shard_devices = placement.get(plan.named[0]) or (
            [devices[s % len(devices)] for s in range(plan.layout.num_shards)] if devices else None
        )
        store = ShardStore.allocate(
            plan.layout, plan.param.shape, plan.param.dtype, devices=shard_devices, values=plan.param.detach(),
            requires_grad=True,
        )  # fmt: skip
        stores.append(store)
    result = ModelPartition(module)
    paths = _module_paths(module)
    for plan, store in zip(plans, stores, strict=True):
        _give_shards(module, plan, store, paths)
        for t in store.local_shards().values():
            t.requires_grad_(plan.param.requires_grad)
        record = PartitionedParameter(plan.named[0], plan.param, plan.layout, list(store.local_shards().values()))
        record.users = plan.users
        for name in plan.named:
            result.parameters[name] = record
    _swap_collections(module, containers)
    if plans:
        _guard(module)
    return result


def _swap_collections(module: nn.Module, containers: dict[str, nn.Module]) -> None:
    """Put an EmbeddingBagList / Dict of the (now sharded) bags in place of each named container."""
    for name, bags in containers.items():
        parent, attr = _owner(module, name)
        if isinstance(bags, nn.ModuleDict):
            setattr(parent, attr, EmbeddingBagDict(dict(bags.items())))
        else:
            setattr(parent, attr, EmbeddingBagList(list(bags)))


def _keys(bags: nn.Module) -> list[str]:
    return list(bags.keys()) if isinstance(bags, nn.ModuleDict) else [str(i) for i in range(len(bags))]


def _collection_containers(module: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    """The named lists / dicts of embedding bags, checked before anything changes."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ShardvarTypeError(f"collections must be a list of submodule names; got {names!r}")
    out, problems = {}, []
    for name in names:
        try:
            bags = module.get_submodule(name)
        except AttributeError:
            problems.append(f"{name}: no such submodule")
            continue
        if not isinstance(bags, (nn.ModuleList, nn.ModuleDict)) or not len(bags):
            problems.append(f"{name}: a {type(bags).__name__}, not a non-empty nn.ModuleList or nn.ModuleDict")
            continue
        wrong = [k for k in _keys(bags) if not isinstance(bags.get_submodule(k), (nn.EmbeddingBag, nn.Embedding))]
        if wrong:
            problems.append(f"{name}: entries {wrong} are not nn.EmbeddingBag or nn.Embedding")
        out[name] = bags
    if problems:
        raise ShardvarValueError("cannot make these collections:\n  " + "\n  ".join(problems))
    return out


# Model methods that rebuild or re-tie parameters (HuggingFace's) cannot act on shards: resizing would
# replace a table by an unsharded one after changing some attributes, and tying looks for parameters
# by their unsharded names. On a partitioned model they refuse, before changing anything.
_GUARDS = {
    "resize_token_embeddings": "resize the model before partition_model, then partition the resized model",
    "tie_weights": "tied parameters already share their shards; tie them before partition_model",
}


def _refusal(method: str, advice: str):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ShardvarTypeError(f"{method}() cannot change a partitioned model: {advice}")

    refuse.__name__ = method
    return refuse


def _guard(module: nn.Module) -> None:
    for sub in module.modules():
        for method, advice in _GUARDS.items():
            if callable(getattr(sub, method, None)):
                sub.__dict__[method] = _refusal(method, advice)  # this instance only


def _module_paths(module: nn.Module) -> dict[int, list[str]]:
    """Every path each submodule is registered under (a module may be registered twice)."""
    paths: dict[int, list[str]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(path)
    return paths


def _give_shards(module: nn.Module, plan: _Plan, store: ShardStore, paths: dict[int, list[str]]) -> None:
    """Every user of the parameter reads ``store``'s shards: a replaced module, or a parametrization."""
    done: set[tuple[int, str]] = set()
    variable = ShardedVariable.from_store(store, name="weight")
    owners = [_owner(module, name) for name in plan.users]  # before any of them is replaced
    for owner, attr in owners:
        if (id(owner), attr) in done:
            continue  # a module registered under two paths is replaced once
        done.add((id(owner), attr))
        cls = _replacement(owner, attr, plan.layout, owner is module)
        if cls is None:
            shard_parameter(owner, attr, variable)
            continue
        new = _sharded_module(cls, owner, variable)
        for path in paths[id(owner)]:
            parent, _, child = path.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, child, new)


def _sharded_module(cls: type, old: nn.Module, variable: ShardedVariable) -> nn.Module:
    if cls is ShardedLinear:
        bias = old.bias if old.bias is not None else False
        return ShardedLinear(old.in_features, old.out_features, bias, weight=variable)
    common = {
        "max_norm": old.max_norm,
        "norm_type": old.norm_type,
        "scale_grad_by_freq": old.scale_grad_by_freq,
        "sparse": old.sparse,
        "padding_idx": old.padding_idx,
        "_store": variable.store,
    }
    if cls is ShardedEmbeddingBag:
        return cls(
            old.num_embeddings, old.embedding_dim, mode=old.mode, include_last_offset=old.include_last_offset, **common
        )
    return cls(old.num_embeddings, old.embedding_dim, **common)
