"""quantize(path, dtype, dst=...) packs the embedding tables only: the manifest says which they are.

``shardvar.save`` records each variable's role ("table" / "other"); a checkpoint without the
record (older ones) needs ``tables=``. Dense layers come out bit for bit as they went in, and the
serving model (float dense layers, quantized tables) loads the result.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shardvar
from shardvar import CheckpointError, EmbeddingBagCollection, ShardedEmbeddingBag, TableConfig, quantize
from shardvar.checkpoint import Manifest


class Ranker(nn.Module):
    """Tables of every kind shardvar saves, and dense 2-D layers of the sizes a table could have."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        if kind == "collection":
            self.emb = EmbeddingBagCollection({"users": TableConfig(12, 4, 2, "mod", feature_names=["u", "v"])})
        elif kind == "sharded_bag":
            self.emb = ShardedEmbeddingBag(12, 4, 3, mode="sum")
        else:
            self.emb = nn.EmbeddingBag(12, 4, mode="sum")
        self.fc = nn.Linear(4, 12)  # 2-D float [12, 4]: the shape of the table
        self.out = nn.Linear(12, 4)
        shardvar.shard_parameter(self.out, "weight", 2)  # a sharded dense layer is not a table either

    def tables(self) -> list[str]:
        return [n for n in _names(self) if n.startswith("m/emb")]


def _names(model: nn.Module) -> list[str]:
    return sorted(shardvar.checkpoint._state.resolve({"m": model}).variables)


def _serving(model: Ranker, dtype: torch.dtype) -> Ranker:
    serving = Ranker("collection" if isinstance(model.emb, EmbeddingBagCollection) else "sharded_bag")
    float_emb = model.emb if not isinstance(model.emb, nn.EmbeddingBag) or hasattr(model.emb, "store") else None
    if float_emb is None:  # torch's bag: served by its sharded twin
        float_emb = ShardedEmbeddingBag.from_pretrained(model.emb.weight.detach(), mode="sum")
    serving.emb = quantize(float_emb, dtype)
    with torch.no_grad():  # the dense layers as a load must fill them
        for p in [*serving.fc.parameters(), *serving.out.parameters()]:
            p.zero_()
    return serving


KINDS = ["collection", "sharded_bag", "torch_bag"]


@pytest.mark.parametrize("dtype", [torch.quint8, torch.quint4x2, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_tables_packed_dense_layers_untouched_and_the_serving_model_loads_it(tmp_path, kind, dtype) -> None:
    model = Ranker(kind)
    shardvar.save({"m": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}, tmp_path / "f")
    roles = {n: v.role for n, v in Manifest.read(tmp_path / "f").variables.items()}
    assert {n for n, r in roles.items() if r == "table"} == set(model.tables()) != set()
    assert all(r == "other" for n, r in roles.items() if n not in model.tables())  # dense, optimizer state
    quantize(tmp_path / "f", dtype, dst=tmp_path / "q")
    manifest = Manifest.read(tmp_path / "q")
    assert set(manifest.extra["packed"]) == set(model.tables())
    assert all(manifest.variables[n].role == "table" for n in model.tables())
    serving = _serving(model, dtype)
    shardvar.load({"m": serving}, tmp_path / "q")
    assert torch.equal(serving.fc.weight, model.fc.weight) and torch.equal(serving.fc.bias, model.fc.bias)
    dense = [shardvar.nn.sharded_parameters(m.out)["weight"].to_tensor() for m in (serving, model)]
    assert torch.equal(*dense)
    want = _serving(model, dtype).emb  # the tables quantized in memory: the same packed rows
    got_rows = {n: t.dequantize() for n, t in _tables(serving.emb).items()}
    assert all(torch.equal(got_rows[n], t.dequantize()) for n, t in _tables(want).items())


def _tables(emb: nn.Module) -> dict:
    return dict(emb.embedding_bags) if hasattr(emb, "embedding_bags") else {"": emb}


def _unrecorded(path) -> None:
    """The checkpoint as a shardvar without the role record wrote it (no "role" fields)."""
    manifest = Manifest.read(path)
    for name, entry in manifest.variables.items():
        manifest.variables[name] = type(entry)(entry.name, entry.dtype, entry.shape, entry.layout, entry.pieces)
    text = manifest.to_json()
    assert '"role"' not in text
    (path / "manifest.json").write_text(text)


@pytest.mark.parametrize(
    "tables",
    [
        ["m/emb.embedding_bags.users.weight"],
        "m/emb.embedding_bags.users.weight",
        "m/emb.*",
        re.compile(r"m/emb\..*\.weight"),
        ("m/emb*",),
    ],
)
def test_a_checkpoint_that_does_not_say_needs_tables(tmp_path, tables) -> None:
    model = Ranker("collection")
    shardvar.save({"m": model}, tmp_path / "f")
    _unrecorded(tmp_path / "f")
    loaded = Ranker("collection")
    shardvar.load({"m": loaded}, tmp_path / "f")  # an old manifest loads: its roles are unknown
    assert all(v.role is None for v in Manifest.read(tmp_path / "f").variables.values())
    with pytest.raises(CheckpointError, match=r"does not say whether \[.*'m/fc.weight'.*pass tables="):
        quantize(tmp_path / "f", torch.quint8, dst=tmp_path / "q")
    assert not (tmp_path / "q").exists()
    quantize(tmp_path / "f", torch.quint8, dst=tmp_path / "q", tables=tables)
    assert set(Manifest.read(tmp_path / "q").extra["packed"]) == set(model.tables())
    shardvar.load({"m": _serving(model, torch.quint8)}, tmp_path / "q")


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        ("m/nothing*", r"tables 'm/nothing\*' names no table"),
        (re.compile("x"), "names no table"),
        ([], "tables must be"),
        (3, "tables must be"),
        (["m/fc.bias"], "cannot quantize variable 'm/fc.bias'"),
    ],
)
def test_bad_tables_refused_before_writing(tmp_path, tables, match) -> None:
    shardvar.save({"m": Ranker("collection")}, tmp_path / "f")
    with pytest.raises(CheckpointError, match=match):
        quantize(tmp_path / "f", torch.quint8, dst=tmp_path / "q", tables=tables)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    ("stored", "requested"), [("quint4x2", "quint8"), ("quint8", "float16"), ("float16", "quint4x2")]
)
def test_packed_rows_are_not_silently_kept_in_another_format(tmp_path, stored, requested) -> None:
    model = Ranker("collection")
    shardvar.save({"m": model}, tmp_path / "f")
    quantize(tmp_path / "f", getattr(torch, stored), dst=tmp_path / "s")
    with pytest.raises(CheckpointError, match=rf"stored as {stored} rows; {requested} was requested"):
        quantize(tmp_path / "s", getattr(torch, requested), dst=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    quantize(tmp_path / "s", getattr(torch, stored), dst=tmp_path / "same")  # the format it holds: a copy
    assert Manifest.read(tmp_path / "same").extra["packed"] == Manifest.read(tmp_path / "s").extra["packed"]


@pytest.mark.parametrize("role", ["dense", 1, None])
def test_a_role_outside_the_format_is_refused(tmp_path, role) -> None:
    shardvar.save({"m": Ranker("collection")}, tmp_path)
    text = (tmp_path / "manifest.json").read_text()
    manifest = Manifest.read(tmp_path)
    body = manifest._body()
    body["variables"]["m/fc.weight"]["role"] = role
    from shardvar.checkpoint._manifest import _checksum

    raw = {"checksum": _checksum(body), **body}
    (tmp_path / "manifest.json").write_text(__import__("json").dumps(raw))
    with pytest.raises(CheckpointError, match="a role is one of"):
        Manifest.read(tmp_path)
    assert text  # the checkpoint as saved was readable


def test_a_bare_variable_is_unknown_and_a_module_says() -> None:
    state = shardvar.checkpoint._state.resolve(
        {"t": shardvar.shard_tensor(torch.randn(6, 3), shardvar.Layout.balanced("div", 6, 2)), "m": Ranker("torch_bag")}
    )
    assert "t" not in state.roles and state.roles["m/emb.weight"] == "table" and state.roles["m/fc.weight"] == "other"
