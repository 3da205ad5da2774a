"""partition_model: rewrite a model so chosen parameters become partitioned (AutoDist's VariablePartitioner).

nn.Embedding and nn.EmbeddingBag become ShardedEmbedding / ShardedEmbeddingBag; any other
parameter (a Linear weight along axis 0 or 1, ...) is replaced by its shards through a
``torch.nn.utils.parametrize`` parametrization, so the module forwards and backwards as before
while autograd and optimizers see the shards. Everything is checked before anything changes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._errors import ShardvarError, ShardvarValueError
from ..layout import Layout
from ..nn import ShardedEmbedding, ShardedEmbeddingBag
from ._spec import PartitionSpec, as_spec

__all__ = ["partition_model", "ModelPartition", "PartitionedParameter", "ShardsParametrization"]


class ShardsParametrization(nn.Module):
    """The logical tensor from its shards (forward) and the shards from a tensor (right_inverse)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, *shards: torch.Tensor) -> torch.Tensor:
        return self.layout.join(shards)

    def right_inverse(self, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(part.clone() for part in self.layout.split(value))

    def extra_repr(self) -> str:
        return f"layout={self.layout}"


@dataclass
class PartitionedParameter:
    """One parameter the transform partitioned: its old tensor and its new shards."""

    name: str
    old: nn.Parameter
    layout: Layout
    shards: list[nn.Parameter]


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
                params.extend(by_old[id(p)].shards if id(p) in by_old else [p])
            groups.append({**group, "params": params})
        rebuilt = type(optimizer)(groups, **optimizer.defaults)
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            state = optimizer.state.get(p)
            if not state:
                continue
            if id(p) not in by_old:
                rebuilt.state[p] = state
                continue
            part = by_old[id(p)]
            for s, shard in enumerate(part.shards):
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


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    prefix, _, attr = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), prefix, attr


def partition_model(
    module: nn.Module,
    strategy: Mapping[str, Any] | Any,
    devices: Sequence[torch.device | str] | None = None,
) -> ModelPartition:
    """Partition the parameters ``strategy`` names (exact names or glob patterns), in place.

    ``strategy`` maps names to a partitioner, PartitionerConfig, "1,4,1" string, shard count,
    Layout or PartitionSpec; or it is a :class:`~shardvar.Plan`, whose placement is then used.
    Shards go to ``devices`` round-robin (default: where the parameter is).

    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6))
    >>> part = partition_model(model, {"0.weight": 2, "1.weight": "1,2"})
    >>> type(model[0]).__name__, [tuple(p.shape) for p in part.parameters["1.weight"].shards]
    ('ShardedEmbedding', [(6, 2), (6, 2)])
    """
    placement: dict[str, list[str]] = {}
    if hasattr(strategy, "strategy") and hasattr(strategy, "placement"):
        placement = dict(strategy.placement)
        strategy = strategy.strategy
    every = list(module.named_parameters(remove_duplicate=False))
    names = [n for n, _ in every]
    chosen, problems = _matches(strategy, names)
    seen: dict[int, list[str]] = {}
    for n, p in every:
        seen.setdefault(id(p), []).append(n)
    layouts: dict[str, Layout] = {}
    for name, spec in chosen.items():
        param = dict(every)[name]
        owner, _, attr = _owner(module, name)
        if len(seen[id(param)]) > 1:
            others = [o for o in seen[id(param)] if o != name]
            problems.append(f"{name}: tied/shared with {', '.join(others)} (partition each copy's owner instead)")
            continue
        if param.dim() == 0:
            problems.append(f"{name}: a 0-d parameter cannot be partitioned")
            continue
        if ".parametrizations." in name or isinstance(owner, (ShardedEmbedding, ShardedEmbeddingBag)):
            problems.append(f"{name}: already partitioned")
            continue
        try:
            layouts[name] = spec.layout(tuple(param.shape), param.dtype)
        except ShardvarError as e:
            problems.append(f"{name}: {e}")
    if problems:
        raise ShardvarValueError("cannot partition these parameters:\n  " + "\n  ".join(problems))
    result = ModelPartition(module)
    for name, layout in layouts.items():
        param = dict(every)[name]
        owner, prefix, attr = _owner(module, name)
        shard_devices = placement.get(name) or (
            [devices[s % len(devices)] for s in range(layout.num_shards)] if devices else None
        )
        if prefix and attr == "weight" and isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and layout.axis == 0:
            # A row-split table becomes a ShardedEmbedding(Bag): lookups touch only the shards they need.
            new = _sharded_embedding(owner, layout, shard_devices)
            parent, _, child = prefix.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, child, new)
            shards = list(new.shards)
        else:
            parametrize.register_parametrization(owner, attr, ShardsParametrization(layout), unsafe=True)
            original = owner.parametrizations[attr]
            shards = [getattr(original, f"original{s}") for s in range(layout.num_shards)]
            if shard_devices:
                with torch.no_grad():
                    for s, shard in enumerate(shards):
                        shard.data = shard.data.to(shard_devices[s])
        result.parameters[name] = PartitionedParameter(name, param, layout, shards)
    return result


def _sharded_embedding(old: nn.Module, layout: Layout, devices: list | None) -> nn.Module:
    common = {
        "partitioner": layout,
        "partition_strategy": layout.strategy,
        "max_norm": old.max_norm,
        "norm_type": old.norm_type,
        "scale_grad_by_freq": old.scale_grad_by_freq,
        "sparse": old.sparse,
        "padding_idx": old.padding_idx,
        "_weight": old.weight.detach(),
        "devices": devices,
    }
    if isinstance(old, nn.EmbeddingBag):
        new = ShardedEmbeddingBag(
            old.num_embeddings, old.embedding_dim, mode=old.mode, include_last_offset=old.include_last_offset, **common
        )
    else:
        new = ShardedEmbedding(old.num_embeddings, old.embedding_dim, **common)
    for p in new.parameters():
        p.requires_grad_(old.weight.requires_grad)
    return new
