"""A feature several tables serve (issue 36, point 3): the tables, batches and the plain reference every
family is checked against, and the distributed workers (run by dist_workers.many)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardvar
from shardvar import KeyedJagged, TableConfig
from shardvar.distributed import DistributedEmbeddingBagCollection, DistributedEmbeddingCollection
from shardvar.variables import RowInitializer

TABLES = {  # "a" is served by all three: two of one width (one group) and one of another (a group apart)
    "u": TableConfig(12, 4, 2, "mod", feature_names=("a", "b")),
    "v": TableConfig(9, 4, feature_names=("c", "a")),
    "w": TableConfig(7, 6, 3, "div", feature_names=("a",)),
}
ROWS = {"c": 9, "a": 7, "b": 12}  # the features in the order they are given; "a"'s ids fit every table of it
# TorchRec's names (a shared feature is "feature@table"), written out by hand: in the order the features
# are given, a shared feature's keys in the tables' order; each key's (feature, table).
KEYS = {"c": ("c", "v"), "a@u": ("a", "u"), "a@v": ("a", "v"), "a@w": ("a", "w"), "b": ("b", "u")}
PLACEMENTS = {"row": {}, "table": dict.fromkeys(TABLES, "table"), "replicate": dict.fromkeys(TABLES, "replicate")}
PLACEMENTS["mixed"] = {"u": "row", "v": "table", "w": "replicate"}  # "a" read by a table of each placement


def batch(seed: int, form: str, pooled: bool) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """(features, per-sample weights): a dict of 2-D ids ("a" weighted, when pooled), or a KeyedJagged."""
    g = torch.Generator().manual_seed(seed)
    if form == "jagged":
        lengths = torch.randint(0, 4, (len(ROWS), 4), generator=g)
        values = [torch.randint(0, ROWS[f], (int(n),), generator=g) for f, n in zip(ROWS, lengths.sum(1), strict=True)]
        return KeyedJagged(tuple(ROWS), torch.cat(values), lengths), None
    ids = {f: torch.randint(0, n, (4, 3), generator=g) for f, n in ROWS.items()}
    return ids, ({"a": torch.rand(4, 3, generator=g)} if pooled else None)


def plain_tables(weights: dict[str, torch.Tensor], pooled: bool, sparse: bool) -> nn.ModuleDict:
    """A plain ``nn.EmbeddingBag`` (sum) or ``nn.Embedding`` per table, from ``weights``."""
    make = nn.EmbeddingBag if pooled else nn.Embedding
    options = {"mode": "sum"} if pooled else {}
    return nn.ModuleDict(
        {t: make.from_pretrained(w.clone(), freeze=False, sparse=sparse, **options) for t, w in weights.items()}
    )


def reference(plain: nn.ModuleDict, features: Any, weights: dict | None, pooled: bool) -> dict[str, Any]:
    """Each key of KEYS looked up by its table's plain module on its feature's ids: bags, or (rows, lengths)."""
    if isinstance(features, KeyedJagged):
        ids, offsets, _ = features.split()
    else:
        ids = {f: x.reshape(-1) for f, x in features.items()}
        offsets = {f: torch.arange(x.shape[0]) * x.shape[1] for f, x in features.items()}
    out = {}
    for key, (f, t) in KEYS.items():
        if pooled:
            w = (weights or {}).get(f)
            out[key] = plain[t](ids[f], offsets[f], per_sample_weights=None if w is None else w.reshape(-1))
        else:
            out[key] = (plain[t](ids[f]), torch.diff(offsets[f], append=torch.tensor([ids[f].numel()])))
    return out


def loss(out: dict[str, Any]) -> torch.Tensor:
    """Every output weighted by its place: a key's gradient differs from its feature's other keys'."""
    values = [v if isinstance(v, torch.Tensor) else v[0] if isinstance(v, tuple) else v.values for v in out.values()]
    return sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(values))


def initial() -> dict[str, torch.Tensor]:
    """The tables a distributed collection starts from with RowInitializer(5): end to end, by logical row."""
    first, out = 0, {}
    for t, c in TABLES.items():
        out[t] = RowInitializer(5).rows(first + torch.arange(c.num_embeddings), (c.embedding_dim,))
        first += c.num_embeddings
    return out


def train_shared(rank: int, world: int, path: str, pooled: bool, placement: str, fused: bool) -> dict:
    """Two steps of a distributed twin on this rank's batches (fused RowWiseAdagrad, sparse; or SGD, dense),
    each step's outputs, and the model and optimizer saved to ``path``."""
    cls = DistributedEmbeddingBagCollection if pooled else DistributedEmbeddingCollection
    module = cls(TABLES, placement=PLACEMENTS[placement], sparse=fused, initializer=RowInitializer(5))
    opt = shardvar.optim.RowWiseAdagrad(module, lr=0.1) if fused else torch.optim.SGD(module.parameters(), lr=0.1)
    if fused:
        shardvar.optim.fuse(opt)
    outs = []
    for step in range(2):
        features, weights = batch(10 * step + rank, "jagged" if step else "dict", pooled)
        out = module(features, per_sample_weights=weights) if pooled else module(features)
        outs.append({k: v.detach() if pooled else (v.values.detach(), v.lengths) for k, v in out.items()})
        loss(out).backward()
        opt.step()
        opt.zero_grad()
    shardvar.distributed.save({"model": module, **({"opt": opt} if fused else {})}, path)
    return {"outs": outs}


def left_out(rank: int, world: int) -> dict[bool, str]:
    """The error of each twin called without one of its features (refused before any exchange)."""
    out = {}
    for cls in (DistributedEmbeddingBagCollection, DistributedEmbeddingCollection):
        module = cls(TABLES)
        try:
            module({"a": torch.tensor([[1]]), "b": torch.tensor([[2]])})
        except shardvar.ShardvarValueError as e:
            out[cls.pooled] = str(e)
    return out
