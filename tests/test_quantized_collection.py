"""Quantized collections against their dequantized float twins: the same lookup code, the same rules.

A twin is a float collection of the same configs holding the quantized tables' dequantized rows,
so the two give equal outputs (to float rounding of the kernels), the same keys in the same
order, and the same exception (class and message) for every bad input.
"""

from __future__ import annotations

import pytest
import torch

import shardvar
from shardvar import EmbeddingBagCollection, EmbeddingCollection, KeyedJagged, TableConfig, quantize
from shardvar.nn import JaggedRows
from shardvar.quantized import QuantizedEmbeddingBagCollection, QuantizedEmbeddingCollection, accepted

DTYPES = [torch.quint8, torch.quint4x2, torch.float16]

CONFIGS = {
    "named_as_tables": {"a": TableConfig(20, 4, 2, "mod"), "b": TableConfig(9, 4, 3, mode="mean")},
    "features_named_otherwise": {
        "users": TableConfig(20, 4, 2, "mod", feature_names=["query_user"]),
        "products": TableConfig(9, 6, 3, mode="mean", feature_names=["item"]),
    },
    "several_features_per_table": {
        "users": TableConfig(20, 4, 3, "mod", feature_names=["query_user", "candidate_user", "friend"]),
        "products": TableConfig(9, 4, 1, mode="sum", feature_names=["item", "seen"]),
        "ads": TableConfig(7, 4, 2, mode="max"),
    },
}


def _twins(kind: str, configs: dict, dtype: torch.dtype):
    """(the quantized collection, a float collection of the same configs holding its dequantized rows)."""
    torch.manual_seed(0)
    cls = EmbeddingBagCollection if kind == "pooled" else EmbeddingCollection
    if kind == "sequence":
        configs = {n: TableConfig(c.num_embeddings, c.embedding_dim, c.partitioner, c.partition_strategy,
                                  feature_names=c.feature_names) for n, c in configs.items()}  # fmt: skip
    q = quantize(cls(configs), dtype)
    twin = cls(configs)
    prefix = "embedding_bags" if kind == "pooled" else "embeddings"
    tables = getattr(q, prefix)
    twin.load_state_dict({f"{prefix}.{n}.weight": t.dequantize() for n, t in tables.items()})
    return q, twin


def _inputs(configs: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = {f: c.num_embeddings for n, c in configs.items() for f in (c.feature_names or (n,))}
    return {f: torch.randint(0, r, (3, 2), generator=g) for f, r in reversed(rows.items())}  # not config order


def _same(out: dict, ref: dict) -> None:
    assert list(out) == list(ref)
    for k in ref:
        rows = isinstance(ref[k], JaggedRows)
        got, want = (out[k].values, ref[k].values) if rows else (out[k], ref[k])
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
        if rows:
            assert torch.equal(out[k].lengths, ref[k].lengths)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["pooled", "sequence"])
def test_equals_its_dequantized_float_twin(kind, name, dtype) -> None:
    configs = CONFIGS[name]
    q, twin = _twins(kind, configs, dtype)
    assert isinstance(q, QuantizedEmbeddingBagCollection if kind == "pooled" else QuantizedEmbeddingCollection)
    assert q.feature_tables == twin.feature_tables
    features = _inputs(configs, 1)
    with torch.no_grad():
        _same(q(features), twin(features))
        some = dict(list(features.items())[:1])  # a subset of the features, as the float collection takes
        _same(q(some), twin(some))
        flat = {f: ids.reshape(-1) for f, ids in features.items()}
        offsets = {f: torch.tensor([0, 1, 1, 4]) for f in flat}
        _same(q(flat, offsets), twin(flat, offsets))
        keys = tuple(features)
        kjt = KeyedJagged(keys, torch.cat([flat[k] for k in keys]), torch.tensor([[2, 0, 4]] * len(keys)))
        _same(q(kjt), twin(kjt))
        if kind == "pooled":
            summed = [f for f, t in q.feature_tables.items() if configs[t].mode == "sum"]
            weights = {f: torch.rand(3, 2) for f in summed}
            _same(q(features, per_sample_weights=weights), twin(features, per_sample_weights=weights))


def _bad_inputs(configs: dict) -> list[tuple]:
    features = _inputs(configs, 2)
    first, *_ = features
    mean = [f for f, t in _feature_tables(configs).items() if configs[t].mode != "sum"]
    out = [
        ({"nope": torch.tensor([[1]])},),
        ([torch.tensor([[1]])],),
        ({**features, first: torch.tensor([[1, 10_000]])},),
        ({**features, first: torch.tensor([[1, -1]])},),
        ({**features, first: torch.tensor([[[1]]])},),
        ({**features, first: torch.tensor([[1.5]])},),
        ({first: features[first]}, {"stray": torch.tensor([0])}),
        ({first: features[first].reshape(-1)}, {first: torch.tensor([0, 9])}),
        (KeyedJagged((first,), torch.tensor([1]), torch.tensor([[1]])), {first: torch.tensor([0])}),
    ]
    if mean:
        out.append(({mean[0]: features[mean[0]]}, None, {mean[0]: torch.ones(3, 2)}))
    return out


def _feature_tables(configs: dict) -> dict[str, str]:
    return {f: n for n, c in configs.items() for f in (c.feature_names or (n,))}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["pooled", "sequence"])
def test_the_same_error_for_every_bad_input(kind, name) -> None:
    configs = CONFIGS[name]
    q, twin = _twins(kind, configs, torch.quint8)
    for args in _bad_inputs(configs):
        if kind == "sequence" and len(args) > 2:  # its forward takes no per_sample_weights
            continue
        with pytest.raises(Exception) as want:  # whatever the float twin raises
            twin(*args)
        assert isinstance(want.value, shardvar.ShardvarError), (args, want.value)
        with pytest.raises(type(want.value)) as got, torch.no_grad():
            q(*args)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value), args


def test_every_accepted_type_is_named_and_nothing_else() -> None:
    names = accepted()
    assert len(set(names)) == len(names)
    expected = {
        "ShardedEmbedding", "ShardedEmbeddingBag", "EmbeddingBagCollection", "EmbeddingCollection",
        "DistributedEmbeddingBagCollection", "DistributedEmbeddingCollection",
    }  # fmt: skip
    assert set(names) == expected  # shardvar.distributed registered its collections on import
    with pytest.raises(shardvar.ShardvarTypeError, match=rf"quantize takes a {', '.join(names)} \(or a subclass\)"):
        quantize(torch.nn.Linear(2, 2), torch.quint8)
