"""Write the TensorFlow checkpoints the tests of ``shardvar.tf`` read, with TF's own values beside them.

Run by hand, in a separate environment (TensorFlow is no dependency of shardvar or its tests)::

    python -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install tensorflow-cpu==2.21.0 tf-keras==2.21.0
    /tmp/tfenv/bin/python tests/data/tf/make_checkpoints.py

Made with tensorflow-cpu 2.21.0 and tf-keras 2.21.0 (Keras 2's optimizers record their slots in
the object graph; Keras 3's do not). Each checkpoint directory gets ``expected.npz``: every
numeric variable as ``tf.train.load_variable`` reads it, keyed by its checkpoint name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.python.distribute.sharded_variable import ShardedVariable

HERE = Path(__file__).parent


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _init(seed: int, shape: tuple[int, int]) -> object:
    """Each partition gets its own slice of one array, so every row of a variable differs."""
    full = _values(shape, seed)

    def initializer(shape: list[int], dtype: object = None, partition_info: object = None) -> tf.Tensor:
        offset = partition_info.var_offset if partition_info is not None else [0] * len(shape)
        return tf.constant(full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])

    return initializer


def _expected(directory: Path) -> None:
    values = {}
    for name, _ in tf.train.list_variables(str(directory)):
        value = np.asarray(tf.train.load_variable(str(directory), name))
        if value.dtype.kind not in "OSU":
            values[name] = value
    np.savez(directory / "expected.npz", **values)


def saver_v1(directory: Path) -> None:
    """A TF1 Saver checkpoint of PartitionedVariables with Adam and Momentum slots, in 3 data shards."""
    graph = tf.Graph()
    with graph.as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        with tf.device("/cpu:0"):
            emb = tf.compat.v1.get_variable(
                "emb", [10, 4], initializer=_init(1, (10, 4)), partitioner=tf.compat.v1.fixed_size_partitioner(3)
            )
        with tf.device("/cpu:1"):
            big = tf.compat.v1.get_variable(
                "big",
                [13, 3],
                initializer=_init(2, (13, 3)),
                partitioner=tf.compat.v1.min_max_variable_partitioner(max_partitions=4, min_slice_size=32),
            )
            cols = tf.compat.v1.get_variable(
                "cols", [5, 6], initializer=_init(3, (5, 6)), partitioner=tf.compat.v1.fixed_size_partitioner(2, axis=1)
            )
        with tf.device("/cpu:2"):
            counts = tf.compat.v1.get_variable("counts", initializer=np.array([3, -7, 1 << 40], np.int64))
            half = tf.compat.v1.get_variable("half", initializer=_values((2, 3), 4).astype(np.float16))
        ids = tf.constant([0, 3, 9, 4])
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids) ** 2) + tf.reduce_sum(
            tf.nn.embedding_lookup(big, [1, 12]) ** 2
        )
        loss += tf.reduce_sum(tf.concat(list(cols), axis=1) ** 2)
        adam = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, var_list=[*emb, *big], global_step=step)
        momentum = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, var_list=list(cols))
        saver = tf.compat.v1.train.Saver(sharded=True)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 3})
        with tf.compat.v1.Session(config=config) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(tf.compat.v1.assign_add(counts, [1, 1, 1]))
            for _ in range(3):
                session.run([adam, momentum])
            saver.save(session, str(directory / "model.ckpt"), global_step=step, write_meta_graph=False)
    # The Saver records absolute paths; relative ones (as CheckpointManager writes) let the tree move.
    state = directory / "checkpoint"
    state.write_text(state.read_text().replace(f"{directory}/", ""))
    del half


class _Model(tf.Module):
    def __init__(self, tables: dict) -> None:
        super().__init__()
        for name, value in tables.items():
            setattr(self, name, value)


def checkpoint_v2(directory: Path, optimizer: tf_keras.optimizers.legacy.Optimizer) -> None:
    """A tf.train.Checkpoint with a ShardedVariable of uneven shards, dense variables and optimizer slots."""
    parts = [tf.Variable(_values((n, 4), 10 + i), name=f"emb/part_{i}") for i, n in enumerate([4, 3, 3])]
    emb = ShardedVariable(parts, name="emb")
    dense = tf.Variable(_values((3, 2), 20), name="dense")
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [0, 5, 9, 5]) ** 2) + tf.reduce_sum(dense**3)
        grads = tape.gradient(loss, [*parts, dense])
        optimizer.apply_gradients(zip(grads, [*parts, dense], strict=True))
    extra = {
        "counts": tf.Variable(np.array([[1, -2], [1 << 40, 5]], np.int64)),
        "half": tf.Variable(_values((3,), 21).astype(np.float16)),
    }
    checkpoint = tf.train.Checkpoint(model=_Model({"emb": emb, "dense": dense, **extra}), opt=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=1)
    manager.save()


def dtypes_v2(directory: Path) -> None:
    """One variable of every dtype a checkpoint stores, and a string variable (listed, refused as a tensor)."""
    rng = np.random.default_rng(5)
    tables = {
        "f64": tf.Variable(rng.standard_normal((2, 3))),
        "bf16": tf.Variable(tf.cast(_values((4,), 6), tf.bfloat16)),
        "flag": tf.Variable(np.array([True, False, True])),
        "text": tf.Variable(np.array([b"alpha", b"be"])),
    }
    for dtype in ("int8", "int16", "int32", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(dtype)
        tables[dtype] = tf.Variable(np.array([info.min, 0, 7, info.max], dtype))
    tf.train.Checkpoint(model=_Model(tables)).save(str(directory / "ckpt"))


def main() -> None:
    makers = {
        "saver_v1": saver_v1,
        "checkpoint_v2_adam": lambda d: checkpoint_v2(d, tf_keras.optimizers.legacy.Adam(0.05)),
        "checkpoint_v2_adagrad": lambda d: checkpoint_v2(d, tf_keras.optimizers.legacy.Adagrad(0.05)),
        "dtypes_v2": dtypes_v2,
    }
    for name, make in makers.items():
        directory = HERE / name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        make(directory)
        _expected(directory)
        print(name, sorted(p.name for p in directory.iterdir()))


if __name__ == "__main__":
    main()
