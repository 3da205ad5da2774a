"""A store mixing shards on the meta device with shards on real ones has no whole rows to read.

(All on meta, a table being planned, reads give shape-only results: ``_functional._source``.)"""

from __future__ import annotations

from .._errors import ShardvarDeviceError
from ._store import ShardStore

__all__ = ["check_readable"]


def check_readable(store: ShardStore) -> None:
    """Refuse a read of a store whose shards lie some on the meta device and some on real ones.

    All on meta (a table being planned), reads give shape-only meta results; a mix (a shard
    materialised or moved alone) has rows with values and rows without, so no read is whole.
    """
    groups = store.groups
    if len(groups) > 1 and len({g.device.type == "meta" for g in groups}) > 1:
        meta = sorted(s for s, t in store.local_shards().items() if t.is_meta)
        real = sorted({str(g.device) for g in groups if g.device.type != "meta"})
        raise ShardvarDeviceError(
            f"shard{'s' if len(meta) > 1 else ''} {', '.join(map(str, meta))} of the variable "
            f"{'are' if len(meta) > 1 else 'is'} on the meta device (no values) and the others on {real}; "
            "a read needs them all on real devices (materialise them, e.g. module.to_empty(device=...)), "
            "or all on meta for shapes only"
        )
