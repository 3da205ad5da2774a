"""PartitionSpec: how one parameter is partitioned, and a strategy's JSON form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._deprecation import deprecated_property, renamed
from .._errors import ShardvarTypeError, ShardvarValueError
from ..layout import Layout
from ..partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    PartitionerConfig,
)
from ..variables import to_layout

__all__ = ["PartitionSpec", "as_spec", "strategy_to_json", "strategy_from_json"]

_PARTITIONERS = {c.__name__: c for c in (FixedShardsPartitioner, MinSizePartitioner, MaxSizePartitioner)}


@dataclass(frozen=True)
class PartitionSpec:
    """A partitioner, PartitionerConfig, shard count or explicit Layout, and the partition strategy.

    >>> PartitionSpec("1,4").layout((3, 10))
    Layout(strategy='div', sizes=(3, 3, 2, 2), axis=1)
    """

    partitioner: Any
    partition_strategy: str = "div"

    strategy = deprecated_property("strategy", "PartitionSpec.partition_strategy", lambda s: s.partition_strategy)

    def layout(self, shape: tuple[int, ...], dtype: Any = None) -> Layout:
        return to_layout(self.partitioner, shape, dtype, self.partition_strategy)

    def to_json_obj(self) -> dict[str, Any]:
        p = self.partitioner
        if isinstance(p, Layout):
            body: dict[str, Any] = {"layout": p.to_json()}
        elif isinstance(p, PartitionerConfig):
            body = {"partition_list": p.partition_list}
        elif isinstance(p, Partitioner) and type(p).__name__ in _PARTITIONERS:
            body = {"partitioner": type(p).__name__, "args": dict(vars(p))}
        elif isinstance(p, str):
            body = {"partition_list": PartitionerConfig(partition_str=p).partition_list}
        elif isinstance(p, int) and not isinstance(p, bool):
            body = {"num_shards": p}
        else:
            raise ShardvarTypeError(f"cannot serialise partitioner {p!r} to JSON")
        return {**body, "strategy": self.partition_strategy}  # the file format's key stays

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, Any]) -> PartitionSpec:
        strategy = obj.get("strategy", "div")
        if "layout" in obj:
            layout = Layout.from_json(obj["layout"])
            return cls(layout, layout.strategy)
        if "partition_list" in obj:
            return cls(PartitionerConfig(obj["partition_list"]), strategy)
        if "partitioner" in obj:
            if obj["partitioner"] not in _PARTITIONERS:
                raise ShardvarValueError(
                    f"unknown partitioner {obj['partitioner']!r}; expected one of {sorted(_PARTITIONERS)}"
                )
            return cls(_PARTITIONERS[obj["partitioner"]](**obj.get("args", {})), strategy)
        if "num_shards" in obj:
            return cls(int(obj["num_shards"]), strategy)
        raise ShardvarValueError(
            f"a partition spec needs layout, partition_list, partitioner or num_shards; got {dict(obj)}"
        )


PartitionSpec.__init__ = renamed(strategy="partition_strategy")(PartitionSpec.__init__)  # type: ignore[method-assign]


def as_spec(value: Any) -> PartitionSpec:
    """A PartitionSpec from a spec, partitioner, PartitionerConfig, "1,4,1" string, count or Layout."""
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, Layout):
        return PartitionSpec(value, value.strategy)
    if isinstance(value, str):
        PartitionerConfig(partition_str=value)  # refuse a malformed string now, naming it
        return PartitionSpec(value)
    if isinstance(value, (Partitioner, PartitionerConfig)) or (isinstance(value, int) and not isinstance(value, bool)):
        return PartitionSpec(value)
    raise ShardvarTypeError(
        f"a strategy maps names to a partitioner, PartitionerConfig, '1,4,1' string, shard count, Layout or "
        f"PartitionSpec; got {value!r}"
    )


def strategy_to_json(strategy: Mapping[str, Any]) -> str:
    """The JSON text of a strategy (parameter name or glob pattern -> spec)."""
    return json.dumps({name: as_spec(v).to_json_obj() for name, v in strategy.items()}, indent=1, sort_keys=True)


def strategy_from_json(text: str) -> dict[str, PartitionSpec]:
    """The strategy :func:`strategy_to_json` wrote."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ShardvarValueError(f"a strategy's JSON must be an object mapping names to specs; got {text!r:.80}")
    return {name: PartitionSpec.from_json_obj(obj) for name, obj in raw.items()}
