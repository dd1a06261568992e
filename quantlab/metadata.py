"""What quantlab records inside an ONNX model besides its graph, and node attributes read alike.

Facts an import step learns about a model (the BatchNormalizations folded, the inputs
frozen, the sample axes, the shapes the data fed) travel with the model file as JSON
values in its ``metadata_props``, under ``quantlab.*`` keys, so every later command
reads them from the model it is given. Both :mod:`quantlab.graph` and
:mod:`quantlab.calibration.folding` write them; this module imports neither.
"""

from __future__ import annotations

import json

import onnx
from onnx import helper


def read(model: onnx.ModelProto, key: str, default=None):
    """The JSON value recorded under `key` in the model's metadata (`default` when absent)."""
    value = next((p.value for p in model.metadata_props if p.key == key), None)
    return json.loads(value) if value else default


def write(model: onnx.ModelProto, key: str, value) -> None:
    """Record `value` (JSON, keys sorted) under `key`, in place, replacing any earlier entry;
    an empty value (None, {}, []) removes the entry."""
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if value:
        model.metadata_props.add(key=key, value=json.dumps(value, sort_keys=True))


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of attribute `name` of `node` (ints, floats, lists, tensors as ONNX gives
    them), `default` when the node does not set it (the operator's default)."""
    for found in node.attribute:
        if found.name == name:
            return helper.get_attribute_value(found)
    return default
