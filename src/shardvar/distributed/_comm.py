"""The collectives shardvar uses, over the caller's process group, counted and with clear errors.

Every distributed variable uses the caller's group (the default one unless given): no group is
created per variable, so a thousand tables on NCCL cost nothing extra. Each collective is issued
asynchronously and waited on with the variable's timeout (default 60 s), so a rank that dies or
hangs makes the others raise ShardvarDistributedError instead of waiting forever. A Comm counts
its collectives, and the bytes each all_to_all sends to other ranks.
"""

from __future__ import annotations

import pickle
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from .._errors import ShardvarDistributedError
from .._validate import check_number

__all__ = ["Comm", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0
_ARRIVALS: Counter[int] = Counter()  # agreement collectives so far, per process group (same on every rank)


class Comm:
    """One user's view of a process group: shardvar's timeout, counters and error translation."""

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ShardvarDistributedError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group (torchrun sets "
                "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) before creating distributed variables"
            )
        self.group = group
        self.timeout = check_number(timeout, "timeout", positive=True)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
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

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses of several kinds
            raise self._fail(what, e) from None

    def _run(self, collective: str, options: Any, what: str, *args: Any) -> None:
        """Issue ``collective`` on the group's backend with shardvar's timeout in its options, and wait.

        The timeout goes down to the backend, not only to the wait: work that outlived a failed
        wait would stay pending in gloo's threads, waiting for a rank that is gone or stuck until
        the group's own timeout (30 min by default), and the group's destructor joins those
        threads, so the process could not exit after the error and a launcher could not restart
        the job. With the same timeout the backend gives up when the wait does.
        """
        options.timeout = timedelta(seconds=self.timeout)
        options.asyncOp = True
        group = self.group or dist.distributed_c10d._get_default_group()
        try:
            work = getattr(group, collective)(*args, options)
        except Exception as e:
            raise self._fail(what, e) from None
        self._wait(work, what)

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str
    ) -> None:
        self.calls["all_to_all"] += 1
        row = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
        self.bytes_sent += row * (sum(in_splits) - in_splits[self.rank])
        options = dist.AllToAllOptions()
        self._run("alltoall_base", options, f"all_to_all of {what}", out, inp, out_splits, in_splits)

    def _store(self) -> Any:
        try:
            return dist.distributed_c10d._get_process_group_store(self.group or dist.group.WORLD)
        except Exception:  # a group without a store of its own: failures just cannot name ranks
            return None

    def _arrive(self) -> str | None:
        """Note this rank's arrival at the next agreement in the group's store; return the key prefix."""
        store = self._store()
        if store is None:
            return None
        group_key = id(self.group or dist.group.WORLD)
        _ARRIVALS[group_key] += 1
        prefix = f"shardvar/arrive/{_ARRIVALS[group_key]}"
        try:
            store.set(f"{prefix}/{self.rank}", "1")
        except Exception:
            return None
        return prefix

    def _missing(self, prefix: str | None) -> str:
        store = self._store()
        if prefix is None or store is None:
            return ""
        try:
            absent = [r for r in range(self.world) if not store.check([f"{prefix}/{r}"])]
        except Exception:
            return ""
        return f"; rank(s) {absent} never reached it" if absent else ""

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        """Everyone's ``obj`` in rank order: pickled bytes in two all_gathers (sizes, then bytes).

        Used where the ranks agree (construction, checkpoints): a failure names the ranks that never
        arrived, so a rank that died early is reported as such.
        """
        self.calls["all_gather_object"] += 1
        prefix = self._arrive()
        try:
            return self._gather_object(obj, what)
        except ShardvarDistributedError as e:
            raise ShardvarDistributedError(f"{e}{self._missing(prefix)}") from None

    def _gather_object(self, obj: Any, what: str) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        self._run("allgather", AllgatherOptions(), f"all_gather of {what} (sizes)", [sizes], [size])
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        self._run("allgather", AllgatherOptions(), f"all_gather of {what}", [gathered], [padded])
        return [pickle.loads(g[: int(s)].cpu().numpy().tobytes()) for g, s in zip(gathered, sizes, strict=True)]

    def all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        self.calls["all_reduce"] += 1
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._run("allreduce", options, f"all_reduce of {what}", [tensor])

    def barrier(self, what: str) -> None:
        self.calls["barrier"] += 1
        flag = torch.zeros(1, device=self.device)
        self._run("allreduce", dist.AllreduceOptions(), f"barrier ({what})", [flag])
