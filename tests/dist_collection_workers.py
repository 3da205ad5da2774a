"""Workers for the distributed embedding-collection tests (run by dist_workers.main)."""

from __future__ import annotations

import torch

import shardvar
from shardvar import KeyedJagged, TableConfig
from shardvar.distributed import (
    DistributedEmbeddingBag,
    DistributedEmbeddingBagCollection,
    DistributedEmbeddingCollection,
)
from shardvar.variables import RowInitializer

TABLES = {
    "a": TableConfig(30, 4, 3, "mod"),
    "b": TableConfig(20, 4, 2, "div"),
    "c": TableConfig(11, 4),
    "d": TableConfig(9, 6, 2, "div"),
    "e": TableConfig(7, 4),
    "f": TableConfig(5, 4),
    "g": TableConfig(6, 6),
}
PLACEMENT = {"c": "table", "e": 1, "f": "replicate", "g": "replicate"}


def batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randint(0, c.num_embeddings, (3, 2), generator=g) for k, c in TABLES.items()}


def all_to_alls(module: torch.nn.Module) -> int:
    comms = {id(m.store.exchange.comm): m.store.exchange.comm for m in module.modules() if hasattr(m, "store")}
    return sum(c.calls["all_to_all"] for c in comms.values())


def train_collection(rank: int, world: int, path: str) -> dict:
    ebc = DistributedEmbeddingBagCollection(TABLES, placement=PLACEMENT, initializer=RowInitializer(5))
    shardvar.distributed.save({"model": ebc}, f"{path}/init")
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    per_step = []
    for step in range(4):
        before = all_to_alls(ebc)
        out = ebc(batch(rank, step))
        sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(out.values())).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(all_to_alls(ebc) - before)
    shardvar.distributed.save({"model": ebc}, f"{path}/final")
    lone = DistributedEmbeddingBag(30, 4, 2)
    before = all_to_alls(lone)
    lone(torch.tensor([[1, 2]])).sum().backward()
    return {"per_step": per_step, "one_table": all_to_alls(lone) - before, "groups": len(ebc.groups)}


SPARSE_TABLES = {"r": TableConfig(8, 4), "a": TableConfig(30, 4, 3, "mod")}


def train_sparse_replicated(rank: int, world: int, path: str) -> dict:
    ebc = DistributedEmbeddingBagCollection(
        SPARSE_TABLES, placement={"r": "replicate"}, sparse=True, initializer=RowInitializer(5)
    )
    shardvar.distributed.save({"model": ebc}, f"{path}/init")
    opt = torch.optim.SparseAdam(list(ebc.parameters()), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        feats = {
            k: torch.randint(0, c.num_embeddings // (1 + rank), (3, 2), generator=g) for k, c in SPARSE_TABLES.items()
        }
        out = ebc(feats)
        sum(v.pow(2).sum() for v in out.values()).backward()
        opt.step()
        opt.zero_grad()
    shardvar.distributed.save({"model": ebc}, f"{path}/final")
    return {"replica": ebc.embedding_bags["r"].weight.detach().clone()}


def auto_placement(rank: int, world: int) -> dict:
    ebc = DistributedEmbeddingBagCollection(TABLES, placement="auto")
    out = ebc(batch(rank, 0))
    sequence = DistributedEmbeddingCollection(TABLES, placement="auto")  # the same planner for sequence tables
    rows = sequence(batch(rank, 0))
    return {
        "groups": len(ebc.groups),
        "replicated": sorted(ebc.replicas.configs),
        "shapes": {k: tuple(v.shape) for k, v in out.items()},
        "sequence_replicated": sorted(sequence.replicas.configs),
        "sequence_shapes": {k: tuple(v.values.shape) for k, v in rows.items()},
    }


def bad_jagged() -> dict[str, tuple[dict, type, str]]:
    """Every kind of KeyedJagged that would lose data, as (fields, error, match), over tables "0" and "1"."""
    keys, values, lengths = ("0", "1"), torch.tensor([1, 2, 3, 4, 5]), torch.tensor([[2, 1], [0, 2]])

    def case(error: type, match: str, **changed: object) -> tuple[dict, type, str]:
        return {"keys": keys, "values": values, "lengths": lengths, "weights": None, **changed}, error, match

    return {
        "duplicate key": case(ValueError, "keys must be unique; '0' is given 2 times", keys=("0", "0")),
        "key not a string": case(TypeError, r"keys must be strings .*got 1 \(int\) at 1", keys=("0", 1)),
        "keys a string": case(TypeError, "keys must be a tuple or list", keys="01"),
        "float values": case(TypeError, "values must be integer ids; got dtype torch.float32", values=values.float()),
        "2-D values": case(ValueError, r"values must be 1-D .*got shape \[5, 1\]", values=values[:, None]),
        "float lengths": case(TypeError, "lengths must be an integer tensor; got dtype", lengths=lengths.double()),
        "1-D lengths": case(
            ValueError, r"lengths must be \[2 keys, batch\]; got shape \[4\]", lengths=lengths.reshape(-1)
        ),
        "lengths for 3 keys": case(ValueError, r"got shape \[3, 2\]", lengths=torch.tensor([[2, 1], [0, 2], [0, 0]])),
        "negative length": case(
            ValueError, "lengths must be >= 0; got -1 for key '1', bag 0", lengths=torch.tensor([[2, 2], [-1, 2]])
        ),
        "lengths not adding up": case(
            ValueError, "lengths add up to 6 ids; values holds 5", lengths=torch.tensor([[2, 2], [0, 2]])
        ),
        "lengths wrapping past int64": case(  # their int64 sum wraps round to 5
            ValueError,
            "lengths must be at most the 5 ids of values; got 4611686018427387904 for key '0', bag 0",
            lengths=torch.tensor([[2**62, 2**62], [2**62, 2**62 + 5]]),
        ),
        "meta lengths": case(TypeError, "lengths of shape .* on the meta device", lengths=lengths.to("meta")),
        "meta values": case(TypeError, "values of shape .* on the meta device", values=values.to("meta")),
        "short weights": case(ValueError, r"values holds 5 ids; weights has shape \[4\] \(4\)", weights=torch.ones(4)),
        "2-D weights": case(ValueError, r"weights has shape \[5, 1\]", weights=torch.ones(5, 1)),
        "integer weights": case(
            TypeError, "weights must be a floating tensor", weights=torch.ones(5, dtype=torch.int64)
        ),
    }


def unchecked(fields: dict) -> KeyedJagged:
    """A KeyedJagged that skipped its construction checks, as an unpickled or in-place-edited one has."""
    jagged = object.__new__(KeyedJagged)
    for name, value in fields.items():
        object.__setattr__(jagged, name, value)
    return jagged


MIXED = {"0": TableConfig(7, 4, 2, "mod"), "1": TableConfig(7, 4), "2": TableConfig(6, 6, 2), "3": TableConfig(5, 4)}


def mixed_batch(rank: int) -> tuple[dict, dict, dict]:
    """Ids and offsets of every MIXED table, weights for tables "0" (grouped with "1") and "2" (alone) only."""
    g = torch.Generator().manual_seed(rank)
    ids = {k: torch.randint(0, c.num_embeddings, (6,), generator=g) for k, c in MIXED.items()}
    offsets = {k: torch.tensor([0, 2, 2]) for k in MIXED}
    return ids, offsets, {k: torch.rand(6, generator=g) for k in ("0", "2")}


def jagged_inputs(rank: int, world: int) -> dict:
    """Each bad kind refused on every rank before any collective; then weights for some features only."""
    ebc = DistributedEmbeddingBagCollection(MIXED, placement={"3": "replicate"}, initializer=RowInitializer(5))
    errors = {}
    for kind, (fields, _, _) in bad_jagged().items():
        try:
            ebc(unchecked(fields))
        except Exception as e:  # the test checks the class and message
            errors[kind] = ([c.__name__ for c in type(e).__mro__], str(e))
    out = ebc(*mixed_batch(rank))
    sequence = DistributedEmbeddingCollection(MIXED, placement={"3": "replicate"})  # the sequence twin alike
    sequence_errors = {}
    for kind, (fields, _, _) in bad_jagged().items():
        try:
            sequence(unchecked(fields))
        except Exception as e:  # the test checks the class and message
            sequence_errors[kind] = ([c.__name__ for c in type(e).__mro__], str(e))
    weighted = {k: v.detach() for k, v in out.items()}
    return {"errors": errors, "sequence_errors": sequence_errors, "groups": ebc.groups, "weighted": weighted}


SHARED = {  # a row-sharded table serving two features, one serving one, a replicated table serving two
    "user": TableConfig(30, 4, 3, "mod", feature_names=("query_user", "candidate_user")),
    "item": TableConfig(20, 4, 2, feature_names=("item",)),
    "ctx": TableConfig(6, 4, feature_names=("ctx_a", "ctx_b")),
}


def shared_batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    rows = {"query_user": 30, "candidate_user": 30, "item": 20, "ctx_a": 6, "ctx_b": 6}
    return {f: torch.randint(0, n, (3, 2), generator=g) for f, n in rows.items()}


def bytes_sent(module: torch.nn.Module) -> int:
    comms = {id(m.store.exchange.comm): m.store.exchange.comm for m in module.modules() if hasattr(m, "store")}
    return sum(c.bytes_sent for c in comms.values())


def shared_tables(rank: int, world: int) -> dict:
    """Train a collection whose tables serve several features; the bytes one table's features send."""
    ebc = DistributedEmbeddingBagCollection(SHARED, placement={"ctx": "replicate"}, initializer=RowInitializer(5))
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    out = ebc(shared_batch(rank, 0))
    sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(out.values())).backward()
    opt.step()
    before = all_to_alls(ebc)
    after = {k: v.detach() for k, v in ebc(shared_batch(rank, 1)).items()}
    calls = [all_to_alls(ebc) - before]  # three features of two tables: one exchange
    ids = torch.arange(10 * rank, 10 * rank + 12).reshape(4, 3)  # ids of both ranks' shards
    sent = []
    for features in (("query_user",), ("query_user", "candidate_user")):
        one = DistributedEmbeddingBagCollection({"user": TableConfig(30, 4, 3, "mod", feature_names=features)})
        before, sent_before = all_to_alls(one), bytes_sent(one)
        one(dict.fromkeys(features, ids))
        sent.append(bytes_sent(one) - sent_before)
        calls.append(all_to_alls(one) - before)
    return {"after": after, "sent": sent, "calls": calls}


SEQUENCE = {  # a row-sharded table serving two sequence features, a whole one, a replicated one
    "history": TableConfig(30, 4, 3, "mod", feature_names=("clicks", "views")),
    "item": TableConfig(20, 4, 2),
    "ctx": TableConfig(6, 4),
}


def sequence_batch(rank: int, step: int) -> KeyedJagged:
    g = torch.Generator().manual_seed(20 * step + rank)
    keys, rows = ("clicks", "views", "item", "ctx"), (30, 30, 20, 6)
    lengths = torch.randint(0, 4, (4, 3), generator=g)
    values = [torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths.sum(1), strict=True)]
    return KeyedJagged(keys, torch.cat(values), lengths)


def train_sequence(rank: int, world: int, path: str) -> dict:
    """Two steps of the distributed sequence collection; one exchange per step for its three tables."""
    ec = DistributedEmbeddingCollection(
        SEQUENCE, placement={"item": "table", "ctx": "replicate"}, sparse=True, initializer=RowInitializer(5)
    )
    opt = torch.optim.SparseAdam(list(ec.parameters()), lr=0.05)
    calls = []
    for step in range(2):
        before = all_to_alls(ec)
        out = ec(sequence_batch(rank, step))
        calls.append(all_to_alls(ec) - before)
        sum((rows.values * (i + 1)).pow(2).sum() for i, rows in enumerate(out.values())).backward()
        opt.step()
        opt.zero_grad()
    shardvar.distributed.save({"model": ec}, f"{path}/sequence")
    return {"calls": calls, "groups": ec.groups, "lengths": {f: rows.lengths for f, rows in out.items()}}


def sequence_steps(rank: int, world: int, path: str) -> dict:
    """Whole steps (forward and backward) of the sequence twin trained by the fused RowWiseAdagrad (the
    example's set-up): all_to_alls per step against one table's, and the bytes a table's second feature adds."""
    ec = DistributedEmbeddingCollection(
        SEQUENCE, placement={"item": "table", "ctx": "replicate"}, sparse=True, initializer=RowInitializer(5)
    )
    shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(ec, lr=0.1))
    steps = []
    for step in range(2):
        before = all_to_alls(ec)
        out = ec(sequence_batch(rank, step))
        sum((rows.values * (i + 1)).pow(2).sum() for i, rows in enumerate(out.values())).backward()
        steps.append(all_to_alls(ec) - before)
    shardvar.distributed.save({"model": ec}, f"{path}/sequence_fused")
    ids = torch.arange(10 * rank, 10 * rank + 12).reshape(4, 3)  # ids of both ranks' shards
    one_table, sent = [], []
    for features in (("query",), ("query", "candidate")):
        one = DistributedEmbeddingCollection(
            {"user": TableConfig(30, 4, 3, "mod", feature_names=features)}, sparse=True
        )
        before, sent_before = all_to_alls(one), bytes_sent(one)
        out = one(dict.fromkeys(features, ids))
        forward = bytes_sent(one) - sent_before
        sum(rows.values.pow(2).sum() for rows in out.values()).backward()
        one_table.append(all_to_alls(one) - before)
        sent.append((forward, bytes_sent(one) - sent_before - forward))
    return {"steps": steps, "one_table": one_table, "sent": sent}


def _local_state(opt: shardvar.optim.RowWiseAdagrad) -> dict[str, torch.Tensor]:
    """This rank's part of a table optimizer's state, by variable and shard."""
    out = {}
    for name, v in opt.sharded_variables().items():
        for s, t in {0: v}.items() if isinstance(v, torch.Tensor) else v.local_shards().items():
            out[f"{name}#{s}"] = t.detach().clone()
    return out


def optimizer_checkpoints(rank: int, world: int, path: str) -> dict[str, str]:
    """A table optimizer's state over each distributed twin, saved and loaded back (the error, or "ok")."""
    outcomes = {}
    for cls in (DistributedEmbeddingBagCollection, DistributedEmbeddingCollection):
        for placement in ({}, {"item": "table", "ctx": "replicate"}):  # then one rank holds none of "item"

            def make(cls: type = cls, placement: dict = placement) -> tuple:
                module = cls(SEQUENCE, placement=placement, sparse=True, initializer=RowInitializer(5))
                return module, shardvar.optim.RowWiseAdagrad(module, lr=0.1)

            module, opt = make()
            out = module(sequence_batch(rank, 0))
            sum((v if cls.pooled else v.values).pow(2).sum() for v in out.values()).backward()
            opt.step()
            where = f"{cls.__name__} {sorted(placement.values()) or ['row']}"
            try:  # collective, and agreed: every rank raises alike
                shardvar.distributed.save({"model": module, "opt": opt}, f"{path}/opt/{len(outcomes)}")
                again, again_opt = make()
                shardvar.distributed.load({"model": again, "opt": again_opt}, f"{path}/opt/{len(outcomes)}")
                saved, loaded = _local_state(opt), _local_state(again_opt)
                same = saved.keys() == loaded.keys() and all(torch.equal(v, loaded[k]) for k, v in saved.items())
                outcomes[where] = "ok" if same else "restored other values"
            except shardvar.ShardvarError as e:
                outcomes[where] = f"{type(e).__name__}: {e}"
    try:  # a state dict holds whole tensors, which no rank has
        opt.state_dict()
    except shardvar.ShardvarValueError as e:
        outcomes["state_dict"] = str(e)
    return outcomes


def distributed_collections(rank: int, world: int, path: str) -> dict:
    """Every distributed collection check of the feature tests in one 2-rank run (one start-up)."""
    return {
        "inputs": jagged_inputs(rank, world),
        "shared": shared_tables(rank, world),
        "sequence": train_sequence(rank, world, path),
        "sequence_steps": sequence_steps(rank, world, path),
        "optimizer_checkpoints": optimizer_checkpoints(rank, world, path),
    }
