"""The behaviour suite's distributed families (2 ranks) and the worker that runs every case of them.

``matrix`` runs every (behaviour, family) case in one process group per rank (run by
dist_workers.main through tests/distributed.py ``run_ranks``); a case where one rank alone passes
a bad id runs last, each family on a process group of its own with a short collective timeout and
the known defects after the rest: a family that leaves its ranks out of step (a timed-out collective
closes connections gloo shares) spoils no case that should pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardvar
from behaviour import (
    ANY_ID,
    BEHAVIOURS,
    INFERENCE_ONLY,
    INIT,
    KNOWN_DEFECTS,
    LAYOUTS,
    NO_BAGS,
    NO_FEATURES,
    NO_PADDING,
    NO_WEIGHTS,
    Family,
    SpecRows,
    padded_configs,
    table_configs,
)
from behaviour_checks import observe
from shardvar.distributed import (
    DistributedDynamicEmbedding,
    DistributedEmbedding,
    DistributedEmbeddingBag,
    DistributedEmbeddingBagCollection,
    DistributedEmbeddingCollection,
)
from shardvar.variables import RowInitializer

WORLD = 2
ONE_RANK_TIMEOUT = 5.0  # seconds a collective waits in a case where ranks may fall out of step
KNOWN_DEFECT_TIMEOUT = 1.0  # ... in such a case known to leave them out of step today: it fails fast
CONTEXT: dict[str, Any] = {"group": None, "timeout": 60.0}  # the process group the current case builds on


def _options() -> dict[str, Any]:
    return {"group": CONTEXT["group"], "timeout": CONTEXT["timeout"]}


def _save(state: dict, path: str) -> None:
    shardvar.distributed.save(state, path, **_options())


def _load(state: dict, path: str) -> None:
    shardvar.distributed.load(state, path, **_options())


def _float(kind: str, placement: dict[str, str] | None = None, sparse: bool = False):
    def build(variant: str, padding_idx: int | None = None, init: RowInitializer = INIT) -> nn.Module:
        shards, strategy = LAYOUTS[variant]["user"]
        extra = {} if padding_idx is None else {"padding_idx": padding_idx}
        if kind == "embedding":
            return DistributedEmbedding(10, 4, shards, strategy, initializer=init, sparse=sparse, **extra, **_options())
        if kind == "bag":
            return DistributedEmbeddingBag(
                10, 4, shards, strategy, initializer=init, mode="sum", sparse=sparse, **extra, **_options()
            )
        configs = (
            table_configs(variant, kind == "pooled") if padding_idx is None else padded_configs(variant, padding_idx)
        )
        cls = DistributedEmbeddingBagCollection if kind == "pooled" else DistributedEmbeddingCollection
        return cls(configs, initializer=init, placement=placement, sparse=sparse, **_options())

    return build


def _quantized(kind: str):
    def build(variant: str, padding_idx: int | None = None, init: RowInitializer = INIT) -> nn.Module:
        return shardvar.quantize(_float(kind)(variant, padding_idx, init), torch.float16)

    return build


def _dynamic(variant: str, padding_idx: int | None = None, init: RowInitializer = INIT) -> nn.Module:
    """One shard per rank whatever the variant: it saves and loads into the same layout."""
    extra = {} if padding_idx is None else {"padding_idx": padding_idx}  # no such option: a TypeError names it
    return DistributedDynamicEmbedding(4, 32, initializer=SpecRows(init), **extra, **_options())


PLACED = {"user": "table", "item": "replicate"}
SEQUENCE_WEIGHTS = (shardvar.ShardvarValueError, "is not pooled .* it takes no weights")


def _families() -> list[Family]:
    common = {"world": WORLD, "save": _save, "load": _load}
    refuses = {
        "embedding": {"per_sample_weights": NO_WEIGHTS},
        "bag": {},
        "pooled": {"padding": NO_PADDING},
        "sequence": {"padding": NO_PADDING, "per_sample_weights": SEQUENCE_WEIGHTS},
    }
    na = {"embedding": {"feature_names": NO_FEATURES, "empty_bags": NO_BAGS}, "bag": {"feature_names": NO_FEATURES}}
    out = []
    for kind, refused in refuses.items():
        out.append(
            Family(f"dist_{kind}", kind, _float(kind), refuses=refused, not_applicable=na.get(kind, {}), **common)
        )
        q = {**refused, "train_step": INFERENCE_ONLY}
        if kind in ("pooled", "sequence"):  # a quantized distributed collection is served, not checkpointed
            q["save_load"] = (shardvar.ShardvarTypeError, "is not checkpointed: save the float collection")
        out.append(Family(f"dist_quantized_{kind}", kind, _quantized(kind), quantized=True, trains=False, refuses=q,
                          not_applicable=na.get(kind, {}), **common))  # fmt: skip
    for kind in ("pooled", "sequence"):  # "user" whole on one rank, "item" on every rank: the other twins' rules
        out.append(Family(f"dist_{kind}_placed", kind, _float(kind, PLACED), refuses=refuses[kind], **common))
    for kind, refused in refuses.items():  # sparse gradients (the replicas' too): another backward, the same behaviour
        build = _float(kind, PLACED if kind in ("pooled", "sequence") else None, sparse=True)
        out.append(
            Family(f"dist_{kind}_sparse", kind, build, refuses=refused, not_applicable=na.get(kind, {}), **common)
        )
    dynamic_refuses = {
        "padding": NO_PADDING,
        "per_sample_weights": NO_WEIGHTS,
    }
    skip = {"bad_ids": ANY_ID, "bad_ids_one_rank": ANY_ID, **na["embedding"]}
    out.append(Family("dist_dynamic_embedding", "embedding", _dynamic, refuses=dynamic_refuses,
                      not_applicable=skip, **common))  # fmt: skip
    return out


DISTRIBUTED = {f.name: f for f in _families()}


def matrix(rank: int, world: int, path: str) -> dict:
    """Every case's observation on this rank: ``{(behaviour, family): observation}``."""
    cases = [(b, f) for b in BEHAVIOURS for f in DISTRIBUTED.values() if b not in f.not_applicable]
    # Known defects last: a case that leaves its ranks out of step can spoil the cases after it.
    last = sorted(
        ((b, f) for b, f in cases if b.endswith("_one_rank")), key=lambda c: (c[0], c[1].name) in KNOWN_DEFECTS
    )
    groups = {(b, f.name): dist.new_group(list(range(world))) for b, f in last}  # made while every rank is in step
    out: dict[Any, Any] = {}
    for behaviour, family in [c for c in cases if c not in last]:
        out[behaviour, family.name] = observe(behaviour, family, rank, path)
    for behaviour, family in last:
        known = (behaviour, family.name) in KNOWN_DEFECTS
        CONTEXT.update(
            group=groups[behaviour, family.name], timeout=KNOWN_DEFECT_TIMEOUT if known else ONE_RANK_TIMEOUT
        )
        out[behaviour, family.name] = observe(behaviour, family, rank, path)
    # A case whose ranks fell out of step may leave a collective pending: then leave without tearing
    # the groups down (dist_workers.main skips it when the result has an error).
    spoiled = [k for k, v in out.items() if k[0].endswith("_one_rank") and "crash" in v]
    return {"cases": out, "error": f"cases left ranks out of step: {spoiled}" if spoiled else None}
