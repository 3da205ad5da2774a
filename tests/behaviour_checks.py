"""Each behaviour of the suite, run on a family (``observe``, on every rank of a distributed family) and
compared with the plain-torch reference (``verify``, in the test process).

``observe`` returns only tensors, strings and lists, so a distributed worker can send it back; a
family that refuses a behaviour is observed doing what the behaviour asks, and ``verify`` checks
the refusal: the exception's class and the words of its message.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from behaviour import (
    LR,
    PADDING,
    SHAPES,
    TABLE_OF,
    Batch,
    Family,
    initial_tables,
    make_batch,
    sample_weights,
    with_padding,
)
from shardvar.variables import RowInitializer

OTHER_ROWS = RowInitializer(99)  # a module loaded into starts from other rows than the one saved


def error_record(e: BaseException) -> dict:
    return {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def _loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    outputs = [v for k, v in sorted(out.items()) if not k.endswith(".lengths")]
    return sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(outputs))


def _detached(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in out.items()}


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (this rank's): what a refused call must leave as it was."""
    return {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}


def unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ from ``before`` (empty: nothing changed)."""
    now = snapshot(module)
    return sorted(
        n for n in before.keys() | now.keys() if n not in now or n not in before or not now[n].equal(before[n])
    )


def step(family: Family, module: torch.nn.Module, batch: Any, weights: dict | None = None, train: bool = True) -> dict:
    """A training step (SGD) and the lookup after it; a family that does not train only looks up."""
    if not (train and family.trains):
        module.train()  # a dynamic table admits ids in training; a quantized one looks up without grad
        with torch.no_grad():
            return {"out": _detached(family.call(module, batch, weights))}
    module.train()
    out = family.call(module, batch, weights)
    _loss(out).backward()
    with torch.no_grad():  # SGD by hand: torch.optim's first step imports torch._dynamo (seconds per process)
        for p in module.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
                p.grad = None
    module.eval()  # a dynamic table reads its rows without admitting ids
    with torch.no_grad():
        after = family.call(module, batch, weights)
    module.train()
    return {"out": _detached(out), "after": _detached(after)}


def _refused(run: Callable[[], Any]) -> dict:
    try:
        run()
    except Exception as e:  # the refusal is compared with the family's declaration by verify
        return {"refused": error_record(e)}
    return {"refused": None}


Spoil = Callable[[Batch, bool], tuple[Batch, "dict | None"]]  # (batch, bad here) -> (batch, weights)


def _bad_id(feature: str, bad: int) -> Spoil:
    def spoil(batch: Batch, here: bool) -> tuple[Batch, None]:
        if here:
            ids, offsets = batch[feature]
            batch[feature] = torch.cat([ids[:1], torch.tensor([bad]), ids[2:]]), offsets
        return batch, None

    return spoil


def _bad_input(family: Family, what: str) -> Spoil:
    feature = family.features[0]  # "user": a sum table, weighed

    def spoil(batch: Batch, here: bool) -> tuple[Batch, dict | None]:
        ids, offsets = batch[feature]
        weights = sample_weights(batch) if what in ("per_sample_weights", "non-finite weights") else None
        if here and what == "float ids":
            batch[feature] = ids.float(), offsets
        elif here and what == "offsets":  # past the end of the ids
            batch[feature] = ids, torch.tensor([0, len(ids) + 4, len(ids) + 4])
        elif here and what == "non-finite weights":
            weights[feature] = weights[feature].clone().index_fill_(0, torch.tensor([0]), float("nan"))
        elif here:
            weights[feature] = weights[feature][:-1]
        return batch, weights

    return spoil


def bad_inputs(family: Family) -> list[str]:
    """The inputs a family checks besides its ids' range (offsets and weights where its call takes them)."""
    return ["float ids", *(["offsets"] if family.kind != "embedding" else []),
            *(["per_sample_weights", "non-finite weights"] if family.kind in ("bag", "pooled") else [])]  # fmt: skip


def _spoiled(family: Family, rank: int, bad_ranks: tuple[int, ...], spoils: list[Spoil]) -> dict:
    """Each spoiled call (spoiled on ``bad_ranks``), what it raised and changed; then a good step on every rank."""
    module = family.build("a")
    out: dict[str, Any] = {"errors": [], "changed": []}
    for spoil in spoils:
        batch, weights = spoil(make_batch(family.features, rank, 0), rank in bad_ranks)
        before = snapshot(module)
        try:
            step(family, module, batch, weights)
            out["errors"].append(None)
        except Exception as e:
            out["errors"].append({**error_record(e), "here": rank in bad_ranks})
        out["changed"].append(unchanged(module, before))
    out.update(step(family, module, make_batch(family.features, rank, 0)))
    return out


def _bad_ids(family: Family, rank: int, bad_ranks: tuple[int, ...]) -> dict:
    """Each bad id (past the end, -1) on ``bad_ranks``; then a good step on every rank."""
    feature = family.features[-1 if len(family.features) == 1 else 1]  # "friend" in a collection
    values = (SHAPES[TABLE_OF[feature]][0] + 3, -1)
    out = _spoiled(family, rank, bad_ranks, [_bad_id(feature, bad) for bad in values])
    return {**out, "feature": feature, "values": values}


def _save_load(family: Family, rank: int, path: str) -> dict:
    batch = make_batch(family.features, rank, 0)
    saved = family.build("a")
    step(family, saved, batch)  # rows of its own (a family that does not train loads from other rows below)
    saved.eval()
    family.save({"model": saved}, f"{path}/{family.name}")
    loaded = family.build("b", init=OTHER_ROWS)
    loaded.eval()
    with torch.no_grad():
        before = family.call(loaded, batch)
        family.load({"model": loaded}, f"{path}/{family.name}")
        return {"saved": _detached(family.call(saved, batch)), "before": before, "loaded": family.call(loaded, batch)}


def observe(behaviour: str, family: Family, rank: int, path: str | Path) -> dict:
    """What ``family`` does for ``behaviour`` on this rank (a crash is recorded, not raised)."""
    try:
        return _observe(behaviour, family, rank, str(path))
    except Exception as e:
        return {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def _observe(behaviour: str, family: Family, rank: int, path: str) -> dict:
    batch = make_batch(family.features, rank, 0)
    refusal = family.refuses.get(behaviour)
    if behaviour == "lookup":
        return step(family, family.build("a"), batch, train=False)
    if behaviour == "train_step":
        module = family.build("a")
        if refusal:
            return _refused(lambda: _loss(family.call(module.train(), batch)).backward())
        return step(family, module, batch)
    if behaviour == "bad_ids":
        return _bad_ids(family, rank, tuple(range(family.world)))
    if behaviour == "bad_ids_one_rank":
        return _bad_ids(family, rank, (1,))
    if behaviour in ("bad_inputs", "bad_inputs_one_rank"):
        bad_ranks = (1,) if behaviour == "bad_inputs_one_rank" else tuple(range(family.world))
        return _spoiled(family, rank, bad_ranks, [_bad_input(family, what) for what in bad_inputs(family)])
    if behaviour == "padding":
        if refusal:
            return _refused(lambda: family.build("a", PADDING))
        return step(family, family.build("a", PADDING), with_padding(batch))
    if behaviour == "empty_bags":
        return step(family, family.build("a"), make_batch(family.features, rank, 0, empty=True))
    if behaviour == "per_sample_weights":
        module = family.build("a")
        if refusal:
            return _refused(lambda: family.call(module, batch, {"user": torch.ones(len(batch["user"][0]))}))
        return step(family, module, batch, sample_weights(batch))
    if behaviour == "feature_names":  # "user" and "friend" read one table; ids both hold are one row's
        batch["friend"] = batch["user"]
        return step(family, family.build("a"), batch)
    if behaviour == "save_load":
        if refusal:
            return _refused(lambda: family.save({"model": family.build("a").eval()}, f"{path}/{family.name}"))
        return _save_load(family, rank, path)
    raise AssertionError(f"no behaviour {behaviour!r}")


def batches(behaviour: str, family: Family) -> list[tuple[Any, dict | None, int | None]]:
    """Each rank's (batch, per-sample weights, padding_idx) of ``behaviour``, as ``observe`` made them."""
    out = []
    for rank in range(family.world):
        batch, weights, padding_idx = make_batch(family.features, rank, 0), None, None
        if behaviour == "padding":
            batch, padding_idx = with_padding(batch), PADDING
        elif behaviour == "empty_bags":
            batch = make_batch(family.features, rank, 0, empty=True)
        elif behaviour == "per_sample_weights":
            weights = sample_weights(batch)
        elif behaviour == "feature_names":
            batch["friend"] = batch["user"]
        out.append((batch, weights, padding_idx))
    return out


def check_step(family: Family, observed: list[dict], inputs: list[tuple[Any, dict | None, int | None]],
               train: bool = True) -> None:  # fmt: skip
    """Each rank's output equals the reference's, and (a family that trains) so do its rows after one step
    whose gradient is every rank's loss summed."""
    padding_idx = inputs[0][2]
    tables = {t: w.requires_grad_() for t, w in initial_tables(padding_idx=padding_idx).items()}
    refs = [family.reference(tables, batch, weights, padding_idx) for batch, weights, _ in inputs]
    for rank, (obs, ref) in enumerate(zip(observed, refs, strict=True)):
        torch.testing.assert_close(
            obs["out"], _detached(ref), atol=1e-5, rtol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}"
        )
    if not (train and family.trains):
        assert all("after" not in obs for obs in observed)
        return
    sum(_loss(ref) for ref in refs).backward()
    with torch.no_grad():
        new = {t: w - LR * w.grad if w.grad is not None else w.detach() for t, w in tables.items()}
    for rank, (obs, (batch, weights, _)) in enumerate(zip(observed, inputs, strict=True)):
        want = family.reference(new, batch, weights, padding_idx)
        torch.testing.assert_close(
            obs["after"], want, atol=1e-5, rtol=1e-5, msg=lambda m, r=rank: f"rank {r}, after the step: {m}"
        )


def check_refusal(family: Family, behaviour: str, observed: list[dict]) -> None:
    error, pattern = family.refuses[behaviour]
    for rank, obs in enumerate(observed):
        got = obs["refused"]
        assert got is not None, (
            f"rank {rank}: {family.name} did {behaviour} instead of refusing it with {error.__name__}"
        )
        assert error.__name__ in got["mro"], f"rank {rank}: {got}"
        assert re.search(pattern, got["message"]), f"rank {rank}: {got['message']!r} does not match {pattern!r}"


def _check_spoiled(family: Family, observed: list[dict], expect: list[tuple[str, str]]) -> None:
    """Every rank refuses each spoiled call: where it was spoiled with ``expect``'s (error, regex), elsewhere with
    a ShardvarError that is not a failed collective; no rank's tensors change; a good step after it works."""
    for rank, obs in enumerate(observed):
        for (error_name, pattern), error, changed in zip(expect, obs["errors"], obs["changed"], strict=True):
            assert error is not None, f"rank {rank}: a call spoiled on some rank (wanted {error_name}) did not raise"
            assert "ShardvarError" in error["mro"], f"rank {rank}: {error}"
            if error["here"]:
                assert error_name in error["mro"], f"rank {rank}: {error}"
                assert re.search(pattern, error["message"]), f"rank {rank}: {error['message']!r} lacks {pattern!r}"
            else:
                assert not re.search(COLLECTIVE_FAILED, error["message"]), f"rank {rank}: {error['message']!r}"
            assert changed == [], f"rank {rank}: a refused call changed {changed}"
    check_step(family, observed, batches("train_step", family))


COLLECTIVE_FAILED = r"failed \(RuntimeError|timeout|never reached it"
BAD_INPUT_ERRORS = {
    "float ids": ("ShardvarTypeError", r"integer"),
    "offsets": ("ShardvarValueError", r"offsets"),
    "per_sample_weights": ("ShardvarValueError", r"per_sample_weights"),
    "non-finite weights": ("ShardvarValueError", r"per_sample_weights must be finite; got nan at position 0"),
}


def check_bad_ids(family: Family, observed: list[dict]) -> None:
    """Where passed, the error names the range, the value (and, in a collection, the feature); elsewhere the range."""
    obs = observed[0]
    feature = f"feature '{obs['feature']}'.*" if family.kind in ("pooled", "sequence") else ""
    expect = [("ShardvarIndexError", rf"{feature}\[0, \d+\).*(?<![\d-]){bad}(?!\d)") for bad in obs["values"]]
    _check_spoiled(family, observed, expect)
    for rank, obs in enumerate(observed):
        for error in obs["errors"]:
            assert {"ShardvarIndexError", "IndexError"} <= set(error["mro"]), f"rank {rank}: {error}"
            assert re.search(r"\[0, \d+\)", error["message"]), f"rank {rank}: {error['message']!r} names no range"


def check_save_load(observed: list[dict]) -> None:
    for rank, obs in enumerate(observed):
        assert any(not torch.equal(obs["before"][k], v) for k, v in obs["saved"].items()), "nothing to load"
        torch.testing.assert_close(obs["loaded"], obs["saved"], atol=0, rtol=0, msg=lambda m, r=rank: f"rank {r}: {m}")


def verify(behaviour: str, family: Family, observed: list[dict]) -> None:
    """``observed`` (one per rank) is what the reference does, or the refusal the family declares."""
    for rank, obs in enumerate(observed):
        assert "crash" not in obs, f"rank {rank}: {obs['crash']}"
    if behaviour in family.refuses:
        return check_refusal(family, behaviour, observed)
    if behaviour in ("bad_ids", "bad_ids_one_rank"):
        return check_bad_ids(family, observed)
    if behaviour in ("bad_inputs", "bad_inputs_one_rank"):
        return _check_spoiled(family, observed, [BAD_INPUT_ERRORS[what] for what in bad_inputs(family)])
    if behaviour == "save_load":
        return check_save_load(observed)
    check_step(family, observed, batches(behaviour, family), train=behaviour != "lookup")
