"""Workers for tests/test_distributed_agreement.py: bad input on one rank, refused on every rank.

Each job builds one distributed module twice (twins A and B, equal by construction), trains both
on the same good steps, and between them gives A a call in which one rank's input is bad. Every
rank must raise the same error, A must be bitwise as it was (tables, optimizer state, step
counts), and A must stay B's twin through the good steps after it: the ranks' collectives still
pair up, step with step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import shardvar
from shardvar import TableConfig
from shardvar import optim as so
from shardvar.distributed import (
    Comm,
    DistributedDynamicEmbedding,
    DistributedEmbedding,
    DistributedEmbeddingBag,
    DistributedEmbeddingBagCollection,
    DistributedEmbeddingCollection,
    DistributedShardedVariable,
)
from shardvar.variables import RowInitializer

ROWS, DIM, TIMEOUT = 12, 8, 10.0
TABLES = {"a": TableConfig(12, 4, 2, "mod"), "b": TableConfig(10, 4, 2), "c": TableConfig(8, 4)}
PLACEMENTS = {
    "row": {},
    "table": {n: "table" for n in TABLES},
    "replicate": {n: "replicate" for n in TABLES},
    "mixed": {"b": "table", "c": "replicate"},
}
BAD_FEATURE = "c"  # the feature given bad input (a replicated table's under "mixed")


def _bag_input(rank: int, step: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, rows, (6,), generator=g)
    return {"ids": ids, "offsets": torch.tensor([0, 2, 2, 5]), "weights": torch.rand(6, generator=g)}


def corrupt(kind: str, x: dict[str, Any], rows: int) -> dict[str, Any]:
    """``x`` (ids, offsets, weights) with one fault of ``kind``: the local twin's checks refuse each."""
    x = dict(x)
    if kind in ("id out of range", "index out of range"):
        x["ids"] = x["ids"].clone().index_fill_(0, torch.tensor([3]), rows + 3)
    elif kind == "negative id":
        x["ids"] = x["ids"].clone().index_fill_(0, torch.tensor([1]), -2)
    elif kind in ("float ids", "float index"):
        x["ids"] = x["ids"].float()
    elif kind == "bad offsets":
        x["offsets"] = torch.tensor([0, 4, 2, 5])
    elif kind == "bad per-sample weights":
        x["weights"] = torch.rand(5)
    elif kind == "mixed strings":
        x["ids"] = ["a", *x["ids"].tolist()[1:]]
    elif kind != "unknown feature":
        raise ValueError(kind)
    return x


class Case:
    """One family's module, its optimizer, and how a step calls it (``good``: this rank's input)."""

    def __init__(self, family: str, placement: str, fused: bool, sparse: bool) -> None:
        self.family, self.placement, self.fused, self.sparse = family, placement, fused, sparse
        self.module, self.opt = self._build()

    def _build(self) -> tuple[Any, Any]:
        family, sparse = self.family, self.sparse
        timeout = {"timeout": TIMEOUT}
        ranks = None if self.placement == "row" else [1, 1, 1]  # "table": every shard on rank 1
        if family in ("DistributedEmbeddingBag", "DistributedEmbedding", "quantized") or family.startswith("variable"):
            init = RowInitializer(3)
            if family.startswith("variable"):
                return DistributedShardedVariable((ROWS, DIM), 3, initializer=init, placement=ranks, **timeout), None
            cls = DistributedEmbedding if family == "DistributedEmbedding" else DistributedEmbeddingBag
            options = {"mode": "sum"} if cls is DistributedEmbeddingBag else {}
            module = cls(ROWS, DIM, 3, "mod", initializer=init, placement=ranks, sparse=sparse, **options, **timeout)
            if family == "quantized":
                return shardvar.quantize(module, torch.quint8), None
        elif family == "DistributedDynamicEmbedding":
            module = DistributedDynamicEmbedding(DIM, 64, sparse=sparse, **timeout)
            opt = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(list(module.parameters()), lr=0.05)
            module.attach_optimizer(opt)
            return module, opt
        else:
            cls = DistributedEmbeddingBagCollection if family == "collection" else DistributedEmbeddingCollection
            placement = PLACEMENTS[self.placement]
            module = cls(TABLES, placement=placement, sparse=sparse, initializer=RowInitializer(3), **timeout)
        opt = so.Adam(module, lr=0.05)
        if self.fused:
            so.fuse(opt)
        return module, opt

    def inputs(self, rank: int, step: int, kind: str | None) -> dict[str, Any]:
        """This rank's input at ``step``, with a fault of ``kind`` if given."""
        if self.family in ("collection", "sequence"):
            features = {n: _bag_input(rank, 10 * step + i, c.num_embeddings) for i, (n, c) in enumerate(TABLES.items())}
            if kind is not None:
                features[BAD_FEATURE] = corrupt(kind, features[BAD_FEATURE], TABLES[BAD_FEATURE].num_embeddings)
            ids = {n: x["ids"] for n, x in features.items()}
            if kind == "unknown feature":
                ids["nope"] = ids["a"]
            weights = {n: x["weights"] for n, x in features.items()}
            if self.family == "sequence":  # it takes no weights: those of the bad feature are its fault
                weights = {BAD_FEATURE: weights[BAD_FEATURE]} if kind == "bad per-sample weights" else None
            return {"features": ids, "offsets": {n: x["offsets"] for n, x in features.items()}, "weights": weights}
        x = _bag_input(rank, step, ROWS)
        if self.family == "DistributedDynamicEmbedding":
            x["ids"] = x["ids"] * 7919 - 40000  # any int64 is an id of a dynamic table
        return corrupt(kind, x, ROWS) if kind is not None else x

    def call(self, x: dict[str, Any]) -> Any:
        """The module's forward (a read for the variable) on ``x``."""
        m = self.module
        if self.family in ("collection", "sequence"):
            return m(x["features"], x["offsets"], x["weights"])
        if self.family in ("DistributedEmbeddingBag", "quantized"):
            return m(x["ids"], x["offsets"], per_sample_weights=x["weights"])
        if self.family == "variable.lookup":
            return m.lookup(x["ids"])
        if self.family == "variable[]":
            return m[x["ids"]]
        return m(x["ids"])

    def train(self, x: dict[str, Any]) -> None:
        """A whole step on ``x``: forward, and where the module trains, backward and the optimizer's step."""
        out = self.call(x)
        if self.opt is None:
            return
        parts = out.values() if isinstance(out, dict) else [out]
        loss = sum((p.values if isinstance(p, shardvar.nn.JaggedRows) else p).pow(2).sum() for p in parts)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict[str, Any]:
        """This rank's tables, buffers and optimizer state (step counts included), copied."""
        m, opt = self.module, self.opt
        out: dict[str, Any] = {f"param/{n}": p.detach().clone() for n, p in m.named_parameters()}
        out.update({f"buffer/{n}": b.clone() for n, b in m.named_buffers()})
        if isinstance(opt, so.TableOptimizer):
            for name, v in opt.sharded_variables().items():
                shards = {"": v} if isinstance(v, torch.Tensor) else v.shards
                out.update({f"opt/{name}/{s}": t.detach().clone() for s, t in shards.items()})
        elif opt is not None:
            for i, st in enumerate(opt.state.values()):
                out.update({f"opt/{i}/{k}": v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()})
        return out

    def comms(self) -> list[Comm]:
        found = {}
        for m in [self.module, *(self.module.modules() if isinstance(self.module, torch.nn.Module) else [])]:
            for c in (
                getattr(m, "comm", None),
                getattr(getattr(getattr(m, "_store", None), "exchange", None), "comm", None),
            ):
                if isinstance(c, Comm):
                    found[id(c)] = c
        return list(found.values())


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bitwise equal states (NaNs equal where both have them)."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            if (
                x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
            ):
                return False
        elif x != y:
            return False
    return True


def _calls(comms: list[Comm], step: Callable[[], None]) -> dict[str, int]:
    before = [dict(c.calls) for c in comms]
    step()
    out: dict[str, int] = {}
    for c, b in zip(comms, before, strict=True):
        for k, n in c.calls.items():
            if n - b.get(k, 0):
                out[k] = out.get(k, 0) + n - b.get(k, 0)
    return out


def agreement(rank: int, world: int, family: str, placement: str, fused: bool, sparse: bool, kinds: list[str]) -> dict:
    """For each kind and each refusing rank: the error on this rank, whether A stayed as it was, whether A
    and B are equal after the next good step, and the collectives of that step."""
    a, b = Case(family, placement, fused, sparse), Case(family, placement, fused, sparse)
    step = 0
    for twin in (a, b):
        twin.train(twin.inputs(rank, step, None))
    results = {}
    for kind in kinds:
        for bad_rank in range(world):
            before = a.state()
            try:
                a.train(a.inputs(rank, step, kind if rank == bad_rank else None))
                error = None
            except Exception as e:  # the test checks the class and the message
                error = ([c.__name__ for c in type(e).__mro__], str(e))
            unchanged = same(before, a.state())
            step += 1
            calls = _calls(a.comms(), lambda: a.train(a.inputs(rank, step, None)))  # noqa: B023 (called here)
            b.train(b.inputs(rank, step, None))
            results[kind, bad_rank] = {
                "error": error, "unchanged": unchanged, "twins": same(a.state(), b.state()), "calls": calls,
            }  # fmt: skip
    return results


def variable_reads(rank: int, world: int) -> dict:
    """Reads of a variable whose shards all live on rank 1 (which could read them alone, but reads with
    the others: every read is collective), and a write, refused on every rank alike."""
    v = DistributedShardedVariable((ROWS, DIM), 3, initializer=RowInitializer(3), placement=[1, 1, 1], timeout=TIMEOUT)
    reads = {
        "int": v[3],
        "slice": v[2:5],
        "ids": v[torch.tensor([0, 11])],
        "mask": v[torch.arange(ROWS) % 5 == 0],
        "whole": v.to_tensor(),
        "lookup": v.lookup(torch.tensor([4])),
    }
    try:
        v.scatter_update([1], torch.zeros(1, DIM))
        write = None
    except shardvar.ShardvarTypeError as e:
        write = str(e)
    reads["plus one"] = v + 1  # a torch op on the whole variable
    keys = sorted(v.state_dict())  # each rank its own shards: the whole lives on no rank's state dict
    return {"reads": {k: x.detach() for k, x in reads.items()}, "write": write, "keys": keys}


def _refusal(build: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        build()
    except shardvar.ShardvarError as e:
        return type(e).__name__, str(e)
    return None


def initial_values(rank: int, world: int) -> dict:
    """``_weight`` / ``from_pretrained`` of the distributed modules: every rank keeps its owned rows of the
    given table; a bad table on one rank, or a table on one rank only, is refused on every rank."""
    table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5))
    out: dict[str, Any] = {}
    for cls in (DistributedEmbedding, DistributedEmbeddingBag):
        for strategy in ("div", "mod"):
            m = cls.from_pretrained(table, False, partitioner=3, partition_strategy=strategy, padding_idx=2, timeout=TIMEOUT)
            ids = torch.arange(ROWS)
            got = m(ids) if cls is DistributedEmbedding else m(ids.view(-1, 1))
            out[cls.__name__, strategy] = (got.detach(), [p.requires_grad for p in m.parameters()])
    frozen = DistributedEmbedding.from_pretrained(table, partitioner=2, timeout=TIMEOUT)  # freeze=True: the default
    out["frozen"] = [p.requires_grad for p in frozen.parameters()]
    wrong = table if rank == 0 else table[:, :3]
    out["bad shape"] = _refusal(lambda: DistributedEmbedding(ROWS, DIM, 2, _weight=wrong, timeout=TIMEOUT))
    alone = {"_weight": table} if rank == 1 else {}
    out["one rank"] = _refusal(lambda: DistributedEmbeddingBag(ROWS, DIM, 2, timeout=TIMEOUT, **alone))
    after = DistributedEmbedding.from_pretrained(table, partitioner=2, timeout=TIMEOUT)  # the ranks still pair up
    out["after"] = after(torch.arange(ROWS)).detach()
    return out
