"""Every rank's verdict on its own input, agreed before a distributed call does anything.

A distributed call runs the checks of its local twin on each rank's input. A rank that refused
and raised alone would leave the others in the call's collectives, paired with its *next* call:
their tables and optimizer state would change by a step that never was, and they would fail
later blaming a dead rank. So every distributed module calls :func:`agree` where its first
collective is: the verdict rides beside the split sizes of the all_to_all that sends ids (no
extra collective on the hot path), or goes in an all_reduce of one int where no collective
carries sizes. If any rank refused, the ranks gather the refusals (that path only) and every
rank raises the same error: the class and message of the lowest rank that refused, naming it.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from .._errors import ShardvarError, ShardvarValueError
from ._comm import Comm

__all__ = ["agree", "refuse"]


def agree(
    comm: Comm, error: ShardvarError | None, counts: torch.Tensor | None = None, what: str = "split sizes"
) -> list[int]:
    """Collective: raise ``error`` (this rank's refusal of its input, or None) agreed on every rank.

    ``counts`` ([world] int64: the items this rank sends each rank) makes the agreement that
    all_to_all of split sizes, the verdict beside each count; the counts every rank sends this one
    come back. Without ``counts`` the verdicts meet in an all_reduce of one int (returns []).
    A rank that refused sends zero counts (see :func:`refuse`).
    """
    flag = 0 if error is None else 1
    if counts is None:
        verdict = torch.tensor([flag], dtype=torch.int64, device=comm.device)
        comm.all_reduce(verdict, dist.ReduceOp.MAX, "input verdicts")
        refused, received = bool(verdict), []
    else:
        header = torch.stack([counts, torch.full_like(counts, flag)], dim=1).reshape(-1)
        got = torch.empty_like(header)
        comm.all_to_all(got, header, [2] * comm.world, [2] * comm.world, what)
        pairs = got.reshape(comm.world, 2).tolist()  # one read of every count and verdict
        refused, received = any(v for _, v in pairs), [c for c, _ in pairs]
    if refused:
        raise _agreed(comm, error) from error
    return received


def refuse(comm: Comm, error: ShardvarError, carries_counts: bool = True) -> NoReturn:
    """Collective, in place of the call whose input this rank refused: its :func:`agree` with no
    items to send (``carries_counts``: the call's first collective is an all_to_all of split sizes;
    else the all_reduce). Every rank raises the agreed error; a lone process raises ``error``."""
    if comm.world == 1:
        raise error
    zeros = torch.zeros(comm.world, dtype=torch.int64, device=comm.device) if carries_counts else None
    agree(comm, error, zeros)
    raise error  # not reached: agree raises when a rank refused, and this one did


def _agreed(comm: Comm, error: ShardvarError | None) -> ShardvarError:
    """The error every rank raises: the first refusing rank's class and message, prefixed with its rank."""
    mine = None if error is None else (type(error), str(error))
    everyone = comm.all_gather_object(mine, "the refused inputs")
    refusals = [(rank, got) for rank, got in enumerate(everyone) if got is not None]
    rank, (cls, message) = refusals[0]
    text = f"rank {rank}: {message}"
    if len(refusals) > 1:
        text += f" (rank(s) {[r for r, _ in refusals[1:]]} refused their input too)"
    if not (isinstance(cls, type) and issubclass(cls, ShardvarError)):
        cls = ShardvarValueError
    return cls(text)
