"""KeyedJagged inputs that would lose data are refused, at construction and by every collection entry point."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from dist_collection_workers import bad_jagged, unchecked
from shardvar import EmbeddingBagCollection, EmbeddingCollection, KeyedJagged, ShardedEmbeddingBag, TableConfig
from shardvar.nn import EmbeddingBagDict, EmbeddingBagList

BAD = bad_jagged()
WIDTHS = {"grouped": 4, "apart": 6}  # table "1" as wide as table "0" (one kernel for both) or not


def _bags(width: int) -> list[ShardedEmbeddingBag]:
    return [ShardedEmbeddingBag(7, 4, 2, "mod"), ShardedEmbeddingBag(7, width)]


ENTRY_POINTS = {
    "EmbeddingBagCollection": lambda w: EmbeddingBagCollection(
        {"0": TableConfig(7, 4, 2, "mod"), "1": TableConfig(7, w)}
    ),
    "EmbeddingCollection": lambda w: EmbeddingCollection({"0": TableConfig(7, 4, 2, "mod"), "1": TableConfig(7, w)}),
    "EmbeddingBagDict": lambda w: EmbeddingBagDict(dict(zip("01", _bags(w), strict=True))),
    "EmbeddingBagList": lambda w: EmbeddingBagList(_bags(w)),
}


@pytest.mark.parametrize("kind", BAD)
def test_construction_refuses_every_bad_kind(kind) -> None:
    fields, error, match = BAD[kind]
    with pytest.raises(error, match=match) as caught:
        KeyedJagged(**fields)
    assert isinstance(caught.value, shardvar.ShardvarError)


@pytest.mark.parametrize("grouping", WIDTHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_every_bad_kind_before_any_lookup(entry, grouping, monkeypatch) -> None:
    module = ENTRY_POINTS[entry](WIDTHS[grouping])

    def no_lookup(*args: object) -> None:
        raise AssertionError("a lookup ran before the input was checked")

    monkeypatch.setattr(shardvar.nn._collection, "_lookup_group", no_lookup)
    for kind, (fields, error, match) in BAD.items():
        with pytest.raises(error, match=match) as caught:
            module(unchecked(fields))
        assert isinstance(caught.value, shardvar.ShardvarError), kind


@pytest.mark.parametrize("grouping", WIDTHS)
@pytest.mark.parametrize("kind", [EmbeddingBagCollection, EmbeddingCollection])
def test_a_refused_batch_leaves_tables_gradients_and_fused_state_as_they_were(kind, grouping) -> None:
    module = kind({"0": TableConfig(7, 4, 2, "mod"), "1": TableConfig(7, WIDTHS[grouping])}, sparse=True)
    opt = shardvar.optim.RowWiseAdagrad(module, lr=0.1)
    shardvar.optim.fuse(opt)
    good = KeyedJagged(("0", "1"), torch.tensor([1, 2, 3, 4, 5]), torch.tensor([[2, 1], [0, 2]]))
    out = module(good)
    sum((v.values if kind is EmbeddingCollection else v).pow(2).sum() for v in out.values()).backward()  # a step
    tables = {k: v.clone() for k, v in module.state_dict().items()}
    state = {k: v.clone() for k, v in opt.state_dict()["state"].items()}
    for kind_of_bad, (fields, error, _) in BAD.items():
        kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        with pytest.raises(error):
            module(unchecked(fields))
        for k, v in fields.items():  # the batch itself is not rewritten (a meta tensor holds nothing to compare)
            same = v == kept[k] if not isinstance(v, torch.Tensor) else v.is_meta or torch.equal(v, kept[k])
            assert same, (kind_of_bad, k)
    assert all(torch.equal(v, tables[k]) for k, v in module.state_dict().items())
    assert all(torch.equal(v, state[k]) for k, v in opt.state_dict()["state"].items())
    assert all(p.grad is None for p in module.parameters())  # nothing reached backward


def test_tensors_written_in_place_after_construction_are_checked_again() -> None:
    ebc = ENTRY_POINTS["EmbeddingBagCollection"](4)
    jagged = KeyedJagged(("0", "1"), torch.tensor([1, 2, 3, 4, 5]), torch.tensor([[2, 1], [0, 2]]))
    jagged.lengths[1] = torch.tensor([-1, 3])  # still adds up to 5: only the sign check sees it
    with pytest.raises(ValueError, match="lengths must be >= 0; got -1 for key '1', bag 0"):
        ebc(jagged)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=1, max_size=4),
    corrupt=st.data(),
)
def test_any_jagged_batch_splits_as_sliced_and_any_negative_length_is_refused(lengths, corrupt) -> None:
    keys = tuple(f"f{i}" for i in range(len(lengths)))
    values = torch.arange(sum(map(sum, lengths)))
    ids, offsets, _ = KeyedJagged(keys, values, torch.tensor(lengths)).split()
    start = 0
    for k, row in zip(keys, lengths, strict=True):
        assert ids[k].tolist() == list(range(start, start + sum(row)))
        assert offsets[k].tolist() == [0, row[0]]
        start += sum(row)
    key = corrupt.draw(st.integers(0, len(keys) - 1))
    bad = torch.tensor(lengths)
    bad[key, 0] -= sum(map(sum, lengths)) + 1  # negative; the total is moved to the next bag so it still adds up
    bad[key, 1] += sum(map(sum, lengths)) + 1
    with pytest.raises(ValueError, match=f"got -\\d+ for key '{keys[key]}', bag 0"):
        KeyedJagged(keys, values, bad)


def test_keyed_jagged_batches_compare_by_identity_as_torchrecs_do() -> None:
    def make() -> KeyedJagged:
        return KeyedJagged(("0", "1"), torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [0, 1]]))

    one, other = make(), make()
    assert one == one and one != other and one in [other, one] and len({one, other}) == 2  # no tensor truth value
    rows = shardvar.JaggedRows(torch.ones(2, 3), torch.tensor([2]))
    assert rows == rows and rows != shardvar.JaggedRows(torch.ones(2, 3), torch.tensor([2]))
