"""Tests for quantlab.switchboard: one graph, any plan by feed, equal to qdq's model per plan."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_plan import residual_block

from quantlab import graph, pipeline, plan, qdq, switchboard
from quantlab.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError

NO_OPTIMIZATION = ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def fake_quant_run(model, feeds, name="model"):
    """ORT without graph optimizations: Q/DQ stay float ops (fake quantization), no fusion."""
    return OnnxRuntimeBackend(model, name=name, optimization=NO_OPTIMIZATION,
                              check_inputs=False).run(feeds)


def calibrated(g: graph.Graph, feeds) -> dict[str, float]:
    names = qdq.activation_tensors_to_calibrate(g.model)
    values = OnnxRuntimeBackend(g.model).run(feeds, names)
    return {name: float(np.abs(v).max()) for name, v in values.items()}


def random_plans(units, choices, count, seed=0):
    rng = np.random.default_rng(seed)
    plans = [{u.name: "int8" for u in units}, {u.name: "fp32" for u in units}]
    plans += [{u.name: str(rng.choice(choices)) for u in units} for _ in range(count)]
    return plans


def node_plan(units, precisions) -> dict[str, str]:
    return {node: precisions[u.name] for u in units for node in u.nodes}


@pytest.fixture(scope="module")
def residual_case():
    g = residual_block()
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    units = plan.find_units(g, {"x": [2, 3, 8, 8]})
    return g, feeds, units, calibrated(g, feeds)


@pytest.fixture(scope="module")
def digits_case():
    from quantlab import zoo

    model = graph.normalize(pipeline.export_zoo_model("digits-cnn"))
    g = graph.Graph(model)
    images = zoo.get("digits-cnn").eval_set().inputs[:16].astype(np.float32)
    feeds = {"input": images}
    units = plan.find_units(g, {"input": list(images.shape)})
    return g, feeds, units, calibrated(g, feeds)


@pytest.mark.parametrize("case", ["residual_case", "digits_case"])
def test_switchboard_equals_qdq_model_for_int8_fp32_plans(case, request):
    g, feeds, units, amax = request.getfixturevalue(case)
    board = switchboard.build(g, units, amax)
    session = OnnxRuntimeBackend(board.model, optimization=NO_OPTIMIZATION, check_inputs=False)
    for precisions in random_plans(units, ["int8", "fp32"], 6):
        got = session.run({**feeds, **board.feeds(precisions)})
        want = fake_quant_run(qdq.quantize_model(g.model, amax, node_plan(units, precisions)),
                              feeds)
        # Same float32 ops on the same values, Where only selects: bit-exact.
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=str(precisions))


@pytest.mark.parametrize("case", ["residual_case", "digits_case"])
def test_switchboard_bias_shifts_equal_shifted_qdq_models(case, request):
    """Per unit, the shift acts only while the unit runs INT8 and the flag is on.

    The switchboard adds the shift to the op's output, the Q/DQ model to its bias
    (repairs.shift_biases): the same sum in another order, so equal to float32
    rounding of the output (2 ** -20 of its largest magnitude, a few ulps of
    float32's 2 ** -24 accumulated over the later layers), not bit for bit.
    With the flag off the board is the unshifted Q/DQ model bit for bit.
    """
    from quantlab import repairs

    g, feeds, units, amax = request.getfixturevalue(case)
    measured, _ = repairs.bias_shifts(g.model, qdq.quantize_model(g.model, amax), [feeds])
    assert set(measured) == {n for u in units for n in u.linear}
    # Larger than measured (and random), so that a shift in the wrong place shows.
    rng = np.random.default_rng(3)
    shifts = {n: rng.normal(0, 0.05, v.shape) for n, v in measured.items()}
    board = switchboard.build(g, units, amax, shifts=shifts)
    session = OnnxRuntimeBackend(board.model, optimization=NO_OPTIMIZATION, check_inputs=False)
    for precisions in random_plans(units, ["int8", "fp32"], 4, seed=1):
        built = qdq.quantize_model(g.model, amax, node_plan(units, precisions))
        board.bias_corrected = True
        got = session.run({**feeds, **board.feeds(precisions)})
        want = fake_quant_run(repairs.shift_biases(g.model, built, shifts), feeds)
        for name in want:
            scale = float(np.abs(want[name]).max())
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2.0 ** -20 * scale,
                                       err_msg=str(precisions))
        if any(p == "int8" for p in precisions.values()):
            plain = fake_quant_run(built, feeds)
            assert any(np.abs(want[n] - plain[n]).max() > 1e-3 for n in want)
        board.bias_corrected = False
        got = session.run({**feeds, **board.feeds(precisions)})
        for name, value in fake_quant_run(built, feeds).items():
            np.testing.assert_array_equal(got[name], value)


FP16_UNIT_ROUNDOFF = 2.0 ** -11


def test_fp16_head_unit_within_float16_accumulation_bound(residual_case):
    g, feeds, units, amax = residual_case
    board = switchboard.build(g, units, amax)
    precisions = {u.name: "fp32" for u in units} | {"conv3": "fp16"}
    got = fake_quant_run(board.model, {**feeds, **board.feeds(precisions)})["y"]
    want = fake_quant_run(qdq.quantize_model(g.model, amax, node_plan(units, precisions)),
                          feeds)["y"]
    # conv3 is a 1x1 conv over K = 16 channels of p (= its input, identical in both models:
    # everything before it is FP32). ORT's float16 kernel is within gamma_K * sum|p w| + u|d|
    # of the exact product of the float16-rounded values; the switchboard accumulates in
    # float32 (K * 2**-24 * sum|p w|) and rounds d to float16 (u|d|); y is d's mean.
    p = OnnxRuntimeBackend(g.model).run(feeds, ["p"])["p"].astype(np.float16).astype(np.float64)
    w = graph.initializers(g.model)["w3"][:, :, 0, 0].astype(np.float16).astype(np.float64)
    magnitude = np.einsum("ok,nkhw->nohw", np.abs(w), np.abs(p))
    d = np.einsum("ok,nkhw->nohw", w, p)
    k, u = 16, FP16_UNIT_ROUNDOFF
    bound = (k * u / (1 - k * u) + k * 2.0 ** -24) * magnitude + 2 * u * np.abs(d)
    assert np.all(np.abs(got - want) <= bound.mean(axis=(2, 3)) + 1e-6)
    assert np.abs(got - fake_quant_run(g.model, feeds)["y"]).max() > 0  # FP16 is not FP32


def float32_accumulation(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every float16 compute node run in float32 between Casts (float16 I/O kept).

    This is the arithmetic the switchboard's FP16 path emulates: values rounded to
    float16 at a unit's inputs and outputs, accumulation in float32 (as TensorRT's FP16
    kernels with float32 accumulators do; ONNX Runtime's CPU float16 kernels do not).
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(onnx.shape_inference.infer_shapes(model))
    g = graph.Graph(copy)
    stored = graph.initializers(copy)
    half = {n for n in [*g.values, *stored]
            if (stored[n].dtype if n in stored else g.dtype(n)) == np.float16}
    nodes, widened = [], set()
    for node in copy.graph.node:
        if node.op_type == "Cast" or not any(i in half for i in node.input):
            nodes.append(node)
            continue
        for index, name in enumerate(node.input):
            if name in half:
                node.input[index] = f"{name}::as_fp32"
                if name not in widened:
                    widened.add(name)
                    nodes.append(helper.make_node("Cast", [name], [node.input[index]],
                                                  to=TensorProto.FLOAT))
        outputs = list(node.output)
        node.output[:] = [f"{o}::fp32" for o in outputs]
        nodes.append(node)
        nodes += [helper.make_node("Cast", [f"{o}::fp32"], [o], to=TensorProto.FLOAT16)
                  for o in outputs]
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    del copy.graph.value_info[:]
    return copy


@pytest.mark.parametrize("case", ["residual_case", "digits_case"])
def test_switchboard_equals_qdq_model_with_fp16_units_at_float32_accumulation(case, request):
    g, feeds, units, amax = request.getfixturevalue(case)
    board = switchboard.build(g, units, amax)
    session = OnnxRuntimeBackend(board.model, optimization=NO_OPTIMIZATION, check_inputs=False)
    for precisions in random_plans(units, ["int8", "fp16", "fp32"], 6, seed=1)[2:]:
        got = session.run({**feeds, **board.feeds(precisions)})
        built = qdq.quantize_model(g.model, amax, node_plan(units, precisions))
        want = fake_quant_run(float32_accumulation(built), feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=str(precisions))


def test_feeds_reject_unknown_units_and_precisions(residual_case):
    g, _, units, amax = residual_case
    board = switchboard.build(g, units, amax)
    assert set(board.flags) == {u.name for u in units}
    flags = board.feeds({"conv1": "fp16"})
    assert flags[board.flags["conv1"][1]] and not flags[board.flags["conv1"][0]]
    assert flags[board.flags["conv0"][0]]
    with pytest.raises(ConfigError, match="units \\['relu0'\\] are not in the switchboard"):
        board.feeds({"relu0": "fp32"})
    with pytest.raises(ConfigError, match="unit 'conv0' has precision 'int4'"):
        board.feeds({"conv0": "int4"})
