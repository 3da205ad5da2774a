"""ShardedLinear: ``nn.Linear`` with its weight split by output features (vocabulary-parallel).

The ``[out_features, in_features]`` weight lives in a :class:`ShardStore` split along axis 0, so
an output projection can share its shards with an embedding table (GPT-2's ``lm_head`` and
``wte``). With one slab the forward is one ``F.linear`` over it; otherwise each shard computes its
slice of the output and the layout (along the output's last axis) joins the slices: the whole
weight is never materialised.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_bool, check_device, check_int
from ..layout import Layout
from ..variables import ShardedVariable, ShardStore, functional, to_layout
from ._sharded_weight import ShardedWeight

__all__ = ["ShardedLinear"]


def _initial_weight(out_features: int, in_features: int, device: Any, dtype: Any) -> torch.Tensor:
    device = None if device is None else check_device(device)  # a bad device: shardvar's error, not torch's
    # Drawn exactly as nn.Linear.reset_parameters draws it, for the whole weight at once, so the
    # values (and the random stream after them) never depend on the layout.
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


def _initial_bias(out_features: int, in_features: int, device: Any, dtype: Any) -> torch.Tensor:
    device = None if device is None else check_device(device)  # a bad device: shardvar's error, not torch's
    bias = torch.empty(out_features, device=device, dtype=dtype)
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    nn.init.uniform_(bias, -bound, bound)
    return bias


class ShardedLinear(ShardedWeight, nn.Linear):
    """``nn.Linear`` whose weight is split into shards by output features.

    ``weight=`` a ShardedVariable of shape ``[out_features, in_features]`` split along axis 0
    shares its shard Parameters (a tied output projection); else the shards are new.

    >>> torch.manual_seed(0) and None
    >>> fc = ShardedLinear(4, 10, partitioner=3, partition_strategy="mod")
    >>> fc(torch.ones(2, 4)).shape, list(fc.state_dict())
    (torch.Size([2, 10]), ['weight', 'bias'])
    """

    # nn.Linear's signature plus the layout's arguments, alike in shape to the embedding tables'
    # (each a drop-in for its torch module); the weight's rules are ShardedWeight's.
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool | nn.Parameter = True,
        partitioner: Any = 1,
        partition_strategy: str = "div",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        devices: list[torch.device | str] | None = None,
        *,
        weight: ShardedVariable | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the whole weight
        self.in_features = check_int(in_features, "in_features", minimum=0)
        self.out_features = check_int(out_features, "out_features", minimum=0)
        shape = (self.out_features, self.in_features)
        store = weight.store if isinstance(weight, ShardedVariable) else None
        if weight is not None and store is None:
            raise ShardvarTypeError(f"weight must be a ShardedVariable; got {type(weight).__name__}")
        if store is None:
            layout = to_layout(partitioner, shape, dtype or torch.float32, partition_strategy)
            initial = _initial_weight(*shape, device, dtype)
            store = ShardStore.allocate(
                layout, shape, initial.dtype, devices=devices, values=initial, requires_grad=True
            )
        if store.layout.axis != 0 or tuple(store.shape) != shape or not store.is_complete:
            raise ShardvarValueError(
                f"ShardedLinear's weight is split by output features (axis 0) with shape {list(shape)}, all shards "
                f"local; got shape {list(store.shape)}, layout {store.layout}"
            )
        self._adopt(store)
        if isinstance(bias, nn.Parameter):
            self.bias = bias  # an existing bias, kept as the same Parameter (ties survive)
        elif check_bool(bias, "bias"):
            first = store.groups[0].device if store.groups else device
            self.bias = nn.Parameter(_initial_bias(*shape, first, store.dtype))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, partitioner: Any = 1, partition_strategy: str = "div", devices: list | None = None
    ) -> ShardedLinear:
        """The Linear's weight copied into shards; its bias kept as the same Parameter object."""
        if not isinstance(linear, nn.Linear):
            raise ShardvarTypeError(f"from_linear expects an nn.Linear; got {type(linear).__name__}")
        shape = tuple(linear.weight.shape)
        layout = to_layout(partitioner, shape, linear.weight.dtype, partition_strategy)
        store = ShardStore.allocate(
            layout, shape, linear.weight.dtype, devices=devices, values=linear.weight.detach(), requires_grad=True
        )
        for p in store.local_shards().values():
            p.requires_grad_(linear.weight.requires_grad)
        bias = linear.bias if linear.bias is not None else False
        return cls(linear.in_features, linear.out_features, bias, weight=ShardedVariable.from_store(store))

    _state_order = ("weight", "bias")  # nn.Linear's

    @property
    def layout(self) -> Layout:
        return self._store.layout

    def reset_parameters(self) -> None:
        self.weight.assign(_initial_weight(self.out_features, self.in_features, None, self.store.dtype))
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(_initial_bias(self.out_features, self.in_features, None, self.bias.dtype))

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        store = self.store
        if store.full_slab is not None:
            weight = functional.slab_weight(store)
            if store.logical_slab:
                return F.linear(input, weight, self.bias)
            # Mod shards one after another: the slab's rows are in storage order. One matmul, the bias
            # permuted into that order, then one gather puts the outputs in logical order.
            rows = store.slab_rows(torch.arange(self.out_features, device=weight.device))
            order = torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))
            bias = None if self.bias is None else self.bias.index_select(0, order.to(self.bias.device))
            return F.linear(input, weight, bias).index_select(-1, rows.to(input.device))
        # Several slabs or devices: each shard yields its slice of the outputs, joined along the last axis.
        shards = list(store.local_shards().values())
        biases = [None] * len(shards) if self.bias is None else self.layout.split(self.bias)
        parts = [
            F.linear(input.to(w.device), w, None if b is None else b.to(w.device))
            for w, b in zip(shards, biases, strict=True)
        ]
        by_output = Layout(self.layout.strategy, self.layout.sizes, input.dim() - 1 if input.dim() else 0)
        return by_output.join([p.to(input.device) for p in parts])

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, layout={self.layout}"
