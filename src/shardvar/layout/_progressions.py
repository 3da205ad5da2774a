"""Arithmetic progressions of logical indices: every shard of every layout holds one."""

from __future__ import annotations

import math

__all__ = ["intersect_progressions"]


def intersect_progressions(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    """The common indices of two progressions ``(start, step, count)``, as one progression.

    >>> intersect_progressions((0, 1, 10), (1, 4, 3))   # rows 0..9 and 1, 5, 9
    (1, 4, 3)
    >>> intersect_progressions((2, 3, 5), (0, 2, 8))    # 2, 5, 8, 11, 14 and 0, 2, ..., 14
    (2, 6, 3)
    """
    (s1, m, c1), (s2, n, c2) = a, b
    if c1 <= 0 or c2 <= 0:
        return (max(s1, s2), 1, 0)
    g = math.gcd(m, n)
    if (s2 - s1) % g:
        return (max(s1, s2), 1, 0)
    lcm = m // g * n
    # x = s1 + m*k with m*k = s2 - s1 (mod n): k = ((s2 - s1)/g) * inverse(m/g) (mod n/g).
    k = ((s2 - s1) // g * pow(m // g, -1, n // g)) % (n // g) if n // g > 1 else 0
    x = s1 + m * k
    low = max(s1, s2)
    if x < low:
        x += -(-(low - x) // lcm) * lcm
    last = min(s1 + m * (c1 - 1), s2 + n * (c2 - 1))
    count = (last - x) // lcm + 1 if x <= last else 0
    return (x, lcm, count)
