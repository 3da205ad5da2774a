"""Bag modes have one definition (``_validate.BAG_MODES``): every bag of every family takes each of them, pools
as torch does, and refuses any other with the same message."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import shardvar
from shardvar import DynamicEmbeddingBag, EmbeddingBagCollection, ShardedEmbeddingBag, ShardvarValueError, TableConfig
from shardvar._validate import BAG_MODES

IDS, OFFSETS = torch.tensor([1, 4, 4, 0, 7, 2]), torch.tensor([0, 2, 2, 5])


def _bag(mode: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    bag = ShardedEmbeddingBag(8, 3, partitioner=3, mode=mode)
    return lambda: bag(IDS, OFFSETS), bag.weight.to_tensor().detach()


def _functional(mode: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    table = torch.randn(8, 3)
    shards = list(table.split([3, 3, 2]))
    return lambda: shardvar.embedding_bag(shards, IDS, OFFSETS, mode=mode, partition_strategy="div"), table


def _collection(mode: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    ebc = EmbeddingBagCollection({"t": TableConfig(8, 3, 2, mode=mode)})
    return lambda: ebc({"t": IDS}, {"t": OFFSETS})["t"], ebc.embedding_bags["t"].weight.to_tensor().detach()


def _quantized(mode: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    quantized = shardvar.quantize(ShardedEmbeddingBag(8, 3, partitioner=2, mode="sum"), torch.float16)
    quantized.mode = mode  # the packed lookup checks the mode it is given
    return lambda: quantized(IDS, OFFSETS), quantized.dequantize()


def _dynamic(mode: str) -> tuple[Callable[[], torch.Tensor], None]:
    dyn = DynamicEmbeddingBag(3, 16, mode=mode)
    return lambda: dyn(IDS, OFFSETS), None


FAMILIES = {"module": _bag, "functional": _functional, "collection": _collection, "quantized": _quantized}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", BAG_MODES)
def test_every_bag_pools_every_mode_as_torch(family: str, mode: str) -> None:
    call, table = FAMILIES[family](mode)
    out = call()
    if table is not None:
        expected = F.embedding_bag(IDS, table, OFFSETS, mode=mode)
        torch.testing.assert_close(out, expected.to(out.dtype))


@pytest.mark.parametrize("family", sorted([*FAMILIES, "dynamic"]))
@pytest.mark.parametrize("bad", ["median", "Sum", 0, None])
def test_every_bag_refuses_another_mode_alike(family: str, bad: object) -> None:
    make = {**FAMILIES, "dynamic": _dynamic}[family]
    with pytest.raises(ShardvarValueError, match=rf"mode must be one of \['sum', 'mean', 'max'\]; got {bad!r}"):
        call, _ = make(bad)  # a module refuses it when built; a lookup when called
        call()
