"""Workers for tests/test_tiered_distributed.py: distributed tiered tables against the same tables in RAM.

One launch runs every case (``cases``): each returns what the test process checks.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import shardvar
from shardvar import optim
from shardvar.distributed import DistributedEmbedding, DistributedEmbeddingBag, DistributedEmbeddingBagCollection
from shardvar.tiered import BackingFileError, cache_bytes_for
from shardvar.variables import RowInitializer

ROWS, DIM, SHARDS = 30, 4, 4


def storage(path: Path, name: str, rows: int = 4) -> shardvar.Tiered:
    """A cache of ``rows`` of a rank's 15 (at most 4 asked of an owner per step: rows leave it every step)."""
    cache = cache_bytes_for(rows, DIM, rows=ROWS // 2, state_width=1, read_ahead=0.0)  # RowWiseAdagrad's one sum
    return shardvar.Tiered(path / name, cache_bytes=cache, read_ahead=0.0)


def make(cls, path: Path | None, name: str = "t.rows", rows: int = 4, **kw):
    tiered = {} if path is None else {"storage": storage(path, name, rows)}
    return cls(ROWS, DIM, SHARDS, "mod", initializer=RowInitializer(3), sparse=True, **tiered, **kw)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    ids = (torch.rand(2, generator=g) ** 2 * ROWS).long()  # skewed: hits and misses both
    return ids, torch.tensor([0, 1, 1])


def weights_of(module) -> dict[int, torch.Tensor]:
    return {s: t.clone() for s, t in module.sharded_variables()["weight"].local_shards().items()}


def state_of(opt) -> dict[str, torch.Tensor]:
    """Every slot's shards of this rank (the checkpoint's view of the optimizer's state)."""
    out = {}
    for name, value in opt.sharded_variables().items():
        if isinstance(value, torch.Tensor):
            out[name] = value.clone()
        else:
            out.update({f"{name}@{s}": t.clone() for s, t in value.local_shards().items()})
    return out


def train(module, steps: range, rank: int) -> list[torch.Tensor]:
    outs = []
    for step in steps:
        ids, offsets = batch(rank, step)
        out = module(ids, offsets) if isinstance(module, DistributedEmbeddingBag) else module(ids)
        outs.append(out.detach().clone())
        (out * torch.linspace(-1, 1, DIM)).square().sum().backward()
    return outs


def bag_exact(rank: int, path: Path) -> dict:
    ref, tiered = make(DistributedEmbeddingBag, None, mode="sum"), make(DistributedEmbeddingBag, path, mode="sum")
    start = (weights_of(ref), weights_of(tiered))
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    outs = [train(m, range(8), rank) for m in (ref, tiered)]
    return {
        "start": start,
        "outs": outs,
        "weights": (weights_of(ref), weights_of(tiered)),
        "state": tuple(state_of(o) for o in opts),
        "stats": tiered.cache_stats(),
        "file": str(tiered.tier.rows.file.path),
        "repr": repr(tiered),
    }


def bad_id(rank: int, path: Path) -> dict:
    """A bad id on rank 1, then more rows asked of the owners than their caches hold: every rank refuses."""
    tiered = make(DistributedEmbedding, path, "bad.rows")
    opt = optim.RowWiseAdagrad(tiered, lr=0.1)
    optim.fuse(opt)
    train(tiered, range(2), rank)
    out = []
    for ids in ([1, 2, ROWS + 5 if rank == 1 else 3], list(range(0, 24, 2))):
        before = (weights_of(tiered), state_of(opt), tiered.cache_stats())
        try:
            tiered(torch.tensor(ids)).sum().backward()
            error = None
        except (shardvar.ShardvarIndexError, shardvar.ShardvarValueError) as e:
            error = f"{type(e).__name__}: {e}"
        out.append(
            {"error": error, "before": before, "after": (weights_of(tiered), state_of(opt), tiered.cache_stats())}
        )
    train(tiered, range(2, 4), rank)  # the ranks go on together
    return {"cases": out}


def refusals(rank: int, path: Path) -> dict:
    found = {}

    def refused(name, call, *errors):
        try:
            call()
        except errors as e:
            found[name] = f"{type(e).__name__}: {e}"

    refused("max_norm", lambda: make(DistributedEmbedding, path, "norm.rows", max_norm=1.0), shardvar.ShardvarError)
    tiered = make(DistributedEmbeddingBag, path, "refused.rows", mode="sum")
    ref = make(DistributedEmbeddingBag, None, mode="sum")
    refused("weight", lambda: tiered.weight, shardvar.ShardvarTypeError)
    refused("state_dict", lambda: tiered.load_state_dict(ref.state_dict()), shardvar.ShardvarTypeError)
    refused("reset", tiered.reset_parameters, shardvar.ShardvarTypeError)
    before = weights_of(tiered)
    torch.optim.SGD(tiered.parameters(), lr=0.1)
    refused("torch_sgd", lambda: tiered(*batch(rank, 0)).sum().backward(), shardvar.ShardvarTypeError)
    optim.RowWiseAdagrad(tiered, lr=0.1)  # not fused
    refused("unfused", lambda: tiered(*batch(rank, 1)).sum().backward(), shardvar.ShardvarTypeError)
    found["unchanged"] = all(torch.equal(a, weights_of(tiered)[s]) for s, a in before.items())
    replicated = {"t": shardvar.TableConfig(ROWS, DIM, storage=storage(path, "rep.rows"))}
    refused(
        "replicate",
        lambda: DistributedEmbeddingBagCollection(replicated, placement={"t": "replicate"}),
        shardvar.ShardvarValueError,
    )
    # a rank's file held open elsewhere: every rank refuses the table, and no rank keeps a file
    holder = None
    if rank == 1:
        holder = shardvar.ShardedEmbedding(4, DIM, storage=storage(path, "busy.rank1.rows"))
    refused("busy", lambda: make(DistributedEmbedding, path, "busy.rows"), BackingFileError)
    found["left"] = sorted(p.name for p in path.iterdir() if p.name.startswith("busy"))
    del holder
    ranked = make(DistributedEmbedding, path, "named.{rank}.rows")
    found["named"] = ranked.tier.rows.file.path.name
    return found


def checkpoints(rank: int, path: Path) -> dict:
    """Tiered -> in RAM and in RAM -> tiered, through distributed checkpoints (the model and its optimizer)."""
    tiered = make(DistributedEmbeddingBag, path, "ckpt.rows", mode="sum")
    opt = optim.RowWiseAdagrad(tiered, lr=0.1)
    optim.fuse(opt)
    train(tiered, range(4), rank)
    shardvar.distributed.save({"model": tiered, "opt": opt}, path / "from_tiered")
    saved = (weights_of(tiered), state_of(opt))
    ram = DistributedEmbeddingBag(ROWS, DIM, SHARDS, "mod", mode="sum", sparse=True, initializer=RowInitializer(9))
    ram_opt = optim.RowWiseAdagrad(ram, lr=0.1)
    shardvar.distributed.load({"model": ram, "opt": ram_opt}, path / "from_tiered")
    into_ram = (weights_of(ram), state_of(ram_opt))
    optim.fuse(ram_opt)
    train(ram, range(4, 6), rank)
    shardvar.distributed.save({"model": ram, "opt": ram_opt}, path / "from_ram")
    back = make(DistributedEmbeddingBag, path, "back.rows", mode="sum")
    back_opt = optim.RowWiseAdagrad(back, lr=0.1)
    shardvar.distributed.load({"model": back, "opt": back_opt}, path / "from_ram")
    return {
        "saved": saved,
        "into_ram": into_ram,
        "ram": (weights_of(ram), state_of(ram_opt)),
        "back": (weights_of(back), state_of(back_opt)),
    }


def collection(rank: int, path: Path) -> dict:
    def tables(tiered: bool) -> dict:
        big = {"storage": storage(path, "big.rows")} if tiered else {}
        return {
            "big": shardvar.TableConfig(ROWS, DIM, SHARDS, "mod", mode="sum", **big),
            "small": shardvar.TableConfig(12, DIM, 2, mode="sum"),
        }

    ref, tiered = (DistributedEmbeddingBagCollection(tables(t), sparse=True) for t in (False, True))
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    outs = []
    for m in (ref, tiered):
        outs.append([])
        for step in range(6):
            ids, offsets = batch(rank, step)
            out = m({"big": ids, "small": ids % 12}, {"big": offsets, "small": offsets})
            outs[-1].append({k: v.detach().clone() for k, v in out.items()})
            sum((v * torch.linspace(-1, 1, DIM)).square().sum() for v in out.values()).backward()
    shardvar.distributed.save({"model": tiered, "opt": opts[1]}, path / "collection")
    return {
        "outs": outs,
        "weights": [
            {k: {s: t.clone() for s, t in v.local_shards().items()} for k, v in m.sharded_variables().items()}
            for m in (ref, tiered)
        ],
        "state": tuple(state_of(o) for o in opts),
        "stats": tiered.embedding_bags["big"].cache_stats(),
        "big": weights_of(tiered.embedding_bags["big"]),
        "names": [t.name for t in opts[1].tables],
    }


def cases(rank: int, world: int, path: str) -> dict:
    root = Path(path)
    out = {}
    for name, case in [
        ("bag", bag_exact),
        ("bad", bad_id),
        ("refusals", refusals),
        ("ckpt", checkpoints),
        ("collection", collection),
    ]:
        here = root / name
        here.mkdir(exist_ok=True)
        start = time.perf_counter()
        out[name] = case(rank, here)
        out.setdefault("seconds", {})[name] = time.perf_counter() - start
    return out
