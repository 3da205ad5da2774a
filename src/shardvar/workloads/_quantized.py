"""A trained model served with its tables at int8 and int4 (``shardvar demo --quantize``).

Each table module of the model is replaced by ``shardvar.quantize(table, dtype)`` (same layout,
one kernel per table), the evaluation logloss is measured, and the float tables are put back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..quantized import quantize

__all__ = ["QUANTIZED", "logloss_of", "serve_quantized"]

QUANTIZED = (("int8 (quint8)", torch.quint8), ("int4 (quint4x2)", torch.quint4x2))


def _bytes(module: nn.Module) -> int:
    nbytes = getattr(module, "nbytes", None)
    return nbytes if nbytes is not None else sum(p.numel() * p.element_size() for p in module.parameters())


def serve_quantized(
    model: nn.Module, tables: list[str], logloss: Callable[[nn.Module], float]
) -> list[tuple[str, int, float]]:
    """(label, table bytes, logloss) for the float model and for its tables quantized to int8 and int4."""
    floats = {name: getattr(model, name) for name in tables}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = [("float32", sum(_bytes(m) for m in floats.values()), logloss(model))]
            for label, dtype in QUANTIZED:
                for name, table in floats.items():
                    setattr(model, name, quantize(table, dtype))
                out.append((label, sum(_bytes(getattr(model, n)) for n in tables), logloss(model)))
    finally:
        for name, table in floats.items():
            setattr(model, name, table)
        model.train(was_training)
    return out


def logloss_of(predict: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[nn.Module], float]:
    """The evaluation logloss of ``model`` given ``predict(model) -> (logits, labels)``."""
    return lambda model: float(nn.functional.binary_cross_entropy_with_logits(*predict(model)))
