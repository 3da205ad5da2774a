"""The collectives shardvar uses, over torch.distributed, counted and with clear errors.

Each distributed variable gets its own process group created with a timeout (default 60 s), so
a rank that dies or hangs makes the others raise ShardvarDistributedError instead of waiting
forever. Every collective is counted, and the bytes each all_to_all sends to other ranks too.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._errors import ShardvarDistributedError

__all__ = ["Comm", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0


class Comm:
    """A process group with shardvar's timeout, collective counters and error translation."""

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ShardvarDistributedError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group (torchrun sets "
                "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) before creating distributed variables"
            )
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # Our own group: its timeout bounds every collective of this variable.
        self.group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=timeout))
        self.timeout = timeout
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        self.calls: Counter[str] = Counter()
        self.bytes_sent = 0  # to other ranks, by all_to_all

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _fail(self, what: str, e: Exception) -> ShardvarDistributedError:
        return ShardvarDistributedError(
            f"rank {self.rank}/{self.world}: {what} failed ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
            f"another rank probably died, hung for more than the {self.timeout:g} s timeout, or stopped calling "
            "the same collectives"
        )

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str
    ) -> None:
        self.calls["all_to_all"] += 1
        row = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
        self.bytes_sent += row * (sum(in_splits) - in_splits[self.rank])
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses of several kinds
            raise self._fail(f"all_to_all of {what}", e) from None

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        self.calls["all_gather_object"] += 1
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:
            raise self._fail(f"all_gather of {what}", e) from None
        return out

    def barrier(self, what: str) -> None:
        self.calls["barrier"] += 1
        try:
            dist.barrier(group=self.group)
        except Exception as e:
            raise self._fail(f"barrier ({what})", e) from None
