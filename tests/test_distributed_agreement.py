"""Bad input on one rank of a distributed module is refused on every rank, before anything changes.

Every family (the two modules, both collections in every placement, the dynamic table, the
distributed variable's reads, a quantized module), fused or not, sparse or dense gradients, each
kind of bad input on rank 0 alone and on rank 1 alone: every rank raises the same error (the
local twin's class and message, naming the refusing rank), no rank's tables, optimizer state or
step counts change, and the next good steps keep the module the twin of one never given bad
input (the ranks' collectives still pair step with step). Two processes run every case, in one
launch (``distributed.batched``). And a distributed variable is read together by every rank, also
by one that holds every shard (it would read alone, and the ranks' collectives part ways).
"""

from __future__ import annotations

import re

import pytest
import torch

from dist_agreement_workers import BAD_FEATURE, DIM, ROWS, TABLES
from distributed import batched
from shardvar.variables import RowInitializer

IDS = ("id out of range", "negative id", "float ids")
BAGS = (*IDS, "bad offsets", "bad per-sample weights")
KINDS = {  # family -> (placements, fused options, sparse options, kinds of bad input)
    "DistributedEmbeddingBag": (("row", "table"), (False, True), (False, True), BAGS),
    "DistributedEmbedding": (("row", "table"), (False, True), (False, True), IDS),
    "collection": (("row", "table", "replicate", "mixed"), (False, True), (False, True), (*BAGS, "unknown feature")),
    "sequence": (("row", "table", "replicate", "mixed"), (False, True), (False, True), (*BAGS, "unknown feature")),
    "DistributedDynamicEmbedding": (("row",), (False,), (False, True), ("float ids", "mixed strings")),
    "variable.lookup": (("row", "table"), (False,), (False,), IDS),
    "variable[]": (("row", "table"), (False,), (False,), ("index out of range", "float index")),
    "quantized": (("row", "table"), (False,), (False,), BAGS),
}
JOBS = {
    (family, placement, fused, sparse): (
        2,
        "dist_agreement_workers:agreement",
        {"family": family, "placement": placement, "fused": fused, "sparse": sparse, "kinds": list(kinds)},
    )
    for family, (placements, fuses, sparses, kinds) in KINDS.items()
    for placement in placements
    for fused in fuses
    for sparse in sparses
}
CASES = [(*key, kind, bad) for key, (_, _, job) in JOBS.items() for kind in job["kinds"] for bad in (0, 1)]
JOBS["variable reads"] = (2, "dist_agreement_workers:variable_reads", {})
JOBS["initial values"] = (2, "dist_agreement_workers:initial_values", {})
ERRORS = {  # kind -> (the local twin's error class, what its message says)
    "id out of range": ("ShardvarIndexError", r"ids must be in \[0, {rows}\); got {bad} at position 3"),
    "negative id": ("ShardvarIndexError", r"ids must be in \[0, {rows}\); got -2 at position 1"),
    "float ids": ("ShardvarTypeError", r"float32"),
    "mixed strings": ("ShardvarTypeError", r"ids mix strings and other values"),
    "bad offsets": ("ShardvarValueError", r"offsets must be non-decreasing"),
    "bad per-sample weights": ("ShardvarValueError", r"per_sample_weights|weights"),
    "unknown feature": ("ShardvarValueError", r"no feature named \['nope'\]"),
    "index out of range": ("ShardvarIndexError", r"index {bad} is out of bounds for axis 0 with size {rows}"),
    "float index": ("ShardvarTypeError", r"index tensors must hold integers or booleans; got dtype torch.float32"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    return batched(lambda: tmp_path_factory.mktemp("agreement"), JOBS)


def _case_id(case: tuple) -> str:
    family, placement, fused, sparse, kind, bad = case
    return f"{family}-{placement}-{'fused' if fused else 'unfused'}-{'sparse' if sparse else 'dense'}-{kind}-rank{bad}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_on_one_rank_is_refused_on_every_rank_and_changes_nothing(results, case) -> None:
    family, placement, fused, sparse, kind, bad = case
    ranks = [r[kind, bad] for r in results((family, placement, fused, sparse))]
    errors = [r["error"] for r in ranks]
    assert all(e is not None for e in errors), errors  # every rank raised
    assert errors[0] == errors[1], errors  # the same class and message
    mro, message = errors[0]
    name, pattern = ERRORS[kind]
    assert name in mro and "ShardvarError" in mro, mro
    collections = family in ("collection", "sequence")
    rows = TABLES[BAD_FEATURE].num_embeddings if collections else ROWS
    feature = f"feature '{BAD_FEATURE}'" if collections and kind != "unknown feature" else ""
    assert message.startswith(f"rank {bad}: {feature}"), message  # names the rank that refused, and the feature
    assert re.search(pattern.format(rows=rows, bad=rows + 3), message), message
    for r in ranks:
        assert r["unchanged"]  # tables, optimizer state and step counts bitwise as they were
        assert r["twins"]  # the next good step paired up: equal to a twin never given bad input
        assert "all_gather_object" not in r["calls"], r["calls"]  # the refusals are gathered only on refusal


def test_a_distributed_variable_is_read_together_by_every_rank_also_one_that_holds_every_shard(results) -> None:
    table = RowInitializer(3)((ROWS, DIM))
    want = {
        "int": table[3],
        "slice": table[2:5],
        "ids": table[[0, 11]],
        "mask": table[torch.arange(ROWS) % 5 == 0],
        "whole": table,
        "lookup": table[[4]],
        "plus one": table + 1,
    }
    for rank, r in enumerate(results("variable reads")):
        assert r["keys"] == ([] if rank == 0 else ["shard_0", "shard_1", "shard_2"])  # each rank's shards
        assert r["reads"].keys() == want.keys()
        for k, x in want.items():
            torch.testing.assert_close(r["reads"][k], x, atol=0, rtol=0, msg=k)
        assert r["write"] and "scatter_update needs every shard in this process" in r["write"], r["write"]


def test_distributed_modules_keep_the_rows_they_are_given_and_refuse_a_bad_table_on_every_rank(results) -> None:
    table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5))
    for r in results("initial values"):
        for key in [(m, s) for m in ("DistributedEmbedding", "DistributedEmbeddingBag") for s in ("div", "mod")]:
            got, grads = r[key]
            want = table.clone()
            if key[0] == "DistributedEmbeddingBag":  # a bag of the padding id alone is empty: zeros
                want[2] = 0
            assert torch.equal(got, want), key  # from_pretrained's rows, the padding row's too (as nn.Embedding's)
            assert grads and all(grads), key  # freeze=False
        assert r["frozen"] and not any(r["frozen"])
        name, message = r["bad shape"]
        assert name == "ShardvarValueError" and "on rank 1, the initial values have shape [12, 3]" in message
        name, message = r["one rank"]
        assert name == "ShardvarDistributedError" and "rank 0" in message and "no initial values" in message
        assert torch.equal(r["after"], table)
