"""The distributed collections, checked in one 2-rank run: bad inputs, features sharing tables, sequences."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardvar
from dist_collection_workers import (
    MIXED,
    SEQUENCE,
    SHARED,
    bad_jagged,
    mixed_batch,
    sequence_batch,
    shared_batch,
)
from distributed import run_ranks
from shardvar.variables import RowInitializer

BAD = bad_jagged()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], object]:
    path = tmp_path_factory.mktemp("collections")
    return run_ranks(2, "dist_collection_workers:distributed_collections", path / "w", path=str(path)), path


def initial(tables: dict[str, shardvar.TableConfig]) -> dict[str, torch.Tensor]:
    """The tables a distributed collection starts from with RowInitializer(5): end to end, by logical row."""
    first = dict(zip(tables, itertools.accumulate([0, *(c.num_embeddings for c in tables.values())]), strict=False))
    return {
        t: RowInitializer(5).rows(first[t] + torch.arange(c.num_embeddings), (c.embedding_dim,))
        for t, c in tables.items()
    }


def test_bad_inputs_are_refused_on_every_rank_and_weights_for_some_features_weigh_only_those(results) -> None:
    for rank, result in enumerate(r["inputs"] for r in results[0]):
        for errors in (result["errors"], result["sequence_errors"]):  # the pooled twin and the sequence twin
            assert set(errors) == set(BAD)
            for kind, (mro, message) in errors.items():
                _, error, match = BAD[kind]
                assert error.__name__ in mro and "ShardvarError" in mro, (kind, mro)
                assert re.search(match, message), (kind, message)
        assert result["groups"] == [["0", "1"], ["2"]]  # a weighted table grouped with an unweighted one, and alone
        ids, offsets, weights = mixed_batch(rank)
        tables = initial(MIXED)
        for k in MIXED:
            want = F.embedding_bag(ids[k], tables[k], offsets[k], mode="sum", per_sample_weights=weights.get(k))
            torch.testing.assert_close(result["weighted"][k], want, atol=1e-6, rtol=0)


def test_tables_serve_their_features_in_one_exchange_with_shared_ids_sent_once(results) -> None:
    weights = {t: w.requires_grad_() for t, w in initial(SHARED).items()}
    table_of = {f: t for t, c in SHARED.items() for f in c.feature_names}
    loss = 0
    for rank in range(2):
        out = {f: F.embedding_bag(x, weights[table_of[f]], mode="sum") for f, x in shared_batch(rank, 0).items()}
        loss = loss + sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(out.values()))
    loss.backward()
    with torch.no_grad():
        for w in weights.values():
            w -= 0.1 * w.grad
    for rank, result in enumerate(r["shared"] for r in results[0]):
        for f, x in shared_batch(rank, 1).items():
            want = F.embedding_bag(x, weights[table_of[f]].detach(), mode="sum")
            torch.testing.assert_close(result["after"][f], want, atol=1e-5, rtol=0)
        assert result["calls"][0] == result["calls"][1] == result["calls"][2]  # one exchange for every feature
        assert result["sent"][0] == result["sent"][1] > 0  # the second feature's ids (the same) cost nothing


def test_the_sequence_collection_trains_as_one_process_in_one_exchange_and_restores_locally(results) -> None:
    ranks, path = results
    one_table = ranks[0]["shared"]["calls"][1]  # one feature of one table: one exchange
    assert all(r["sequence"]["calls"] == [one_table, one_table] for r in ranks)
    assert ranks[0]["sequence"]["groups"] == [["history", "item"]]  # "ctx" is replicated
    plain = nn.ModuleDict(
        {t: nn.Embedding.from_pretrained(w, freeze=False, sparse=True) for t, w in initial(SEQUENCE).items()}
    )
    table_of = {"clicks": "history", "views": "history", "item": "item", "ctx": "ctx"}
    opt = torch.optim.SparseAdam(list(plain.parameters()), lr=0.05)
    for step in range(2):
        loss = 0
        for rank in range(2):
            batch = sequence_batch(rank, step)
            ids, _, _ = batch.split()
            loss = loss + sum((plain[table_of[f]](ids[f]) * (i + 1)).pow(2).sum() for i, f in enumerate(batch.keys))
        loss.backward()
        opt.step()
        opt.zero_grad()
    for rank, r in enumerate(ranks):
        assert {f: x.tolist() for f, x in r["sequence"]["lengths"].items()} == {
            f: x.tolist() for f, x in zip(sequence_batch(rank, 1).keys, sequence_batch(rank, 1).lengths, strict=True)
        }
    local = shardvar.EmbeddingCollection(
        {
            t: shardvar.TableConfig(c.num_embeddings, c.embedding_dim, 2, "div", feature_names=c.feature_names)
            for t, c in SEQUENCE.items()
        }
    )
    shardvar.load({"model": local}, path / "sequence")  # the distributed tables restore into other layouts
    for t, emb in local.embeddings.items():
        torch.testing.assert_close(emb.weight.to_tensor(), plain[t].weight.detach(), atol=1e-5, rtol=0)


def test_a_sequence_step_costs_one_tables_exchanges_and_a_shared_tables_second_feature_sends_nothing(results) -> None:
    ranks, path = results
    for r in ranks:
        steps = r["sequence_steps"]
        one_table = steps["one_table"][0]  # one feature of one table: its forward and backward exchanges
        assert one_table > 0 and steps["steps"] == [one_table, one_table]  # three tables, four features, one group
        assert steps["one_table"][1] == one_table  # a table's second feature: no exchange of its own
        assert steps["sent"][1] == steps["sent"][0] and all(b > 0 for b in steps["sent"][0])  # ids, rows, gradients
    plain = nn.ModuleDict(  # the fused RowWiseAdagrad over the ranks equals one process over both ranks' batches
        {t: nn.Embedding.from_pretrained(w, freeze=False, sparse=True) for t, w in initial(SEQUENCE).items()}
    )
    opt = shardvar.optim.RowWiseAdagrad(plain, lr=0.1)
    table_of = {"clicks": "history", "views": "history", "item": "item", "ctx": "ctx"}
    for step in range(2):
        for rank in range(2):
            batch = sequence_batch(rank, step)
            ids, _, _ = batch.split()
            sum((plain[table_of[f]](ids[f]) * (i + 1)).pow(2).sum() for i, f in enumerate(batch.keys)).backward()
        opt.step()
        opt.zero_grad()
    local = shardvar.EmbeddingCollection(
        {
            t: shardvar.TableConfig(c.num_embeddings, c.embedding_dim, feature_names=c.feature_names)
            for t, c in SEQUENCE.items()
        }
    )
    shardvar.load({"model": local}, path / "sequence_fused")
    for t, emb in local.embeddings.items():
        torch.testing.assert_close(emb.weight.to_tensor(), plain[t].weight.detach(), atol=1e-5, rtol=0)


def test_a_table_optimizers_state_over_a_distributed_collection_reshards_into_one_process(results) -> None:
    ranks, path = results
    for rank, r in enumerate(ranks):  # saved by every rank and loaded back; a replicated table's state written once
        outcomes = dict(r["optimizer_checkpoints"])
        shards = "[0, 2]" if rank == 0 else "[1]"  # of "history"'s 3 mod shards
        assert re.search(
            rf"'embeddings.history.weight/sum' is distributed: this process holds shards {re.escape(shards)} of 3",
            outcomes.pop("state_dict"),
        )
        assert outcomes == dict.fromkeys(outcomes, "ok"), outcomes
    table_of = {"clicks": "history", "views": "history", "item": "item", "ctx": "ctx"}
    for i, pooled in enumerate([True, True, False, False]):  # the worker's order: each twin, two placements
        weights = {t: w.requires_grad_() for t, w in initial(SEQUENCE).items()}  # one step of both ranks' loss
        loss = 0
        for rank in range(2):
            ids, offsets, _ = sequence_batch(rank, 0).split()
            for f, x in ids.items():
                w = weights[table_of[f]]
                rows = F.embedding_bag(x, w, offsets[f], mode="sum") if pooled else F.embedding(x, w)
                loss = loss + rows.pow(2).sum()
        loss.backward()
        configs = {  # one process, other layouts: 2 div shards per table
            t: shardvar.TableConfig(c.num_embeddings, c.embedding_dim, 2, "div", feature_names=c.feature_names)
            for t, c in SEQUENCE.items()
        }
        local = (shardvar.EmbeddingBagCollection if pooled else shardvar.EmbeddingCollection)(configs, sparse=True)
        opt = shardvar.optim.RowWiseAdagrad(local, lr=0.1)
        shardvar.load({"model": local, "opt": opt}, path / "opt" / str(i))
        for t, w in weights.items():
            name = f"{'embedding_bags' if pooled else 'embeddings'}.{t}.weight"
            want_sum = w.grad.pow(2).mean(1)  # row-wise Adagrad's accumulator after one step
            torch.testing.assert_close(opt.state_dict()["state"][f"{name}/sum"], want_sum, atol=1e-5, rtol=1e-5)
            want = w.detach() - 0.1 * w.grad / (want_sum.sqrt() + 1e-10)[:, None]
            torch.testing.assert_close(local.state_dict()[name], want, atol=1e-5, rtol=0)
            assert int(opt.state_dict()["state"][f"{name}/step"]) == 1, (i, t)
