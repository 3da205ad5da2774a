"""Layout math: pure functions and frozen values describing how a tensor is split into shards.

Nothing here holds state or touches torch.distributed; every layer above builds on it.
"""

from .._validate import normalise_axis
from ._ids import as_ids, check_ids, group_positions, last_occurrence
from ._layout import Layout, ceil_sizes
from ._progressions import intersect_progressions
from ._slices import SlicePiece, SlicePlan
from ._strategies import STRATEGIES, Strategy, balanced_sizes, get_strategy, mod_sizes

__all__ = [
    "Layout",
    "SlicePiece",
    "SlicePlan",
    "STRATEGIES",
    "Strategy",
    "as_ids",
    "balanced_sizes",
    "ceil_sizes",
    "check_ids",
    "get_strategy",
    "group_positions",
    "last_occurrence",
    "intersect_progressions",
    "mod_sizes",
    "normalise_axis",
]
