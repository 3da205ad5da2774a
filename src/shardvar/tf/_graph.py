"""Names in an object-based checkpoint, from its ``_CHECKPOINTABLE_OBJECT_GRAPH``.

``tf.train.Checkpoint`` stores a ``TrackableObjectGraph`` (tensorflow/core/protobuf/
trackable_object_graph.proto) as a string tensor: node 0 is the root, children are named edges,
a node's attributes name the checkpoint keys of its tensors, and an optimizer node lists its
slot variables as (variable node, slot name, slot node). The short name of a key is the path of
edges to its node (``model/emb`` for ``model/emb/.ATTRIBUTES/VARIABLE_VALUE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._errors import CheckpointError
from ._proto import TrackableObjectGraph

__all__ = ["GRAPH_KEY", "ObjectGraph", "Slot"]

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass(frozen=True)
class Slot:
    """An optimizer slot variable: its key, the key of the variable it belongs to, the slot's name."""

    key: str
    variable: str
    optimizer: str
    name: str


@dataclass
class ObjectGraph:
    short_names: dict[str, str] = field(default_factory=dict)  # short name -> checkpoint key
    slots: list[Slot] = field(default_factory=list)

    @classmethod
    def parse(cls, data: bytes, where: str) -> ObjectGraph:
        try:
            graph = TrackableObjectGraph.FromString(data)
        except Exception as e:  # protobuf's DecodeError, or RuntimeError on absurd nesting
            raise CheckpointError(f"{where}: {GRAPH_KEY} is not a valid TrackableObjectGraph: {e}") from None
        nodes = graph.nodes
        paths = {0: ""} if nodes else {}
        frontier = [0] if nodes else []
        while frontier:  # breadth first: each node is named by its shortest path, as TensorFlow names it
            nxt = []
            for n in frontier:
                for child in nodes[n].children:
                    if 0 <= child.node_id < len(nodes) and child.node_id not in paths:
                        paths[child.node_id] = f"{paths[n]}/{child.local_name}".lstrip("/")
                        nxt.append(child.node_id)
            frontier = nxt
        out = cls()
        value_key = {}  # slot variables are no one's children: every node counts here
        for n, node in enumerate(nodes):
            for attribute in node.attributes:
                if attribute.name == "VARIABLE_VALUE":
                    value_key[n] = attribute.checkpoint_key
                    if n in paths:
                        out.short_names.setdefault(paths[n], attribute.checkpoint_key)
        for n, path in paths.items():
            for ref in nodes[n].slot_variables:
                var, slot = value_key.get(ref.original_variable_node_id), value_key.get(ref.slot_variable_node_id)
                if var is not None and slot is not None:
                    out.slots.append(Slot(slot, var, path, ref.slot_name))
        return out


def short_name(key: str) -> str:
    """``model/emb`` for ``model/emb/.ATTRIBUTES/VARIABLE_VALUE``; other keys unchanged."""
    return key.removesuffix(VALUE_SUFFIX)


def saver_slots(keys: list[str]) -> list[Slot]:
    """A TF1 Saver checkpoint's slots, by their names: ``<variable>/<Optimizer>[_1]`` (no graph records them)."""
    known = set(keys)
    found = []
    for key in keys:
        variable, _, slot = key.rpartition("/")
        if variable in known and slot.split("_")[0] in _V1_OPTIMIZERS:
            found.append(Slot(key, variable, slot.split("_")[0], slot))
    return found


# tf.compat.v1.train optimizers' default names, whose slots are named after them
_V1_OPTIMIZERS = {"Adam", "Adagrad", "Momentum", "RMSProp", "Ftrl", "Adadelta", "ProximalAdagrad", "LazyAdam"}
