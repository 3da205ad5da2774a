"""shardvar.tf.convert: TensorFlow checkpoints into shardvar checkpoints that load into modules and optimizers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import shardvar
from shardvar import CheckpointError, EmbeddingBagCollection, ShardedEmbedding
from shardvar.checkpoint import Manifest
from shardvar.nn import TableConfig
from shardvar.tf import TFCheckpoint, convert
from tf_bundle import write_bundle

DATA = Path(__file__).parent / "data" / "tf"


def _expected(kind: str) -> dict[str, np.ndarray]:
    return dict(np.load(DATA / kind / "expected.npz"))


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_partitioned_variable_loads_into_a_sharded_embedding(tmp_path: Path, strategy: str) -> None:
    done = convert(DATA / "saver_v1", tmp_path / "out", {"emb": "model/weight"}, partitioner=3, partition_strategy=strategy)
    assert done.variables == {"emb": "model/weight"} and "big" in done.skipped
    manifest = Manifest.read(tmp_path / "out")
    assert manifest.variables["model/weight"].layout == shardvar.Layout.balanced(strategy, 10, 3)
    model = ShardedEmbedding(10, 4, partitioner=4, partition_strategy="mod" if strategy == "div" else "div")
    shardvar.load({"model": model}, tmp_path / "out")
    assert np.array_equal(model.weight.to_tensor().detach().numpy(), _expected("saver_v1")["emb"])


def test_sharded_variable_and_axis1_partitions_load_into_a_collection(tmp_path: Path) -> None:
    expected_v1, expected_v2 = _expected("saver_v1"), _expected("checkpoint_v2_adam")
    convert(DATA / "checkpoint_v2_adam", tmp_path / "a", {"model/emb": "ebc/embedding_bags.user.weight"},
            partitioner=2, partition_strategy="mod")  # fmt: skip
    convert(DATA / "saver_v1", tmp_path / "b", {"cols": "ebc/embedding_bags.user.weight"})
    ebc = EmbeddingBagCollection({"user": TableConfig(10, 4, partitioner=3, partition_strategy="mod")})
    shardvar.load({"ebc": ebc}, tmp_path / "a")
    table = ebc.embedding_bags["user"].weight.to_tensor().detach().numpy()
    assert np.array_equal(table, expected_v2["model/emb/.ATTRIBUTES/VARIABLE_VALUE"])
    cols = EmbeddingBagCollection({"user": TableConfig(5, 6, partitioner=2)})
    shardvar.load({"ebc": cols}, tmp_path / "b")  # TF split it by columns; shardvar by rows
    assert np.array_equal(cols.embedding_bags["user"].weight.to_tensor().detach().numpy(), expected_v1["cols"])


def test_default_mapping_takes_every_numeric_variable_by_short_name(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    done = convert(DATA / "dtypes_v2", tmp_path / "out", progress=lambda n, total: calls.append((n, total)))
    assert calls[-1][0] == calls[-1][1] > 0 and [n for n, _ in calls] == sorted(n for n, _ in calls)
    assert done.variables["model/bf16/.ATTRIBUTES/VARIABLE_VALUE"] == "model/bf16"
    assert "model/text/.ATTRIBUTES/VARIABLE_VALUE" in done.skipped  # strings are not tensors of numbers
    got = shardvar.checkpoint.read_shard(tmp_path / "out", "model/int16")
    assert np.array_equal(got.numpy(), _expected("dtypes_v2")["model/int16/.ATTRIBUTES/VARIABLE_VALUE"])
    assert shardvar.checkpoint.read_shard(tmp_path / "out", "model/uint64").dtype == torch.uint64
    renamed = convert(DATA / "dtypes_v2", tmp_path / "renamed", lambda name: name.upper() if "int8" in name else None)
    assert set(renamed.variables.values()) == {"MODEL/INT8", "MODEL/UINT8"}


def _check_state(
    optimizer: torch.optim.Optimizer, table: ShardedEmbedding, want: dict[str, np.ndarray], step: int
) -> None:
    layout = table.weight.layout
    for s, shard in sorted(table.weight.local_shards().items()):
        state = optimizer.state[shard]
        rows = layout.shard_ids(s)
        for key, value in want.items():
            assert np.array_equal(state[key].numpy(), value[rows.numpy()]), key
        if "step" in state:
            assert state["step"].item() == step and state["step"].dtype == torch.float32


def test_v1_adam_slots_become_torch_adam_state(tmp_path: Path) -> None:
    exp = _expected("saver_v1")
    done = convert(DATA / "saver_v1", tmp_path / "out", {"emb": "m/weight"}, partitioner=2, partition_strategy="mod",
                   optimizer="adam")  # fmt: skip
    assert done.step == 3 and done.slots == {
        "emb/Adam": "opt/m/weight/exp_avg",
        "emb/Adam_1": "opt/m/weight/exp_avg_sq",
    }
    table = ShardedEmbedding(10, 4, partitioner=3)
    adam = torch.optim.Adam(table.parameters(), lr=0.5)
    shardvar.load({"m": table, "opt": adam}, tmp_path / "out")
    _check_state(adam, table, {"exp_avg": exp["emb/Adam"], "exp_avg_sq": exp["emb/Adam_1"]}, step=3)
    assert adam.param_groups[0]["lr"] == 0.5  # hyper-parameters stay the torch optimizer's own
    table(torch.tensor([1, 2])).sum().backward()
    adam.step()  # the converted state is usable


def test_keras_slots_become_adam_and_adagrad_state(tmp_path: Path) -> None:
    for kind, name, torch_cls, states in [
        ("checkpoint_v2_adam", "adam", torch.optim.Adam, {"exp_avg": "m", "exp_avg_sq": "v"}),
        ("checkpoint_v2_adagrad", "adagrad", torch.optim.Adagrad, {"sum": "accumulator"}),
    ]:
        exp = _expected(kind)
        out = tmp_path / kind
        done = convert(DATA / kind, out, {"model/emb": "t/weight"}, partitioner=3, optimizer=name)
        assert done.step == 2  # the Keras optimizer's `iter`
        assert any("dense" in k and "not converted" in why for k, why in done.skipped.items())
        table = ShardedEmbedding(10, 4, partitioner=2, partition_strategy="mod")
        optimizer = torch_cls(table.parameters())
        shardvar.load({"t": table, "opt": optimizer}, out)
        slot = "model/emb/.OPTIMIZER_SLOT/opt/{}/.ATTRIBUTES/VARIABLE_VALUE"
        _check_state(optimizer, table, {k: exp[slot.format(v)] for k, v in states.items()}, step=2)


def test_momentum_slots_become_sgd_momentum_buffers(tmp_path: Path) -> None:
    exp = _expected("saver_v1")
    done = convert(DATA / "saver_v1", tmp_path / "out", {"cols": "c/weight"}, optimizer="momentum")
    assert done.step is None and done.slots == {"cols/Momentum": "opt/c/weight/momentum_buffer"}
    table = ShardedEmbedding(5, 6, partitioner=2)
    sgd = torch.optim.SGD(table.parameters(), lr=0.1, momentum=0.9)
    shardvar.load({"c": table, "opt": sgd}, tmp_path / "out")
    _check_state(sgd, table, {"momentum_buffer": exp["cols/Momentum"]}, step=0)


def test_slots_that_cannot_map_are_reported(tmp_path: Path) -> None:
    done = convert(DATA / "saver_v1", tmp_path / "out", {"emb": "e", "cols": "c"}, optimizer="adam")
    assert "no Adam state" in done.skipped["cols/Momentum"]
    done = convert(DATA / "saver_v1", tmp_path / "plain", {"emb": "e"})
    assert "pass optimizer=" in done.skipped["emb/Adam"]


def test_two_optimizers_slots_for_one_state_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slots = TFCheckpoint(DATA / "checkpoint_v2_adam").slots()
    twice = [*slots, *(dataclasses.replace(s, optimizer="opt2") for s in slots)]
    monkeypatch.setattr(TFCheckpoint, "slots", lambda self: twice)
    with pytest.raises(CheckpointError, match="two optimizers' slots"):
        convert(DATA / "checkpoint_v2_adam", tmp_path / "out", {"model/emb": "e"}, optimizer="adam")
    assert not (tmp_path / "out").exists()


def test_bad_arguments_write_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [
        ({"mapping": {"nope": "x"}}, "no variable 'nope'"),
        ({"mapping": {"emb": "x", "big": "x"}}, "names both"),
        ({"mapping": {"emb": "x"}, "optimizer": "ftrl"}, "optimizer must be one of"),
        ({"mapping": {"emb": "x"}, "partitioner": {"y": 2}}, "does not produce"),
        ({"mapping": {"emb": "x"}, "partition_strategy": "diagonal"}, "diagonal"),
        ({"mapping": {"emb": "x"}, "partitioner": 0}, "partitioner"),
    ]
    for kwargs, match in cases:
        with pytest.raises(shardvar.ShardvarError, match=match):
            convert(DATA / "saver_v1", out, **kwargs)
        assert not out.exists()
    convert(DATA / "saver_v1", out, {"emb": "x"})
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        convert(DATA / "saver_v1", out, {"emb": "x"})
    convert(DATA / "saver_v1", out, {"emb": "y"}, overwrite=True)
    assert set(Manifest.read(out).variables) == {"y"}


def test_a_damaged_table_fails_the_conversion_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    table = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    write_bundle(tmp_path / "ck", {"emb": table}, {"emb": [500, 500]})
    data = tmp_path / "ck.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 1  # the last slice's last row: only the last target shard reads it
    data.write_bytes(bytes(raw))
    for strategy in ("div", "mod"):
        with pytest.raises(CheckpointError, match=r"emb.*crc32c"):
            convert(tmp_path / "ck", tmp_path / strategy, {"emb": "e"}, partitioner=3, partition_strategy=strategy)
        assert not (tmp_path / strategy).exists()
    convert(DATA / "saver_v1", tmp_path / "prev", {"emb": "e"})
    with pytest.raises(CheckpointError, match="crc32c"):
        convert(tmp_path / "ck", tmp_path / "prev", {"emb": "e"}, overwrite=True)
    assert shardvar.checkpoint.read_shard(tmp_path / "prev", "e").shape == (10, 4)


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def test_convert_streams_with_bounded_memory(tmp_path: Path) -> None:
    """A 64 MiB table into 4 mod shards of 16 MiB (each gathers every 4th row of the whole table):
    the peak stays under the issue's bound (largest shard + 64 MiB) and well under the table."""
    rows, shard = 16 * 1024, 16 << 20
    table = np.arange(rows * 1024, dtype=np.int32).reshape(rows, 1024)
    write_bundle(tmp_path / "ck", {"emb": table}, {"emb": [rows // 3, rows // 3, rows - 2 * (rows // 3)]})
    del table
    convert(DATA / "saver_v1", tmp_path / "warm", {"emb": "e"})  # first-use allocations (imports, buffers)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to the current RSS (Linux >= 4.0)
    convert(tmp_path / "ck", tmp_path / "o", {"emb": "e"}, partitioner=4, partition_strategy="mod")
    growth = _status("VmHWM") - before
    assert growth < min(shard + (64 << 20), (64 << 20) - shard), growth
    got = shardvar.checkpoint.read_shard(tmp_path / "o", "e", shardvar.Layout.div(rows, 2), 1)
    assert got[0, 0].item() == rows // 2 * 1024 and got[-1, -1].item() == rows * 1024 - 1
