"""``list_variables`` and ``load_variable``, named and behaving as TensorFlow's ``tf.train`` ones."""

from __future__ import annotations

import os

import torch

from ._reader import TFCheckpoint

__all__ = ["list_variables", "load_variable"]


def list_variables(ckpt: str | os.PathLike) -> list[tuple[str, list[int]]]:
    """Every ``(name, shape)`` of TensorFlow checkpoint ``ckpt``, sorted by name, as ``tf.train.list_variables``.

    ``ckpt`` is a checkpoint prefix or a directory whose ``checkpoint`` state file names the latest.
    A variable saved as slices (a PartitionedVariable or ShardedVariable) appears once, whole.

    >>> from shardvar.tf import list_variables
    >>> list_variables("tests/data/tf/saver_v1")[:3]
    [('beta1_power', []), ('beta2_power', []), ('big', [13, 3])]
    """
    reader = TFCheckpoint(ckpt)
    return [(name, list(v.shape)) for name, v in sorted(reader.variables.items())]


def load_variable(ckpt: str | os.PathLike, name: str) -> torch.Tensor:
    """Variable ``name`` of checkpoint ``ckpt`` as one tensor (its slices joined, every crc32c checked).

    ``name`` is a checkpoint key or, in an object-based checkpoint, its short form (``model/emb``
    for ``model/emb/.ATTRIBUTES/VARIABLE_VALUE``). String variables are refused (CheckpointError).

    >>> from shardvar.tf import load_variable
    >>> load_variable("tests/data/tf/checkpoint_v2_adam", "model/emb").shape
    torch.Size([10, 4])
    """
    return TFCheckpoint(ckpt).load(name)
