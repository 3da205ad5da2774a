"""partitioned_call and StatefulPartitionedCall."""

from __future__ import annotations

import pytest
import torch

from shardvar.transform import PartitionError, StatefulPartitionedCall, partitioned_call


@pytest.mark.parametrize("strategy", ["div", "mod"])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_split_run_concat_equals_the_whole(strategy, n) -> None:
    x, y = torch.randn(10, 3), torch.randn(10, 3)
    out = partitioned_call(lambda a, b: (a * b, a + 1), (x, y), num_partitions=n, partition_strategy=strategy)
    torch.testing.assert_close(out[0], x * y)
    torch.testing.assert_close(out[1], x + 1)
    cols = partitioned_call(lambda a: a * 2, x, axis=1, num_partitions=2, partition_strategy=strategy)
    torch.testing.assert_close(cols, x * 2)


def test_aggregations_and_presplit_inputs() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(partitioned_call(lambda a: a.sum(0), x, num_partitions=3, aggregate="sum"), x.sum(0))
    assert torch.equal(partitioned_call(lambda a: a.sum(0), x, num_partitions=2, aggregate="mean"), x.sum(0) / 2)
    parts = partitioned_call(lambda a: a.shape[0], x, num_partitions=4, aggregate="list")
    assert parts == [2, 2, 1, 1]
    assert partitioned_call(lambda a: a.max(), x, num_partitions=3, aggregate=lambda outs: max(outs)) == 11
    presplit = [torch.ones(2), torch.zeros(3)]
    assert partitioned_call(lambda a: a + 1, presplit, axis=None).tolist() == [2, 2, 1, 1, 1]
    out = partitioned_call(lambda a: a, x, devices=["cpu", "cpu"])
    assert torch.equal(out, x)


def test_tout_is_checked() -> None:
    x = torch.ones(4)
    with pytest.raises(TypeError, match="partition 0 returned 2 outputs; Tout declares 1"):
        partitioned_call(lambda a: (a, a), x, num_partitions=2, Tout=[torch.float32])
    with pytest.raises(TypeError, match=r"output 1 of partition 0 is torch\.int64; Tout declares torch\.float32"):
        partitioned_call(lambda a: (a, a.long()), x, num_partitions=2, Tout=[torch.float32, torch.float32])
    out = partitioned_call(lambda a: (a, a.long()), x, num_partitions=2, Tout=[torch.float32, torch.int64])
    assert out[1].dtype == torch.int64


def test_a_failing_partition_is_named() -> None:
    def fn(a):
        if a[0] >= 6:
            raise ValueError("no sixes")
        return a

    with pytest.raises(PartitionError, match=r"partition\(s\) 2 \(cpu\) failed; partition 2: ValueError: no sixes"):
        partitioned_call(fn, torch.arange(9.0), num_partitions=3)
    with pytest.raises(ValueError, match="same size along axis 0"):
        partitioned_call(lambda a, b: a, (torch.ones(3), torch.ones(4)), num_partitions=2)
    with pytest.raises(ValueError, match=r"aggregate must be"):
        partitioned_call(lambda a: a, torch.ones(4), num_partitions=2, aggregate="median")


def accumulate(x, state):
    state["total"] += x.sum()
    state["calls"] += 1
    if bool((x < 0).any()):
        raise RuntimeError("negative input")
    return x + state["total"]


def test_stateful_call_keeps_state_and_commits_all_or_nothing(tmp_path) -> None:
    call = StatefulPartitionedCall(accumulate, [{"total": torch.tensor(0.0), "calls": torch.tensor(0)}] * 2)
    first = call(torch.ones(4))
    assert first.tolist() == [3.0, 3.0, 3.0, 3.0]
    call(torch.ones(4))
    assert [float(s["total"]) for s in call.state] == [4.0, 4.0]
    before = [{k: v.clone() for k, v in s.items()} for s in call.state]
    with pytest.raises(PartitionError, match=r"partition\(s\) 1 \(cpu\) failed"):
        call(torch.tensor([1.0, 1.0, -1.0, 1.0]))
    for s, b in zip(call.state, before, strict=True):  # partition 0 succeeded, but nothing was committed
        assert all(torch.equal(s[k], b[k]) for k in b)
    call.save(tmp_path / "state")
    other = StatefulPartitionedCall(accumulate, [{"total": torch.tensor(9.0), "calls": torch.tensor(9)}] * 2)
    other.load(tmp_path / "state")
    assert [float(s["total"]) for s in other.state] == [4.0, 4.0] and int(other.state[1]["calls"]) == 2
    assert torch.equal(other(torch.ones(4)), call(torch.ones(4)))
