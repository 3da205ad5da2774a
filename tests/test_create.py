"""create_partitioned_variables with every initializer convention: reference callables, PyTorch's, tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar

INITS = [nn.init.normal_, nn.init.uniform_, nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.kaiming_uniform_,
         nn.init.kaiming_normal_, nn.init.trunc_normal_, nn.init.orthogonal_, nn.init.zeros_, nn.init.ones_,
         nn.init.eye_]  # fmt: skip


@pytest.mark.parametrize("init", INITS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("slicing", [[3, 1], [1, 2]])
def test_pytorch_in_place_initializers_give_the_unsharded_values(init, slicing) -> None:
    torch.manual_seed(11)
    v = shardvar.create_partitioned_variables([7, 4], slicing, init)
    torch.manual_seed(11)
    want = init(torch.empty(7, 4))
    torch.testing.assert_close(v.to_tensor().detach(), want, atol=0, rtol=0)
    assert v.dtype == torch.float32 and v.requires_grad


def test_lambdas_of_either_convention() -> None:
    filled = shardvar.create_partitioned_variables([4, 2], [2, 1], lambda t: t.fill_(2.0))
    assert bool((filled.to_tensor() == 2).all())
    made = shardvar.create_partitioned_variables(
        [4, 2], [2, 1], lambda shape, dtype=None, partition_info=None: torch.ones(shape)
    )
    assert bool((made.to_tensor() == 1).all())


def test_callables_returning_nested_lists_and_tensor_dtypes() -> None:
    v = shardvar.create_partitioned_variables([2, 2], [2, 1], lambda shape, dtype: [[1, 2], [3, 4]])
    assert v.to_tensor().tolist() == [[1.0, 2.0], [3.0, 4.0]] and v.dtype == torch.float32
    half = shardvar.create_partitioned_variables([4, 2], [2, 1], torch.ones(4, 2, dtype=torch.float16))
    assert half.dtype == torch.float16  # an initializer tensor keeps its dtype when none is given


def test_integer_variables_work_and_are_not_trainable() -> None:
    ids = shardvar.create_partitioned_variables([6], [3], torch.arange(6))
    assert ids.dtype == torch.int64 and not ids.requires_grad and ids.to_tensor().tolist() == list(range(6))
    counts = shardvar.create_partitioned_variables([6, 2], [2, 1], 0, dtype=torch.int32)
    assert counts.dtype == torch.int32 and not counts.requires_grad
    with pytest.raises(
        shardvar.ShardvarTypeError, match=r"torch.int64 variable cannot be trainable; pass trainable=False"
    ):
        shardvar.create_partitioned_variables([6], [3], torch.arange(6), trainable=True)
    with pytest.raises(shardvar.ShardvarTypeError, match=r"dtype must be a torch\.dtype; got 'float32'"):
        shardvar.create_partitioned_variables([6], [3], 0.0, dtype="float32")


def test_partials_of_pytorch_initializers() -> None:
    import functools

    torch.manual_seed(2)
    v = shardvar.create_partitioned_variables([6, 3], [3, 1], functools.partial(nn.init.normal_, std=0.02))
    torch.manual_seed(2)
    torch.testing.assert_close(v.to_tensor().detach(), nn.init.normal_(torch.empty(6, 3), std=0.02), atol=0, rtol=0)
