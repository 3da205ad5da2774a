"""Which TensorFlow optimizer slots become which ``torch.optim`` state, and the step count.

One table: TensorFlow's slot names (Keras 2 optimizers' ``m``/``v``/``accumulator``/``momentum``;
``tf.compat.v1.train`` optimizers name slots after themselves: ``Adam``, ``Adam_1``, ``Adagrad``,
``Momentum``) to the state keys the torch optimizer keeps per parameter. The update rules agree
(Adam's moments, Adagrad's sum of squared gradients, the heavy-ball momentum buffer with
``dampening=0``); what differs is not state: TensorFlow's epsilon placement in Adam, and v1
Adam's ``beta1_power``/``beta2_power``, which torch derives from ``step``. Other optimizers (Ftrl,
RMSProp, Adadelta, LazyAdam's sparse updates aside) have no torch state of the same meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import CheckpointError

__all__ = ["OPTIMIZERS", "TorchOptimizer", "optimizer_spec"]


@dataclass(frozen=True)
class TorchOptimizer:
    cls: type[torch.optim.Optimizer]
    states: dict[str, str]  # TensorFlow slot name -> torch state key
    counts_steps: bool  # whether the torch state has a ``step``

    @property
    def class_name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


OPTIMIZERS = {
    "adam": TorchOptimizer(
        torch.optim.Adam, {"m": "exp_avg", "v": "exp_avg_sq", "Adam": "exp_avg", "Adam_1": "exp_avg_sq"}, True
    ),
    "adagrad": TorchOptimizer(torch.optim.Adagrad, {"accumulator": "sum", "Adagrad": "sum"}, True),
    "momentum": TorchOptimizer(torch.optim.SGD, {"momentum": "momentum_buffer", "Momentum": "momentum_buffer"}, False),
}

# Where a checkpoint keeps the number of steps taken: Keras 2 optimizers' ``iter``, then TF1's global step.
STEP_NAMES = ("{optimizer}/iter", "global_step")


def optimizer_spec(name: str) -> TorchOptimizer:
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise CheckpointError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}")
    return OPTIMIZERS[name.lower()]
