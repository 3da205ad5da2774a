"""The update rules: SGD, Adagrad, row-wise Adagrad, Adam and row-wise Adam over tables.

Each rule updates weight rows and state rows in place. With dense gradients ``rows`` are the
whole slab and the result equals the torch.optim optimizer of the same name; with sparse ones
they are the distinct rows a batch touched, and only those rows (moments and weight decay
included) change, as torch.optim.SparseAdam does for Adam. Row-wise slots keep one value per row
(the mean of the squared gradient over the row), 1/dim of an element-wise slot's memory: DLRM's
row-wise Adagrad, and Adam with a row-wise second moment.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from .._errors import ShardvarValueError
from .._validate import check_bool, check_number
from ._base import TableOptimizer
from ._kernel import Rule, adagrad_rule, adam_rule

__all__ = ["SGD", "Adagrad", "RowWiseAdagrad", "Adam", "RowWiseAdam"]


def _decayed(w: torch.Tensor, g: torch.Tensor, o: dict[str, Any]) -> torch.Tensor:
    return g.add(w, alpha=o["weight_decay"]) if o["weight_decay"] else g


def _row_mean_square(g: torch.Tensor) -> torch.Tensor:
    """Each row's mean squared value (the norm, squared: no squared copy of the rows)."""
    return torch.linalg.vector_norm(g, dim=1).square_().div_(max(g.shape[1], 1))


def _betas(o: dict[str, Any]) -> tuple[float, float]:
    b1, b2 = o["betas"]
    return float(b1), float(b2)


class SGD(TableOptimizer):
    """Stochastic gradient descent with momentum and Nesterov momentum (``torch.optim.SGD``'s rule)."""

    def __init__(
        self, params: Any, lr: float = 1e-3, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay})

    def _check_options(self, group: dict[str, Any]) -> None:
        super()._check_options(group)
        check_number(group["momentum"], "momentum", minimum=0)
        if check_bool(group["nesterov"], "nesterov") and group["momentum"] <= 0:
            raise ShardvarValueError(f"nesterov momentum needs momentum > 0; got momentum={group['momentum']}")

    def needed_slots(self) -> dict[str, tuple[bool, str | float]]:
        return {"momentum_buffer": (False, 0.0)} if any(g["momentum"] for g in self.param_groups) else {}

    def linear(self, group: dict[str, Any]) -> bool:
        return not group["momentum"] and not group["weight_decay"]

    @staticmethod
    def update(w: torch.Tensor, s: dict, g: torch.Tensor, step: int, o: dict, sparse: bool) -> None:
        d = _decayed(w, g, o)
        if o["momentum"]:
            buf = s["momentum_buffer"].mul_(o["momentum"]).add_(d)  # zero-initialised: the first step is d
            d = d.add(buf, alpha=o["momentum"]) if o["nesterov"] else buf
        w.add_(d, alpha=-o["lr"])


class Adagrad(TableOptimizer):
    """Adagrad: a sum of squared gradients per element (``torch.optim.Adagrad``'s rule)."""

    slots: ClassVar[dict[str, tuple[bool, str | float]]] = {"sum": (False, "initial_accumulator_value")}

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        defaults = {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay, "eps": eps}
        super().__init__(params, {**defaults, "initial_accumulator_value": initial_accumulator_value})

    def _check_options(self, group: dict[str, Any]) -> None:
        super()._check_options(group)
        for name in ("lr_decay", "initial_accumulator_value", "eps"):
            check_number(group[name], name, minimum=0)

    @staticmethod
    def update(w: torch.Tensor, s: dict, g: torch.Tensor, step: int, o: dict, sparse: bool) -> None:
        g = _decayed(w, g, o)
        clr = o["lr"] / (1 + (step - 1) * o["lr_decay"])
        total = s["sum"].addcmul_(g, g)
        w.addcdiv_(g, total.sqrt().add_(o["eps"]), value=-clr)


class RowWiseAdagrad(TableOptimizer):
    """Adagrad with one accumulator per row: the mean squared gradient of the row (DLRM's RWSAdagrad)."""

    slots: ClassVar[dict[str, tuple[bool, str | float]]] = {"sum": (True, "initial_accumulator_value")}

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "eps": eps}
        super().__init__(params, {**defaults, "initial_accumulator_value": initial_accumulator_value})

    def _check_options(self, group: dict[str, Any]) -> None:
        super()._check_options(group)
        for name in ("initial_accumulator_value", "eps"):
            check_number(group[name], name, minimum=0)

    def native_rule(self, state: dict[str, torch.Tensor], group: dict, step: int) -> tuple[Rule, torch.Tensor] | None:
        return adagrad_rule(group["lr"], group["eps"], group["weight_decay"]), state["sum"]

    @staticmethod
    def update(w: torch.Tensor, s: dict, g: torch.Tensor, step: int, o: dict, sparse: bool) -> None:
        g = _decayed(w, g, o)
        total = s["sum"].add_(_row_mean_square(g))
        w.addcdiv_(g, total.sqrt().add_(o["eps"]).unsqueeze(1), value=-o["lr"])


class Adam(TableOptimizer):
    """Adam: ``torch.optim.Adam`` with dense gradients, ``torch.optim.SparseAdam`` with sparse ones."""

    slots: ClassVar[dict[str, tuple[bool, str | float]]] = {"exp_avg": (False, 0.0), "exp_avg_sq": (False, 0.0)}

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _check_options(self, group: dict[str, Any]) -> None:
        super()._check_options(group)
        _check_betas(group["betas"])
        check_number(group["eps"], "eps", minimum=0)

    @staticmethod
    def update(w: torch.Tensor, s: dict, g: torch.Tensor, step: int, o: dict, sparse: bool) -> None:
        g = _decayed(w, g, o)
        b1, b2 = _betas(o)
        m, v = s["exp_avg"].lerp_(g, 1 - b1), s["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        if sparse:  # SparseAdam's form of the same update
            w.addcdiv_(m, v.sqrt().add_(o["eps"]), value=-o["lr"] * math.sqrt(bc2) / bc1)
        else:
            w.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(o["eps"]), value=-o["lr"] / bc1)


class RowWiseAdam(Adam):
    """Adam with the first moment per element and the second per row (mean over the row)."""

    slots: ClassVar[dict[str, tuple[bool, str | float]]] = {"exp_avg": (False, 0.0), "exp_avg_sq": (True, 0.0)}

    def native_rule(self, state: dict[str, torch.Tensor], group: dict, step: int) -> tuple[Rule, torch.Tensor] | None:
        o = group
        rule = adam_rule(state["exp_avg"], o["lr"], _betas(o), o["eps"], o["weight_decay"], step)
        return None if rule is None else (rule, state["exp_avg_sq"])

    @staticmethod
    def update(w: torch.Tensor, s: dict, g: torch.Tensor, step: int, o: dict, sparse: bool) -> None:
        g = _decayed(w, g, o)
        b1, b2 = _betas(o)
        m = s["exp_avg"].lerp_(g, 1 - b1)
        v = s["exp_avg_sq"].mul_(b2).add_(_row_mean_square(g), alpha=1 - b2)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        denom = v.sqrt().div_(math.sqrt(bc2)).add_(o["eps"]).unsqueeze(1)
        w.addcdiv_(m, denom, value=-o["lr"] / bc1)


def _check_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ShardvarValueError(f"betas must be a pair of numbers in [0, 1); got {betas!r}")
    for b in betas:
        check_number(b, "beta", minimum=0)
        if b >= 1:
            raise ShardvarValueError(f"betas must be in [0, 1); got {betas!r}")
