"""One public vocabulary: each thing has one spelling, and every retired spelling warns once and still works."""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardvar
from shardvar import ShardvarTypeError
from shardvar._deprecation import deprecated_names, deprecated_property, renamed

PUBLIC = ["shardvar"] + [
    f"shardvar.{m}"
    for m in (
        "layout", "partitioners", "variables", "nn", "optim", "dynamic", "checkpoint", "quantized", "tf",
        "distributed", "transform", "tiered", "workloads",
    )
]  # fmt: skip
RETIRED = ("strategy", "num_shards")  # spelled partition_strategy= and partitioner=
# Where these names are deliberate, and why (anything else carrying one fails the walk):
DELIBERATE = {
    # the layout math's own vocabulary (like DTensor's placements), not a user keyword
    "shardvar.Layout", "shardvar.Layout.balanced", "shardvar.Layout.ceil", "shardvar.Layout.div",
    "shardvar.Layout.mod", "shardvar.ceil_sizes", "shardvar.layout.Strategy.sizes",
    "shardvar.layout.balanced_sizes", "shardvar.layout.mod_sizes",
    # TensorFlow's names for the partitioners' own parameter
    "shardvar.FixedShardsPartitioner", "shardvar.fixed_size_partitioner",
    # a plan's strategy: parameter name -> spec (a mapping, not a partition strategy)
    "shardvar.Plan", "shardvar.partition_model", "shardvar.transform.strategy_to_json",
    # the hash index's bucket count and a placement rule's shard count (counts, not a split to choose)
    "shardvar.dynamic.HashIndex", "shardvar.dynamic.HashIndex.allocate", "shardvar.dynamic.shard_of",
    "shardvar.distributed.round_robin",
    # the settings record of ``shardvar demo``'s flags (--strategy)
    "shardvar.workloads.DemoSettings",
}  # fmt: skip


def _callables() -> Iterator[tuple[str, Callable[..., Any]]]:
    seen: set[int] = set()
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                yield f"{module_name}.{name}", obj
                for attr, member in vars(obj).items():
                    member = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                    if not attr.startswith("_") and callable(member):
                        yield f"{module_name}.{name}.{attr}", member
            elif callable(obj):
                yield f"{module_name}.{name}", obj


def test_no_public_callable_takes_a_retired_keyword() -> None:
    found, walked = [], 0
    for where, obj in _callables():
        try:
            parameters = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue
        walked += 1
        if set(parameters) & set(RETIRED) and where not in DELIBERATE:
            found.append((where, sorted(set(parameters) & set(RETIRED))))
    assert walked > 200  # the walk reached the API
    assert found == []


def test_the_deliberate_list_names_only_what_exists() -> None:
    # A stale entry would let a new retired keyword hide behind an old exemption.
    walked = {where for where, _ in _callables()}
    assert walked >= DELIBERATE


def test_the_walk_finds_a_retired_keyword() -> None:
    @renamed()
    def f(x: int, strategy: str = "div") -> None: ...

    assert "strategy" in inspect.signature(f).parameters


# -- each retired spelling warns once, still works, and refuses to be given with its new one ------------


def _table(strategy: str = "mod") -> torch.nn.Module:
    torch.manual_seed(0)
    return shardvar.ShardedEmbedding(7, 3, 3, strategy)


def _saved(tmp_path: Path) -> Path:
    shardvar.save({"m": _table()}, tmp_path / "a")
    return tmp_path / "a"


def _tf() -> str:
    return str(Path(__file__).parent / "data" / "tf" / "saver_v1")


P = shardvar.FixedShardsPartitioner(3)
# name: (a call taking the keyword, the retired keyword)
KEYWORDS: dict[str, tuple[Callable[..., Any], str]] = {
    "Partitioner.layout": (lambda **k: P.layout((7, 3), "float32", **k), "strategy"),
    "AxisPartitioner.layout": (lambda **k: shardvar.fixed_size_partitioner(3).layout((7, 3), **k), "strategy"),
    "PartitionerConfig.layout": (lambda **k: shardvar.PartitionerConfig([3, 1]).layout((7, 3), **k), "strategy"),
    "Layout.from_partitions": (lambda **k: shardvar.Layout.from_partitions((7, 3), [3, 1], **k), "strategy"),
    "to_layout": (lambda **k: shardvar.variables.to_layout(3, (7, 3), **k), "strategy"),
    "ShardedVariable": (lambda **k: shardvar.ShardedVariable([torch.ones(2, 2), torch.ones(1, 2)], **k).layout, "strategy"),
    "PartitionSpec": (lambda **k: shardvar.PartitionSpec(3, **k).layout((7, 3)), "strategy"),
}  # fmt: skip
NEW = {"strategy": "partition_strategy", "num_shards": "partitioner"}
VALUES = {"strategy": "mod", "num_shards": 3}


@pytest.mark.parametrize("name", sorted(KEYWORDS))
def test_a_retired_keyword_warns_once_and_works(name: str) -> None:
    call, old = KEYWORDS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = call(**{old: VALUES[old]})
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, f"{name}({old}=) is deprecated and will be removed in the next release; use {NEW[old]}=")
    ]
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert got == call(**{NEW[old]: VALUES[old]})


@pytest.mark.parametrize("name", sorted(KEYWORDS))
def test_both_spellings_at_once_are_refused(name: str) -> None:
    call, old = KEYWORDS[name]
    with pytest.raises(ShardvarTypeError, match=rf"got both {old}= \(deprecated\) and {NEW[old]}="):
        call(**{old: VALUES[old], NEW[old]: VALUES[old]})


def _spelled(kwargs: dict[str, Any], old: str) -> dict[str, Any]:
    """``kwargs`` with ``old`` spelled the retired way and the rest the new way."""
    return {(k if k == old else NEW[k]): v for k, v in kwargs.items()}


def _layout_of(path: Path, name: str) -> shardvar.Layout:
    return shardvar.checkpoint.Manifest.read(path).variables[name].layout


@pytest.mark.parametrize("old", ["num_shards", "strategy"])
def test_reshard_and_convert_take_their_retired_keywords(tmp_path: Path, old: str) -> None:
    src, kwargs = _saved(tmp_path), {"num_shards": 2, "strategy": "mod"}
    with pytest.warns(FutureWarning, match=rf"^reshard\({old}=\) is deprecated .* use {NEW[old]}=$") as record:
        shardvar.reshard(src, tmp_path / "old", **_spelled(kwargs, old))
    assert len(record) == 1
    shardvar.reshard(src, tmp_path / "new", **_spelled(kwargs, ""))
    assert (
        _layout_of(tmp_path / "old", "m/weight")
        == _layout_of(tmp_path / "new", "m/weight")
        == shardvar.Layout.mod(7, 2)
    )
    with pytest.warns(FutureWarning, match=rf"^convert\({old}=\) is deprecated") as record:
        shardvar.tf.convert(_tf(), tmp_path / "tf-old", {"emb": "emb"}, **_spelled(kwargs, old))
    assert len(record) == 1
    shardvar.tf.convert(_tf(), tmp_path / "tf-new", {"emb": "emb"}, **_spelled(kwargs, ""))
    assert _layout_of(tmp_path / "tf-old", "emb") == _layout_of(tmp_path / "tf-new", "emb")
    with pytest.raises(ShardvarTypeError, match=rf"got both {old}="):
        shardvar.reshard(src, tmp_path / "both", **_spelled(kwargs, ""), **{old: kwargs[old]})
    assert not (tmp_path / "both").exists()


def test_dynamic_tables_take_num_shards_with_a_warning() -> None:
    for cls in (shardvar.DynamicEmbedding, shardvar.DynamicEmbeddingBag):
        with pytest.warns(FutureWarning, match=rf"{cls.__name__}\(num_shards=\) is deprecated") as record:
            old = cls(4, 8, num_shards=2)
        assert len(record) == 1 and old.num_shards == cls(4, 8, partitioner=2).num_shards == 2
        with pytest.raises(ShardvarTypeError, match="got both num_shards="):
            cls(4, 8, num_shards=2, partitioner=2)


def test_a_dynamic_table_takes_a_partitioner_like_the_modules() -> None:
    table = shardvar.DynamicEmbedding(4, 8, partitioner=shardvar.FixedShardsPartitioner(4))
    assert table.num_shards == 4 and table.table.layout == shardvar.Layout.div(8, 4)
    with pytest.raises(shardvar.ShardvarValueError, match="splits axis 1"):
        shardvar.DynamicEmbedding(4, 8, partitioner="1,2")


@pytest.mark.parametrize(
    "make", [lambda: _table(), lambda: shardvar.ShardedLinear(5, 4, partitioner=2)], ids=["emb", "linear"]
)
def test_a_modules_shards_are_its_weights_variables(make: Callable[[], Any]) -> None:
    module = make()
    with pytest.warns(FutureWarning, match=r"\.shards is deprecated .* use module\.weight\.variables") as record:
        old = module.shards
    assert len(record) == 1
    params = [p for _, p in sorted((int(n[6:]), p) for n, p in module.named_parameters() if n.startswith("shard_"))]
    assert all(a is b for a, b in zip(old, module.weight.variables, strict=True))
    assert all(a is b for a, b in zip(params, module.weight.variables, strict=True))  # shard order


def test_shard_indices_pair_with_variables() -> None:
    v = shardvar.shard_tensor(torch.arange(14.0).reshape(7, 2), shardvar.Layout.mod(7, 3))
    assert v.shard_indices == [0, 1, 2]
    assert dict(zip(v.shard_indices, v.variables, strict=True)) == v.local_shards()


def test_partition_spec_strategy_attribute_warns() -> None:
    spec = shardvar.PartitionSpec(2, "mod")
    with pytest.warns(FutureWarning, match=r"PartitionSpec\.strategy is deprecated .* use PartitionSpec\.partition_"):
        assert spec.strategy == spec.partition_strategy == "mod"


def test_shards_parametrization_has_one_home() -> None:
    with pytest.warns(FutureWarning, match=r"shardvar\.transform\.ShardsParametrization is deprecated .* shardvar\.nn"):
        assert shardvar.transform.ShardsParametrization is shardvar.nn.ShardsParametrization
    assert "ShardsParametrization" not in shardvar.transform.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        shardvar.transform.Nope  # noqa: B018
    assert not hasattr(importlib.import_module("shardvar.checkpoint._state"), "Partial")


def test_the_helpers_on_their_own() -> None:
    class Thing:
        old = deprecated_property("old", "Thing.new", lambda self: 5)

    with pytest.warns(FutureWarning, match=r"^Thing\.old is deprecated and will be removed in the next release; use"):
        assert Thing().old == 5
    getattr_ = deprecated_names("pkg", {"Old": ("shardvar.layout", "Layout")})
    with pytest.warns(FutureWarning, match=r"pkg\.Old is deprecated .* use shardvar\.layout\.Layout"):
        assert getattr_("Old") is shardvar.Layout
    with pytest.raises(AttributeError):
        getattr_("Missing")


@pytest.mark.parametrize(
    ("partitioner", "want", "tf_shards"),  # the saved table is 7 x 3, TensorFlow's "emb" 10 x 4 (float32)
    [
        (3, shardvar.Layout.div(7, 3), 3),
        (shardvar.FixedShardsPartitioner(3), shardvar.Layout.div(7, 3), 3),
        (shardvar.PartitionerConfig([2, 1]), shardvar.Layout.div(7, 2), 2),
        ("1,3", shardvar.Layout.div(3, 3, axis=1), None),
        (shardvar.MaxSizePartitioner(3 * 4 * 4), shardvar.Layout.div(7, 2), 4),
    ],
    ids=["count", "partitioner", "config", "string", "max-size"],
)
def test_reshard_and_convert_take_what_the_modules_partitioner_takes(
    tmp_path: Path, partitioner: Any, want: shardvar.Layout, tf_shards: int | None
) -> None:
    src = _saved(tmp_path)
    shardvar.reshard(src, tmp_path / "r", partitioner)
    assert _layout_of(tmp_path / "r", "m/weight") == want
    if tf_shards is None:  # a TensorFlow table converts by rows
        with pytest.raises(shardvar.CheckpointError, match="split along axis 1; tables convert by rows"):
            shardvar.tf.convert(_tf(), tmp_path / "t", {"emb": "emb"}, partitioner=partitioner)
        assert not (tmp_path / "t").exists()
    else:
        shardvar.tf.convert(_tf(), tmp_path / "t", {"emb": "emb"}, partitioner={"emb": partitioner})
        assert _layout_of(tmp_path / "t", "emb") == shardvar.Layout.div(10, tf_shards)


def test_a_partitioned_parameters_shards_are_its_variables() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(6, 2))
    part = shardvar.partition_model(model, {"0.weight": 3}).parameters["0.weight"]
    with pytest.warns(
        FutureWarning, match=r"PartitionedParameter\.shards is deprecated .* use PartitionedParameter\.v"
    ):
        assert part.shards is part.variables
    assert all(a is b for a, b in zip(part.variables, model[0].weight.variables, strict=True))
    with pytest.warns(FutureWarning, match=r"PartitionedParameter\(shards=\) is deprecated"):
        again = type(part)(part.name, part.old, part.layout, shards=part.variables)
    assert again.variables is part.variables and again.layout == part.layout
