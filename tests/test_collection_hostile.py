"""Inputs a hostile user gives collections, against plain torch: each one means the same whatever the grouping.

Every case runs with the tables grouped into one kernel, apart (different widths), and with a table
moved out of its group's allocation (looked up by its own forward): one rule, whatever the path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import EmbeddingBagCollection, EmbeddingCollection, KeyedJagged, ShardedEmbeddingBag, TableConfig
from shardvar.nn import EmbeddingBagDict, EmbeddingBagList

PLACEMENTS = ("grouped", "apart", "moved")


def collection(placement: str, kind: type = EmbeddingBagCollection, **options: object) -> nn.Module:
    width = 6 if placement == "apart" else 4
    torch.manual_seed(0)
    tables = {"a": TableConfig(10, 4, 2, "mod"), "b": TableConfig(7, width, feature_names=["b1", "b2"])}
    module = kind(tables, **options)
    if placement == "moved":
        getattr(module, "embedding_bags", getattr(module, "embeddings", None))["a"].double().float()
    return module


BAD_WEIGHTS = {  # ids [[1, 2]] of feature "a": weights torch's nn.EmbeddingBag refuses too
    "transposed": (torch.tensor([[0.5], [2.0]]), ValueError, r"feature 'a': per_sample_weights of shape \[2, 1\]"),
    "flat for 2-D ids": (torch.tensor([0.5, 2.0]), ValueError, r"shape \[2\] must match input of shape \[1, 2\]"),
    "too few": (torch.tensor([[0.5]]), ValueError, r"shape \[1, 1\] must match input of shape \[1, 2\]"),
    "integers": (torch.tensor([[1, 2]]), TypeError, "must have the table's dtype torch.float32; got torch.int64"),
    "float64": (torch.tensor([[1.0, 2.0]], dtype=torch.float64), TypeError, "got torch.float64"),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_per_sample_weights_follow_torchs_rule_on_every_path(placement, bad) -> None:
    ebc = collection(placement)
    weights, error, match = BAD_WEIGHTS[bad]
    with pytest.raises(error, match=match) as caught:
        ebc({"a": torch.tensor([[1, 2]]), "b1": torch.tensor([[3, 4]])}, per_sample_weights={"a": weights})
    assert isinstance(caught.value, shardvar.ShardvarError)
    jagged = KeyedJagged(("b1", "a"), torch.tensor([3, 1, 2]), torch.tensor([[1, 0], [1, 1]]), torch.ones(3).double())
    with pytest.raises(TypeError, match=r"got torch\.float64"):
        ebc(jagged)  # a KeyedJagged's weights too


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_weights_of_the_right_shape_and_dtype_weight_as_torch(placement) -> None:
    ebc = collection(placement)
    plain = nn.EmbeddingBag.from_pretrained(ebc.embedding_bags["a"].weight.to_tensor(), mode="sum")
    ids, weights = torch.tensor([[1, 2], [3, 3]]), torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    got = ebc({"a": ids, "b1": ids}, per_sample_weights={"a": weights})
    torch.testing.assert_close(got["a"], plain(ids, per_sample_weights=weights), atol=1e-6, rtol=0)


def _empty_batches() -> dict[str, tuple[object, object]]:
    long = torch.int64
    return {  # (features, offsets): no bag at all
        "2-D": ({"a": torch.empty(0, 3, dtype=long), "b1": torch.empty(0, 2, dtype=long)}, None),
        "1-D with empty offsets": ({"a": torch.empty(0, dtype=long)}, {"a": torch.empty(0, dtype=torch.int32)}),
        "KeyedJagged": (KeyedJagged(("b2", "a"), torch.empty(0, dtype=long), torch.empty(2, 0, dtype=long)), None),
    }


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("form", _empty_batches())
def test_an_empty_batch_gives_no_bags_and_no_gradient(form, placement, sparse) -> None:
    features, offsets = _empty_batches()[form]
    for kind in (EmbeddingBagCollection, EmbeddingCollection):
        module = collection(placement, kind, sparse=sparse)
        out = module(features, offsets)
        for f, x in out.items():
            rows = x.values if kind is EmbeddingCollection else x
            assert rows.shape == (0, 6 if placement == "apart" and f != "a" else 4), (kind, f)
            if kind is EmbeddingCollection:
                assert x.lengths.tolist() == [] and x.to_padded().shape[:2] == (0, 0)
        sum(x.sum() if isinstance(x, torch.Tensor) else x.values.sum() for x in out.values()).backward()


def test_a_lone_bag_takes_an_empty_batch_as_torch_and_refuses_ids_without_bags() -> None:
    bag = ShardedEmbeddingBag(10, 4, 2, "mod", mode="max")
    assert bag(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)).shape == (0, 4)
    # torch drops ids that no bag holds (an empty offsets tensor): refused here, naming them
    with pytest.raises(ValueError, match=r"offsets must be 1-D, non-empty and start at 0; got \[\] for 2 ids"):
        bag(torch.tensor([1, 2]), torch.empty(0, dtype=torch.long))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_nested_ids_are_refused_on_every_path(placement) -> None:
    nested = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged)
    with pytest.raises(TypeError, match="feature 'a': ids must be a plain tensor here; got a nested tensor"):
        collection(placement)({"a": nested})


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_offsets_of_a_float_dtype_are_named_as_offsets(placement) -> None:
    ebc = collection(placement)
    with pytest.raises(TypeError, match=r"feature 'a': offsets must be an integer tensor; got dtype torch\.float32"):
        ebc({"a": torch.tensor([1, 2, 3])}, {"a": torch.tensor([0.0, 1.0])})


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sequence_lengths_are_int64_whatever_the_path_and_input(placement, dtype) -> None:
    ec = collection(placement, EmbeddingCollection)
    jagged = KeyedJagged(("a", "b1"), torch.tensor([1, 2, 3], dtype=dtype), torch.tensor([[1, 2], [0, 0]], dtype=dtype))
    offsets = {"a": torch.tensor([0, 2], dtype=dtype)}
    for out in (ec(jagged), ec({"a": torch.tensor([[1, 2]])}), ec({"a": torch.tensor([1, 2, 3])}, offsets)):
        assert {f: rows.lengths.dtype for f, rows in out.items()} == dict.fromkeys(out, torch.int64)


def _last_offset_tables() -> list[ShardedEmbeddingBag]:
    torch.manual_seed(0)
    return [ShardedEmbeddingBag(10, 4, 2, "mod", mode="sum", include_last_offset=True), ShardedEmbeddingBag(10, 4)]


@pytest.mark.parametrize("container", [EmbeddingBagDict, EmbeddingBagList])
def test_a_table_with_include_last_offset_takes_2d_ids_and_keyed_jagged_as_torch(container) -> None:
    bags = _last_offset_tables()
    module = container(dict(zip("01", bags, strict=True)) if container is EmbeddingBagDict else bags)
    stock = nn.EmbeddingBag.from_pretrained(bags[0].weight.to_tensor(), mode="sum", include_last_offset=True)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    got = module({"0": ids} if container is EmbeddingBagDict else {0: ids})
    torch.testing.assert_close(next(iter(got.values())), stock(ids), atol=1e-6, rtol=0)
    jagged = KeyedJagged(("0",), torch.tensor([1, 2, 3]), torch.tensor([[2, 0, 1]]))
    want = stock(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 2, 3]))
    torch.testing.assert_close(module(jagged)["0"], want, atol=1e-6, rtol=0)
    given = module({"0": torch.tensor([1, 2, 3])}, {"0": torch.tensor([0, 2, 2, 3])})  # offsets as the table reads
    torch.testing.assert_close(next(iter(given.values())), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("container", [EmbeddingBagDict, EmbeddingBagList])
def test_no_table_is_renormalised_when_another_features_input_is_refused(container) -> None:
    torch.manual_seed(0)
    bags = [ShardedEmbeddingBag(10, 4, max_norm=0.1, mode="sum") for _ in range(2)] + [ShardedEmbeddingBag(10, 4)]
    module = container(dict(zip("012", bags, strict=True)) if container is EmbeddingBagDict else bags)
    before = [b.weight.to_tensor().clone() for b in bags]
    ok = torch.tensor([[1, 2]])
    refused = [  # each with the max_norm tables' own ids valid: they would renormalise rows 1 and 2 first
        ({"0": ok, "1": ok, "2": torch.tensor([[1, 10]])}, None, IndexError),
        ({"0": ok, "1": torch.tensor([[1, 10]])}, None, IndexError),
        ({"0": ok, "1": ok}, {"1": torch.ones(2, 1)}, ValueError),
    ]
    for features, weights, error in refused:
        if container is EmbeddingBagList:
            features = {int(k): v for k, v in features.items()}
            weights = None if weights is None else {int(k): v for k, v in weights.items()}
        with pytest.raises(error):
            module(features, per_sample_weights=weights)
        assert all(torch.equal(b.weight.to_tensor(), w) for b, w in zip(bags, before, strict=True))


@pytest.mark.parametrize("kind", [EmbeddingBagCollection, EmbeddingCollection])
@pytest.mark.parametrize(
    ("name", "error", "match"),
    [(1, TypeError, r"got 1 \(int\)"), ("a.b", ValueError, "got 'a.b'"), ("", ValueError, "got ''")],
)
def test_table_names_that_are_not_module_names_are_refused_by_shardvar(kind, name, error, match) -> None:
    with pytest.raises(error, match=f"table names must be non-empty strings without '.'.*{match}") as caught:
        kind({"ok": TableConfig(5, 2), name: TableConfig(5, 2)})
    assert isinstance(caught.value, shardvar.ShardvarError)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32"])
def test_a_table_dtype_that_cannot_be_trained_is_refused_before_anything_is_allocated(dtype) -> None:
    makers = [
        lambda: EmbeddingBagCollection({"a": TableConfig(5, 2)}, dtype=dtype),
        lambda: EmbeddingCollection({"a": TableConfig(5, 2)}, dtype=dtype),
        lambda: ShardedEmbeddingBag(5, 2, 2, dtype=dtype),
        lambda: shardvar.ShardedEmbedding(5, 2, dtype=dtype),
    ]
    for make in makers:
        with pytest.raises(TypeError, match=f"dtype must be a floating torch.dtype; got {dtype!r}") as caught:
            make()
        assert isinstance(caught.value, shardvar.ShardvarError)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m, x: m([x, None]), ValueError, r"features\[1\] is None; give ids for every table"),
        (lambda m, x: m({0: x, "0": x + 1}), ValueError, "features 0 and '0' name the same table"),
        (lambda m, x: m([x, x], per_sample_weights={1: None, "1": x.float()}), ValueError, "1 and '1' name the same"),
        (lambda m, x: m([x.reshape(-1), x], [torch.tensor([0])]), ValueError, "offsets has 1 entries for 2 tables"),
    ],
)
def test_a_list_of_tables_refuses_inputs_it_would_drop_or_misplace(call, error, match) -> None:
    module = EmbeddingBagList([ShardedEmbeddingBag(10, 4, mode="sum"), ShardedEmbeddingBag(10, 4, 2, mode="sum")])
    with pytest.raises(error, match=match) as caught:
        call(module, torch.tensor([[1, 2]]))
    assert isinstance(caught.value, shardvar.ShardvarError)


# Any batch of any features, in any order, on any placement of the tables.
BATCHES = {
    "placement": st.sampled_from(PLACEMENTS),
    "sparse": st.booleans(),
    "batch": st.integers(0, 4),
    "keys": st.permutations(["a", "b1", "b2"]).flatmap(lambda p: st.integers(0, 3).map(lambda n: p[:n])),
    "seed": st.integers(0, 10_000),
}


@settings(max_examples=30, deadline=None)
@given(**BATCHES, weighted=st.sets(st.sampled_from(["a", "b1", "b2"])))
def test_any_keyed_jagged_batch_pools_and_trains_as_separate_embedding_bags(
    placement, sparse, batch, keys, weighted, seed
) -> None:
    ebc = collection(placement, sparse=sparse)
    tables = {t: b.weight.to_tensor().detach() for t, b in ebc.embedding_bags.items()}
    plain = {f: nn.EmbeddingBag.from_pretrained(tables[ebc.feature_tables[f]], freeze=False, mode="sum") for f in keys}
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys), batch), generator=g)
    rows = {"a": 10, "b1": 7, "b2": 7}
    values = [torch.randint(0, rows[k], (int(n),), generator=g) for k, n in zip(keys, lengths.sum(1), strict=True)]
    values = torch.cat(values) if values else torch.empty(0, dtype=torch.long)
    weights = torch.rand(values.numel(), generator=g) if weighted & set(keys) else None
    jagged = KeyedJagged(tuple(keys), values, lengths, weights)
    out = ebc(jagged)
    ids, offsets, psw = jagged.split()
    assert list(out) == list(keys)
    for i, k in enumerate(keys):
        want = plain[k](ids[k], offsets[k], per_sample_weights=psw.get(k))
        torch.testing.assert_close(out[k], want, atol=1e-6, rtol=0)
        (want * (i + 1)).sum().backward()
    if out:
        sum((v * (i + 1)).sum() for i, v in enumerate(out.values())).backward()
    for t, bag in ebc.embedding_bags.items():
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in bag.weight.variables]
        got = shardvar.ShardedVariable(grads, partition_strategy=bag.layout.strategy).to_tensor()
        want = sum((plain[f].weight.grad for f in keys if ebc.feature_tables[f] == t), torch.zeros_like(got))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(**BATCHES)
def test_any_keyed_jagged_batch_gives_each_ids_row_as_separate_embeddings(placement, sparse, batch, keys, seed) -> None:
    ec = collection(placement, EmbeddingCollection, sparse=sparse)
    tables = {t: e.weight.to_tensor().detach() for t, e in ec.embeddings.items()}
    plain = {f: nn.Embedding.from_pretrained(tables[ec.feature_tables[f]], freeze=False) for f in keys}
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys), batch), generator=g)
    rows = {"a": 10, "b1": 7, "b2": 7}
    values = [torch.randint(0, rows[k], (int(n),), generator=g) for k, n in zip(keys, lengths.sum(1), strict=True)]
    jagged = KeyedJagged(tuple(keys), torch.cat(values) if values else torch.empty(0, dtype=torch.long), lengths)
    out = ec(jagged)
    ids, _, _ = jagged.split()
    assert list(out) == list(keys)
    for i, k in enumerate(keys):
        assert torch.equal(out[k].lengths, lengths[i]) and out[k].lengths.dtype == torch.int64
        want = plain[k](ids[k])
        torch.testing.assert_close(out[k].values, want, atol=0, rtol=0)
        (want * (i + 1)).pow(2).sum().backward()
    if out:
        sum((v.values * (i + 1)).pow(2).sum() for i, v in enumerate(out.values())).backward()
    for t, emb in ec.embeddings.items():
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in emb.weight.variables]
        got = shardvar.ShardedVariable(grads, partition_strategy=emb.layout.strategy).to_tensor()
        want = sum((plain[f].weight.grad for f in keys if ec.feature_tables[f] == t), torch.zeros_like(got))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["items", "keys", "values", "training", "forward", "update", "_modules"])
@pytest.mark.parametrize("collection", [EmbeddingBagCollection, EmbeddingCollection])
def test_a_table_named_as_a_moduledict_attribute_is_refused_by_name(collection, name) -> None:
    # torch's ModuleDict keeps tables as attributes beside its own (items, keys, training, ...).
    with pytest.raises(shardvar.ShardvarValueError, match=rf"table name '{name}' is an attribute of torch's ModuleDict"):
        collection({name: TableConfig(10, 4)})


def test_a_feature_may_keep_a_name_its_table_cannot() -> None:
    ebc = EmbeddingBagCollection({"item_table": TableConfig(10, 4, feature_names=["items"])})
    assert ebc({"items": torch.tensor([[1, 2]])})["items"].shape == (1, 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("sparse", [True, False])
def test_non_finite_weights_are_refused_before_a_fused_step_changes_anything(bad, sparse) -> None:
    # A NaN weight would reach the fused update in backward and poison rows and state for good.
    ebc = EmbeddingBagCollection({"t": TableConfig(20, 4, 2, "mod")}, sparse=sparse)
    opt = shardvar.optim.RowWiseAdagrad(ebc, lr=0.1)
    shardvar.optim.fuse(opt)
    ids, weights = torch.tensor([[1, 2, 3]]), torch.tensor([[1.0, bad, 1.0]])
    ebc({"t": ids}, per_sample_weights={"t": torch.ones(1, 3)})["t"].sum().backward()  # state exists
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    state = [t.clone() for t in opt.state_dict()["state"].values() if isinstance(t, torch.Tensor)]
    assert state
    with pytest.raises(shardvar.ShardvarValueError, match=rf"per_sample_weights must be finite; got {bad} at position 1"):
        ebc({"t": ids}, per_sample_weights={"t": weights})
    assert all(torch.equal(v, before[k]) for k, v in ebc.state_dict().items())
    after = [t for t in opt.state_dict()["state"].values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, state, strict=True))
