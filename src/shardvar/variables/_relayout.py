"""Laying a mod table's shards row by row in logical order, in place, and back.

A complete local mod table whose shards lie back to back (shard-major) reads id ``i`` at storage
row ``(i % n) * q + i // n``: every lookup pays that arithmetic and a range check over its ids.
Laid row by row (shard ``s`` the view ``table[s::n]``), an id is its row. torch's sparse
optimizers cannot update such strided shards (their sparse ``add_`` refuses strided leaf
parameters), so only an owner of the updates, a fused shardvar optimizer, lays a table so, and
lays it back when it lets go (see :mod:`shardvar.optim._fused`).

The rows move in place with a small buffer (1/64 of the table or less): a table-sized copy would
raise the peak memory of building and training by the table's size.

Nothing moves while a backward that maps the rows as they lie is pending (``ShardStore.reading``:
tokens its Function holds until it runs). A table someone else's tensor views is not laid row by
row, and is laid back into new memory, leaving that tensor the old.
"""

from __future__ import annotations

import math

import torch

from .._pages import empty
from ._memory import _PLAIN, _base_use, _use_count, place, storage_ptr
from ._plan import RowOrder
from ._store import ShardStore

__all__ = ["interleave", "deinterleave", "transpose_rows_"]

_MOVES = 4096  # the most blocks moved one by one (a Python step each)


def _blocks(a: int, b: int) -> int | None:
    """``m`` dividing ``b`` for the two-step transpose of ``a x b`` rows: at most :data:`_MOVES` blocks
    moved one by one, and a buffer of ``a * b / m`` rows at most 1/64 of them (None: no such m)."""
    m = next((m for m in range(min(b, max(_MOVES // a, 1)), 0, -1) if b % m == 0), 1)
    return m if a * (b // m) <= max(a * b // 64, 4096) else None


def _cycle(blocks: torch.Tensor, dest: list[int]) -> None:
    """Move block ``p`` of ``blocks`` (``[N, rows, width]``) to ``dest[p]``, following each cycle with
    two blocks of buffer."""
    carry, swap = torch.empty_like(blocks[0]), torch.empty_like(blocks[0])
    seen = bytearray(len(dest))
    for start in range(len(dest)):
        if seen[start] or dest[start] == start:
            continue
        carry.copy_(blocks[start])
        p = start
        while True:
            d, seen[p] = dest[p], 1
            if d == start:
                blocks[start].copy_(carry)
                break
            swap.copy_(blocks[d])
            blocks[d].copy_(carry)
            carry, swap, p = swap, carry, d


def transpose_rows_(x: torch.Tensor, a: int, b: int, inverse: bool = False) -> bool:
    """Rows of ``x`` (``[a * b, width]``) as an ``a x b`` matrix become its ``b x a`` transpose, in
    place (``inverse``: back). False, with ``x`` untouched, when no small buffer does it."""
    m = _blocks(a, b)
    if m is None:
        return False
    c = b // m
    blocks = x.view(a * m, c, -1)  # [a, m] blocks of c rows -> [m, a]; then each [a, c] -> [c, a]
    there = [(p % m) * a + p // m for p in range(a * m)]
    if not inverse:
        _cycle(blocks, there)
    chunks = x.view(m, a * c, -1)
    buffer = empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    for chunk in chunks:
        before = chunk.view(a, c, -1) if not inverse else chunk.view(c, a, -1)
        buffer.view(before.shape[1], before.shape[0], -1).copy_(before.transpose(0, 1))
        chunk.copy_(buffer)
    if inverse:
        back = [0] * len(there)
        for p, d in enumerate(there):
            back[d] = p
        _cycle(blocks, back)
    return True


def _eligible(store: ShardStore, order: RowOrder) -> bool:
    layout, shards = store.layout, list(store.local_shards().values())
    n = layout.num_shards
    return (
        not layout.contiguous
        and n > 1
        and layout.axis == 0
        and layout.num_rows % n == 0
        and store.exchange is None
        and store.adopt  # a store told not to move its shards' memory (a view over another's) keeps it
        and store.is_complete
        and store.full_slab is not None
        and store.width > 0
        and store.row_order is order
        and all(type(t) in _PLAIN for t in shards)
        and _blocks(n, layout.num_rows // n) is not None
        and not any(s.rows_held for s in (store, *store.companions))  # a pending backward maps rows as they lie
    )


def _unshared(store: ShardStore) -> bool:
    """Whether only shardvar's own tensors over the table's memory hold it (the store's and its
    companions' shards and slabs): anyone else's (a view of a shard, a kept ``state_dict``, the
    tensor the shards were cut from, a pending backward's saved slab) would see its rows move."""
    first = store.local_shards()[0]
    ours: dict[int, torch.Tensor] = {}
    for owner in (store, *store.companions):
        ours.update((id(t), t) for t in owner.local_shards().values())
        ours.update((id(g.slab), g.slab) for g in owner.groups if g.slab is not None)
    known = sum(1 for t in ours.values() if storage_ptr(t) == storage_ptr(first))
    return _use_count(first) - (_base_use() - 1) == known


def _alone(t: torch.Tensor) -> bool:
    return _use_count(t) == _base_use()


def _relay(store: ShardStore, extra: list[torch.Tensor], interleaved: bool, fresh: bool = False) -> bool:
    """Move the rows in place; ``fresh``: the table's rows (and any state tensor someone else views)
    into new memory instead, the old left as it is to whoever holds it."""
    n, rows = store.layout.num_shards, store.layout.num_rows
    slab = store.full_slab
    with torch.no_grad():
        if fresh:
            slab = _moved(slab, n, interleaved)
        for t in extra:
            if _alone(t):
                transpose_rows_(t.view(rows, -1), n, rows // n, inverse=not interleaved)
            else:
                t.set_(_moved(t.view(rows, -1), n, interleaved).view(t.shape))
        if not fresh:
            transpose_rows_(slab, n, rows // n, inverse=not interleaved)
        whole = slab.view(rows, *store.row_shape)
        pieces = [whole[s::n] for s in range(n)] if interleaved else list(whole.split(rows // n))
        for s, t in store.local_shards().items():
            place(t, pieces[s])
    store.moved_rows(interleaved)
    return True


def _moved(x: torch.Tensor, n: int, interleaved: bool) -> torch.Tensor:
    """A copy of ``x``'s rows (``[n * q, width]``) row by row in logical order (or back), in new memory."""
    q = x.shape[0] // n
    return (x.view(n, q, -1) if interleaved else x.view(q, n, -1)).transpose(0, 1).reshape(x.shape)


def interleave(store: ShardStore, extra: list[torch.Tensor] = ()) -> bool:
    """Lay the store's mod shards row by row in logical order, and each tensor of ``extra`` (the
    table's optimizer state, one row per table row) alike; False, changing nothing, when the table
    is not a complete local mod table of equal shards lying back to back in one slab, or when a
    tensor other than shardvar's own holds its memory."""
    ready = _eligible(store, RowOrder.STORAGE) and _unshared(store) and all(_alone(t) for t in extra)
    return ready and _relay(store, list(extra), True)


def deinterleave(store: ShardStore, extra: list[torch.Tensor] = ()) -> bool:
    """Undo :func:`interleave`: the shards back to back, each contiguous (as torch's sparse optimizers need).
    Where another tensor views their memory, they move into new memory (as after ``module.to()``): that
    tensor keeps its values, and torch's optimizers can update the shards. False, changing nothing,
    while a backward that maps the rows as they lie is pending."""
    if not _eligible(store, RowOrder.LOGICAL) or math.prod(store.local_shards()[0].stride()[:1]) == store.width:
        return False
    return _relay(store, list(extra), False, fresh=not _unshared(store))
