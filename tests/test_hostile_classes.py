"""Hostile inputs as generated classes: every public entry point x every bad kind (issue 22, part 5).

Each table below is an entry point registry; the tests are their product with the bad kinds, so a
new entry point is covered by adding one row, and ``test_every_public_entry_point_is_registered``
fails when a public callable that takes devices or ids is missing from its registry. Every case
must raise the right ShardvarError subclass (also the matching built-in), name the bad value,
and leave every variable, shard, module, optimizer and checkpoint of the world as it was.
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardvar
from shardvar import Layout, ShardedVariable


@dataclass
class World:
    """Everything a hostile call could damage: checked before and after every case."""

    v: ShardedVariable
    emb: shardvar.ShardedEmbedding
    bag: shardvar.ShardedEmbeddingBag
    model: nn.Sequential
    opt: torch.optim.Optimizer
    dyn: shardvar.DynamicEmbedding
    ckpt: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """One world for the module: every case checks it is left unchanged, so none can spoil the next."""
    tmp_path = tmp_path_factory.mktemp("world")
    torch.manual_seed(0)
    table = torch.arange(20.0).reshape(10, 2)
    v = ShardedVariable([nn.Parameter(t.clone()) for t in shardvar.shard_tensor(table, Layout.mod(10, 3)).variables])
    model = nn.Sequential(nn.Embedding(10, 2), nn.Linear(2, 3))
    emb = shardvar.ShardedEmbedding(10, 2, partitioner=3)
    bag = shardvar.ShardedEmbeddingBag(10, 2, partitioner=2, mode="sum")
    opt = torch.optim.Adam([*emb.parameters(), *model.parameters(), *v.parameters()], lr=0.1)
    (emb(torch.tensor([1, 2])).sum() + model(torch.tensor([3])).sum() + v.to_tensor().sum()).backward()
    opt.step()  # the optimizer has state to lose
    dyn = shardvar.DynamicEmbedding(2, 8)
    ckpt = tmp_path / "ckpt"
    shardvar.save({"v": v, "emb": emb, "model": model, "opt": opt}, ckpt)
    return World(v, emb, bag, model, opt, dyn, ckpt)


def snapshot(w: World) -> dict[str, Any]:
    tensors = {"v": w.v.to_tensor().detach().clone()}
    for name, module in {"emb": w.emb, "bag": w.bag, "model": w.model, "dyn": w.dyn}.items():
        tensors |= {f"{name}.{k}": t.detach().clone() for k, t in module.state_dict(keep_vars=True).items()}
    for i, state in enumerate(w.opt.state.values()):
        tensors |= {f"opt.{i}.{k}": t.clone() for k, t in state.items() if isinstance(t, torch.Tensor)}
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(w.ckpt.rglob("*")) if p.is_file()}
    return {"tensors": tensors, "files": files, "names": [n for n, _ in w.model.named_parameters()]}


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["files"] == after["files"] and before["names"] == after["names"]
    assert before["tensors"].keys() == after["tensors"].keys()
    for k, t in before["tensors"].items():
        assert torch.equal(t, after["tensors"][k]), k


def refused(w: World, call, error: type, match: str) -> None:
    before = snapshot(w)
    with pytest.raises(shardvar.ShardvarError, match=match) as info:
        call()
    assert isinstance(info.value, error), type(info.value).__mro__
    assert_unchanged(before, snapshot(w))


# -- devices: every place a device is accepted x every bad device -------------------------------

DEVICE_ENTRY_POINTS = {
    "ShardedVariable.to_tensor": lambda w, d: w.v.to_tensor(d),
    "ShardedVariable.to": lambda w, d: w.v.to(d),
    "shard_tensor": lambda w, d: shardvar.shard_tensor(torch.ones(4, 2), Layout.div(4, 2), devices=["cpu", d]),
    "ShardStore.allocate": lambda w, d: shardvar.variables.ShardStore.allocate(
        Layout.div(4, 2), (4, 2), torch.float32, devices=[d, "cpu"]
    ),
    "shard_parameter": lambda w, d: shardvar.shard_parameter(w.model[1], "weight", 2, devices=["cpu", d]),
    "partition_model": lambda w, d: shardvar.partition_model(w.model, {"0.weight": 2}, devices=[d]),
    "ShardedEmbedding(device)": lambda w, d: shardvar.ShardedEmbedding(4, 2, device=d),
    "ShardedEmbedding(devices)": lambda w, d: shardvar.ShardedEmbedding(4, 2, partitioner=2, devices=["cpu", d]),
    "ShardedEmbeddingBag(device)": lambda w, d: shardvar.ShardedEmbeddingBag(4, 2, device=d),
    "ShardedEmbeddingBag(devices)": lambda w, d: shardvar.ShardedEmbeddingBag(4, 2, partitioner=2, devices=[d, "cpu"]),
    "ShardedLinear(device)": lambda w, d: shardvar.ShardedLinear(4, 2, device=d),
    "ShardedLinear(devices)": lambda w, d: shardvar.ShardedLinear(4, 2, partitioner=2, devices=["cpu", d]),
    "DynamicEmbedding(devices)": lambda w, d: shardvar.DynamicEmbedding(2, 8, partitioner=2, devices=[d, "cpu"]),
    "DynamicEmbeddingBag(devices)": lambda w, d: shardvar.DynamicEmbeddingBag(2, 8, partitioner=2, devices=[d, "cpu"]),
    "partitioned_call": lambda w, d: shardvar.partitioned_call(lambda x: x, torch.ones(4), devices=[d]),
    "StatefulPartitionedCall": lambda w, d: shardvar.StatefulPartitionedCall(lambda x, s: x, [{"a": torch.ones(1)}], devices=[d]),
}  # fmt: skip

BAD_DEVICES = {
    "missing cuda": ("cuda:9", shardvar.ShardvarDeviceError, r"cuda:9 does not exist: this machine has \d+ CUDA"),
    "missing backend": ("xpu:3", shardvar.ShardvarDeviceError, r"xpu:3 does not exist: this machine has \d+ XPU"),
    "unparsable": ("nonsense", shardvar.ShardvarDeviceError, r"'nonsense' is not a device .*expected e\.g\. 'cpu'"),
    "not a device": (3.5, shardvar.ShardvarTypeError, r"(must be a torch\.device|takes a device).*; got 3\.5"),
}


@pytest.mark.parametrize("kind", sorted(BAD_DEVICES))
@pytest.mark.parametrize("entry", sorted(DEVICE_ENTRY_POINTS))
def test_a_bad_device_is_refused_everywhere_a_device_is_accepted(world, entry, kind) -> None:
    device, error, match = BAD_DEVICES[kind]
    refused(world, lambda: DEVICE_ENTRY_POINTS[entry](world, device), error, match)


# -- ids: every lookup or write that takes ids x every bad kind of ids ---------------------------


def _write(op: str):
    return lambda w, ids: getattr(w.v, op)(ids, torch.ones(2, 2))


ID_ENTRY_POINTS = {
    "embedding_lookup": lambda w, ids: shardvar.embedding_lookup(w.v, ids),
    "embedding_lookup max_norm": lambda w, ids: shardvar.embedding_lookup(w.v, ids, max_norm=1.0),
    "sparse_read": lambda w, ids: w.v.sparse_read(ids),
    "getitem": lambda w, ids: w.v[ids],
    "setitem": lambda w, ids: w.v.__setitem__(ids, 0.0),
    **{op: _write(op) for op in (
        "scatter_update", "scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max",
        "batch_scatter_update",
    )},
    "embedding_bag": lambda w, ids: shardvar.embedding_bag(w.v, _as_bags(ids)),
    "ShardedEmbedding": lambda w, ids: w.emb(ids),
    "ShardedEmbeddingBag": lambda w, ids: w.bag(_as_bags(ids)),
    "DynamicEmbedding": lambda w, ids: w.dyn(ids),
}  # fmt: skip


def _as_bags(ids: torch.Tensor) -> torch.Tensor:
    return ids.reshape(1, -1) if not ids.is_nested and ids.dim() == 1 else ids


def _strided_nested() -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that the strided layout is a prototype: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3, 4])])


BAD_IDS = {
    "meta": (torch.tensor([1, 2], device="meta"), shardvar.ShardvarTypeError, r"shape \[(1, )?2\] on the meta device"),
    "floats": (torch.tensor([1.0, 2.0]), shardvar.ShardvarTypeError, r"(integer|integers).*float32|float32.*integer"),
    "out of range": (torch.tensor([1, 99]), shardvar.ShardvarIndexError, "99"),
    "negative": (torch.tensor([-11, 1]), shardvar.ShardvarIndexError, "-11"),
    "strided nested": (_strided_nested(), shardvar.ShardvarTypeError, "layout=torch.strided"),
}
# A dynamic table takes any int64 id (hashed), so out-of-range ids are not bad there.
NOT_BAD = {("DynamicEmbedding", "out of range"), ("DynamicEmbedding", "negative")}


@pytest.mark.parametrize("kind", sorted(BAD_IDS))
@pytest.mark.parametrize("entry", sorted(ID_ENTRY_POINTS))
def test_bad_ids_are_refused_by_every_entry_point(world, entry, kind) -> None:
    if (entry, kind) in NOT_BAD:
        pytest.skip("not a bad input for this entry point")
    ids, error, match = BAD_IDS[kind]
    refused(world, lambda: ID_ENTRY_POINTS[entry](world, ids), error, match)


META_VALUE_ENTRY_POINTS = {
    "assign": lambda w, t: w.v.assign(t),
    "assign_add": lambda w, t: w.v.assign_add(t),
    "setitem": lambda w, t: w.v.__setitem__(slice(0, 10), t),
    "scatter_update": lambda w, t: w.v.scatter_update(list(range(10)), t),
    "copy_": lambda w, t: w.v.copy_(t),
}


@pytest.mark.parametrize("entry", sorted(META_VALUE_ENTRY_POINTS))
def test_values_on_the_meta_device_are_refused_by_every_write(world, entry) -> None:
    meta = torch.ones(10, 2, device="meta")
    refused(world, lambda: META_VALUE_ENTRY_POINTS[entry](world, meta), shardvar.ShardvarTypeError, "meta device")


META_VARIABLE_READS = {
    "numpy": lambda v: v.numpy(),
    "tolist": lambda v: v.tolist(),
    "float": lambda v: float(v),
    "int": lambda v: int(v),
    "bool": lambda v: bool(v),
    "save": lambda v: shardvar.save({"meta": v}, Path(v.name)),
}


@pytest.mark.parametrize("entry", sorted(META_VARIABLE_READS))
def test_a_meta_variable_refuses_every_read_of_its_values(world, entry, tmp_path) -> None:
    v = ShardedVariable([torch.empty(1, device="meta")], name=str(tmp_path / "meta-ckpt"))
    refused(world, lambda: META_VARIABLE_READS[entry](v), shardvar.ShardvarTypeError, r"on the meta device")
    assert not (tmp_path / "meta-ckpt").exists()


# -- partition_model's arguments ------------------------------------------------------------------

BAD_PARTITIONS = {
    "int strategy": (lambda m: shardvar.partition_model(m, 5), shardvar.ShardvarTypeError, "got 5"),
    "None strategy": (lambda m: shardvar.partition_model(m, None), shardvar.ShardvarTypeError, "got None"),
    "list strategy": (lambda m: shardvar.partition_model(m, [2]), shardvar.ShardvarTypeError, r"got \[2\]"),
    "not a module": (lambda m: shardvar.partition_model(5, {"0.weight": 2}), shardvar.ShardvarTypeError, "got int: 5"),
    "devices string": (lambda m: shardvar.partition_model(m, {"0.weight": 2}, devices="cpu"), shardvar.ShardvarTypeError, "got 'cpu'"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_PARTITIONS))
def test_partition_model_refuses_bad_arguments_before_changing_the_model(world, case) -> None:
    call, error, match = BAD_PARTITIONS[case]
    refused(world, lambda: call(world.model), error, match)
    assert type(world.model[0]) is nn.Embedding


# -- partitioned calls whose outputs cannot be combined -------------------------------------------

UNCOMBINABLE = {
    "sum": ("sum", r"output 0 of the partitions cannot be combined with aggregate='sum': shapes \[\[2\], \[1\]\]"),
    "mean": ("mean", r"aggregate='mean': shapes \[\[2\], \[1\]\]"),
    "concat": ("concat", r"aggregate='concat': shapes \[\[2, 2\], \[1, 3\]\] by partition; expected one shape except"),
    "stack": (lambda outs: torch.stack(outs), r"aggregate '<lambda>' failed on the partitions' outputs"),
}


def _uneven(x: torch.Tensor, state: dict) -> tuple:
    out = x if x.shape[0] == 2 else torch.ones(1, 3)
    return (out.sum(1) if x.shape[0] == 2 else out[:, 0]), {"n": state["n"] + 1}


@pytest.mark.parametrize("aggregate", sorted(UNCOMBINABLE))
def test_a_stateful_call_whose_outputs_cannot_be_combined_commits_nothing(aggregate) -> None:
    how, match = UNCOMBINABLE[aggregate]
    fn = (
        _uneven
        if aggregate != "concat"
        else lambda x, s: (x if x.shape[0] == 2 else torch.ones(1, 3), {"n": s["n"] + 1})
    )
    call = shardvar.StatefulPartitionedCall(fn, [{"n": torch.tensor(0)}, {"n": torch.tensor(0)}], aggregate=how)
    with pytest.raises(shardvar.ShardvarValueError, match=match):
        call(torch.ones(3, 2))
    assert [int(s["n"]) for s in call.state] == [0, 0]
    with pytest.raises(shardvar.ShardvarValueError, match=match):
        shardvar.partitioned_call(lambda x: fn(x, {"n": 0})[0], torch.ones(3, 2), num_partitions=2, aggregate=how)


def test_a_bad_aggregate_or_tout_is_refused_before_any_partition_runs() -> None:
    ran = []
    with pytest.raises(shardvar.ShardvarValueError, match=r"aggregate must be one of .*; got 'median'"):
        shardvar.StatefulPartitionedCall(lambda x, s: ran.append(x), [{"n": torch.tensor(0)}], aggregate="median")
    with pytest.raises(shardvar.ShardvarValueError, match=r"got 'median'"):
        shardvar.partitioned_call(lambda x: ran.append(x), torch.ones(2), aggregate="median")
    with pytest.raises(shardvar.ShardvarTypeError, match=r"Tout must be a list of torch dtypes.*; got 'float32'"):
        shardvar.partitioned_call(lambda x: ran.append(x), torch.ones(2), Tout="float32")
    with pytest.raises(shardvar.ShardvarTypeError, match=r"got \[torch.float32, 'int'\]"):
        shardvar.StatefulPartitionedCall(
            lambda x, s: ran.append(x), [{"n": torch.tensor(0)}], Tout=[torch.float32, "int"]
        )
    assert ran == []


# -- messages name the offending value ------------------------------------------------------------

NAMED = {
    "axis=None inputs": (lambda: shardvar.partitioned_call(lambda x: x, 5, axis=None), "got 5"),
    "strategy JSON": (lambda: shardvar.transform._spec.strategy_from_json("[1, 2]"), r"got '\[1, 2\]'"),
    "no tables": (lambda: shardvar.optim.SGD([], lr=0.1), r"params=\[\]"),
    "bool key": (lambda: ShardedVariable([torch.ones(2)])[True], "got key True"),
    "two ellipses": (lambda: ShardedVariable([torch.ones(2)])[..., ...], r"got key \(Ellipsis, Ellipsis\)"),
    "newaxis write": (lambda: ShardedVariable([torch.ones(2)]).__setitem__((None, 0), 1.0), r"got key \(None, 0\)"),
    "offsets with 2-D": (lambda: shardvar.embedding_bag([torch.ones(3, 2)], torch.tensor([[1]]), torch.tensor([0])), r"offsets=tensor\(\[0\]\) with input of shape \[1, 1\]"),
    "sp_weights indices": (lambda: shardvar.embedding_lookup_sparse(
        [torch.ones(3, 2)], torch.tensor([[0, 1]]).to_sparse(), torch.tensor([[1.0, 0.0]]).to_sparse()
    ), r"got 1 entries at \[\[0, 0\]\]\.\.\. for 1 at \[\[0, 1\]\]"),
    "empty plan": (lambda: shardvar.plan({"a": (4, 2)}, {}), r"got \{\}"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(NAMED))
def test_messages_name_the_offending_value(case) -> None:
    call, match = NAMED[case]
    with pytest.raises(shardvar.ShardvarError, match=match):
        call()


# -- the registries cover the public API -----------------------------------------------------------


def test_every_public_entry_point_is_registered() -> None:
    """A public callable that takes devices or ids must be in a registry above (so it is attacked)."""
    covered = {k.split("(")[0].split(".")[0] for k in (*DEVICE_ENTRY_POINTS, *ID_ENTRY_POINTS)}
    covered.add("plan")  # its "devices" are budget labels of any machine ("gpu0"), not devices of this one
    missing = []
    for name in shardvar.__all__:
        obj = getattr(shardvar, name)
        try:
            params = set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue
        if params & {"device", "devices", "ids"} and name not in covered:
            missing.append(name)
    assert missing == [], f"add these to DEVICE_ENTRY_POINTS / ID_ENTRY_POINTS: {missing}"
