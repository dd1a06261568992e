"""Engine layers -> ONNX nodes and tensors, on layer information of each TensorRT version's shape.

No engine is built here (TensorRT cannot be installed): the layer information below is
written by hand in the documented format, each field from a named source:

- ``{"Layers": [...], "Bindings": [...]}``, ``Name``, ``LayerType``, ``Inputs``/``Outputs``
  (``Name``, ``Format/Datatype``), ``Weights.Type``: the engine inspector's JSON with
  ``ProfilingVerbosity.DETAILED`` as exported by trt-engine-explorer
  (NVIDIA/TensorRT tools/experimental/trt-engine-explorer, ``resnet-qat.onnx.engine.graph.json``;
  tests/engine/test_tensorrt.py keeps verbatim layers of it).
- ``Metadata``: ``[ONNX Layer: NODE]`` entries joined by ``\\x1e``/``\\x1f``, set by
  onnx-tensorrt on the layers it adds for a node (``processMetadata``; trt-engine-explorer
  ``parser.py``), from TensorRT 8.6 (``ILayer.metadata``, ``NvInfer.h``).
- Myelin regions: ``{ForeignNode[first...last]}`` with ``LayerType`` ``Myelin`` (trtexec
  layer dumps of TensorRT 8.6+; TensorRT#2577).
- Reformats: ``Reformatting CopyNode for Output Tensor 0 to LAYER`` reading
  ``Reformatted Output Tensor 0 to LAYER`` (resnet-qat above).
- Unfused debug tensors (10.12+) are reported under the names the inspector lists
  (``NvInfer.h`` markUnfusedTensorsAsDebugTensors: "the names correspond to the names
  obtained by IEngineInspector"), here a fused convolution's internal output name.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantlab.engine.backends.tensorrt import ExposedTensors, exposed_tensors
from quantlab.engine.trt_layers import (
    engine_layers,
    engine_tensor_names,
    int8_coverage,
    metadata_nodes,
    opaque_nodes,
    precision_mismatches,
    surviving_tensors,
)


def qdq_cnn() -> onnx.ModelProto:
    """x -> Q/DQ -> conv (int8 weight behind a DQ) -> relu -> pool -> flatten -> fc (Gemm) -> y:
    the shape of a model.int8.onnx quantlab writes, names included."""
    inits = [numpy_helper.from_array(np.float32(0.02), "s"),
             numpy_helper.from_array(np.int8(0), "z"),
             numpy_helper.from_array(np.ones((4, 3, 3, 3), np.int8), "w_quantized"),
             numpy_helper.from_array(np.full(4, 0.01, np.float32), "w_scale"),
             numpy_helper.from_array(np.zeros(4, np.int8), "w_zero_point"),
             numpy_helper.from_array(np.ones((2, 16), np.float32), "fc_w"),
             numpy_helper.from_array(np.zeros(2, np.float32), "fc_b")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_quantized"],
                         name="x_QuantizeLinear"),
        helper.make_node("DequantizeLinear", ["x_quantized", "s", "z"], ["x_dequantized"],
                         name="x_DequantizeLinear"),
        helper.make_node("DequantizeLinear", ["w_quantized", "w_scale", "w_zero_point"],
                         ["w_dequantized"], name="w_DequantizeLinear", axis=0),
        helper.make_node("Conv", ["x_dequantized", "w_dequantized"], ["c"], name="conv",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])
    model = helper.make_model(helper.make_graph(nodes, "cnn", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def tensor(name: str, datatype: str) -> dict:
    return {"Name": name, "Format/Datatype": datatype}


INT8, FP32 = "Four wide channel vectorized row major Int8 format", "Row major linear FP32"
QUANTIZE = {"Name": "x_QuantizeLinear", "LayerType": "Reformat",
            "Inputs": [tensor("x", FP32)], "Outputs": [tensor("x_quantized", INT8)],
            "Metadata": "[ONNX Layer: x_QuantizeLinear]"}
# The conv with its Relu fused, and the pool: the same layers on 8.6 and 10.x.
CONV_RELU_POOL = [
    {"Name": "w_DequantizeLinear + conv + relu", "LayerType": "CaskConvolution",
     "Inputs": [tensor("x_quantized", INT8)], "Outputs": [tensor("r", FP32)],
     "Weights": {"Type": "Int8", "Count": 108},
     "Metadata": "[ONNX Layer: w_DequantizeLinear]\x1e[ONNX Layer: conv]\x1e[ONNX Layer: relu]"},
    {"Name": "pool", "LayerType": "CaskPooling", "Inputs": [tensor("r", FP32)],
     "Outputs": [tensor("p", FP32)], "Metadata": "[ONNX Layer: pool]"},
]

# TensorRT 8.6, tensors the unmarked engine keeps marked as network outputs (r, p): the conv
# runs with its Relu fused, the Gemm is onnx-tensorrt's MatMul layer named "fc" plus an unnamed
# bias add with no Metadata: onnx-tensorrt writes it only on the layer registerLayer names
# (8.6-GA ImporterContext.cpp L112-137; the Gemm importer registers only the MatMul).
LAYERS_8_6 = {"Layers": [
    QUANTIZE, *CONV_RELU_POOL,
    {"Name": "fc", "LayerType": "CaskGemmConvolution", "Inputs": [tensor("p", FP32)],
     "Outputs": [tensor("(Unnamed Layer* 11) [Matrix Multiply]_output", "Half")],
     "Metadata": "[ONNX Layer: flatten]\x1f[ONNX Layer: fc]"},
    {"Name": "(Unnamed Layer* 12) [ElementWise]", "LayerType": "PointWiseV2",
     "Inputs": [tensor("(Unnamed Layer* 11) [Matrix Multiply]_output", "Half")],
     "Outputs": [tensor("y", FP32)]},
], "Bindings": ["x", "y", "r", "p"]}

# TensorRT 10.0 - 10.11, r and p marked with mark_debug; flatten + fc in a Myelin region.
LAYERS_10_X = {"Layers": [
    QUANTIZE, *CONV_RELU_POOL,
    {"Name": "{ForeignNode[flatten...fc]}", "LayerType": "Myelin",
     "Inputs": [tensor("p", FP32)], "Outputs": [tensor("y", FP32)]},
], "Bindings": ["x", "y"]}

# TensorRT 10.12+ and 11.x with every unfused tensor a debug tensor: the conv's output (before
# the Relu's PointWise layer) under an internal name, the pool's under a reformat's name.
LAYERS_10_12 = {"Layers": [
    QUANTIZE,
    {"Name": "conv", "LayerType": "CaskConvolution", "Inputs": [tensor("x_quantized", INT8)],
     "Outputs": [tensor("__myl_conv_out_0", FP32)], "Weights": {"Type": "Int8", "Count": 108},
     "Metadata": "[ONNX Layer: w_DequantizeLinear]\x1e[ONNX Layer: conv]"},
    {"Name": "PWN(relu)", "LayerType": "PointWise", "Inputs": [tensor("__myl_conv_out_0", FP32)],
     "Outputs": [tensor("r", FP32)], "Metadata": "[ONNX Layer: relu]"},
    {"Name": "pool", "LayerType": "CaskPooling", "Inputs": [tensor("r", FP32)],
     "Outputs": [tensor("Reformatted Output Tensor 0 to pool", FP32)]},
    {"Name": "Reformatting CopyNode for Output Tensor 0 to pool", "LayerType": "Reformat",
     "Inputs": [tensor("Reformatted Output Tensor 0 to pool", FP32)],
     "Outputs": [tensor("p", FP32)]},
    {"Name": "{ForeignNode[flatten...fc]}", "LayerType": "Myelin",
     "Inputs": [tensor("p", FP32)], "Outputs": [tensor("y", FP32)]},
], "Bindings": ["x", "y"]}


def rows(exposed: ExposedTensors) -> list[tuple[str, str, str]]:
    return [(row["tensor"], row["obtained"], row["engine_name"])
            for row in exposed.table(qdq_cnn())]


def test_layer_table_of_tensorrt_8_6_network_outputs():
    model = qdq_cnn()
    kept = surviving_tensors(engine_layers(LAYERS_8_6, model), model)
    assert kept == ["r", "p", "y"]  # the graph input x is not compared; y is an output
    exposed = exposed_tensors(LAYERS_8_6, model, "network_output", ["r", "p"])
    assert rows(exposed) == [
        ("x_dequantized", "not exposed", ""), ("w_dequantized", "not exposed", ""),
        ("c", "not exposed", ""), ("r", "network_output", "r"), ("p", "network_output", "p"),
        ("f", "not exposed", ""), ("y", "graph_output", "y")]
    assert "network output" in exposed.notes[0]


def test_layer_table_of_tensorrt_10_mark_debug():
    model = qdq_cnn()
    kept = [t for t in surviving_tensors(engine_layers(LAYERS_10_X, model), model) if t != "y"]
    assert kept == ["r", "p"]
    # A marked tensor the marked engine does not hold (fused anyway) is not claimed.
    exposed = exposed_tensors(LAYERS_10_X, model, "debug_marked", kept + ["f"])
    assert [r[:2] for r in rows(exposed) if r[1] != "not exposed"] == [
        ("r", "debug_marked"), ("p", "debug_marked"), ("y", "graph_output")]


def test_layer_table_of_tensorrt_10_12_unfused_names_mapped_back():
    model = qdq_cnn()
    assert engine_tensor_names(engine_layers(LAYERS_10_12, model), model) == {
        "x": "x", "x_quantized": "x_quantized", "r": "r", "p": "p", "y": "y",
        "__myl_conv_out_0": "c"}  # the pool's reformat name is not mapped twice onto p
    exposed = exposed_tensors(LAYERS_10_12, model, "debug_unfused")
    assert rows(exposed) == [
        ("x_dequantized", "not exposed", ""), ("w_dequantized", "not exposed", ""),
        ("c", "debug_unfused", "__myl_conv_out_0"), ("r", "debug_unfused", "r"),
        ("p", "debug_unfused", "p"), ("f", "not exposed", ""), ("y", "graph_output", "y")]
    # NvInfer.h: "There is no guarantee that all unfused tensors are marked".
    exposed.keep_returned({"y", "r", "__myl_conv_out_0"})
    assert [r[0] for r in rows(exposed) if r[1] != "not exposed"] == ["c", "r", "y"]
    assert "1 unfused tensor(s)" in exposed.notes[-1]


def test_gemm_mismatch_is_found_on_its_unnamed_bias_layer():
    # trt-review F9: the Gemm's MatMul layer is "fc", its bias add "(Unnamed Layer* 12)"; the
    # bias add running FP16 while the plan says fp32 used to go unreported.
    layers = engine_layers(LAYERS_8_6, qdq_cnn())
    mismatches = precision_mismatches(layers, {"fc": "fp32", "conv": "int8", "pool": "fp32"})
    assert [(m.node, m.engine, m.layer) for m in mismatches] == [
        ("fc", "fp16", "(Unnamed Layer* 12) [ElementWise]")]


def test_nodes_in_myelin_regions_are_not_reported_as_mismatches():
    # trt-review F14: a Myelin region shows only its I/O formats; its nodes' precision is not
    # the region's input type.
    layers = engine_layers(LAYERS_10_X, qdq_cnn())
    plan = {"fc": "int8", "conv": "int8", "pool": "fp16"}
    assert [(m.node, m.engine) for m in precision_mismatches(layers, plan)] == [("pool", "fp32")]
    assert opaque_nodes(layers, plan) == ["fc"]
    assert layers[-1].is_opaque and layers[-1].precision is None


@pytest.mark.parametrize("metadata, nodes", [
    ("[ONNX Layer: /blocks/0/Add]", ["/blocks/0/Add"]),
    # trt-review F20: onnx-tensorrt (main) writes the local function a node comes from.
    ("[ONNX Layer: /blocks/0/Add | Local Function: LayerNorm]\x1f[ONNX Layer: relu]",
     ["/blocks/0/Add", "relu"]),
    # trt-review-r2 N12: 8.6 appends the node's doc string after " | ".
    ("[ONNX Layer: conv1 | /m.py(12): forward]", ["conv1"]),
    ("", []),
])
def test_metadata_nodes(metadata, nodes):
    assert metadata_nodes(metadata) == nodes


def test_unnamed_bias_add_without_metadata_is_the_gemm_layer():
    # trt-review F9 / r2: found through the unnamed MatMul output it reads, not through
    # Metadata that onnx-tensorrt never writes there.
    layers = engine_layers(LAYERS_8_6, qdq_cnn())
    assert layers[-1].metadata == "" and layers[-1].nodes == ["flatten", "fc"]
    assert engine_layers(LAYERS_8_6)[-1].nodes == ["flatten", "fc"]  # without the model too


# The constructs of a real engine's inspector JSON, on qdq_cnn: NVIDIA/TensorRT
# tools/experimental/trt-engine-explorer/tests/inputs/mobilenet_v2_residuals.qat.onnx.engine.
# graph.json (TensorRT 8.x, MobileNetV2 QAT; read, not copied: the workplace keeps public files
# out of commits) has, and this fixture mirrors with its field names and strings: the input Q as
# a "Reformat" layer of "Origin" "QDQ"; convolutions named "W + QuantizeLinear_N + Conv_N +
# PWN(Clip_N)" whose ONNX-named outputs are held Int8 ("Thirty-two wide channel vectorized row
# major Int8 format"), with Kernel/OutMaps/Groups/Weights.Count and output Dimensions; a
# "Reformatting CopyNode for Input Tensor 0 to GlobalAveragePool_N" into FP16 before the pool;
# the classifier Gemm fused with its bias add as "W + QuantizeLinear_N + Gemm_N + B +
# (Unnamed Layer* N) [Shuffle] + unsqueeze_node_after_B + ... + (Unnamed Layer* N)
# [ElementWise]" writing "(Unnamed Layer* N) [ElementWise]_out_tensor", and a NoOp
# "copied_squeeze_after_(Unnamed Layer* N) [ElementWise]" writing the graph output. It has no
# Metadata (written from 8.6 on).
INT8_32 = "Thirty-two wide channel vectorized row major Int8 format"
FP16_2 = "Two wide channel vectorized row major FP16 format"


def dims(name: str, datatype: str, shape: list[int]) -> dict:
    return {**tensor(name, datatype), "Location": "Device", "Dimensions": shape}


LAYERS_REAL_SHAPED = {"Layers": [
    {"Name": "x_QuantizeLinear", "LayerType": "Reformat", "ParameterType": "Reformat",
     "Origin": "QDQ", "Inputs": [dims("x", FP32, [1, 3, 4, 4])],
     "Outputs": [dims("x_quantized", INT8, [1, 3, 4, 4])]},
    {"Name": "w_quantized + w_DequantizeLinear + conv + PWN(relu)",
     "LayerType": "CaskConvolution", "ParameterType": "Convolution",
     "Inputs": [dims("x_quantized", INT8, [1, 3, 4, 4])],
     "Outputs": [dims("r", INT8_32, [1, 4, 4, 4])], "Kernel": [3, 3], "OutMaps": 4,
     "Groups": 1, "Weights": {"Type": "Int8", "Count": 108}, "Bias": {"Type": "Float",
                                                                      "Count": 4}},
    {"Name": "Reformatting CopyNode for Input Tensor 0 to pool", "LayerType": "Reformat",
     "Origin": "REFORMAT", "Inputs": [dims("r", INT8_32, [1, 4, 4, 4])],
     "Outputs": [dims("Reformatted Input Tensor 0 to pool", FP16_2, [1, 4, 4, 4])]},
    {"Name": "pool", "LayerType": "TiledPooling", "ParameterType": "Pooling",
     "Inputs": [dims("Reformatted Input Tensor 0 to pool", FP16_2, [1, 4, 4, 4])],
     "Outputs": [dims("p", FP16_2, [1, 4, 2, 2])]},
    {"Name": "fc_w + fc + fc_b + (Unnamed Layer* 12) [Shuffle] + unsqueeze_node_after_fc_b + "
             "(Unnamed Layer* 13) [ElementWise]", "LayerType": "CaskConvolution",
     "ParameterType": "Convolution", "Inputs": [dims("p", FP16_2, [1, 4, 2, 2])],
     "Outputs": [dims("(Unnamed Layer* 13) [ElementWise]_out_tensor", FP32, [1, 2, 1, 1])],
     "Kernel": [1, 1], "OutMaps": 2, "Groups": 1, "Weights": {"Type": "Float", "Count": 32}},
    {"Name": "copied_squeeze_after_(Unnamed Layer* 13) [ElementWise]", "LayerType": "NoOp",
     "Inputs": [dims("(Unnamed Layer* 13) [ElementWise]_out_tensor", FP32, [1, 2, 1, 1])],
     "Outputs": [dims("y", FP32, [1, 2])]},
], "Bindings": ["x", "y"]}


def test_int8_held_tensors_are_never_compared_as_float():
    # trt-review-r2 N4: "r" is held as int8 codes (the conv with a Q fused in); its float value
    # exists only as the pool's FP16 reformat input, which is what gets mapped.
    model = qdq_cnn()
    layers = engine_layers(LAYERS_REAL_SHAPED, model)
    names = engine_tensor_names(layers, model)
    assert "r" not in names and names["Reformatted Input Tensor 0 to pool"] == "r"
    assert "r" not in surviving_tensors(layers, model)
    exposed = exposed_tensors(LAYERS_REAL_SHAPED, model, "debug_unfused")
    assert exposed.engine_names["r"] == "Reformatted Input Tensor 0 to pool"
    marked = exposed_tensors(LAYERS_REAL_SHAPED, model, "debug_marked", ["r", "p"])
    assert "r" not in marked.sources and marked.sources["p"] == "debug_marked"


def test_layers_of_a_real_shaped_engine_map_to_their_nodes():
    model = qdq_cnn()
    layers = engine_layers(LAYERS_REAL_SHAPED, model)
    assert [layer.nodes for layer in layers] == [
        ["x_QuantizeLinear"], ["x_DequantizeLinear", "w_DequantizeLinear", "conv", "relu"], [],
        ["pool"], ["fc"], []]  # the Q runs as a reformat and holds its node
    assert [layer.precision for layer in layers] == [
        "fp32", "int8", "int8", "fp16", "fp32", "fp32"]
    assert [layer.is_reformat for layer in layers] == [False, False, True, False, False, True]


def test_int8_coverage_is_the_share_of_macs_in_int8_layers():
    model = qdq_cnn()
    # The reference: MACs from the ONNX shapes, conv 4x4x4 outputs x (3 x 3x3) inputs each,
    # the Gemm 2 outputs x 16 inputs.
    conv_macs, fc_macs = 4 * 4 * 4 * 3 * 3 * 3, 2 * 16
    coverage = int8_coverage(engine_layers(LAYERS_REAL_SHAPED, model))
    assert (coverage["int8_macs"], coverage["macs"]) == (conv_macs, conv_macs + fc_macs)
    assert coverage["share"] == pytest.approx(conv_macs / (conv_macs + fc_macs))
    assert coverage["float_layers"] == [LAYERS_REAL_SHAPED["Layers"][4]["Name"]]
    assert int8_coverage(engine_layers(LAYERS_10_X, model))["share"] is None  # no Count
