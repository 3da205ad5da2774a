"""A model's own list or dict of embedding bags, with the collection's one-kernel lookup added.

``partition_model(..., collections=["emb_l"])`` puts these in place of DLRM's ``emb_l``: they are
an ``nn.ModuleList`` / ``nn.ModuleDict`` of ``ShardedEmbeddingBag`` (or ``ShardedEmbedding``, whose
features come back as ``JaggedRows``, as from an ``EmbeddingCollection``) (so ``emb_l[k](ids, offsets)``,
``len``, iteration and the state dict keys ``emb_l.0.weight`` ... are the stock model's) whose
tables share allocations, and calling the container looks every table up at once.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._errors import ShardvarTypeError, ShardvarValueError
from ._collection import KeyedJagged, batch_tables, lookup_tables
from ._embedding import ShardedEmbedding, ShardedEmbeddingBag

__all__ = ["EmbeddingBagList", "EmbeddingBagDict"]


def _check_bags(bags: list[Any]) -> None:
    bad = [i for i, b in enumerate(bags) if not isinstance(b, (ShardedEmbeddingBag, ShardedEmbedding))]
    if bad:
        got = type(bags[bad[0]]).__name__
        raise ShardvarTypeError(f"entries {bad} are not ShardedEmbeddingBags or ShardedEmbeddings; got {got}")


class _Batched:
    """The grouping of the tables into shared allocations, rebuilt if the container's tables change."""

    def _tables(self) -> dict[str, ShardedEmbeddingBag]:
        raise NotImplementedError

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        super()._apply(fn, recurse)  # type: ignore[misc]
        self.__dict__.pop("_group_key", None)  # a move gives each shard its own memory: grouped again, now
        self._grouped()
        return self

    def _grouped(self) -> list:
        tables = self._tables()
        key = tuple((k, id(b)) for k, b in tables.items())
        if self.__dict__.get("_group_key") != key:
            _check_bags(list(tables.values()))
            self._groups, self._group_key = batch_tables(tables), key
        return self._groups


class EmbeddingBagList(_Batched, nn.ModuleList):
    """``nn.ModuleList`` of ``ShardedEmbeddingBag``; ``self(features)`` looks them all up together.

    ``features`` is a list of ids (one per table, in order), a dict ``{index: ids}``, or a
    KeyedJagged with keys ``"0"``, ``"1"``, ...; ``offsets`` and ``per_sample_weights`` are given
    the same way. Returns the bags in the same form (a list, or a dict by index).
    """

    def __init__(self, bags: list[ShardedEmbeddingBag]) -> None:
        _check_bags(list(bags))
        super().__init__(bags)
        self._grouped()

    def _tables(self) -> dict[str, ShardedEmbeddingBag]:
        return {str(i): b for i, b in enumerate(self)}

    def forward(self, features: Any, offsets: Any = None, per_sample_weights: Any = None) -> Any:
        if isinstance(features, KeyedJagged):
            return lookup_tables(self._tables(), self._grouped(), features, offsets, per_sample_weights)
        as_list = isinstance(features, (list, tuple))
        keys = list(range(len(features))) if as_list else list(features) if isinstance(features, dict) else None
        if keys is None:
            raise ShardvarTypeError(
                f"features must be a list or dict of ids, or a KeyedJagged; got {type(features).__name__}"
            )
        if as_list and len(features) != len(self):
            raise ShardvarValueError(f"got {len(features)} features for {len(self)} tables; give one per table")
        if as_list and any(x is None for x in features):
            at = next(i for i, x in enumerate(features) if x is None)
            raise ShardvarValueError(f"features[{at}] is None; give ids for every table, or a dict of those given")
        inputs = {"features": features, "offsets": offsets, "per_sample_weights": per_sample_weights}
        out = lookup_tables(self._tables(), self._grouped(), *(_by_name(v, what, keys) for what, v in inputs.items()))
        return [out[str(k)] for k in keys] if as_list else {k: out[str(k)] for k in keys}


def _by_name(given: Any, what: str, keys: list[Any]) -> dict[str, Any] | None:
    """A list's or dict's entries by table name (``"0"``, ``"1"``...); a list's None: none for that table."""
    if given is None:
        return None
    if isinstance(given, (list, tuple)):
        if len(given) != len(keys):
            raise ShardvarValueError(f"{what} has {len(given)} entries for {len(keys)} tables; give one per table")
        return {str(k): v for k, v in zip(keys, given, strict=True) if v is not None}
    if not isinstance(given, dict):
        raise ShardvarTypeError(f"{what} must be given like features (a list or dict); got {type(given).__name__}")
    named: dict[str, Any] = {}
    first: dict[str, Any] = {}
    for k, v in given.items():
        if str(k) in first:  # 0 and "0": one table given twice, one of them would be dropped
            raise ShardvarValueError(f"{what} {first[str(k)]!r} and {k!r} name the same table; give it once")
        first[str(k)] = k
        named[str(k)] = v
    return named


class EmbeddingBagDict(_Batched, nn.ModuleDict):
    """``nn.ModuleDict`` of ``ShardedEmbeddingBag``; ``self(features)`` (dict or KeyedJagged) looks them all up."""

    def __init__(self, bags: dict[str, ShardedEmbeddingBag]) -> None:
        _check_bags(list(bags.values()))
        super().__init__(bags)
        self._grouped()

    def _tables(self) -> dict[str, ShardedEmbeddingBag]:
        return dict(self.items())

    def forward(self, features: Any, offsets: Any = None, per_sample_weights: Any = None) -> dict[str, Any]:
        return lookup_tables(self._tables(), self._grouped(), features, offsets, per_sample_weights)
