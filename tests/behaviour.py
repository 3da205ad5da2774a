"""The behaviour suite's registry: one shared spec, every module family built from it, its plain-torch reference.

A family is a small object: it builds its module from the spec (tables, widths, features, a layout
variant), calls it on a batch given per feature as 1-D ids with offsets, and says which behaviours it
has, which it refuses (the exception and the words its message must hold) and which cannot even be
asked of it. ``behaviour_checks`` runs each behaviour on a family (here, or on every rank of a
distributed run) and compares it with the reference: ``torch.nn.functional`` on the whole tables.

``KNOWN_DEFECTS`` lists the (behaviour, family) cases that fail today for a known reason; each runs as
a strict xfail, so a fix turns its case red until its entry is deleted here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardvar
from shardvar import KeyedJagged, TableConfig
from shardvar.variables import RowInitializer

SEED, PADDING, LR = 5, 2, 0.1
INIT = RowInitializer(SEED)
# Two tables: "user" serves two features ("user" and "friend"), "item" one named apart from it ("clicked").
LAYOUTS = {  # layout variant -> table -> (shards, strategy): save in "a", load into "b"
    "a": {"user": (3, "div"), "item": (2, "mod")},
    "b": {"user": (2, "mod"), "item": (3, "div")},
}
SHAPES = {"user": (10, 4), "item": (7, 4)}
FEATURES = {"user": ("user", "friend"), "item": ("clicked",)}
MODES = {"user": "sum", "item": "mean"}
FIRST = dict(zip(SHAPES, itertools.accumulate([0, *(r for r, _ in SHAPES.values())]), strict=False))
TABLE_OF = {f: t for t, fs in FEATURES.items() for f in fs}
BATCH = 3  # bags per feature

BEHAVIOURS = ("lookup", "train_step", "bad_ids", "bad_ids_one_rank", "bad_inputs", "bad_inputs_one_rank", "padding", "empty_bags",
              "per_sample_weights", "feature_names", "save_load")  # fmt: skip


def table_configs(variant: str = "a", pooled: bool = True) -> dict[str, TableConfig]:
    return {
        t: TableConfig(*SHAPES[t], *LAYOUTS[variant][t], mode=MODES[t] if pooled else "sum", feature_names=FEATURES[t])
        for t in SHAPES
    }


def initial_tables(init: RowInitializer = INIT, padding_idx: int | None = None) -> dict[str, torch.Tensor]:
    """Every family starts from these rows (a distributed collection draws table t's rows as FIRST[t] + i);
    a padding row starts at zero, as nn.Embedding's does."""
    tables = {t: init.rows(FIRST[t] + torch.arange(r), (d,)) for t, (r, d) in SHAPES.items()}
    if padding_idx is not None:
        for w in tables.values():
            w[padding_idx] = 0
    return tables


@dataclass(frozen=True)
class SpecRows:
    """A dynamic table's initializer: id i starts as row i of the "user" table (a stable repr: ranks agree)."""

    init: RowInitializer = INIT

    def __call__(self, keys: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        return self.init.rows(keys, (dim,), dtype)


Batch = dict[str, tuple[torch.Tensor, torch.Tensor]]  # feature -> (ids 1-D, offsets of BATCH bags)


def make_batch(features: tuple[str, ...], rank: int, step: int, empty: bool = False) -> Batch:
    """Ids of each feature in BATCH bags; ``empty``: the first and last bags hold nothing (on rank 1 no bag
    holds anything: a rank without ids still takes part in the exchange)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + 1)
    out = {}
    for f in features:
        lengths = torch.tensor([0, 3 * (rank != 1), 0]) if empty else torch.randint(1, 4, (BATCH,), generator=g)
        ids = torch.randint(0, SHAPES[TABLE_OF[f]][0], (int(lengths.sum()),), generator=g)
        out[f] = ids, torch.cumsum(lengths, 0) - lengths
    return out


def with_padding(batch: Batch) -> Batch:
    """Every feature's batch with the padding id among its ids."""
    return {f: (torch.cat([torch.tensor([PADDING]), ids[1:]]), offs) for f, (ids, offs) in batch.items()}


def sample_weights(batch: Batch) -> dict[str, torch.Tensor]:
    """Per-sample weights for the features of sum tables (a mean bag takes none)."""
    g = torch.Generator().manual_seed(7)
    return {f: torch.rand(len(ids), generator=g) + 0.5 for f, (ids, _) in batch.items() if MODES[TABLE_OF[f]] == "sum"}


@dataclass(frozen=True)
class Family:
    """One module family: how to build and call it, and which behaviours it has or refuses."""

    name: str
    kind: str  # "embedding", "bag" (one table: "user"), "pooled" or "sequence" (every table)
    build: Callable[..., nn.Module]  # (variant, padding_idx=None, init=INIT) -> module
    world: int = 1
    quantized: bool = False  # float16 rows: the reference's tables pass through float16
    trains: bool = True
    refuses: dict[str, tuple[type, str]] = field(default_factory=dict)  # behaviour -> (error, regex)
    not_applicable: dict[str, str] = field(default_factory=dict)  # behaviour -> why it cannot be asked
    save: Callable[[dict, str], Any] = shardvar.save  # a distributed family's: shardvar.distributed's
    load: Callable[[dict, str], Any] = shardvar.load

    @property
    def features(self) -> tuple[str, ...]:
        return ("user",) if self.kind in ("embedding", "bag") else tuple(TABLE_OF)

    def call(self, module: nn.Module, batch: Batch, weights: dict[str, torch.Tensor] | None = None) -> dict:
        """``{feature: output}`` (a sequence's values, and its lengths under ``"<feature>.lengths"``)."""
        if self.kind == "embedding":  # weights given as to a bag: nn.Embedding's forward takes none
            extra = {"per_sample_weights": weights["user"]} if weights else {}
            return {"user": module(batch["user"][0], **extra)}
        if self.kind == "bag":
            ids, offsets = batch["user"]
            return {"user": module(ids, offsets, per_sample_weights=(weights or {}).get("user"))}
        ids = {f: i for f, (i, _) in batch.items()}
        offsets = {f: o for f, (_, o) in batch.items()}
        if self.kind == "pooled":
            return module(ids, offsets, per_sample_weights=weights)
        out = module(as_keyed(batch, weights)) if weights else module(ids, offsets)
        return {**{f: r.values for f, r in out.items()}, **{f"{f}.lengths": r.lengths for f, r in out.items()}}

    def reference(self, tables: dict[str, torch.Tensor], batch: Batch, weights: dict | None = None,
                  padding_idx: int | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """The same call in plain torch on the whole tables."""
        if self.quantized:
            tables = {t: w.half().float() for t, w in tables.items()}
        out = {}
        for f, (ids, offsets) in batch.items():
            w = tables[TABLE_OF[f]]
            if self.kind in ("embedding", "sequence"):
                out[f] = F.embedding(ids, w, padding_idx=padding_idx)
                if self.kind == "sequence":
                    out[f"{f}.lengths"] = torch.diff(offsets, append=torch.tensor([len(ids)]))
            else:
                mode = "sum" if self.kind == "bag" else MODES[TABLE_OF[f]]
                psw = (weights or {}).get(f)
                out[f] = F.embedding_bag(ids, w, offsets, mode=mode, per_sample_weights=psw, padding_idx=padding_idx)
        return out


def as_keyed(batch: Batch, weights: dict[str, torch.Tensor] | None) -> KeyedJagged:
    keys = tuple(batch)
    values = torch.cat([ids for ids, _ in batch.values()])
    lengths = torch.stack([torch.diff(o, append=torch.tensor([len(i)])) for i, o in batch.values()])
    w = None if weights is None else torch.cat([weights.get(f, torch.ones(len(batch[f][0]))) for f in keys])
    return KeyedJagged(keys, values, lengths, weights=w)


def _with_rows(module: nn.Module, tables: dict[str, nn.Module], init: RowInitializer) -> nn.Module:
    """``module`` whose tables hold the spec's initial rows."""
    rows = initial_tables(init)
    for t, table in tables.items():
        table.weight.assign(rows[t])
    return module


def _local(kind: str, sparse: bool = False) -> Callable[..., nn.Module]:
    def build(variant: str, padding_idx: int | None = None, init: RowInitializer = INIT) -> nn.Module:
        shards, strategy = LAYOUTS[variant]["user"]
        rows = initial_tables(init, padding_idx)["user"]
        if kind == "embedding":
            return shardvar.ShardedEmbedding.from_pretrained(
                rows, False, partitioner=shards, partition_strategy=strategy, padding_idx=padding_idx, sparse=sparse,
            )  # fmt: skip
        if kind == "bag":
            return shardvar.ShardedEmbeddingBag.from_pretrained(
                rows, False, partitioner=shards, partition_strategy=strategy, mode="sum", padding_idx=padding_idx,
                sparse=sparse,
            )  # fmt: skip
        configs = (
            table_configs(variant, kind == "pooled") if padding_idx is None else padded_configs(variant, padding_idx)
        )
        if kind == "pooled":
            ebc = shardvar.EmbeddingBagCollection(configs, sparse=sparse)
            return _with_rows(ebc, dict(ebc.embedding_bags.items()), init)
        ec = shardvar.EmbeddingCollection(configs, sparse=sparse)
        return _with_rows(ec, dict(ec.embeddings.items()), init)

    return build


def padded_configs(variant: str, padding_idx: int) -> dict[str, TableConfig]:
    """A collection's tables with a padding row: TableConfig has no such option (a TypeError names it)."""
    return {t: TableConfig(*SHAPES[t], padding_idx=padding_idx) for t in SHAPES}  # raises


def _quantized(kind: str) -> Callable[..., nn.Module]:
    def build(variant: str, padding_idx: int | None = None, init: RowInitializer = INIT) -> nn.Module:
        return shardvar.quantize(_local(kind)(variant, padding_idx, init), torch.float16)

    return build


def _dynamic(kind: str) -> Callable[..., nn.Module]:
    def build(variant: str, padding_idx: int | None = None, init: RowInitializer = INIT) -> nn.Module:
        options: dict[str, Any] = {"initializer": SpecRows(init)}
        if padding_idx is not None:
            options["padding_idx"] = padding_idx  # not an option of a dynamic table: a TypeError names it
        shards = {"a": 2, "b": 4}[variant]
        if kind == "bag":
            return shardvar.DynamicEmbeddingBag(4, 32, shards, mode="sum", **options)
        return shardvar.DynamicEmbedding(4, 32, shards, **options)

    return build


NO_FEATURES = "one table, called with its ids: it has no features to name"
NO_BAGS = "it returns every id's row: it has no bags"
NO_WEIGHTS = (TypeError, "unexpected keyword argument 'per_sample_weights'")  # as nn.Embedding's forward
NO_PADDING = (TypeError, "unexpected keyword argument 'padding_idx'")  # TableConfig's, a dynamic table's
INFERENCE_ONLY = (shardvar.ShardvarValueError, r"is inference-only: its rows are quantized \(float16\)")
ONE_RANK = "one process: no other rank to disagree with"
ANY_ID = "every int64 is an id of a dynamic table: no id is out of range"


def _local_families() -> list[Family]:
    base = {
        "embedding": {"per_sample_weights": NO_WEIGHTS},
        "bag": {},
        "pooled": {"padding": NO_PADDING},
        "sequence": {"padding": NO_PADDING,
                     "per_sample_weights": (shardvar.ShardvarValueError, "is not pooled .* it takes no weights")},
    }  # fmt: skip
    na = {"embedding": {"feature_names": NO_FEATURES, "empty_bags": NO_BAGS}, "bag": {"feature_names": NO_FEATURES}}
    out = []
    for kind, refuses in base.items():
        common = {"not_applicable": {"bad_ids_one_rank": ONE_RANK, "bad_inputs_one_rank": ONE_RANK, **na.get(kind, {})}}
        out.append(Family(kind, kind, _local(kind), refuses=refuses, **common))
        q = {**refuses, "train_step": INFERENCE_ONLY}
        out.append(Family(f"quantized_{kind}", kind, _quantized(kind), quantized=True, trains=False, refuses=q,
                          **common))  # fmt: skip
    for kind, refuses in base.items():  # sparse gradients: another backward, the same behaviour
        common = {"not_applicable": {"bad_ids_one_rank": ONE_RANK, "bad_inputs_one_rank": ONE_RANK, **na.get(kind, {})}}
        out.append(Family(f"{kind}_sparse", kind, _local(kind, sparse=True), refuses=refuses, **common))
    for kind in ("embedding", "bag"):
        refuses = {"padding": NO_PADDING}
        if kind == "embedding":
            refuses["per_sample_weights"] = NO_WEIGHTS
        skip = {"bad_ids": ANY_ID, "bad_ids_one_rank": ONE_RANK, "bad_inputs_one_rank": ONE_RANK, **na[kind]}
        out.append(Family(f"dynamic_{kind}", kind, _dynamic(kind), refuses=refuses, not_applicable=skip))
    return out


LOCAL = {f.name: f for f in _local_families()}

# (behaviour, family) -> why it fails today: each runs as a strict xfail. Delete a defect's line when
# its fix merges (its cases then pass, and a strict xfail that passes is a failure).
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


def cases(behaviour: str, families: dict[str, Family]) -> list:
    """``families`` as pytest params for ``behaviour``: those it cannot be asked of left out, known defects xfail."""
    out = []
    for name, family in families.items():
        if behaviour in family.not_applicable:
            continue
        reason = KNOWN_DEFECTS.get((behaviour, name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(family, id=name, marks=marks))
    return out
