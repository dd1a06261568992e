"""BatchNormalization folding at import: equal to the unfolded model, mapped back, refused with
a reason where TensorRT would not fuse."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import onnx_model
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from quantlab import graph
from quantlab.calibration import folding
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

RNG = np.random.default_rng(7)


def bn_params(channels: int, prefix: str = "bn") -> dict[str, np.ndarray]:
    return {f"{prefix}_scale": RNG.uniform(0.2, 3.0, channels),
            f"{prefix}_bias": RNG.standard_normal(channels),
            f"{prefix}_mean": RNG.standard_normal(channels),
            f"{prefix}_var": RNG.uniform(0.01, 4.0, channels)}


def bn_node(x: str, y: str, prefix: str = "bn") -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", [x] + [f"{prefix}_{p}" for p in
                                                         ("scale", "bias", "mean", "var")],
                            [y], name=f"{prefix}_node", epsilon=1e-3)


def conv_transpose_bn64(feeds, initializers) -> np.ndarray:
    """Grouped ConvTranspose with stride == kernel (no overlap) then BN, in float64."""
    x = feeds["x"].astype(np.float64)
    w, b = initializers["w"].astype(np.float64), initializers["b"].astype(np.float64)
    group, (n, c, h, wd), (_, per_group, k, _) = 2, x.shape, w.shape
    y = np.zeros((n, per_group * group, h * k, wd * k))
    for g in range(group):
        rows = slice(g * c // group, (g + 1) * c // group)
        block = np.einsum("nchw,cjab->njhawb", x[:, rows], w[rows])
        y[:, g * per_group:(g + 1) * per_group] = block.reshape(n, per_group, h * k, wd * k)
    y += b[None, :, None, None]
    gain = initializers["bn_scale"] / np.sqrt(initializers["bn_var"] + 1e-3)
    return ((y - initializers["bn_mean"][None, :, None, None]) * gain[None, :, None, None]
            + initializers["bn_bias"][None, :, None, None])


def float64_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The unfolded model evaluated by ONNX's reference evaluator in float64 (its
    ConvTranspose does not take groups: that case has its own reference above)."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    for init in wide.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(
            numpy_helper.to_array(init).astype(np.float64), init.name))
    for value in [*wide.graph.input, *wide.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    return ReferenceEvaluator(wide).run(None, {k: v.astype(np.float64) for k, v in feeds.items()})


CASES = {
    "conv": lambda: (
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         bn_node("c", "y")],
        [("x", [None, 3, 6, 6])], {"w": RNG.standard_normal((4, 3, 3, 3)),
                                   "b": RNG.standard_normal(4), **bn_params(4)},
        {"x": RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)}),
    "depthwise_conv_without_bias": lambda: (
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", group=4),
         bn_node("c", "y")],
        [("x", [None, 4, 5, 5])], {"w": RNG.standard_normal((4, 1, 3, 3)), **bn_params(4)},
        {"x": RNG.standard_normal((2, 4, 5, 5)).astype(np.float32)}),
    "grouped_conv_transpose": lambda: (
        [helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], name="conv", group=2,
                          strides=[2, 2]),
         bn_node("c", "y")],
        [("x", [None, 4, 3, 3])], {"w": RNG.standard_normal((4, 3, 2, 2)),
                                   "b": RNG.standard_normal(6), **bn_params(6)},
        {"x": RNG.standard_normal((2, 4, 3, 3)).astype(np.float32)}),
    "gemm_trans_b_alpha_beta": lambda: (
        [helper.make_node("Gemm", ["x", "w", "b"], ["c"], name="conv", transB=1, alpha=0.5,
                          beta=2.0),
         bn_node("c", "y")],
        [("x", [None, 5])], {"w": RNG.standard_normal((3, 5)), "b": RNG.standard_normal(3),
                             **bn_params(3)},
        {"x": RNG.standard_normal((4, 5)).astype(np.float32)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_folded_model_equals_the_unfolded_model_in_float64(case):
    nodes, inputs, initializers, feeds = CASES[case]()
    model = onnx_model(nodes, inputs, ["y"], initializers)
    folded = graph.normalize(model)
    assert [n.op_type for n in folded.graph.node] == [nodes[0].op_type]
    (entry,) = folding.folded_batchnorms(folded)
    assert entry["node"] == "conv" and entry["batchnorm"] == "bn_node"
    assert entry["tensor"] == "y" and entry["replaced"] == "c"
    expected = (conv_transpose_bn64(feeds, initializers) if case == "grouped_conv_transpose"
                else float64_outputs(model, feeds)[0])
    got = OnnxRuntimeBackend(folded).run(feeds)["y"]
    # float32 weights and one float32 accumulation: relative error ~1e-6 of the range.
    np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=0)
    # Folding is idempotent: a folded model loads unchanged.
    again = graph.normalize(folded)
    assert len(folding.folded_batchnorms(again)) == 1
    assert [n.op_type for n in again.graph.node] == [nodes[0].op_type]


def test_batchnorm_that_cannot_fold_stays_with_its_reason():
    initializers = {"w": RNG.standard_normal((4, 3, 1, 1)), **bn_params(4),
                    **bn_params(3, "in"), **bn_params(4, "shared")}
    nodes = [
        bn_node("x", "xn", "in"),  # reads a graph input
        helper.make_node("Conv", ["xn", "w"], ["c"], name="conv"),
        bn_node("c", "y", "shared"),  # its Conv output is a graph output too
    ]
    model = graph.normalize(onnx_model(nodes, [("x", [None, 3, 4, 4])], ["y", "c"],
                                      initializers))
    assert [n.op_type for n in model.graph.node].count("BatchNormalization") == 2
    kept = folding.kept_batchnorms(model)
    assert "graph input" in kept["in_node"]
    assert "also read elsewhere" in kept["shared_node"]
    assert not folding.folded_batchnorms(model)


def test_shared_weight_is_copied_not_scaled_in_place():
    w = RNG.standard_normal((4, 3, 1, 1))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1"),
             helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2"),
             bn_node("c1", "y1")]
    model = onnx_model(nodes, [("x", [None, 3, 4, 4])], ["y1", "c2"],
                      {"w": w, **bn_params(4)})
    feeds = {"x": RNG.standard_normal((2, 3, 4, 4)).astype(np.float32)}
    folded = graph.normalize(model)
    expected = float64_outputs(model, feeds)
    got = OnnxRuntimeBackend(folded).run(feeds)
    for name, value in zip(["y1", "c2"], expected, strict=True):
        np.testing.assert_allclose(got[name], value, atol=2e-5 * np.abs(value).max(), rtol=0)
    np.testing.assert_array_equal(graph.initializers(folded)["w"], w.astype(np.float32))
