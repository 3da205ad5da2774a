"""What every module with a sharded ``weight`` has: ``shard_<i>`` Parameters over one store.

ShardedEmbedding(Bag) and ShardedLinear (and through them the distributed modules) keep their
weight here, so the rules they share live once: the store is rebuilt when a shard Parameter is
replaced, ``weight`` is a ShardedVariable over the shards, assigning a ShardedVariable of the
same layout ties the module to its shards, and the state_dict holds ``weight`` whole (or per
shard, opt-in).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._deprecation import deprecated_property
from .._errors import ShardvarTypeError
from .._validate import check_choice
from ..layout import Layout
from ..variables import ShardedVariable, ShardStore
from ._state_dict import FORMS, register_logical_hooks

__all__ = ["ShardedWeight"]


class ShardedWeight:
    """Mixin of the modules whose ``weight`` is a ShardedVariable over their ``shard_<i>`` Parameters.

    Not an ``nn.Module`` itself: each concrete module is the torch module it replaces
    (``nn.Embedding``, ``nn.Linear``, ...) plus this, so a sharded module is one Module level below
    ``nn.Module``, not a chain of them (tests/test_architecture.py keeps chains at most three deep).
    """

    layout: Layout
    _store: ShardStore
    # "logical": state_dict() holds ``weight``, the whole tensor, as the unsharded module's does;
    # "sharded": one entry per shard (``shard_<i>``), for tables too large to materialise.
    # load_state_dict accepts either form whatever this is set to.
    state_dict_form: str = "logical"
    _state_order: Sequence[str] | None = None  # the unsharded module's key order, where it has several

    def _adopt(self, store: ShardStore) -> None:
        """Register ``store``'s shards as this module's Parameters (validated before any is registered)."""
        shards = store.local_shards()
        bad = [s for s, p in shards.items() if not isinstance(p, nn.Parameter)]
        if bad:
            raise ShardvarTypeError(f"shard {bad[0]} of the weight is not an nn.Parameter")
        for s, p in shards.items():
            self.register_parameter(f"shard_{s}", p)  # the same Parameters: tied to every other user
        self._store = store
        if not getattr(self, "_hooked", False):
            register_logical_hooks(self, _weight_state)
            self._hooked = True

    def set_state_dict_form(self, form: str) -> None:
        """``"logical"`` (default: key ``weight``, as the unsharded module) or ``"sharded"`` (keys ``shard_<i>``)."""
        self.state_dict_form = check_choice(form, "form", FORMS)

    def _shard_params(self) -> dict[int, torch.Tensor]:
        return {int(name[6:]): p for name, p in self._parameters.items() if name.startswith("shard_")}

    # ``module.weight.variables``: this module's shard Parameters in shard order (a distributed
    # module's: this rank's); ``.shards`` was a second spelling of them.
    shards = deprecated_property("shards", "module.weight.variables", lambda m: tuple(m.weight.variables))

    @property
    def store(self) -> ShardStore:
        """The store over this module's shard parameters (rebuilt if they were replaced or moved)."""
        if self.__dict__.get("_registered_store") is not self._store:
            shards = self._store.local_shards()
            self._registered = ([f"shard_{s}" for s in shards], list(shards.values()))
            self._registered_store = self._store
        names, tensors = self._registered
        # Every shard Parameter still the store's (C-level loops: this runs on every forward).
        if not all(map(operator.is_, map(self._parameters.get, names), tensors)):
            self._store = self._store.with_shards(self._shard_params())  # a shard Parameter was replaced
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
        if not (
            isinstance(store, ShardStore)
            and store.layout == self.layout
            and tuple(store.shape) == tuple(self._store.shape)
        ):
            raise ShardvarTypeError(
                f"cannot replace the sharded weight of {type(self).__name__} with {type(value).__name__}: assign a "
                "ShardedVariable of the same layout and shape to tie, or copy values in with "
                "module.weight.assign(tensor) (or module.weight.data = tensor)"
            )
        self._adopt(store)

    def sharded_variables(self) -> dict[str, ShardedVariable]:
        """The sharded weight by local name (checkpoints store it as one logical variable)."""
        return {"weight": self.weight}


def _weight_state(module: ShardedWeight) -> tuple[str, Sequence[str] | None, dict]:
    keys = {s: f"shard_{s}" for s in module._shard_params()}
    return module.state_dict_form, module._state_order, {"weight": (module.weight, keys)}
