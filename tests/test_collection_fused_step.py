"""The fused collection step (issue 25, part 6): tables built in place, trained by one update per table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import shardvar
import shardvar.nn._collection_build as build
import shardvar.variables._bag_grad as bag_grad
from shardvar import optim as so

CONFIGS = {  # two widths (two groups), div and mod layouts, one table of one shard
    "a": shardvar.TableConfig(300, 8, 4, "mod"),
    "b": shardvar.TableConfig(701, 16, 3),
    "c": shardvar.TableConfig(50, 8),
    "d": shardvar.TableConfig(900, 16, 8, "mod"),
}


@pytest.mark.parametrize("pooled", [True, False])
def test_tables_are_drawn_in_their_groups_allocation_as_their_own_constructors_draw(monkeypatch, pooled) -> None:
    monkeypatch.setattr(build, "PIECE_BYTES", 16 * 16 * 4)  # pieces of 16 rows: the piecewise draw is exercised
    torch.manual_seed(0)
    made = shardvar.EmbeddingBagCollection(CONFIGS) if pooled else shardvar.EmbeddingCollection(CONFIGS)
    tables = made.embedding_bags if pooled else made.embeddings
    torch.manual_seed(0)
    cls = shardvar.ShardedEmbeddingBag if pooled else shardvar.ShardedEmbedding
    alone = {k: cls(c.num_embeddings, c.embedding_dim, c.partitioner, c.partition_strategy) for k, c in CONFIGS.items()}
    for k, table in alone.items():
        assert torch.equal(tables[k].weight.to_tensor(), table.weight.to_tensor()), k
    groups = {n: variable for names, variable in made._groups for n in names}
    for names in (["a", "c"], ["b", "d"]):  # each group's shards are the allocation they were drawn in
        storages = {p.untyped_storage().data_ptr() for n in names for p in tables[n].weight.variables}
        assert len(storages) == 1 and groups[names[0]] is groups[names[1]]
        assert groups[names[0]].store.full_slab.untyped_storage().data_ptr() in storages


@pytest.mark.parametrize("optimizer", ["RowWiseAdagrad", "RowWiseAdam"])
@pytest.mark.parametrize("shards", [1, 4])
@pytest.mark.parametrize("sliced", [False, True])
def test_the_fused_step_equals_each_table_trained_on_its_own(monkeypatch, optimizer, shards, sliced) -> None:
    if sliced:  # the rows a sink takes at once: 3 rows of 8 floats, so each table's rows come in many slices
        monkeypatch.setattr(bag_grad, "SINK_BYTES", 3 * 8 * 4)
    configs = {k: shardvar.TableConfig(60 + 7 * i, 8, shards, "mod") for i, k in enumerate("xyz")}
    configs["w"] = shardvar.TableConfig(40, 4, shards)  # a table of its own width: a group apart
    ebc = shardvar.EmbeddingBagCollection(configs, sparse=True)
    plain = nn.ModuleDict(
        {k: nn.EmbeddingBag(c.num_embeddings, c.embedding_dim, mode="sum", sparse=True) for k, c in configs.items()}
    )
    for k, bag in plain.items():
        bag.load_state_dict(ebc.embedding_bags[k].state_dict())
    make = getattr(so, optimizer)
    fused, theirs = make(ebc, lr=0.05), {k: make(b, lr=0.05) for k, b in plain.items()}
    so.fuse(fused)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = {k: torch.randint(0, c.num_embeddings // 3, (16, 5), generator=g) for k, c in configs.items()}
        sum(v.pow(2).sum() for v in ebc(ids).values()).backward()  # updated as the backward ends
        assert all(p.grad is None for p in ebc.parameters())
        for k, bag in plain.items():
            bag(ids[k]).pow(2).sum().backward()
            theirs[k].step()
            theirs[k].zero_grad()
    for k, bag in plain.items():
        torch.testing.assert_close(ebc.embedding_bags[k].weight.to_tensor(), bag.weight.detach(), atol=1e-6, rtol=0)
    assert all(int(t.step) == 4 for t in fused.tables)


def test_a_table_whose_features_are_apart_in_the_input_is_updated_once_with_their_summed_gradient() -> None:
    configs = {"t": shardvar.TableConfig(30, 4, 2, "mod", feature_names=["q", "c"]), "u": shardvar.TableConfig(20, 4)}
    ebc = shardvar.EmbeddingBagCollection(configs, sparse=True)
    alone = nn.ModuleDict(
        {k: nn.EmbeddingBag(c.num_embeddings, 4, mode="sum", sparse=True) for k, c in configs.items()}
    )
    for k, bag in alone.items():
        bag.load_state_dict(ebc.embedding_bags[k].state_dict())
    fused, theirs = so.RowWiseAdagrad(ebc, lr=0.1), so.RowWiseAdagrad(alone, lr=0.1)
    so.fuse(fused)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # "u" between the two features of "t": the input is not in table order
        ids = {f: torch.randint(0, 20, (6, 3), generator=g) for f in ("q", "u", "c")}
        sum(v.pow(2).sum() for v in ebc(ids).values()).backward()
        pooled = {"q": alone["t"](ids["q"]), "u": alone["u"](ids["u"]), "c": alone["t"](ids["c"])}
        sum(v.pow(2).sum() for v in pooled.values()).backward()
        theirs.step()
        theirs.zero_grad()
    for k, bag in alone.items():
        torch.testing.assert_close(ebc.embedding_bags[k].weight.to_tensor(), bag.weight.detach(), atol=1e-6, rtol=0)
    assert [int(t.step) for t in fused.tables] == [3, 3]


PEAK = """
import json, sys, torch, shardvar
from shardvar import optim as so
def rss(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
rows, tables, batch = 1 << 17, 4, 256
ids = {f"t{i}": torch.randint(0, rows, (batch, 20), generator=torch.Generator().manual_seed(i)) for i in range(tables)}
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # torch.optim's first use imports ~70 MiB
# a first, tiny collection: what building loads once (lazy imports, kernels) is not counted against the tables
# (counted, it read 1.06-1.10x alone and 1.104x once under CI's load; not counted, 1.03x)
shardvar.EmbeddingBagCollection({"warm": shardvar.TableConfig(64, 64, 8, "mod")}, sparse=True)
open("/proc/self/clear_refs", "w").write("5")
before = rss("VmRSS")
ebc = shardvar.EmbeddingBagCollection({k: shardvar.TableConfig(rows, 64, 8, "mod") for k in ids}, sparse=True)
built = rss("VmHWM") - before
so.fuse(so.RowWiseAdagrad(ebc, lr=0.01))
sum(v.sum() for v in ebc(ids).values()).backward()
open("/proc/self/clear_refs", "w").write("5")
for _ in range(3):
    sum(v.sum() for v in ebc(ids).values()).backward()
print(json.dumps({"built": built, "trained": rss("VmHWM") - before, "tables": tables * rows * 64 * 4}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc")
def test_building_holds_the_tables_once() -> None:
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True, timeout=120)
    peak = json.loads(out.stdout)
    assert peak["built"] <= 1.1 * peak["tables"], peak  # allocated once, drawn in place: not held twice
    # 128 MiB of tables: the batch's ids and rows weigh more than at 512 MiB (bench_fused_step: ~1.17x);
    # holding every table's gradient at once, or a table-sized one, would pass 2x
    assert peak["trained"] <= 1.75 * peak["tables"], peak
