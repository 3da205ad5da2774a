"""A feature several tables serve (issue 36, point 3): every collection family outputs it once per table, keyed
``feature@table`` as TorchRec keys it, and trains, steps and checkpoints as a plain module per table does."""

from __future__ import annotations

import pytest
import torch

import shardvar
from dist_shared_feature_workers import KEYS, PLACEMENTS, TABLES, batch, initial, loss, plain_tables, reference
from distributed import batched
from shardvar import EmbeddingBagCollection, EmbeddingCollection, TableConfig
from shardvar import optim as so

FAMILIES = {"bag": (EmbeddingBagCollection, True), "sequence": (EmbeddingCollection, False)}


def tables_of(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return dict(module.embedding_bags if hasattr(module, "embedding_bags") else module.embeddings)


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {t: table.weight.to_tensor().detach() for t, table in tables_of(module).items()}


def grad_of(table: torch.nn.Module) -> torch.Tensor:
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in table.weight.variables]
    return shardvar.ShardedVariable(grads, partition_strategy=table.layout.strategy).to_tensor()


def assert_outputs(got: dict, want: dict, pooled: bool, atol: float = 1e-5) -> None:
    assert list(got) == list(KEYS)  # TorchRec's names, in the order the features are given
    for k, v in want.items():
        if pooled:
            torch.testing.assert_close(got[k], v, atol=atol, rtol=1e-5)
        else:
            values, lengths = (got[k].values, got[k].lengths) if hasattr(got[k], "lengths") else got[k]
            torch.testing.assert_close(values, v[0], atol=atol, rtol=1e-5)
            assert lengths.tolist() == v[1].tolist()


def test_the_keys_follow_torchrecs_rule() -> None:
    served = shardvar.nn._collection_build.feature_map(TABLES)
    assert served.tables == {
        "a@u": "u",
        "b": "u",
        "c": "v",
        "a@v": "v",
        "a@w": "w",
    }  # tables' order, then their features
    assert served.keys == {"a": ("a@u", "a@v", "a@w"), "b": ("b",), "c": ("c",)}
    alone = shardvar.nn._collection_build.feature_map(
        {"t": TableConfig(3, 2), "s": TableConfig(3, 2, feature_names=["x"])}
    )
    assert alone.tables == {"t": "t", "x": "s"}  # a feature one table serves keeps its name


@pytest.mark.parametrize("form", ["dict", "jagged"])
@pytest.mark.parametrize("grouping", ["grouped", "apart"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_feature_is_output_per_table_and_trains_each_as_a_plain_table(family, sparse, grouping, form) -> None:
    cls, pooled = FAMILIES[family]
    torch.manual_seed(0)
    module = cls(TABLES, sparse=sparse)
    if grouping == "apart":  # new memory for one table: looked up by its own forward, its two features in one call
        tables_of(module)["u"].double().float()
    plain = plain_tables(weights_of(module), pooled, sparse)
    opt, theirs = torch.optim.SGD(module.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        features, weights = batch(step, form, pooled)
        out = module(features, per_sample_weights=weights) if pooled else module(features)
        want = reference(plain, features, weights, pooled)
        assert_outputs(out, want, pooled)
        loss(out).backward()
        loss(want).backward()
        for t, table in tables_of(module).items():  # each table: the gradient of its keys alone
            torch.testing.assert_close(grad_of(table), plain[t].weight.grad.to_dense(), atol=1e-4, rtol=1e-5)
        for o in (opt, theirs):
            o.step()
            o.zero_grad()
    for t, w in weights_of(module).items():
        torch.testing.assert_close(w, plain[t].weight.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_fused_optimizer_updates_every_table_of_a_shared_feature(family, sparse) -> None:
    cls, pooled = FAMILIES[family]
    module = cls(TABLES, sparse=sparse)
    plain = plain_tables(weights_of(module), pooled, sparse)
    fused, theirs = so.RowWiseAdagrad(module, lr=0.1), so.RowWiseAdagrad(plain, lr=0.1)
    so.fuse(fused)
    for step in range(3):
        features, weights = batch(step, "dict", pooled)
        loss(module(features, per_sample_weights=weights) if pooled else module(features)).backward()
        loss(reference(plain, features, weights, pooled)).backward()
        theirs.step()
        theirs.zero_grad()
    for t, w in weights_of(module).items():
        torch.testing.assert_close(w, plain[t].weight.detach(), atol=1e-5, rtol=1e-5)
    assert [int(t.step) for t in fused.tables] == [3, 3, 3]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_collection_with_a_shared_feature_checkpoints_by_table_into_other_layouts(family, tmp_path) -> None:
    cls, pooled = FAMILIES[family]
    module = cls(TABLES, sparse=True)
    opt = so.RowWiseAdagrad(module, lr=0.1)
    features, weights = batch(0, "dict", pooled)
    loss(module(features, per_sample_weights=weights) if pooled else module(features)).backward()
    opt.step()
    opt.zero_grad()
    prefix = "embedding_bags" if pooled else "embeddings"
    assert list(module.state_dict()) == [f"{prefix}.{t}.weight" for t in TABLES]  # by table, not by key
    shardvar.save({"model": module, "opt": opt}, tmp_path / "ckpt")
    other_layouts = {
        t: TableConfig(c.num_embeddings, c.embedding_dim, 2, feature_names=c.feature_names) for t, c in TABLES.items()
    }
    other = cls(other_layouts, sparse=True)
    other_opt = so.RowWiseAdagrad(other, lr=0.1)
    shardvar.load({"model": other, "opt": other_opt}, tmp_path / "ckpt")
    for step in (1, 2):  # the restored state steps as the saved one
        features, weights = batch(step, "jagged", pooled)
        outs = [m(features) for m in (module, other)]
        assert list(outs[1]) == list(KEYS)
        for k in KEYS:
            a, b = (o[k] if pooled else o[k].values for o in outs)
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        for out, o in zip(outs, (opt, other_opt), strict=True):
            loss(out).backward()
            o.step()
            o.zero_grad()
    for t, w in weights_of(other).items():
        torch.testing.assert_close(w, weights_of(module)[t], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.quint8])
@pytest.mark.parametrize("form", ["dict", "jagged"])
def test_the_quantized_collection_outputs_a_shared_feature_per_table(dtype, form) -> None:
    q = shardvar.quantize(EmbeddingBagCollection(TABLES), dtype)
    plain = plain_tables({t: b.dequantize() for t, b in q.embedding_bags.items()}, True, False)
    features, _ = batch(3, form, True)  # unweighted: a packed table serving two features refuses float32
    with torch.no_grad():  # weights in this branch (the quantized collection's rebuild takes them)
        assert_outputs(q(features), reference(plain, features, None, True), True)


def _mean_w() -> dict[str, TableConfig]:
    return {**TABLES, "w": TableConfig(7, 6, 3, "div", mode="mean", feature_names=("a",))}


REFUSED = {  # (tables, call or None, error, match): real errors stay refused, naming the key or feature
    "twice in a table": (lambda: {"t": TableConfig(5, 2, feature_names=("a", "b", "a"))}, None, ValueError,
                         "feature_names must be unique; 'a' is given 2 times"),
    "no features": (lambda: {"t": TableConfig(5, 2, feature_names=[])}, None, ValueError, "feature_names is empty"),
    "keys collide": (lambda: {"t": TableConfig(5, 2, feature_names=("a", "a@s")), "s": TableConfig(5, 2, feature_names=("a",))},
                     None, ValueError, "feature 'a@s' of table 't' and feature 'a' of table 's' are both output as 'a@s'"),
    "a key as input": (lambda: TABLES, lambda m: m({"a@u": torch.tensor([[1]])}), ValueError,
                       r"no feature named \['a@u'\]; the features are \['a', 'b', 'c'\]"),
    "unknown feature": (lambda: TABLES, lambda m: m({"a": torch.tensor([[1]]), "d": torch.tensor([[1]])}), ValueError,
                        r"no feature named \['d'\]"),
    "offsets without ids": (lambda: TABLES, lambda m: m({"b": torch.tensor([1])}, {"a": torch.tensor([0])}), ValueError,
                            r"offsets given for \['a'\], which have no ids"),
    "an id past one table": (lambda: TABLES, lambda m: m({"a": torch.tensor([[1, 7]])}), IndexError,
                             r"feature 'a@w': .*\[0, 7\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("family", FAMILIES)
def test_real_errors_are_still_refused(family, case) -> None:
    cls, _ = FAMILIES[family]
    tables, call, error, match = REFUSED[case]
    with pytest.raises(error, match=match):
        module = cls(tables())
        before = weights_of(module)
        call(module)
    if call is not None:  # nothing changed
        assert all(torch.equal(w, before[t]) for t, w in weights_of(module).items())


def test_weights_for_a_shared_feature_are_refused_where_one_of_its_tables_does_not_sum() -> None:
    module = EmbeddingBagCollection(_mean_w())
    with pytest.raises(ValueError, match=r"per_sample_weights go with mode 'sum'.*feature 'a@w' has mode 'mean'"):
        module({"a": torch.tensor([[1, 2]])}, per_sample_weights={"a": torch.tensor([[0.5, 0.5]])})
    module({"a": torch.tensor([[1, 2]])})  # unweighted, each table pools its own way


# --- the distributed twins: every case in one launch of 2 processes -------------------------------------

CASES = [(pooled, placement, fused) for pooled in (True, False) for placement in PLACEMENTS for fused in (False, True)]


def _name(case: tuple) -> str:
    return f"{'bag' if case[0] else 'sequence'}-{case[1]}-{'fused' if case[2] else 'sgd'}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("shared")
    jobs = {
        c: (2, "dist_shared_feature_workers:train_shared", {"path": str(root / _name(c)), "pooled": c[0],
                                                           "placement": c[1], "fused": c[2]})
        for c in CASES
    }  # fmt: skip
    jobs["left out"] = (2, "dist_shared_feature_workers:left_out", {})
    return batched(lambda: root / "ranks", jobs), root


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_a_distributed_twin_outputs_and_trains_a_shared_feature_as_plain_tables(runs, case) -> None:
    results, root = runs
    pooled, _, fused = case
    ranks = results(case)
    plain = plain_tables(initial(), pooled, fused)
    opt = so.RowWiseAdagrad(plain, lr=0.1) if fused else torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):  # one process over both ranks' batches
        total = 0
        for rank in range(2):
            features, weights = batch(10 * step + rank, "jagged" if step else "dict", pooled)
            want = reference(plain, features, weights, pooled)
            assert_outputs(ranks[rank]["outs"][step], want, pooled)
            total = total + loss(want)
        total.backward()
        opt.step()
        opt.zero_grad()
    configs = {
        t: TableConfig(c.num_embeddings, c.embedding_dim, 2, "mod", feature_names=c.feature_names)
        for t, c in TABLES.items()
    }
    local = (EmbeddingBagCollection if pooled else EmbeddingCollection)(configs, sparse=fused)
    restored = {"model": local, **({"opt": so.RowWiseAdagrad(local, lr=0.1)} if fused else {})}
    shardvar.load(restored, root / _name(case))  # saved by table: into one process, other layouts
    for t, w in weights_of(local).items():
        torch.testing.assert_close(w, plain[t].weight.detach(), atol=1e-5, rtol=1e-5)
    if fused:
        state = restored["opt"].state_dict()["state"]
        prefix = "embedding_bags" if pooled else "embeddings"
        for t in TABLES:
            torch.testing.assert_close(state[f"{prefix}.{t}.weight/sum"], opt.state_dict()["state"][f"{t}.weight/sum"])


def test_a_distributed_twin_names_the_features_a_rank_left_out(runs) -> None:
    # Both ranks leave 'c' out: every rank raises the lowest refusing rank's error, naming the others.
    expected = "rank 0: every rank gives every feature ['a', 'b', 'c']; got ['a', 'b'] (rank(s) [1] refused their input too)"
    for r in runs[0]("left out"):
        assert r == {pooled: expected for pooled in (True, False)}


@pytest.mark.parametrize("form", ["dict", "jagged"])
def test_a_shared_feature_s_ids_are_not_copied_per_table(form) -> None:
    features, weights = batch(0, form, True)
    served = shardvar.nn._collection_build.feature_map(TABLES)
    modes = dict.fromkeys(served.tables, "sum")
    ids, offsets, psw = shardvar.nn._collection.split_inputs(features, None, weights, modes, (), served.keys)
    assert list(ids) == list(KEYS)
    for got in (ids, offsets if form == "jagged" else psw):  # one tensor under each of its keys
        assert got["a@u"] is got["a@v"] is got["a@w"]
