"""ShardedEmbedding and ShardedEmbeddingBag: drop-ins for nn.Embedding and nn.EmbeddingBag.

Both keep their table in a :class:`ShardStore` and look it up with ``F.embedding`` /
``F.embedding_bag`` semantics through ``variables.functional``; the distributed modules are these
same classes over a store whose other shards live on other ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ShardvarTypeError, ShardvarValueError
from .._pages import empty
from .._validate import check_bool, check_choice, check_int, check_number
from ..layout import Layout
from ..variables import ShardedVariable, ShardStore, functional, to_layout
from ._state_dict import FORMS, check_not_assign, load_logical, save_logical

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag"]


def _initial_weight(
    shape: tuple[int, int], weight: torch.Tensor | None, device: Any, dtype: torch.dtype | None
) -> torch.Tensor:
    if weight is None:
        out = empty(shape, device=device, dtype=dtype)
        nn.init.normal_(out)  # drawn once for the whole table: values never depend on the layout
        return out
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ShardvarValueError(f"_weight has shape {got}; expected {list(shape)}")
    return weight.detach().to(device=device or weight.device, dtype=dtype or weight.dtype)


class _ShardedTable(nn.Module):
    """The shards of one ``[num_embeddings, embedding_dim]`` table, as nn.Parameters ``shard_<i>``.

    The concrete modules also subclass ``nn.Embedding`` / ``nn.EmbeddingBag`` (without their
    full-size ``weight``), so code that checks for an embedding (DDP's sparse gradients, model
    initialisers that fill ``module.weight.data``) treats them as one.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        partitioner: Any = 1,
        partition_strategy: str = "div",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        devices: list[torch.device | str] | None = None,
        *,
        _store: ShardStore | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would allocate the whole table
        self.num_embeddings = check_int(num_embeddings, "num_embeddings", minimum=0)
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", minimum=0)
        shape = (self.num_embeddings, self.embedding_dim)
        self.layout: Layout = (
            _store.layout
            if _store is not None
            else to_layout(partitioner, shape, dtype or torch.float32, partition_strategy)
        )
        if self.layout.axis != 0:
            raise ShardvarValueError(f"an embedding table is split by rows (axis 0); got {self.layout}")
        self.padding_idx = functional.check_padding_idx(padding_idx, self.num_embeddings)
        self.max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)
        self.norm_type = check_number(norm_type, "norm_type")
        self.scale_grad_by_freq = check_bool(scale_grad_by_freq, "scale_grad_by_freq")
        self.sparse = check_bool(sparse, "sparse")
        if _store is None:
            weight = _initial_weight(shape, _weight, device, dtype)
            if self.padding_idx is not None and _weight is None:
                weight[self.padding_idx].zero_()
            _store = ShardStore.allocate(
                self.layout, shape, weight.dtype, devices=devices, values=weight, requires_grad=True
            )
        for p in _store.local_shards().values():
            p.requires_grad_(not check_bool(_freeze, "freeze"))
        self._store = _store
        for s, p in _store.local_shards().items():
            self.register_parameter(f"shard_{s}", p)
        self._register_state_dict_hook(_logical_state_dict)
        self._register_load_state_dict_pre_hook(_load_logical_weight, with_module=True)

    # "logical": state_dict() holds ``weight``, the whole table, as nn.Embedding's does; "sharded":
    # one entry per shard (``shard_<i>``), for tables too large to materialise. load_state_dict
    # accepts either form whatever this is set to.
    state_dict_form: str = "logical"

    def set_state_dict_form(self, form: str) -> None:
        """``"logical"`` (default: key ``weight``, as nn.Embedding) or ``"sharded"`` (keys ``shard_<i>``)."""
        self.state_dict_form = check_choice(form, "form", FORMS)

    def _shard_params(self) -> dict[int, torch.Tensor]:
        return {int(name[6:]): p for name, p in self._parameters.items() if name.startswith("shard_")}

    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        """This module's shard parameters, in shard order (for a distributed module: this rank's)."""
        return tuple(p for _, p in sorted(self._shard_params().items()))

    @property
    def store(self) -> ShardStore:
        """The store over this module's shard parameters (rebuilt if they were replaced or moved)."""
        registered = self._parameters
        if self.__dict__.get("_registered_store") is not self._store:
            self._registered = [(f"shard_{s}", t) for s, t in self._store.local_shards().items()]
            self._registered_store = self._store
        if any(registered.get(name) is not t for name, t in self._registered):
            exchange = self._store.exchange  # a shard Parameter was replaced: rebuild over the new ones
            self._store = ShardStore(self.layout, self._store.shape, self._shard_params())
            self._store.exchange = exchange
        return self._store.refresh()

    @property
    def weight(self) -> ShardedVariable:
        """The table as one ShardedVariable over this module's shard parameters."""
        return ShardedVariable.from_store(self.store, name="weight")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight" and "_store" in self.__dict__:
            self._set_weight(value)
            return
        super().__setattr__(name, value)

    def _set_weight(self, value: Any) -> None:
        """``module.weight = v``: tie to another ShardedVariable's shards (same layout), else refuse."""
        store = getattr(value, "store", None)
        if (
            isinstance(store, ShardStore)
            and store.layout == self.layout
            and tuple(store.shape) == tuple(self._store.shape)
        ):
            for s, p in store.local_shards().items():
                if not isinstance(p, nn.Parameter):
                    raise ShardvarTypeError(f"shard {s} of the assigned variable is not an nn.Parameter")
                self.register_parameter(f"shard_{s}", p)  # the same Parameters: tied
            return
        raise ShardvarTypeError(
            f"cannot replace the sharded weight of {type(self).__name__} with {type(value).__name__}: use "
            "module.weight.data = tensor to copy values in, or assign a ShardedVariable of the same layout to tie"
        )

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            self.weight[self.padding_idx] = 0

    def sharded_variables(self) -> dict[str, ShardedVariable]:
        """The module's sharded parameters by local name (checkpoints store each as one variable)."""
        return {"weight": self.weight}

    def reset_parameters(self) -> None:
        weight = empty((self.num_embeddings, self.embedding_dim), dtype=self.store.dtype)
        nn.init.normal_(weight)
        if self.padding_idx is not None:
            weight[self.padding_idx].zero_()
        self.weight.assign(weight)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, layout={self.layout}"
        for name in ("padding_idx", "max_norm"):
            if getattr(self, name) is not None:
                s += f", {name}={getattr(self, name)}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.sparse:
            s += ", sparse=True"
        return s

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, **kwargs: Any):
        """Build from an existing ``[num_embeddings, embedding_dim]`` weight (copied into shards).

        With ``freeze=True`` (the default, as nn.Embedding's) the shards do not require grad.
        """
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            got = list(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
            raise ShardvarValueError(f"embeddings must be a 2-D tensor; got {got}")
        return cls(*embeddings.shape, _weight=embeddings, _freeze=freeze, **kwargs)


def _logical_state_dict(module: _ShardedTable, state: dict, prefix: str, local_metadata: dict) -> None:
    if module.state_dict_form == "logical":
        save_logical(state, prefix, "weight", module.weight, [f"shard_{s}" for s in module._shard_params()])


def _load_logical_weight(
    module: _ShardedTable,
    state: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    """Load ``weight`` (the whole table) by splitting it into the ``shard_<i>`` entries the shards load."""
    check_not_assign(local_metadata, prefix, "weight")  # new Parameters would untie every other user
    shard_keys = {s: f"shard_{s}" for s in module._shard_params()}
    load_logical(state, prefix, "weight", module.weight, shard_keys, missing_keys, error_msgs)


class ShardedEmbedding(_ShardedTable, nn.Embedding):
    """``nn.Embedding`` whose table is split into shards by a partitioner, config or shard count.

    >>> torch.manual_seed(0) and None
    >>> emb = ShardedEmbedding(10, 3, partitioner=4, partition_strategy="mod")
    >>> emb(torch.tensor([[1, 9]])).shape
    torch.Size([1, 2, 3])
    >>> [tuple(p.shape) for p in emb.parameters()]
    [(3, 3), (3, 3), (2, 3), (2, 3)]
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return functional.embedding(
            self.store,
            input,
            padding_idx=self.padding_idx,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            scale_grad_by_freq=self.scale_grad_by_freq,
            sparse=self.sparse,
        )


class ShardedEmbeddingBag(_ShardedTable, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` (modes sum, mean, max) over a sharded table."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        partitioner: Any = 1,
        partition_strategy: str = "div",
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        **kwargs: Any,
    ) -> None:
        self_mode = check_choice(mode, "mode", functional.BAG_MODES)
        super().__init__(
            num_embeddings,
            embedding_dim,
            partitioner,
            partition_strategy,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=_weight,
            **kwargs,
        )
        self.mode, self.include_last_offset = self_mode, check_bool(include_last_offset, "include_last_offset")

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return functional.embedding_bag(
            self.store,
            input,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            padding_idx=self.padding_idx,
            include_last_offset=self.include_last_offset,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            scale_grad_by_freq=self.scale_grad_by_freq,
            sparse=self.sparse,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
