"""Compute-supertask graph payloads (SPEC "Compute supertask payload (`data`)").

``decode_payload`` turns a supertask's ``data`` (base64 of torch.export
``Graph`` JSON plus the producer's ``metadata``) into a torch.fx GraphModule
without executing anything from the file; ``encode_payload`` writes the same
encoding for an aten-level graph.
"""
from fastpipe.payload.constants import bind_external, unbound_external
from fastpipe.payload.decode import decode_payload
from fastpipe.payload.decoded import DecodedGraph, TensorMeta
from fastpipe.payload.encode import encode_payload
from fastpipe.payload.fake import propagate_metas
from fastpipe.payload.targets import allow_namespace, disallow_namespace, allowed_namespaces
from fastpipe.payload.foreign_ops import ForeignOp, foreign_op_names, register_foreign_op, unregister_foreign_op
from fastpipe.payload import producer_ops as _producer_ops

_producer_ops.register()          # the producer's own ops (furiosa::sparse_select_v1_5, ...): built-in entries
from fastpipe.payload.torch21 import to_torch21

__all__ = [
    "ForeignOp", "foreign_op_names", "register_foreign_op", "unregister_foreign_op",
    "to_torch21",
    "DecodedGraph",
    "TensorMeta",
    "allow_namespace", "disallow_namespace",
    "allowed_namespaces",
    "bind_external",
    "decode_payload",
    "encode_payload",
    "propagate_metas",
    "unbound_external",
]
