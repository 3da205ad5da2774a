"""The protobuf messages of a TensorFlow checkpoint, built from their .proto definitions at import.

Transcribed field by field from TensorFlow's ``core/protobuf/tensor_bundle.proto``,
``core/framework/tensor_slice.proto``, ``tensor_shape.proto``, ``versions.proto`` and
``core/protobuf/trackable_object_graph.proto``: only the fields shardvar reads (a parser keeps
the others as unknown fields). Building the descriptors here rather than shipping generated
``_pb2`` modules keeps them working with any protobuf runtime >= 4 (generated code pins one).
Enums (``DataType``, ``Endianness``) are read as their int32 wire value.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["BundleEntryProto", "BundleHeaderProto", "TrackableObjectGraph"]

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {"int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "fixed32": _F.TYPE_FIXED32, "string": _F.TYPE_STRING}
_PACKAGE = "shardvar.tf"

# message -> [(field name, number, type or message name, repeated)]
_MESSAGES: dict[str, list[tuple[str, int, str, bool]]] = {
    "VersionDef": [("producer", 1, "int32", False), ("min_consumer", 2, "int32", False)],
    "BundleHeaderProto": [
        ("num_shards", 1, "int32", False),
        ("endianness", 2, "int32", False),  # LITTLE = 0, BIG = 1
        ("version", 3, "VersionDef", False),
    ],
    "Dim": [("size", 1, "int64", False), ("name", 2, "string", False)],
    "TensorShapeProto": [("dim", 2, "Dim", True), ("unknown_rank", 3, "int32", False)],
    "Extent": [("start", 1, "int64", False), ("length", 2, "int64", False)],  # no length: the whole axis
    "TensorSliceProto": [("extent", 1, "Extent", True)],
    "BundleEntryProto": [
        ("dtype", 1, "int32", False),
        ("shape", 2, "TensorShapeProto", False),
        ("shard_id", 3, "int32", False),
        ("offset", 4, "int64", False),
        ("size", 5, "int64", False),
        ("crc32c", 6, "fixed32", False),
        ("slices", 7, "TensorSliceProto", True),
    ],
    "ObjectReference": [("node_id", 1, "int32", False), ("local_name", 2, "string", False)],
    "SerializedTensor": [("name", 1, "string", False), ("checkpoint_key", 3, "string", False)],
    "SlotVariableReference": [
        ("original_variable_node_id", 1, "int32", False),
        ("slot_name", 2, "string", False),
        ("slot_variable_node_id", 3, "int32", False),
    ],
    "TrackableObject": [
        ("children", 1, "ObjectReference", True),
        ("attributes", 2, "SerializedTensor", True),
        ("slot_variables", 3, "SlotVariableReference", True),
    ],
    "TrackableObjectGraph": [("nodes", 1, "TrackableObject", True)],
}
_PRESENCE = {("Extent", "length")}  # a oneof in TensorFlow's proto3: absent and 0 differ


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="shardvar_tf_checkpoint.proto", package=_PACKAGE, syntax="proto3")
    for message, fields in _MESSAGES.items():
        m = f.message_type.add(name=message)
        for name, number, kind, repeated in fields:
            field = m.field.add(name=name, number=number, json_name=name)
            field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            if kind in _TYPES:
                field.type = _TYPES[kind]
            else:
                field.type, field.type_name = _F.TYPE_MESSAGE, f".{_PACKAGE}.{kind}"
            if (message, name) in _PRESENCE:
                field.proto3_optional = True
                field.oneof_index = len(m.oneof_decl)
                m.oneof_decl.add(name=f"_{name}")
    return f


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def _message(name: str) -> type:
    descriptor = _POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22; older ones have only the factory
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(_POOL).GetPrototype(descriptor)


BundleHeaderProto = _message("BundleHeaderProto")
BundleEntryProto = _message("BundleEntryProto")
TrackableObjectGraph = _message("TrackableObjectGraph")
