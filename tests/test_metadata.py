"""Model metadata entries and node attributes (quantlab.metadata)."""

import json

from helpers import onnx_model
from onnx import helper

from quantlab import metadata


def identity_model():
    return onnx_model([helper.make_node("Identity", ["x"], ["y"], name="id")], [("x", [1])],
                      ["y"], {})


def test_a_value_round_trips_as_sorted_json_and_replaces_the_earlier_one():
    model = identity_model()
    model.metadata_props.add(key="other", value="kept")
    metadata.write(model, "quantlab.k", {"b": [1, None], "a": 2.5})
    metadata.write(model, "quantlab.k", {"b": [1, None], "a": 3})
    entries = {p.key: p.value for p in model.metadata_props}
    assert entries == {"other": "kept", "quantlab.k": json.dumps({"a": 3, "b": [1, None]})}
    assert metadata.read(model, "quantlab.k") == {"a": 3, "b": [1, None]}


def test_an_empty_value_removes_the_entry_and_a_missing_one_reads_as_the_default():
    model = identity_model()
    metadata.write(model, "quantlab.k", [1])
    metadata.write(model, "quantlab.k", [])
    assert not model.metadata_props
    assert metadata.read(model, "quantlab.k") is None
    assert metadata.read(model, "quantlab.k", {}) == {}


def test_attribute_reads_the_value_set_or_the_default():
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=4, pads=[1, 1, 1, 1],
                            alpha=0.5)
    assert metadata.attribute(node, "group", 1) == 4
    assert metadata.attribute(node, "pads") == [1, 1, 1, 1]
    assert metadata.attribute(node, "alpha", 1.0) == 0.5
    assert metadata.attribute(node, "dilations", [1, 1]) == [1, 1]
