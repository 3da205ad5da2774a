"""shardvar.plan: fits every device, balances bytes (and lookups), explains what does not fit."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from shardvar.cli import main
from shardvar.transform import PlanError, partition_model, plan

MiB = 1 << 20


def test_fits_and_balances_bytes() -> None:
    shapes = {"users": (200_000, 64), "items": (50_000, 64), "dense": (1024, 1024), "bias": (1024,)}
    devices = {"gpu0": 64 * MiB, "gpu1": 32 * MiB, "cpu": 16 * MiB}
    p = plan(shapes, devices)
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    assert sum(p.used.values()) == total
    for d, budget in devices.items():
        assert p.used[d] <= budget
        # Every device filled to about the same fraction of its budget.
        assert abs(p.used[d] / budget - total / sum(devices.values())) < 0.02, p.table()
    for name, spec in p.strategy.items():
        layout = spec.layout(shapes[name])
        assert layout.num_rows == shapes[name][0] and len(p.placement[name]) == layout.num_shards
    assert p.placement["bias"] in (["gpu0"], ["gpu1"], ["cpu"])  # small: kept whole
    assert "gpu0" in p.table() and "users[0]" in p.table()


def test_frequencies_balance_lookups() -> None:
    rows = 100_000
    freq = torch.arange(1, rows + 1, dtype=torch.float64) ** -1.05  # hot rows first
    devices = {"a": 40 * MiB, "b": 40 * MiB}
    plain = plan({"t": (rows, 64)}, devices)
    balanced = plan({"t": (rows, 64)}, devices, frequencies={"t": freq})
    sizes = balanced.strategy["t"].partitioner.sizes
    assert sizes[0] < sizes[1]  # the hot head is split off into fewer rows
    assert max(balanced.load.values()) < 0.8  # the plain split would put ~90% of lookups on one device
    head = freq[: plain.strategy["t"].partitioner.sizes[0]].sum() / freq.sum()
    assert head > 0.85


def test_does_not_fit_names_devices_and_amounts() -> None:
    with pytest.raises(PlanError, match=r"need 256.0 MiB but the devices hold 96.0 MiB: short by 160.0 MiB.*a by"):
        plan({"t": (1 << 20, 64)}, {"a": 64 * MiB, "b": 32 * MiB})
    with pytest.raises(PlanError, match=r"no split fits: a would be over its 2\.0 KiB budget by 1\.0 KiB"):
        plan({"one-huge-row": (1, 768)}, {"a": 2048, "b": 2048}, min_split_bytes=0)  # a row cannot be split
    with pytest.raises(ValueError, match="budgets must be positive"):
        plan({"t": (4, 4)}, {"a": 0})


def test_a_plan_drives_partition_model() -> None:
    model = nn.Sequential(nn.Embedding(5000, 32), nn.Linear(32, 4))
    p = plan(model, {"cpu:0": 400_000, "cpu:1": 300_000}, min_split_bytes=0)
    part = partition_model(model, p)
    assert type(model[0]).__name__ == "ShardedEmbedding"
    assert part.parameters["0.weight"].layout.sizes == p.strategy["0.weight"].partitioner.sizes


def test_cli_planner(capsys, tmp_path) -> None:
    assert (
        main(["plan", "--device", "a=8MiB", "--device", "b=4MiB", "--var", "users=40000x64", "--var", "bias=64"]) == 0
    )
    out = capsys.readouterr().out
    assert "users" in out and "a" in out and "rows per shard" in out
    with pytest.raises(SystemExit, match="short by"):
        main(["plan", "--device", "a=1MiB", "--var", "users=40000x64"])
    png = tmp_path / "map.png"
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SystemExit, match=r"^2$"):  # found where parsed, before planning
            main(["plan", "--device", "a=8MiB", "--var", "users=4000x64", "--png", str(png)])
        assert "--png needs matplotlib: pip install 'shardvar[plot]'" in capsys.readouterr().err
    else:
        assert (
            main(["plan", "--device", "a=8MiB", "--device", "b=2MiB", "--var", "users=4000x64", "--png", str(png)]) == 0
        )
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_example_fills_alike_and_balances_lookups() -> None:
    p = plan(
        {"users": (200_000, 64), "items": (50_000, 64)},
        {"gpu0": 64 << 20, "gpu1": 32 << 20},
        frequencies={"users": torch.arange(1, 200_001.0) ** -1.05},
    )
    fills = [p.used[d] / p.budgets[d] for d in p.budgets]
    assert max(fills) - min(fills) < 0.005, p.table()
    assert all(abs(share - 0.5) < 0.01 for share in p.load.values()), p.table()
    assert p.placement["users"].count("gpu0") + p.placement["users"].count("gpu1") <= 4  # a few pieces, not rows


@pytest.mark.parametrize("exponent", [0.8, 1.05, 1.3])
@pytest.mark.parametrize("reverse", [False, True])
def test_zipf_frequencies_from_either_end_give_equal_lookup_shares(exponent, reverse) -> None:
    freq = torch.arange(1, 100_001, dtype=torch.float64) ** -exponent
    freq = freq.flip(0) if reverse else freq
    devices = {"a": 40 * MiB, "b": 40 * MiB, "c": 10 * MiB}
    p = plan({"t": (100_000, 64)}, devices, frequencies={"t": freq})
    # Equal up to the rows at one cut: with a steep Zipf the second-hottest row alone is 10%.
    tolerance = max(0.02, float(freq.sort(descending=True).values[1] / freq.sum()))
    assert all(abs(share - 1 / 3) <= tolerance for share in p.load.values()), p.table()
    fills = [p.used[d] / devices[d] for d in devices]
    assert max(fills) - min(fills) < 1e-3  # memory quotas are exact whatever the frequencies
    layout = p.strategy["t"].layout((100_000, 64))
    assert layout.num_rows == 100_000 and len(p.placement["t"]) == layout.num_shards


def test_equally_hot_rows_give_shares_in_proportion_to_rows() -> None:
    devices = {"a": 40 * MiB, "b": 10 * MiB}
    p = plan({"t": (100_000, 64)}, devices, frequencies={"t": torch.ones(100_000)})
    assert abs(p.load["a"] - 0.8) < 0.01 and abs(p.load["b"] - 0.2) < 0.01


@pytest.mark.parametrize(
    "frequencies, match",
    [
        ({"t": torch.tensor([1.0, float("nan"), 1.0])}, r"must be finite and >= 0; got nan at row 1"),
        ({"t": torch.tensor([1.0, -2.0, 1.0])}, r"got -2.0 at row 1"),
        ({"t": torch.ones(5)}, r"has 5 entries; expected 3"),
        ({"t": torch.zeros(3)}, "all zero"),
        ({"u": torch.ones(3)}, r"frequencies name 'u', which is not a variable"),
    ],
)
def test_bad_frequencies_are_refused(frequencies, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan({"t": (3, 4)}, {"a": MiB}, frequencies=frequencies, min_split_bytes=0)
