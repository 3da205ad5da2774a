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
from .._validate import check_bool, check_choice, check_device, check_int
from ..layout import Layout
from ..variables import ShardedVariable, ShardStore, functional, to_layout
from ._state_dict import FORMS, check_not_assign, load_logical, reorder, save_logical

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


class ShardedLinear(nn.Linear):
    """``nn.Linear`` whose weight is split into shards by output features.

    ``weight=`` a ShardedVariable of shape ``[out_features, in_features]`` split along axis 0
    shares its shard Parameters (a tied output projection); else the shards are new.

    >>> torch.manual_seed(0) and None
    >>> fc = ShardedLinear(4, 10, partitioner=3, partition_strategy="mod")
    >>> fc(torch.ones(2, 4)).shape, list(fc.state_dict())
    (torch.Size([2, 10]), ['weight', 'bias'])
    """

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
        for s, p in store.local_shards().items():
            if not isinstance(p, nn.Parameter):
                raise ShardvarTypeError(f"shard {s} of the weight is not an nn.Parameter")
            self.register_parameter(f"shard_{s}", p)
        self._store = store
        if isinstance(bias, nn.Parameter):
            self.bias = bias  # an existing bias, kept as the same Parameter (ties survive)
        elif check_bool(bias, "bias"):
            first = store.groups[0].device if store.groups else device
            self.bias = nn.Parameter(_initial_bias(*shape, first, store.dtype))
        else:
            self.register_parameter("bias", None)
        self._register_state_dict_hook(_save_hook)
        self._register_load_state_dict_pre_hook(_load_hook, with_module=True)

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

    # -- the weight ---------------------------------------------------------------------------
    state_dict_form: str = "logical"

    def set_state_dict_form(self, form: str) -> None:
        """``"logical"`` (default: key ``weight``, as nn.Linear) or ``"sharded"`` (keys ``shard_<i>``)."""
        self.state_dict_form = check_choice(form, "form", FORMS)

    @property
    def layout(self) -> Layout:
        return self._store.layout

    @property
    def store(self) -> ShardStore:
        """The store over this module's shard parameters (rebuilt if they were replaced or moved)."""
        shards = {int(n[6:]): p for n, p in self._parameters.items() if n.startswith("shard_")}
        if any(self._store.local_shards().get(s) is not p for s, p in shards.items()):
            self._store = ShardStore(self._store.layout, self._store.shape, shards)
        return self._store.refresh()

    @property
    def weight(self) -> ShardedVariable:
        """The weight as one ShardedVariable over this module's shard parameters."""
        return ShardedVariable.from_store(self.store, name="weight")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight" and "_store" in self.__dict__:
            self._tie(value)
            return
        super().__setattr__(name, value)

    def _tie(self, value: Any) -> None:
        """``module.weight = v``: share another ShardedVariable's shards (same layout and shape), else refuse."""
        store = getattr(value, "store", None)
        if not (isinstance(store, ShardStore) and store.layout == self.layout and store.shape == self._store.shape):
            raise ShardvarTypeError(
                f"cannot replace the sharded weight of ShardedLinear with {type(value).__name__}: assign a "
                "ShardedVariable of the same layout and shape to tie, or module.weight.assign(tensor) to copy values"
            )
        shards = store.local_shards()
        bad = [s for s, p in shards.items() if not isinstance(p, nn.Parameter)]
        if bad:
            raise ShardvarTypeError(f"shard {bad[0]} of the assigned variable is not an nn.Parameter")
        for s, p in shards.items():
            self.register_parameter(f"shard_{s}", p)
        self._store = store

    def sharded_variables(self) -> dict[str, ShardedVariable]:
        """The sharded weight by local name (checkpoints store it as one logical variable)."""
        return {"weight": self.weight}

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


def _shard_keys(module: ShardedLinear) -> dict[int, str]:
    return {s: f"shard_{s}" for s in module._store.local_shards()}


def _save_hook(module: ShardedLinear, state: dict, prefix: str, local_metadata: dict) -> None:
    if module.state_dict_form != "logical":
        return
    save_logical(state, prefix, "weight", module.weight, list(_shard_keys(module).values()))
    reorder(state, prefix, ["weight", "bias"])


def _load_hook(
    module: ShardedLinear,
    state: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    check_not_assign(local_metadata, prefix, "weight")
    load_logical(state, prefix, "weight", module.weight, _shard_keys(module), missing_keys, error_msgs)
