"""Checkpoints written and read by all ranks of a group, in the single-process format.

Each rank writes its own shards (and rank 0 the replicated values) into its own data files;
rank 0 writes the manifest once every rank has written and fsynced its files. Any world size,
including a single process with ``shardvar.load``, restores it: each rank reads only the chunks
its own shards need.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch.distributed as dist

from ..checkpoint import STAGING_BYTES, AsyncSave, Coordinator, Progress
from ..checkpoint import load as _load
from ..checkpoint import save as _save
from ._comm import DEFAULT_TIMEOUT, Comm

__all__ = ["save", "load"]

_COMMS: dict[tuple[int, float], Comm] = {}


class GroupCoordinator(Coordinator):
    """Agreement over a process group: a common save id, gathered metadata, a final barrier."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.key = comm  # saves over one communicator run one at a time
        self.rank, self.world = comm.rank, comm.world

    def common_save_id(self) -> str:
        return self.comm.all_gather_object(uuid.uuid4().hex[:16], "the save id")[0]

    def gather(self, obj: Any) -> list[Any]:
        return self.comm.all_gather_object(obj, "checkpoint metadata")

    def barrier(self) -> None:
        self.comm.barrier("checkpoint commit")


def _coordinator(group: Any, timeout: float, background: bool = False) -> GroupCoordinator:
    """Agreement over ``group``; a background save gets a group of its own (created once, by
    every rank), so its collectives never interleave with the training's."""
    key = (id(group), timeout, background)
    if key not in _COMMS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        own = dist.new_group(ranks=ranks, backend="gloo") if background else group
        _COMMS[key] = Comm(own, timeout)
    return GroupCoordinator(_COMMS[key])


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Progress | None = None,
    asynchronous: bool = False,
    staging_bytes: int | None = None,
    delta_of: str | os.PathLike | None = None,
) -> AsyncSave | None:
    """Like :func:`shardvar.save`, called by every rank: each writes its own shards.

    ``state_dict`` may hold DistributedShardedVariables, modules with DistributedEmbeddings,
    replicated tensors and modules (written once, by rank 0), and each rank's optimizer. With
    ``asynchronous=True`` every rank returns once its snapshot is staged; the ranks' writers agree
    over a process group of their own, so training's collectives go on undisturbed. With
    ``delta_of`` each rank writes the rows of its shards that changed since that checkpoint.
    """
    coordinator = _coordinator(group, timeout, background=bool(asynchronous))
    # shardvar.save's own arguments passed on by name (alike in shape to other pass-throughs);
    # the signature above is shardvar.save's plus the group's, as a distributed twin's must be.
    return _save(
        state_dict,
        path,
        progress=progress,
        keep_spare=False,
        coordinator=coordinator,
        asynchronous=asynchronous,
        staging_bytes=staging_bytes,
        delta_of=delta_of,
    )


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    staging_bytes: int = STAGING_BYTES,
    progress: Progress | None = None,
) -> None:
    """Like :func:`shardvar.load`, called by every rank: each restores its own shards.

    Every rank checks its part first; no rank writes anything unless all of them can.
    """
    _load(state_dict, path, staging_bytes=staging_bytes, progress=progress, coordinator=_coordinator(group, timeout))
