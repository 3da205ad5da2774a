"""A DLRM-style model on synthetic Criteo-shaped data, shared by ``shardvar demo --tables`` and
``examples/dlrm.py`` (public names in ``shardvar.workloads``).

13 dense features go through a bottom MLP; up to 26 categorical ones (Criteo's cardinalities,
scaled) are looked up in an ``EmbeddingBagCollection`` (one process) or a
``DistributedEmbeddingBagCollection`` (several: each step is one exchange for all tables); the
pooled vectors and the bottom MLP's output interact by pairwise dot products, and a top MLP
predicts the click. Each rank takes its slice of the same global batch and the dense gradients
are summed over the ranks, so every world size trains the same model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from .._errors import ShardvarDistributedError, ShardvarValueError
from .._validate import check_int, check_number
from ..checkpoint import MANIFEST, load, save
from ..distributed import DEFAULT_TIMEOUT, Comm, DistributedEmbeddingBagCollection
from ..nn import EmbeddingBagCollection, TableConfig
from ..variables import RowInitializer

__all__ = ["CRITEO", "DLRM", "Checkpoints", "build_dlrm", "criteo_tables", "dlrm_batch", "explain_steps", "train_dlrm"]

CRITEO = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
          5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
DENSE, DIM = 13, 16
INIT = RowInitializer(seed=1, std=0.1)  # table values that depend on nothing but the row


def criteo_tables(scale: float, count: int = 26) -> dict[str, TableConfig]:
    """The first ``count`` of Criteo's 26 tables, cardinalities times ``scale``; big ones in 4 mod shards."""
    return {
        f"cat_{i}": TableConfig(max(2, int(n * scale)), DIM, 4 if n * scale > 1000 else 1, "mod")
        for i, n in enumerate(CRITEO[:count])
    }


class DLRM(nn.Module):
    """Bottom MLP, embedding collection, pairwise-dot interaction, top MLP (the DLRM reference's shape)."""

    def __init__(self, embeddings: nn.Module, num_tables: int) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, DIM), nn.ReLU())
        pairs = (num_tables + 1) * num_tables // 2
        self.top = nn.Sequential(nn.Linear(DIM + pairs, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, sparse: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(sparse)
        features = torch.stack([x, *pooled.values()], dim=1)  # [batch, tables + 1, DIM]
        dots = features @ features.transpose(1, 2)
        i, j = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)


def dlrm_batch(configs: dict[str, TableConfig], size: int, step: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A global batch of synthetic Criteo-shaped rows: dense features, one id per table, clicks."""
    g = torch.Generator().manual_seed(step)
    dense = torch.randn(size, DENSE, generator=g).abs().log1p()
    ids = {k: torch.randint(0, c.num_embeddings, (size, 1), generator=g) for k, c in configs.items()}
    first = next(iter(ids.values()))
    logit = dense[:, 0] - dense[:, 1] + (first.squeeze(1) % 3 == 0).float()  # something to learn
    return dense, ids, torch.bernoulli(torch.sigmoid(logit), generator=g)


def build_dlrm(
    configs: dict[str, TableConfig], world: int, placement: Any = None, *, timeout: float = DEFAULT_TIMEOUT
) -> DLRM:
    """The model: a distributed collection over ``world`` ranks (placement by hand, ``"auto"`` or row-wise;
    collectives time out after ``timeout`` s), or one process's collection holding the same values (the
    tables end to end, by logical row)."""
    if world > 1:
        emb: nn.Module = DistributedEmbeddingBagCollection(
            configs, placement=placement, initializer=INIT, timeout=timeout
        )
    else:
        emb = EmbeddingBagCollection(configs)
        start = 0
        with torch.no_grad():
            for bag in emb.embedding_bags.values():
                bag.weight.copy_(INIT.rows(start + torch.arange(bag.num_embeddings), (DIM,), torch.float32))
                start += bag.num_embeddings
    torch.manual_seed(0)  # the dense layers: the same initial values on every rank and world size
    return DLRM(emb, len(configs))


def _finished_key(rank: int) -> str:
    return f"shardvar/dlrm/finished/{rank}"


def explain_steps(error: ShardvarDistributedError, done: int, running: bool) -> ShardvarDistributedError:
    """``error`` (a collective that failed on this rank after ``done`` steps, while it was ``running``
    more or once it had finished) as the user error it is when the ranks stopped after different
    numbers of steps; else ``error`` itself."""
    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != rank]
    finished = {r: int(store.get(_finished_key(r))) for r in others if store.check([_finished_key(r)])}
    if finished and (running or any(n != done for n in finished.values())):
        what = ", ".join(f"rank {r} stopped after {n} steps" for r, n in finished.items())
        mine = f"this rank ({rank}) was running step {done + 1}" if running else f"this rank ({rank}) ran {done}"
        message = f"{what} while {mine}"
    elif not running and len(finished) < len(others):
        missing = [r for r in others if r not in finished]
        message = f"this rank ({rank}) finished its {done} steps and rank(s) {missing} had not (more steps, or died)"
    else:
        return error
    return ShardvarDistributedError(
        f"ranks stopped after different numbers of steps: {message}; every rank must run the same number of "
        f"steps (each takes its slice of every global batch). ({error})"
    )


@dataclass
class Checkpoints:
    """Periodic asynchronous checkpoints under ``root`` (``step-<n>``, every ``every`` steps) and resuming
    from the latest complete one: its manifest exists (rank 0 writes it last, once every rank's files
    are on disk), so a run killed mid-save resumes from the one before. Any world size resumes any."""

    root: Path
    every: int
    timeout: float = DEFAULT_TIMEOUT
    label: str = "dlrm"  # what the line saying where a run resumes from starts with
    pending: Any = field(default=None, repr=False)  # the AsyncSave still writing, if any

    def __post_init__(self) -> None:
        # every=0 once meant "never": a run asked to survive restarts wrote nothing and started over.
        check_int(self.every, "every", minimum=1)

    def latest(self) -> tuple[int, Path] | None:
        done = [(int(p.name[5:]), p) for p in self.root.glob("step-*") if (p / MANIFEST).is_file()]
        return max(done) if done else None

    def resume(self, state: dict[str, Any], world: int) -> int:
        """Load the latest complete checkpoint into ``state``; the step to go on from (0: none)."""
        found = self.latest()
        if found is None:
            return 0
        print(f"{self.label}: resuming from {found[1]}", flush=True)
        if world > 1:
            distributed.load(state, found[1], timeout=self.timeout)
        else:
            load(state, found[1])
        return found[0]

    def after(self, step: int, state: dict[str, Any], world: int) -> None:
        """Start the checkpoint of ``step`` steps done when it is due; training goes on while it writes."""
        if step % self.every == 0:
            path = self.root / f"step-{step:08d}"
            if world > 1:
                self.pending = distributed.save(state, path, timeout=self.timeout, asynchronous=True)
            else:
                self.pending = save(state, path, asynchronous=True)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()


def train_dlrm(
    model: DLRM,
    configs: dict[str, TableConfig],
    steps: int,
    size: int,
    lr: float,
    world: int = 1,
    seconds: list[float] | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    checkpoints: Checkpoints | None = None,
    on_loss: Callable[[int, float], None] | None = None,
) -> list[float]:
    """SGD on the global batch, each rank on its slice; returns the loss of every step it ran (summed
    over ranks): all of them, or those after the checkpoint it resumed from.

    ``seconds``, when given, gets the time each step took; ``on_loss(step, loss)`` is called after each.
    Collectives time out after ``timeout`` s. A run resumed from a checkpoint of ``steps`` steps
    (it had finished) runs none and returns no losses.
    """
    check_int(steps, "steps", minimum=0)
    check_int(size, "size", minimum=1)  # a batch of 0 trains on a NaN loss (a sum over nothing / 0)
    check_number(lr, "lr", positive=True)
    if size % world:
        raise ShardvarValueError(
            f"the global batch ({size}) must divide by the number of processes ({world}): each takes an equal "
            f"slice, and a remainder would be silently dropped; use a multiple of {world}"
        )
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    comm = Comm(None, timeout) if world > 1 else None
    state = {"model": model, "opt": opt}
    first = checkpoints.resume(state, world) if checkpoints else 0
    losses: list[float] = []
    try:
        for step in range(first, steps):
            start = time.perf_counter()
            losses.append(_step(model, configs, opt, step, size, comm))
            if seconds is not None:
                seconds.append(time.perf_counter() - start)
            if on_loss is not None:
                on_loss(step, losses[-1])
            if checkpoints:
                checkpoints.after(step + 1, state, world)
        if checkpoints:
            checkpoints.wait()
    except ShardvarDistributedError as e:
        raise explain_steps(e, first + len(losses), running=True) from None
    if comm is not None:
        dist.distributed_c10d._get_default_store().set(_finished_key(comm.rank), str(steps))
    return losses


def _step(model: DLRM, configs: dict, opt: torch.optim.Optimizer, step: int, size: int, comm: Comm | None) -> float:
    rank, world = (comm.rank, comm.world) if comm else (0, 1)
    per_rank = size // world
    dense, ids, clicks = dlrm_batch(configs, size, step)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    logits = model(dense[mine], {k: v[mine] for k, v in ids.items()})
    loss = nn.functional.binary_cross_entropy_with_logits(logits, clicks[mine], reduction="sum") / size
    opt.zero_grad()
    loss.backward()
    if comm is not None:  # the dense layers are replicated: sum their gradients (and the loss) in one call
        dense_params = [*model.bottom.parameters(), *model.top.parameters()]
        flat = torch.cat([*(p.grad.reshape(-1) for p in dense_params), loss.detach().reshape(1)])
        comm.all_reduce(flat, dist.ReduceOp.SUM, "the dense layers' gradients")
        torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in dense_params])
        loss = flat[-1]
    opt.step()
    return float(loss.detach())
