"""Bad input on the public API: a clear shardvar error of the right class, and nothing changed.

Each row is one attack of a class named in its id; every one must raise a ShardvarError that is
also the expected built-in, with a message matching ``match``, and leave the variable as it was.
"""

from __future__ import annotations

import pytest
import torch

import shardvar
from shardvar import Layout, ShardedVariable


def table(dtype=torch.float32, layout=None):
    layout = layout or Layout.mod(10, 3)
    return shardvar.shard_tensor(torch.arange(20).reshape(10, 2).to(dtype), layout)


def ints(dtype):
    return shardvar.shard_tensor(torch.arange(10, dtype=dtype).reshape(10, 1), Layout.div(10, 3))


ATTACKS = {
    # out-of-range values into integer variables never wrap
    "range/300-into-uint8-assign": (lambda: ints(torch.uint8), lambda v: v.assign(torch.full((10, 1), 300)), ValueError, "300 is out of range for torch.uint8"),
    "range/128-into-int8-setitem": (lambda: ints(torch.int8), lambda v: v.__setitem__(slice(0, 2), 128), ValueError, "128 is out of range for torch.int8"),
    "range/-1-into-uint8-scatter": (lambda: ints(torch.uint8), lambda v: v.scatter_update([3], [[-1]]), ValueError, r"-1 is out of range for torch.uint8: expected \[0, 255\]"),
    "range/float-into-int": (lambda: ints(torch.int32), lambda v: v.assign(torch.full((10, 1), 1.5)), TypeError, "cannot be cast"),
    # a failing write changes nothing
    "partial/scatter_div-int-by-zero": (lambda: ints(torch.int64), lambda v: v.scatter_div([1, 8], [[2], [0]]), ValueError, "by zero"),
    "partial/bad-id-after-good": (lambda: table(), lambda v: v.scatter_add([1, 99], torch.ones(2, 2)), IndexError, r"ids must be in \[0, 10\); got 99 at position 1"),
    "partial/wrong-update-shape": (lambda: table(), lambda v: v.scatter_update([1, 2], torch.ones(3, 2)), ValueError, "does not fit"),
    "partial/inference-shards": (lambda: _inference_table(), lambda v: v.assign(torch.zeros(10, 2)), TypeError, "inference tensor"),
    "partial/expanded-shard": (lambda: ShardedVariable([torch.zeros(1, 2).expand(5, 2), torch.zeros(5, 2)]), lambda v: v.assign(torch.ones(10, 2)), ValueError, "sharing memory"),
    # raw errors become shardvar's
    "raw/assign-None": (lambda: table(), lambda v: v.assign(None), TypeError, "cannot write None"),
    "raw/assign-object": (lambda: table(), lambda v: v.assign(object()), TypeError, "cannot read"),
    "raw/shard_tensor-int-layout": (lambda: table(), lambda v: shardvar.shard_tensor(torch.ones(4, 2), 4), TypeError, "needs a Layout"),
    "raw/meta-ids": (lambda: table(), lambda v: v.sparse_read(torch.tensor([1], device="meta")), TypeError, "meta device"),
    "raw/row-initializer-kind": (lambda: table(), lambda v: shardvar.RowInitializer(kind="gamma"), ValueError, r"kind must be one of \['normal', 'uniform'\]; got 'gamma'"),
    "raw/row-initializer-block": (lambda: table(), lambda v: shardvar.RowInitializer(block_rows=0), ValueError, "block_rows must be >= 1; got 0"),
    "raw/partitions-zero": (lambda: table(), lambda v: shardvar.partitioned_call(lambda x: x, torch.ones(4), num_partitions=0), ValueError, "num_partitions must be >= 1; got 0"),
    "raw/partitions-float": (lambda: table(), lambda v: shardvar.partitioned_call(lambda x: x, torch.ones(4), num_partitions=2.5), TypeError, "num_partitions must be an int; got 2.5"),
    "raw/no-devices": (lambda: table(), lambda v: shardvar.partitioned_call(lambda x: x, torch.ones(4), devices=[]), ValueError, "non-empty list of devices"),
    "raw/missing-device": (lambda: table(), lambda v: shardvar.partitioned_call(lambda x: x, torch.ones(4), devices=["cuda:7"]), ValueError, "cuda:7 does not exist"),
    "raw/stateful-non-tensor": (lambda: table(), lambda v: shardvar.StatefulPartitionedCall(lambda x, s: x, [{"n": 3}]), TypeError, "state 'n' of partition 0 must be a tensor; got int"),
    "raw/stateful-slash-name": (lambda: table(), lambda v: shardvar.StatefulPartitionedCall(lambda x, s: x, [{"a/b": torch.ones(1)}]), ValueError, "got 'a/b'"),
    "raw/overlapping-shards": (lambda: table(), lambda v: ShardedVariable([(t := torch.zeros(6, 2))[0:3], t[2:5]]), ValueError, "share memory"),
    # values named in the message
    "named/uint64-id": (lambda: table(), lambda v: v.sparse_read(torch.tensor([2**64 - 1], dtype=torch.uint64)), IndexError, "18446744073709551615"),
    "named/max_norm-string": (lambda: table(), lambda v: shardvar.embedding_lookup(v, [1], max_norm="x"), TypeError, "max_norm must be a number; got 'x'"),
    "named/padding_idx-float": (lambda: table(), lambda v: shardvar.ShardedEmbedding(10, 2, padding_idx=1.5), TypeError, "padding_idx must be an int; got 1.5"),
    "named/bag-offsets": (lambda: table(), lambda v: shardvar.embedding_bag(v, torch.tensor([1, 2, 3]), torch.tensor([0, 5])), ValueError, r"at most len\(input\)=3"),
    "named/negative-norm_type": (lambda: table(), lambda v: shardvar.ShardedEmbedding(10, 2, max_norm=-1.0), ValueError, "max_norm must be > 0; got -1.0"),
    "named/freeze-flag": (lambda: table(), lambda v: shardvar.ShardedEmbedding(10, 2, sparse="yes"), TypeError, "sparse must be True or False; got 'yes'"),
}  # fmt: skip


def _inference_table():
    with torch.inference_mode():
        shards = [torch.zeros(5, 2), torch.zeros(5, 2)]
    return ShardedVariable(shards)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_refused_clearly_and_changes_nothing(name) -> None:
    make, attack, builtin, match = ATTACKS[name]
    v = make()
    before = [t.detach().clone() for t in v.variables]
    with pytest.raises(shardvar.ShardvarError, match=match) as info:
        attack(v)
    assert isinstance(info.value, builtin), type(info.value).__mro__
    for old, new in zip(before, v.variables, strict=True):
        assert torch.equal(old, new.detach()), name


def test_a_stateful_call_whose_aggregation_fails_commits_nothing() -> None:
    call = shardvar.StatefulPartitionedCall(
        lambda x, st: (x.sum(0) if x.shape[0] > 1 else x, {"n": st["n"] + 1}),
        [{"n": torch.tensor(0)}, {"n": torch.tensor(0)}],
        aggregate=lambda outs: torch.stack(outs),  # the partitions' outputs cannot be stacked
    )
    with pytest.raises(
        shardvar.ShardvarValueError,
        match=r"aggregate '<lambda>' failed on the partitions' outputs \[\[\[2\]\], \[\[1, 2\]\]\]",
    ):
        call(torch.ones(3, 2))
    assert [int(s["n"]) for s in call.state] == [0, 0]


def test_stateful_state_saves_and_loads_under_its_own_names(tmp_path) -> None:
    call = shardvar.StatefulPartitionedCall(lambda x, st: x, [{"a.b": torch.ones(2)}, {"a.b": torch.zeros(2)}])
    call.save(tmp_path / "c")
    other = shardvar.StatefulPartitionedCall(lambda x, st: x, [{"a.b": torch.full((2,), 5.0)}] * 2)
    other.load(tmp_path / "c")
    assert other.state[0]["a.b"].tolist() == [1.0, 1.0] and other.state[1]["a.b"].tolist() == [0.0, 0.0]
