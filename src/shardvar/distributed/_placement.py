"""plan_collection: a placement for each table of a collection, from its size and the world size.

Tiny tables are replicated (a copy per rank costs less than any exchange; never a tiered one,
whose rows are kept out of RAM: ``storage=``), tables larger than
half a rank's fair share of the bytes are split by rows over every rank (whole, one would
unbalance the ranks), and the rest are placed whole, largest first, each on the rank holding the
fewest bytes so far. Pure and deterministic, so every rank computes the same placement.
"""

from __future__ import annotations

from .._errors import ShardvarTypeError
from .._validate import check_int
from ..nn import TableConfig

__all__ = ["plan_collection"]


def _bytes(cfg: TableConfig, itemsize: int) -> int:
    return cfg.num_embeddings * cfg.embedding_dim * itemsize


def plan_collection(
    tables: dict[str, TableConfig], world: int, *, replicate_bytes: int = 1 << 20, itemsize: int = 4
) -> dict[str, str | int]:
    """``{name: "replicate" | "row" | rank}`` for ``DistributedEmbeddingBagCollection(placement=...)``.

    >>> plan_collection({"big": TableConfig(10**6, 64), "a": TableConfig(50_000, 64), "b": TableConfig(40_000, 64),
    ...                  "tiny": TableConfig(10, 64)}, world=2)
    {'big': 'row', 'a': 0, 'b': 1, 'tiny': 'replicate'}
    """
    if not isinstance(tables, dict) or not all(isinstance(c, TableConfig) for c in tables.values()):
        raise ShardvarTypeError(f"tables must be a dict of name -> TableConfig; got {tables!r:.80}")
    world = check_int(world, "world", minimum=1)
    check_int(replicate_bytes, "replicate_bytes", minimum=0)
    size = {n: _bytes(c, itemsize) for n, c in tables.items()}
    tiny = {n for n, b in size.items() if b <= replicate_bytes and tables[n].storage is None}
    out: dict[str, str | int] = dict.fromkeys(tiny, "replicate")
    rest = {n: b for n, b in size.items() if n not in out}
    fair = sum(rest.values()) / world
    load = [0.0] * world
    for n, b in rest.items():
        if world > 1 and b > fair / 2:
            out[n] = "row"
            load = [x + b / world for x in load]
    for n in sorted((n for n in rest if n not in out), key=lambda n: (-rest[n], list(tables).index(n))):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[n] = rank
        load[rank] += rest[n]
    return {n: out[n] for n in tables}
