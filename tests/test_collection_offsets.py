"""A collection checks every feature's offsets and ids as that feature alone would, in feature order,
however its tables are grouped and whichever path (sparse table by table, dense packed) looks them up."""

from __future__ import annotations

import pytest
import torch

from shardvar import EmbeddingBagCollection, ShardvarError, TableConfig

WIDTHS = {"grouped": (4, 4, 4), "apart": (4, 5, 6)}
IDS = {"a": torch.tensor([1, 2, 3, 4]), "b": torch.tensor([0, 5, 6]), "c": torch.tensor([7, 8, 1, 2])}
GOOD = {"a": torch.tensor([0, 2]), "b": torch.tensor([0, 1, 3]), "c": torch.tensor([0, 0])}  # unequal bag counts
BAD = {  # offsets -> the message a feature's own check gives
    "not from 0": (torch.tensor([1, 2]), r"start at 0; got \[1, 2\]"),
    "decreasing": (torch.tensor([0, 3, 2]), r"non-decreasing and at most len\(input\)=\d; got \[0, 3, 2\]"),
    "past the ids": (torch.tensor([0, 9]), r"non-decreasing and at most len\(input\)=\d; got \[0, 9\]"),
    "empty": (torch.tensor([], dtype=torch.int64), r"non-empty and start at 0"),
    "2-D": (torch.tensor([[0, 1]]), r"1-D, non-empty and start at 0"),
}


def collection(grouping: str, sparse: bool, strategy: str) -> EmbeddingBagCollection:
    rows = {"a": 10, "b": 10, "c": 10}
    return EmbeddingBagCollection(
        {n: TableConfig(rows[n], w, 3, strategy) for n, w in zip(rows, WIDTHS[grouping], strict=True)}, sparse=sparse
    )


@pytest.mark.parametrize("strategy", ["div", "mod"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("grouping", WIDTHS)
@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["a", "b", "c"])
def test_bad_offsets_of_any_feature_get_that_features_own_error(grouping, sparse, strategy, equal, bad, where) -> None:
    ebc = collection(grouping, sparse, strategy)
    offsets = {f: torch.tensor([0, 2]) for f in IDS} if equal else dict(GOOD)
    ids = {f: x[:3] if equal else x for f, x in IDS.items()}
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    offsets[where], message = BAD[bad]
    with pytest.raises(ShardvarError, match=rf"feature {where!r}: offsets must be .*{message}"):
        ebc(ids, offsets)
    assert all(torch.equal(v, before[k]) for k, v in ebc.state_dict().items())
    good = ebc(ids, {f: torch.tensor([0, 2]) for f in IDS} if equal else GOOD)  # and the good ones look up
    assert [tuple(v.shape) for v in good.values()] == ([(2, w) for w in WIDTHS[grouping]] if equal else
                                                       [(2, WIDTHS[grouping][0]), (3, WIDTHS[grouping][1]), (2, WIDTHS[grouping][2])])  # fmt: skip


@pytest.mark.parametrize("strategy", ["div", "mod"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("grouping", WIDTHS)
@pytest.mark.parametrize("value", [10, -1, 2**40])
def test_the_first_fault_in_feature_order_is_the_one_named(grouping, sparse, strategy, value) -> None:
    ebc = collection(grouping, sparse, strategy)
    ids = {f: x.clone() for f, x in IDS.items()}
    ids["b"][2] = value  # a bad id in b, bad offsets in c: b's id is named
    offsets = {**GOOD, "c": torch.tensor([0, 3, 1])}
    with pytest.raises(IndexError, match=rf"ids must be in \[0, 10\); got {value} at position 2"):
        ebc(ids, offsets)
    with pytest.raises(IndexError, match=rf"ids must be in \[0, 10\); got {value} at position 2"):
        ebc(ids, GOOD)  # alone, as the kernel would find it on the CPU
    offsets = {**GOOD, "a": torch.tensor([0, 3, 1])}  # bad offsets in a come first
    with pytest.raises(ValueError, match=r"feature 'a': offsets must be non-decreasing"):
        ebc(ids, offsets)
