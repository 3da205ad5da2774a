"""Jagged ids (``torch.nested`` with ``layout=torch.jagged``), the reference's ragged ids.

A lookup runs on the ids' flat values and its rows are wrapped in the ids' own jagged structure
(offsets, lengths and ragged dimension), so ``[B, j]`` ids give ``[B, j, *row_shape]`` rows and
gradients reach the shards through the values. For bags each row of ``[B, j]`` ids is one bag:
its values and offsets are what ``F.embedding_bag`` takes. Strided nested tensors have no flat
values to look up: they are refused with the forms that are supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError

__all__ = ["bags", "check_jagged", "is_nested", "on_values"]

_FORMS = (
    "a tensor, a list or int of ids, or a jagged nested tensor (torch.nested.nested_tensor(..., layout=torch.jagged))"
)


def is_nested(ids: Any) -> bool:
    return isinstance(ids, torch.Tensor) and ids.is_nested


def check_jagged(ids: torch.Tensor, what: str) -> None:
    if ids.layout != torch.jagged:
        raise ShardvarTypeError(f"{what} must be {_FORMS}; got a nested tensor with layout={ids.layout}")


def on_values(ids: Any, lookup: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """``lookup(ids)``; for jagged ids, ``lookup`` of their values wrapped in their jagged structure."""
    if not is_nested(ids):
        return lookup(ids)
    check_jagged(ids, "ids")
    rows = lookup(ids.values())
    return torch.nested.nested_tensor_from_jagged(rows, ids.offsets(), ids.lengths(), jagged_dim=ids._ragged_idx)


def bags(ids: Any, offsets: Any, per_sample_weights: Any, include_last_offset: bool) -> tuple[Any, Any, Any, bool]:
    """Jagged ``[B, j]`` input as (values, offsets with the last, weights' values, True); others unchanged."""
    if not is_nested(ids):
        if is_nested(per_sample_weights):
            raise ShardvarTypeError(
                f"per_sample_weights may be jagged only when the input is jagged; got input of shape {list(ids.shape)}"
            )
        return ids, offsets, per_sample_weights, include_last_offset
    check_jagged(ids, "input")
    if ids.dim() != 2 or ids._ragged_idx != 1 or ids.lengths() is not None:
        raise ShardvarValueError(
            f"jagged input to a bag lookup must be [B, j] bags without holes (ragged dimension 1, no lengths); "
            f"got shape {list(ids.shape)} with ragged dimension {ids._ragged_idx}"
            f"{' and lengths' if ids.lengths() is not None else ''}"
        )
    if offsets is not None or include_last_offset:
        raise ShardvarValueError(
            f"offsets={offsets!r:.60} and include_last_offset={include_last_offset} apply to 1-D input; "
            "each row of jagged input is one bag: leave them out"
        )
    weights = per_sample_weights
    if is_nested(weights):
        check_jagged(weights, "per_sample_weights")
        if not torch.equal(weights.offsets(), ids.offsets()):
            raise ShardvarValueError(
                f"jagged per_sample_weights must have the input's offsets {ids.offsets().tolist()[:8]} (one weight per "
                f"id); got {weights.offsets().tolist()[:8]}"
            )
        weights = weights.values()
    return ids.values(), ids.offsets(), weights, True
