"""Optimizer state has one naming rule (``slot_name``) and one record (``OptimizerRecord``): what a save or a
TensorFlow conversion writes under them, a load finds, for every optimizer shardvar knows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import CheckpointError, ShardedEmbedding
from shardvar.checkpoint import Manifest
from shardvar.checkpoint._optim import OptimizerRecord, slot_name, split_slot_name
from shardvar.tf import convert
from shardvar.tf._slots import OPTIMIZERS as TF_OPTIMIZERS

DATA = Path(__file__).parent / "data" / "tf"

# Every torch.optim optimizer (the checkpoint saves any of them), in a form that keeps extra state.
TORCH: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5, centered=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
}


def _objects(make: Callable) -> tuple[dict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    table, head = ShardedEmbedding(10, 4, partitioner=3, partition_strategy="mod"), nn.Linear(4, 2)
    optimizer = make([*table.parameters(), *head.parameters()])
    return {"t": table, "head": head, "opt": optimizer}, optimizer


@pytest.mark.parametrize("kind", sorted(TORCH))
def test_every_saved_slot_is_named_by_slot_name_and_loads_back(tmp_path: Path, kind: str) -> None:
    objects, optimizer = _objects(TORCH[kind])
    for _ in range(2):
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            p.grad = torch.randn_like(p)
        optimizer.step()
    shardvar.save(objects, tmp_path)
    manifest = Manifest.read(tmp_path)
    record = OptimizerRecord.from_json(manifest.extra["optimizers"]["opt"], "opt")
    assert set(record.slots) == {"t/weight", "head/weight", "head/bias"}
    missing = object()
    tensors = {(p, s) for p, slots in record.slots.items() for s in slots if record.scalar(p, s, missing) is missing}
    assert tensors and {n for n in manifest.variables if n.startswith("opt/")} == {
        slot_name("opt", *t) for t in tensors
    }
    assert {split_slot_name(slot_name("opt", *t)) for t in tensors} == {("opt", *t) for t in tensors}

    fresh, again = _objects(TORCH[kind])
    shardvar.load(fresh, tmp_path)
    saved, loaded = optimizer.state_dict()["state"], again.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for before, after in zip(saved.values(), loaded.values(), strict=True):
        assert before.keys() == after.keys()
        for slot, value in before.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[slot])), slot


# A TensorFlow checkpoint holding slots of each optimizer the converter maps, and the variable with them.
TF_SOURCES = {
    "adam": ("checkpoint_v2_adam", "model/emb", (10, 4)),
    "adagrad": ("checkpoint_v2_adagrad", "model/emb", (10, 4)),
    "momentum": ("saver_v1", "cols", (5, 6)),
}


def test_every_tf_optimizer_has_a_source() -> None:
    assert set(TF_SOURCES) == set(TF_OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(TF_SOURCES))
def test_the_tf_converter_names_slots_by_slot_name_and_they_load(tmp_path: Path, name: str) -> None:
    kind, variable, shape = TF_SOURCES[name]
    spec = TF_OPTIMIZERS[name]
    done = convert(DATA / kind, tmp_path, {variable: "t/weight"}, partitioner=2, optimizer=name, optimizer_key="o")
    states = {spec.states[k.split("/.ATTRIBUTES")[0].rsplit("/", 1)[-1]] for k in done.slots}
    assert sorted(done.slots.values()) == sorted(slot_name("o", "t/weight", s) for s in states)
    manifest = Manifest.read(tmp_path)
    record = OptimizerRecord.from_json(manifest.extra["optimizers"]["o"], "o")
    assert record.cls == spec.class_name and record.slots == {
        "t/weight": states | ({"step"} if spec.counts_steps else set())
    }
    for n in manifest.variables:
        assert n == "t/weight" or split_slot_name(n)[:2] == ("o", "t/weight"), n

    table = ShardedEmbedding(*shape, partitioner=3)
    optimizer = spec.cls(table.parameters(), lr=0.1, **({"momentum": 0.9} if name == "momentum" else {}))
    shardvar.load({"t": table, "o": optimizer}, tmp_path)
    expected = dict(np.load(DATA / kind / "expected.npz"))
    for tf_key, target in done.slots.items():
        state = target.rsplit("/", 1)[1]
        for s, shard in table.weight.local_shards().items():
            rows = table.weight.layout.shard_ids(s).numpy()
            assert np.array_equal(optimizer.state[shard][state].numpy(), expected[tf_key][rows]), tf_key


names = st.text(st.characters(blacklist_characters="/"), min_size=1, max_size=8)


@given(names, st.lists(names, min_size=1, max_size=3).map("/".join), names)
def test_slot_names_split_back(key: str, param: str, slot: str) -> None:
    assert split_slot_name(slot_name(key, param, slot)) == (key, param, slot)


MALFORMED = {
    "not a dict": [],
    "no slots": {"class": "torch.optim.adam.Adam", "param_groups": [], "scalars": {}},
    "class not a string": {"class": 3, "param_groups": [], "slots": {}, "scalars": {}},
    "slots not lists": {"class": "torch.optim.adam.Adam", "param_groups": [], "slots": {"t/weight": 1}, "scalars": {}},
    "params not a list": {"class": "c", "param_groups": [{"params": "t"}], "slots": {}, "scalars": {}},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_record_is_refused_before_anything_changes(tmp_path: Path, case: str) -> None:
    objects, _ = _objects(TORCH["Adam"])
    shardvar.save(objects, tmp_path)
    manifest = Manifest.read(tmp_path)
    manifest.extra["optimizers"]["opt"] = MALFORMED[case]
    (tmp_path / "manifest.json").write_text(manifest.to_json())
    fresh, again = _objects(TORCH["Adam"])
    before = fresh["t"].weight.to_tensor().clone()
    with pytest.raises(CheckpointError, match="record of optimizer 'opt' is malformed"):
        shardvar.load(fresh, tmp_path)
    assert torch.equal(fresh["t"].weight.to_tensor(), before) and not again.state
