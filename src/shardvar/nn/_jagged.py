"""KeyedJagged: the ids of several features as one jagged batch, refused whole if any part is bad;
JaggedRows: one feature's looked-up rows, bag by bag (what an EmbeddingCollection returns).

A jagged batch that is silently misread loses data without an error (a duplicate key drops a
block; a float id is truncated; a negative length shifts every later bag), so every rule is
checked when it is built and again when it is split for a lookup (its tensors may have been
written in place, or the object unpickled, since).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_has_values

__all__ = [
    "Features", "JaggedRows", "KeyedJagged", "PerFeature", "Pooled", "check_jagged", "check_names", "jagged_split",
]  # fmt: skip


def _integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ShardvarTypeError(f"{name} must be a tensor; could not read {value!r:.60} as one ({e})") from None


def check_names(names: Any, what: str = "keys") -> tuple[str, ...]:
    """Feature names as a tuple: a sequence (not one string) of distinct strings."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ShardvarTypeError(f"{what} must be a tuple or list of feature names; got {names!r:.80}")
    for i, k in enumerate(names):
        if not isinstance(k, str):
            got = f"{k!r:.60} ({type(k).__name__}) at {i}"
            raise ShardvarTypeError(f"{what} must be strings (feature names); got {got}")
    repeated = [k for k, n in Counter(names).items() if n > 1]
    if repeated:
        raise ShardvarValueError(f"{what} must be unique; {repeated[0]!r} is given {names.count(repeated[0])} times")
    return tuple(names)


def check_jagged(
    keys: Any, values: Any, lengths: Any, weights: Any
) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The four parts of a :class:`KeyedJagged` as tensors, or the error naming the first bad one."""
    keys = check_names(keys)
    values, lengths = _tensor(values, "values"), _tensor(lengths, "lengths")
    check_has_values(values, "values")
    check_has_values(lengths, "lengths")
    if not _integer(values):
        raise ShardvarTypeError(f"values must be integer ids; got dtype {values.dtype}")
    if values.dim() != 1:
        raise ShardvarValueError(f"values must be 1-D (every key's ids end to end); got shape {list(values.shape)}")
    if not _integer(lengths):
        raise ShardvarTypeError(f"lengths must be an integer tensor; got dtype {lengths.dtype}")
    if lengths.dim() != 2 or lengths.shape[0] != len(keys):
        raise ShardvarValueError(f"lengths must be [{len(keys)} keys, batch]; got shape {list(lengths.shape)}")
    low, high = torch.aminmax(lengths) if lengths.numel() else (0, 0)
    if int(low) < 0:
        key, bag = divmod(int(torch.argmin(lengths)), lengths.shape[1])
        raise ShardvarValueError(f"lengths must be >= 0; got {int(low)} for key {keys[key]!r}, bag {bag}")
    if int(high) > values.numel():  # the sum below could wrap round past int64 and still match
        key, bag = divmod(int(torch.nonzero(lengths.reshape(-1) > values.numel())[0]), lengths.shape[1])
        raise ShardvarValueError(
            f"lengths must be at most the {values.numel()} ids of values; got {int(lengths[key, bag])} for key "
            f"{keys[key]!r}, bag {bag}"
        )
    total = int(lengths.sum())
    if total != values.numel():
        raise ShardvarValueError(f"lengths add up to {total} ids; values holds {values.numel()}")
    if weights is not None:
        weights = check_has_values(_tensor(weights, "weights"), "weights")
        if not weights.dtype.is_floating_point:
            raise ShardvarTypeError(f"weights must be a floating tensor (one weight per id); got dtype {weights.dtype}")
        if weights.dim() != 1 or weights.numel() != values.numel():
            raise ShardvarValueError(
                f"weights must be one per id: values holds {values.numel()} ids; weights has shape "
                f"{list(weights.shape)} ({weights.numel()})"
            )
    return keys, values, lengths, weights


@dataclass(frozen=True, eq=False)  # compared by identity, as TorchRec's: tensors have no single truth value
class KeyedJagged:
    """Ids of several features as one jagged batch: ``values`` of key k are ``lengths[k]`` per bag.

    ``keys`` are unique feature names; ``values`` a 1-D integer tensor of every key's ids end to
    end; ``lengths`` an integer ``[len(keys), batch]`` tensor (ids per bag, >= 0) adding up to
    ``values``; ``weights`` (optional) one float per id, for sum bags.

    >>> kj = KeyedJagged(("user", "item"), torch.tensor([1, 2, 3, 4, 5]), torch.tensor([[2, 1], [0, 2]]))
    >>> kj.split()[0]["item"]
    tensor([4, 5])
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        checked = check_jagged(self.keys, self.values, self.lengths, self.weights)
        for field, value in zip(("keys", "values", "lengths", "weights"), checked, strict=True):
            object.__setattr__(self, field, value)  # frozen: set once, as the checked tensors

    def split(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per key: (ids, offsets, weights), after checking every rule again."""
        keys, values, lengths, weights = check_jagged(self.keys, self.values, self.lengths, self.weights)
        per_key = lengths.sum(1).tolist()
        ids = dict(zip(keys, values.split(per_key), strict=True))
        offsets = {k: torch.cumsum(row, 0) - row for k, row in zip(keys, lengths, strict=True)}
        by_key = {} if weights is None else dict(zip(keys, weights.split(per_key), strict=True))
        return ids, offsets, by_key


@dataclass(frozen=True, eq=False)
class JaggedRows:
    """One feature's looked-up rows, bag by bag: ``values`` ``[ids, dim]`` and ``lengths`` ``[bags]`` (int64).

    >>> rows = JaggedRows(torch.arange(6.0).reshape(3, 2), torch.tensor([2, 0, 1]))
    >>> rows.to_padded().shape, rows.offsets().tolist()
    (torch.Size([3, 2, 2]), [0, 2, 2])
    """

    values: torch.Tensor
    lengths: torch.Tensor

    def offsets(self) -> torch.Tensor:
        """Where each bag starts in ``values``."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    def to_padded(self, padding_value: float = 0.0) -> torch.Tensor:
        """``[bags, longest, dim]``, each bag's rows first and ``padding_value`` after (differentiable)."""
        bags = self.lengths.numel()
        longest = int(self.lengths.max()) if bags else 0
        out = self.values.new_full((bags, longest, self.values.shape[1]), padding_value)
        bag = torch.repeat_interleave(torch.arange(bags, device=self.values.device), self.lengths)
        position = torch.arange(self.values.shape[0], device=self.values.device) - self.offsets()[bag]
        return out.index_put((bag, position), self.values)


def jagged_split(values: torch.Tensor, offsets: torch.Tensor, counts: list[int], features: list[str]) -> dict:
    """Rows looked up for packed features (bags per feature ``counts``) as each feature's JaggedRows."""
    offsets = offsets.to(torch.int64)  # int64 lengths whatever index dtype the kernel read
    lengths = torch.diff(offsets, append=offsets.new_tensor([values.shape[0]]))
    per_feature = lengths.split(counts)
    sizes = [int(x.sum()) for x in per_feature]
    return {f: JaggedRows(v, x) for f, v, x in zip(features, values.split(sizes), per_feature, strict=True)}


# What every collection's forward takes (one spelling for the local, distributed and quantized twins):
# the ids by feature (or one KeyedJagged), and optional offsets / per-sample weights by feature.
Features = dict[str, Any] | KeyedJagged
PerFeature = dict[str, Any] | None
Pooled = dict[str, torch.Tensor]  # bags by output key
