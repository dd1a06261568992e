"""Tests for quantlab.plan: units from qdq's placement, MACs, rules with reason codes, plan.json."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
from helpers import assert_every_column_explained
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph, plan
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.planner import evaluate, flow
from quantlab.planner.certify import Budget, certifiable_drop
from quantlab.planner.trials import front_masks, least_random_trials


def make_graph(nodes, inputs, initializers, outputs=("y",)) -> graph.Graph:
    """A normalized model from nodes; inputs are (name, shape) pairs, shapes may hold None."""
    model = helper.make_model(
        helper.make_graph(
            nodes, "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
            [numpy_helper.from_array(v.astype(np.float32) if v.dtype.kind == "f" else v, k)
             for k, v in initializers.items()]),
        opset_imports=[helper.make_opsetid("", 17)])
    return graph.Graph(graph.normalize(model))


def weights(*shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def units_by_name(g, shapes=None) -> dict[str, plan.Unit]:
    return {u.name: u for u in plan.find_units(g, shapes)}


def residual_block() -> graph.Graph:
    """x -> conv0 -> r (read by conv1, conv2 and the skip of an Add), conv2 -> Add -> conv3."""
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"], name="relu0"),
        helper.make_node("Conv", ["r", "w1"], ["b"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["b"], ["rb"], name="relu1"),
        helper.make_node("Conv", ["rb", "w2"], ["c"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "r"], ["s"], name="add"),
        helper.make_node("MaxPool", ["s"], ["p"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p", "w3"], ["d"], name="conv3"),
        helper.make_node("Conv", ["r", "w4"], ["e"], name="side"),
        helper.make_node("ReduceMean", ["d"], ["y"], name="mean", keepdims=0),
        helper.make_node("ReduceMean", ["e"], ["y2"], name="mean2", keepdims=0),
    ]
    inits = {"w0": weights(16, 3, 3, 3), "w1": weights(16, 16, 3, 3, seed=1),
             "w2": weights(16, 16, 3, 3, seed=2), "w3": weights(32, 16, 1, 1, seed=3),
             "w4": weights(16, 16, 1, 1, seed=4)}
    return make_graph(nodes, [("x", ["N", 3, 8, 8])], inits, outputs=("y", "y2"))


def test_units_merge_readers_of_one_pair_and_residual_skip():
    units = units_by_name(residual_block(), {"x": [2, 3, 8, 8]})
    assert list(units) == ["conv0", "conv1", "conv2", "conv3"]
    # r carries one pair read by conv1, side and the Add's skip input: one decision.
    assert units["conv1"].nodes == ["conv1", "add", "side"]
    assert units["conv1"].tensors == ["r"]
    assert units["conv1"].linear == ["conv1", "side"]
    # conv3's pair moved backward across the MaxPool onto the Add's output s.
    assert units["conv3"].tensors == ["s"] and units["conv3"].weights == ["w3"]
    assert units["conv0"].tensors == ["x"]


def concat_block() -> graph.Graph:
    """a (Relu of conv_a) and cb (conv_b) each have a reader of their own (conv_c, conv_d)
    and are joined, cb through a Reshape, by a Concat read by conv_e; conv_f reads x."""
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["ca"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["ca"], ["a"], name="relu_a"),
        helper.make_node("Conv", ["x", "wb"], ["cb"], name="conv_b", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["cb", "shape"], ["b"], name="reshape_b"),
        helper.make_node("Conv", ["a", "wc"], ["yc"], name="conv_c"),
        helper.make_node("Conv", ["cb", "wd"], ["yd"], name="conv_d"),
        helper.make_node("Concat", ["a", "b"], ["cat"], name="concat", axis=1),
        helper.make_node("Conv", ["cat", "we"], ["ye"], name="conv_e"),
        helper.make_node("Conv", ["x", "wf"], ["yf"], name="conv_f"),
    ]
    inits = {"wa": weights(16, 16, 3, 3), "wb": weights(16, 16, 3, 3, seed=1),
             "wc": weights(16, 16, 1, 1, seed=2), "wd": weights(16, 16, 1, 1, seed=3),
             "we": weights(16, 32, 1, 1, seed=4), "wf": weights(16, 16, 1, 1, seed=5),
             "shape": np.array([1, 16, 4, 4])}
    return make_graph(nodes, [("x", [1, 16, 4, 4])], inits, outputs=("yc", "yd", "ye", "yf"))


def test_pairs_joined_by_a_concat_are_one_unit_with_one_scale():
    from quantlab.calibration import qdq

    g = concat_block()
    # The Concat reads cb through the Reshape: Q moved back across both lands on cb.
    assert plan.scale_groups(g) == [["a", "cb", "cat"]]
    units = units_by_name(g)
    assert list(units) == ["conv_a", "conv_c"]
    assert units["conv_a"].nodes == ["conv_a", "conv_b", "conv_f"]  # one pair on x
    assert units["conv_c"].nodes == ["conv_c", "conv_d", "conv_e"]
    assert units["conv_c"].tensors == ["a", "cb", "cat"]
    assert units["conv_c"].macs == 2 * 16 * 4 * 4 * 16 + 16 * 4 * 4 * 32
    amax = {"x": 1.0, "a": 2.0, "cb": 5.0, "cat": 4.0}
    shared = plan.share_scales(g, amax)
    assert shared == {"x": 1.0, "a": 5.0, "cb": 5.0, "cat": 5.0}
    # The written Q/DQ model quantizes the three tensors with one scale.
    model = qdq.quantize_model(g.model, shared)
    scales = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    quantizers = {n.input[0]: float(scales[n.input[1]]) for n in model.graph.node
                  if n.op_type == "QuantizeLinear"}
    assert {quantizers[t] for t in ("a", "cb", "cat")} == {np.float32(5.0) / np.float32(127)}
    assert quantizers["x"] == pytest.approx(1.0 / 127)


def test_macs_from_real_shapes():
    units = units_by_name(residual_block(), {"x": [2, 3, 8, 8]})
    assert units["conv0"].macs == 2 * 16 * 8 * 8 * 3 * 3 * 3
    assert units["conv1"].macs == 2 * 16 * 8 * 8 * 16 * 9 + 2 * 16 * 8 * 8 * 16
    assert units["conv3"].macs == 2 * 32 * 4 * 4 * 16


def test_symbolic_batch_without_shapes_names_the_node():
    with pytest.raises(ModelError, match="node 'conv0'.*shapes of a real batch"):
        plan.find_units(residual_block())


def test_shapes_inference_leaves_open_are_measured():
    # H stays symbolic (no input shapes given): the planner measures the two tensors whose
    # shapes give conv0's MACs in a run instead; the batch is 2, H is 8.
    asked = []

    def measure(names):
        asked.extend(names)
        return {"a": (2, 16, 8, 8), "w0": (16, 3, 3, 3)}

    g = make_graph([helper.make_node("Conv", ["x", "w0"], ["a"], name="conv0",
                                     pads=[1, 1, 1, 1]),
                    helper.make_node("ReduceMean", ["a"], ["y"], name="mean", keepdims=0)],
                   [("x", [2, 3, "H", 8])], {"w0": weights(16, 3, 3, 3)})
    units = plan.find_units(g, None, measure)
    assert asked == ["a"] and units[0].macs == 2 * 16 * 8 * 8 * 3 * 3 * 3


def test_outputs_with_samples_on_another_axis_are_read_samples_first_in_bounded_runs():
    # y[2, N, 4] (a recurrent state's layout): the planner's measures read it as [N, 2, 4],
    # also when a batch runs in pieces (2 + 2 + 1 samples), joined back in order.
    from quantlab.data import open_data
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g = make_graph([helper.make_node("Transpose", ["x"], ["y"], name="t", perm=[1, 0, 2]),
                    helper.make_node("Relu", ["x"], ["z"], name="r")],
                   [("x", ["N", 2, 4])], {}, outputs=("y", "z"))
    backend = OnnxRuntimeBackend(g.model)
    sizes = []

    def run(batch):
        sizes.append(len(batch["x"]))
        return backend.run(batch)

    batch = {"x": np.arange(5 * 2 * 4, dtype=np.float32).reshape(5, 2, 4)}
    source = open_data(batch["x"], graph.input_specs(g.model), 5)
    axes = plan.output_sample_axes(g.model, run, batch, source)
    assert axes == {"y": 1}
    sizes.clear()
    outputs = plan.in_runs(run, source, 2, axes)(batch)
    assert sizes == [2, 2, 1]
    assert np.array_equal(outputs["y"], batch["x"]) and np.array_equal(outputs["z"], batch["x"])
    # Per-sample noise then pairs each sample with itself: sample 3's noise alone.
    noisy = {k: v.copy() for k, v in outputs.items()}
    noisy["y"][3] += 1.0
    assert np.flatnonzero(plan.sample_nsr(noisy, outputs)).tolist() == [3]
    # The NSR taken run by run (outputs never joined) is that of the joined outputs, exactly.
    assert plan.in_runs(run, source, 2, axes).pooled_nsr(batch, noisy) == \
        plan.pooled_nsr(outputs, noisy) > 0
    # Runs hold at most the budget's bytes of tensors: x, y, z are 3 x 32 bytes a sample.
    assert plan.samples_per_run(g, batch, source, budget=3 * 32 * 2) == 2
    assert plan.samples_per_run(g, batch, source, budget=1) == 1
    assert plan.samples_per_run(g, batch, source) == 5  # never more than the source's batch


def test_gemm_matmul_convtranspose_macs():
    nodes = [
        helper.make_node("Gemm", ["x", "wg"], ["g"], name="gemm", transB=1),
        helper.make_node("MatMul", ["g", "wm"], ["m"], name="matmul"),
        helper.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
        helper.make_node("ConvTranspose", ["r", "wt"], ["y"], name="deconv", strides=[2, 2]),
    ]
    g = make_graph(nodes, [("x", [4, 10])],
                   {"wg": weights(12, 10), "wm": weights(12, 8), "wt": weights(2, 3, 2, 2),
                    "shape": np.array([4, 2, 2, 2])})
    units = units_by_name(g)
    assert units["gemm"].macs == 4 * 12 * 10
    assert units["matmul"].macs == 4 * 8 * 12
    assert units["deconv"].macs == 4 * 2 * 2 * 2 * 3 * 2 * 2


def rule_reasons(g, context=None, shapes=None) -> dict[str, list[plan.Reason]]:
    units = plan.find_units(g, shapes)
    return plan.apply_rules(units, context or plan.RuleContext(g))


def codes(reasons) -> list[tuple[str, bool]]:
    return [(r.code, r.hard) for r in reasons]


def test_kernel_rule_small_odd_channels_and_gemv():
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="ok", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "w1"], ["b"], name="odd"),
        helper.make_node("Reshape", ["b", "shape"], ["f"], name="flat"),
        helper.make_node("MatMul", ["f", "w2"], ["y"], name="gemv"),
    ]
    g = make_graph(nodes, [("x", [1, 16, 4, 4])],
                   {"w0": weights(16, 16, 3, 3), "w1": weights(6, 16, 1, 3),
                    "shape": np.array([1, -1]), "w2": weights(48, 1)})
    reasons = rule_reasons(g)
    assert "ok" not in reasons
    assert codes(reasons["odd"]) == [("R-KERNEL", True)]
    assert "6 output channels" in reasons["odd"][0].evidence
    assert ("R-KERNEL", True) in codes(reasons["gemv"])
    assert "GEMV" in reasons["gemv"][0].evidence
    assert plan.allowed_precisions(reasons["odd"]) == ("fp16", "fp32")


def detector(decode: bool) -> graph.Graph:
    """backbone conv -> head conv -> Sigmoid -> output; optionally a DFL-style decode MatMul."""
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="backbone", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w1"], ["h"], name="head"),
        helper.make_node("Sigmoid", ["h"], ["y"], name="sigmoid"),
    ]
    inits = {"w0": weights(16, 16, 3, 3), "w1": weights(16, 16, 1, 1)}
    outputs = ["y"]
    if decode:
        nodes += [helper.make_node("Transpose", ["h"], ["t"], name="to_bins", perm=[0, 2, 3, 1]),
                  helper.make_node("Softmax", ["t"], ["p"], name="softmax", axis=-1),
                  helper.make_node("MatMul", ["p", "bins"], ["d"], name="expectation"),
                  helper.make_node("Mul", ["d", "stride"], ["boxes"], name="scale")]
        inits |= {"bins": np.arange(16.0).reshape(16, 1) * np.ones((1, 16)),
                  "stride": np.array(8.0)}
        outputs.append("boxes")
    return make_graph(nodes, [("x", [1, 16, 4, 4])], inits, outputs=outputs)


def test_head_rule_soft_for_heads_hard_for_decode():
    reasons = rule_reasons(detector(decode=False))
    assert "backbone" not in reasons
    assert codes(reasons["head"]) == [("R-HEAD", False)]
    reasons = rule_reasons(detector(decode=True))
    assert codes(reasons["expectation"]) == [("R-HEAD", True)]
    assert reasons["expectation"][0].allowed == ("fp32",)
    assert "decode" in reasons["expectation"][0].evidence
    # The head conv feeds the output through a Sigmoid and through the decode.
    assert codes(reasons["head"]) == [("R-HEAD", False)]


def depthwise(spread: float) -> graph.Graph:
    w = np.abs(weights(16, 1, 3, 3)) + 0.5
    w[3] *= spread
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="dw", group=16, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["a", "w1"], ["y"], name="pw")]
    return make_graph(nodes, [("x", [1, 16, 4, 4])], {"w": w, "w1": weights(16, 16, 1, 1)})


def test_depthwise_rule_on_wide_channel_ranges():
    assert "dw" not in rule_reasons(depthwise(2.0))
    reasons = rule_reasons(depthwise(1000.0))
    assert codes(reasons["dw"]) == [("R-DW", False)]
    assert plan.allowed_precisions(reasons["dw"]) == plan.allowed_precisions([])


def test_range_and_fp16_rules_from_calibration_ranges():
    g = depthwise(1.0)
    context = plan.RuleContext(g, amax={"x": 40.0, "a": 3000.0}, p9999={"x": 2.0, "a": 2500.0})
    reasons = rule_reasons(g, context)
    assert codes(reasons["dw"]) == [("R-RANGE", False), ("R-FP16", True)]
    assert "x: amax 40" in reasons["dw"][0].evidence
    # a (max 3000 > 512) is the output of dw and the input of pw: FP16 cannot hold either.
    assert codes(reasons["pw"]) == [("R-HEAD", False), ("R-FP16", True)]
    assert plan.allowed_precisions(reasons["pw"]) == ("int8", "fp32")


def test_hard_rules_combine_kernel_and_fp16_to_fp32():
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="odd")]
    g = make_graph(nodes, [("x", [1, 3, 4, 4])], {"w": weights(6, 3, 1, 3)})
    units = plan.find_units(g)
    reasons = plan.apply_rules(units, plan.RuleContext(g, amax={"y": 1e4}))
    assert codes(reasons["odd"]) == [("R-KERNEL", True), ("R-HEAD", False), ("R-FP16", True)]
    decided = plan.Plan.from_rules(units, reasons)
    assert decided.units["odd"].precision == "fp32"
    assert decided.int8_mac_share() == 0.0


def test_plan_from_rules_save_load_round_trip(tmp_path):
    g = detector(decode=True)
    units = plan.find_units(g)
    reasons = plan.apply_rules(units, plan.RuleContext(g))
    decided = plan.Plan.from_rules(units, reasons)
    decided.units["head"].evidence["sqnr_db"] = {"int8": 31.5, "fp16": 80.0}
    decided.units["head"].predicted = 0.25
    assert decided.node_precisions() == {"backbone": "int8", "head": "int8",
                                         "expectation": "fp32"}
    macs = {u.name: u.macs for u in units}
    assert decided.int8_mac_share() == pytest.approx(
        (macs["backbone"] + macs["head"]) / sum(macs.values()))
    path = decided.save(tmp_path / "plan.json")
    assert plan.Plan.load(path) == decided


def test_plan_load_errors(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "quantlab.scales"}))
    with pytest.raises(DataError, match="not a quantlab plan file"):
        plan.Plan.load(path)
    path.write_text(json.dumps({"format": "quantlab.plan", "version": 1, "metric": "",
                                "budget": None, "units": {"u": {"precision": "int4"}}}))
    with pytest.raises(DataError, match="damaged plan file"):
        plan.Plan.load(path)


def test_zoo_units_cover_every_linear_op():
    from quantlab.calibration import pipeline

    model = graph.normalize(pipeline.export_zoo_model("digits-cnn"))
    g = graph.Graph(model)
    units = plan.find_units(g, {"input": [1, 1, 8, 8]})
    linear = [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert sorted(n for u in units for n in u.linear) == sorted(linear)
    assert all(u.macs > 0 for u in units)


# ---------------------------------------------------------------- output-aware sensitivity

PLANTED = ("conv3", "conv5")


def planted_model(channels: int = 16, depth: int = 6) -> graph.Graph:
    """A chain of 3x3 conv + Relu; conv3's and conv5's inputs carry a huge, useless channel.

    The conv before each planted one adds a bias of 20 to channel 0 (after Relu: a
    constant 20), which the planted conv ignores (zero weights), but the channel sets
    that input's amax: its INT8 step becomes ~0.16 against values of ~0.3, so those two
    units dominate the INT8 output error, and nothing else is unusual.
    """
    rng = np.random.default_rng(0)
    nodes, inits, tensor = [], {}, "x"
    for i in range(1, depth + 1):
        w = rng.standard_normal((channels, channels, 3, 3)) / np.sqrt(channels * 9)
        b = np.zeros(channels)
        if f"conv{i + 1}" in PLANTED:
            b[0] = 20.0
        if f"conv{i}" in PLANTED:
            w[:, 0] = 0.0
        inits |= {f"w{i}": w, f"b{i}": b}
        nodes += [helper.make_node("Conv", [tensor, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}",
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        tensor = f"r{i}"
    nodes.append(helper.make_node("Conv", [tensor, "head_w"], ["y"], name="head"))
    inits["head_w"] = rng.standard_normal((4, channels, 1, 1))
    return make_graph(nodes, [("x", ["N", channels, 6, 6])], inits)


def test_sample_nsr_known_values():
    reference = {"y": np.array([[3.0, 4.0], [1.0, 0.0]]), "ids": np.array([1, 2])}
    outputs = {"y": np.array([[3.0, 4.5], [1.0, 0.0]]), "ids": np.array([1, 2])}
    np.testing.assert_allclose(plan.sample_nsr(outputs, reference), [0.25 / 25, 0.0])
    with pytest.raises(ModelError, match="no float outputs"):
        plan.sample_nsr({"ids": np.array([1])}, {"ids": np.array([1])})


def test_output_sqnr_is_pooled_as_validate_reports_it_not_a_mean_of_sample_ratios():
    from test_compare import LOUD_AND_QUIET_REF, LOUD_AND_QUIET_TEST, loud_and_quiet_sqnr

    pooled, per_sample = loud_and_quiet_sqnr()
    batches = [({k: v[i:i + 1] for k, v in LOUD_AND_QUIET_TEST.items()},
                {k: v[i:i + 1] for k, v in LOUD_AND_QUIET_REF.items()}) for i in range(2)]
    outputs, references = [o for o, _ in batches], [r for _, r in batches]
    assert plan.output_sqnr(outputs, references) == pytest.approx(pooled, rel=1e-12)
    assert plan.output_sqnr([LOUD_AND_QUIET_TEST], [LOUD_AND_QUIET_REF]) == pytest.approx(
        pooled, rel=1e-12)
    assert -10 * np.log10(plan.pooled_nsr(LOUD_AND_QUIET_TEST, LOUD_AND_QUIET_REF)) == \
        pytest.approx(pooled, rel=1e-12)
    # The per-sample ratios rank samples (hardest_samples); they are not the output SQNR.
    assert -10 * np.log10(plan.sample_nsr(LOUD_AND_QUIET_TEST, LOUD_AND_QUIET_REF).mean()) == \
        pytest.approx(per_sample, rel=1e-12)


def test_sample_nsr_in_pieces_equals_the_whole_batch_in_float64(monkeypatch):
    from quantlab.evaluation import compare

    rng = np.random.default_rng(3)
    reference = {"y": rng.standard_normal((7, 5, 3)).astype(np.float32)}
    outputs = {"y": reference["y"] + rng.standard_normal((7, 5, 3)).astype(np.float32) * 0.1}
    ref, out = (a["y"].reshape(7, -1).astype(np.float64) for a in (reference, outputs))
    expected = ((out - ref) ** 2).sum(axis=1) / (ref ** 2).sum(axis=1)
    monkeypatch.setattr(compare, "_FLOAT64_ROWS_BYTES", 2 * 15 * 8)  # 2 samples a piece
    np.testing.assert_allclose(plan.sample_nsr(outputs, reference), expected, rtol=1e-13)


def planned(model, calibration, evaluation, amax, ranges, p9999, *, candidates=None, task=None,
            checkpoint=None, repairs=None, progress=None, **settings) -> plan.PlanResult:
    """plan.make_plan of `model` and its calibration, with these settings."""
    return plan.make_plan(plan.CalibratedModel(model, amax, ranges, p9999, candidates),
                          calibration, evaluation, plan.PlanSettings(**settings), task=task,
                          checkpoint=checkpoint, repairs=repairs, progress=progress)


@pytest.fixture(scope="module")
def planted_case():
    """The planted model, its data, its FP32 backend, a plan runner (unit -> precision:
    the plan's Q/DQ model run on a batch, as the planner's trials run it) and its units."""
    from quantlab import data
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g = planted_model()
    samples = np.random.default_rng(1).standard_normal((64, 16, 6, 6)).astype(np.float32)
    # Samples 5 and 40 are quieter: against fixed INT8 steps their relative error is largest.
    samples[[5, 40]] *= 0.2
    source = data.open_data(samples, g.inputs, batch_size=16)
    fp32 = OnnxRuntimeBackend(g.model)
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run({"x": samples}, names).items()}
    units = plan.find_units(g, {"x": [16, 16, 6, 6]})

    def run_plan(precisions):
        nodes = {n: precisions.get(u.name, "int8") for u in units for n in u.nodes}
        return OnnxRuntimeBackend(qdq.quantize_model(g.model, amax, nodes)).run

    return g, source, fp32, run_plan, units


def planted_trials(run_plan, units, batch, references, **options) -> plan.Trials:
    return plan.Trials(measure_plan(run_plan, batch, references), [u.name for u in units],
                       **options)


def measure_plan(run_plan, batch, references):
    """A trial's measure (``Trials.measure``); the sessions' thread count is left to ONNX
    Runtime."""
    return lambda precisions, threads=None: plan.pooled_nsr(run_plan(precisions)(batch),
                                                             references)


def test_hardest_samples_are_the_quietest(planted_case):
    g, source, fp32, run_plan, _ = planted_case
    seen = []  # a progress wrapper (tqdm) yields the batches but is not the source
    batch, indices, _, drawn = plan.hardest_samples(
        source, fp32.run, run_plan({}), count=4,
        progress=lambda b: seen.append(1) or iter(list(b)))
    assert seen == [1] and drawn is None
    assert {5, 40} <= set(indices.tolist()) and len(indices) == 4
    assert list(indices) == sorted(indices)
    np.testing.assert_array_equal(batch["x"][list(indices).index(40)], next(
        b for i, b in enumerate(source) if i == 2)["x"][8])


def test_hardest_samples_also_draw_random_samples(planted_case):
    """The draw: up to `count` distinct samples in data order, their inputs and the
    reference's outputs on them; not the hardest (a seeded uniform draw of 8 of 64
    holds both of the 2 quietest with probability 8*7/(64*63) = 1.4 %)."""
    g, source, fp32, run_plan, _ = planted_case
    samples = np.concatenate([b["x"] for b in source])
    _, _, _, drawn = plan.hardest_samples(source, fp32.run, run_plan({}), count=8, draw=True)
    batch, references = drawn.inputs, drawn.references
    indices = np.array([int(np.argmin(np.abs(samples - x).reshape(64, -1).max(axis=1)))
                        for x in batch["x"]])
    assert len(set(indices.tolist())) == len(indices) == 8
    assert list(indices) == sorted(indices) and not {5, 40} <= set(indices.tolist())
    np.testing.assert_array_equal(batch["x"], samples[indices])
    np.testing.assert_array_equal(references["y"], fp32.run({"x": samples})["y"][indices])
    _, _, _, every = plan.hardest_samples(source, fp32.run, fp32.run, count=100, draw=True)
    np.testing.assert_array_equal(every.inputs["x"], samples)


def test_hardest_samples_keep_every_samples_energies(planted_case):
    """Besides the hardest samples, the pass keeps the candidate's per-sample noise and
    signal energies over all samples: what the all-INT8 screen for output SQNR reads.
    Equal to the energies of all samples run at once (float64 sums in another order)."""
    g, source, fp32, run_plan, _ = planted_case
    samples = np.concatenate([b["x"] for b in source])
    _, _, energies, drawn = plan.hardest_samples(source, fp32.run, run_plan({}), count=8)
    assert drawn is None
    expected = plan.sample_energies(run_plan({})({"x": samples}), fp32.run({"x": samples}))
    for got, want in zip(energies, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_all_samples_are_the_hardest_when_no_more_are_wanted(planted_case):
    """With as many samples wanted as there are, the hardest samples are all of them, in
    data order: what the planner takes without the ranking pass (measure.all_samples)."""
    from quantlab.planner.measure import all_samples

    g, source, fp32, run_plan, _ = planted_case
    batch, indices, _, _ = plan.hardest_samples(source, fp32.run, run_plan({}), count=64)
    assert indices.tolist() == list(range(64))
    every = all_samples(source)
    np.testing.assert_array_equal(every["x"], batch["x"])
    np.testing.assert_array_equal(every["x"], np.concatenate([b["x"] for b in source]))


@pytest.mark.parametrize("budget, value, trials, expected", [
    # max_drop 2, FP32 100. The noise allowed is N * (2 / drop) ** 2 (power 0.5 from a
    # single failure); the random trials measure about N / 2.
    ((2.0, None), 89.5, 24, 6),   # drop 10.5: 0.036 N, x2 = 0.073 N < N / 2: a quarter
    ((2.0, None), 95.0, 24, 6),   # drop 5: 0.16 N, x2 = 0.32 N < N / 2 (power 1: 0.8 N)
    ((2.0, None), 96.5, 24, None),  # drop 3.5: 0.327 N, x2 = 0.65 N >= N / 2 (alone: < N / 2)
    # All-INT8 inside the budget but not certified (a near miss): the plans that matter are
    # near all-INT8, not the random half-and-half plans, so a quarter (6 before the law's
    # 1.78 N, x2 >= N / 2, asked for every trial at a drop of 1.5; no drop at all, too).
    ((2.0, None), 98.5, 24, 6),
    ((2.0, None), 100.0, 24, 6),
    ((2.0, None), 89.5, 2, 1),    # a quarter of 2 rounds to 0: at least 1
    # min_sqnr 20: the noise allowed is N * 10 ** ((value - 20) / 10).
    ((None, 20.0), 15.78, 24, None),  # 0.378 N, x2 = 0.76 N >= N / 2
    ((None, 20.0), 10.0, 24, 6),    # 0.1 N, x2 = 0.2 N < N / 2
])
def test_random_trials_may_stop_early_where_the_budget_lies_far_below_their_noise(
        budget, value, trials, expected):
    """least_random_trials against the noise the budget allows, worked out by hand from
    all-INT8's evaluation (predicted noise N = 4.86e-3, as on the layout detector): None
    (every trial runs) or the least number that runs."""
    max_drop, min_sqnr = budget
    reference = float("inf") if min_sqnr is not None else 100.0
    limit = min_sqnr if min_sqnr is not None else reference - max_drop
    first = plan.Evaluation(1.0, 4.86e-3, plan.Certificate(
        "m", reference, value, limit, (value - limit - 1, value - limit + 1), 0.95, 16,
        False, False, None), 1.0)
    settings = flow.PlanSettings(metric="m" if min_sqnr is None else "sqnr",
                                 max_drop=max_drop, min_sqnr=min_sqnr, trials=trials)
    assert least_random_trials(settings, first) == expected


def test_random_trials_stop_once_predicted_and_go_on_while_they_surprise_the_fit(capsys):
    """group_test's `least`: noise exactly additive over 40 units (0.01 each). With local
    errors that say so, the fit of the trials before predicts every trial, so they stop
    after PREDICTED_IN_A_ROW in a row once `least` ran (6 of 24). With one unit's local
    error 1000x too small (an amplifier: 100x the others' noise, alone), a draw holding it
    is under-predicted until the fit has seen enough of them, and the trials go on. Every
    trial run is one of the seeded draws, in order; without `least` all 24 run. A log's
    progress lines end where the trials stop."""
    from quantlab.planner import trials as trials_module
    from quantlab.progress import LogLines

    names = [f"u{i}" for i in range(40)]
    true = np.full(40, 0.01)
    true[7] = 1.0

    def measure(precisions, threads=None):
        return float(sum(t for n, t in zip(names, true, strict=True)
                         if precisions[n] == "int8"))

    local = dict(zip(names, true, strict=True))
    wrong = {**local, "u7": 0.001}
    exact = plan.group_test(plan.Trials(measure, names), 24, prior_nsr=local, least=6,
                            progress=lambda rows: LogLines(rows, desc="trials"))
    assert len(exact.nsr) == max(6, trials_module.PREDICTED_IN_A_ROW + 1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "trials: started, 23 it" and lines[-1].startswith(
        f"trials: done, {len(exact.nsr) - 1} it")
    amplified = plan.group_test(plan.Trials(measure, names), 24, prior_nsr=wrong, least=6)
    every = plan.group_test(plan.Trials(measure, names), 24, prior_nsr=wrong)
    assert len(exact.nsr) < len(amplified.nsr) <= len(every.nsr) == 24
    np.testing.assert_array_equal(amplified.masks, every.masks[:len(amplified.nsr)])
    np.testing.assert_array_equal(amplified.nsr, every.nsr[:len(amplified.nsr)])


def test_random_trials_run_side_by_side_are_the_trials_run_one_by_one(monkeypatch):
    """group_test runs at once the trials that run whatever they measure (the stop rule cannot
    fire before them). Reference: the same group_test one trial at a time: the same trials,
    noise and fit, where the trials stop early, where they go on while they surprise the
    fit, and without `least`; no trial is run past the stop, and with 4 sessions side by
    side some runs hold several trials."""
    from quantlab.planner import trials as trials_module

    names = [f"u{i}" for i in range(40)]
    true = np.full(40, 0.01)
    true[7] = 1.0
    local = dict(zip(names, true, strict=True))
    wrong = {**local, "u7": 0.001}
    results = {}
    for at_once in (1, 4):
        monkeypatch.setattr(trials_module, "side_by_side", lambda at_once=at_once: at_once)
        for case, (prior, least) in enumerate(((local, 6), (wrong, 6), (wrong, None))):
            measured = []

            def measure(precisions, threads=None, measured=measured):
                measured.append(1)
                return float(sum(t for n, t in zip(names, true, strict=True)
                                 if precisions[n] == "int8"))

            trials = plan.Trials(measure, names)
            runs, run = [], trials.run
            trials.run = lambda masks, runs=runs, run=run: runs.append(len(masks)) or run(masks)
            sensitivity = plan.group_test(trials, 24, prior_nsr=prior, least=least)
            assert len(measured) == len(sensitivity.nsr)  # none run past the stop
            results[at_once, case] = sensitivity, runs
    for case in range(3):
        (one, one_runs), (four, four_runs) = results[1, case], results[4, case]
        np.testing.assert_array_equal(four.masks, one.masks)
        np.testing.assert_array_equal(four.nsr, one.nsr)
        np.testing.assert_array_equal(four.contribution, one.contribution)
        assert set(one_runs) == {1} and max(four_runs) > 1
        assert sum(four_runs) == sum(one_runs) and len(four_runs) < len(one_runs)


def test_group_test_ranks_planted_units_first(planted_case):
    g, source, fp32, run_plan, units = planted_case
    batch, _, _, _ = plan.hardest_samples(source, fp32.run, run_plan({}), count=16)
    references = fp32.run(batch)
    found = plan.group_test(planted_trials(run_plan, units, batch, references), 16, seed=0)
    assert set(found.ranking()[:2]) == set(PLANTED)
    assert found.masks.shape == (16, len(units)) and found.masks[0].all()
    # The fit reproduces the all-INT8 trial it was fitted on.
    assert found.predicted_nsr(found.units) == pytest.approx(found.nsr[0], rel=0.2)
    planted_share = sum(found.contribution[found.units.index(u)] for u in PLANTED)
    assert planted_share > 0.8 * found.contribution.sum()


def test_group_test_prior_ranks_units_the_trials_cannot_tell_apart(planted_case):
    """With the all-INT8 trial alone every split of its noise fits; the prior picks one.

    The fit then keeps the prior exactly: local NSR times one gain, adding up to
    the trial's noise; a pinned unit gets none, a unit without a local figure the
    median. Without local figures the noise is split evenly.
    """
    g, source, fp32, run_plan, units = planted_case
    batch = next(iter(source))
    names = [u.name for u in units]
    local = {u: 1e-4 * (i + 1) for i, u in enumerate(names[:-2])}  # names[-2] has none
    fixed = {names[-1]: "fp32"}
    found = plan.group_test(planted_trials(run_plan, units, batch, fp32.run(batch), fixed=fixed),
                            1, prior_nsr=local)
    figures = [*local.values(), float(np.median(list(local.values())))]
    expected = np.array([*figures, 0.0]) * found.nsr[0] / sum(figures)
    np.testing.assert_allclose(found.contribution, expected, rtol=1e-6)
    without = plan.group_test(planted_trials(run_plan, units, batch, fp32.run(batch)), 1)
    np.testing.assert_allclose(without.contribution, without.nsr[0] / len(names), rtol=1e-9)


# ---------------------------------------------------------------- search and certification


def test_solve_knapsack_and_front_with_hard_pins():
    units = [plan.Unit(n, [n], [n], [], [], macs) for n, macs in
             [("a", 100), ("b", 50), ("c", 40), ("pinned", 10)]]
    contribution = {"a": 0.5, "b": 0.2, "c": 0.2, "pinned": 0.0}
    allowed = {"pinned": ("fp16", "fp32")}
    best = plan.solve(units, allowed, contribution, budget=0.45)
    # a alone (100 MACs) does not fit 0.45; b + c (90 MACs, 0.4) does.
    assert best.precisions == {"a": "fp16", "b": "int8", "c": "int8", "pinned": "fp16"}
    assert best.int8_mac_share == pytest.approx(90 / 200)
    assert best.predicted == pytest.approx(0.4)
    assert plan.solve(units, allowed, contribution, 0.0, "fp32").precisions["a"] == "fp32"
    points = plan.front(units, allowed, contribution)
    shares = [p.int8_mac_share for p in points]
    assert shares == sorted(shares) and shares[0] == 0.0 and shares[-1] == pytest.approx(190 / 200)
    assert all(p.precisions["pinned"] == "fp16" for p in points)
    with pytest.raises(ConfigError, match="budget must be a number >= 0"):
        plan.solve(units, allowed, contribution, float("nan"))


def test_most_int8_is_the_last_plan_of_the_front():
    """most_int8 (one MILP pair) gives the front's last plan (a hundred): over 150 units, so
    that the front thins its budgets, with pins, FP16 contributions (one infinite) and units
    free of noise, for both high precisions."""
    from quantlab.planner.search import most_int8

    rng = np.random.default_rng(3)
    units = [plan.Unit(f"u{i}", [f"u{i}"], [f"u{i}"], [], [], int(m))
             for i, m in enumerate(rng.integers(1, 10_000, 150))]
    contribution = {u.name: float(10.0 ** rng.uniform(-9, -2)) for u in units}
    contribution.update(u0=0.0, u1=0.0)
    fp16 = {name: c / 300 for name, c in contribution.items()}
    fp16["u2"] = float("inf")
    allowed = {"u3": ("fp16", "fp32"), "u4": ("fp32",)}
    for high in ("fp16", "fp32"):
        last = plan.front(units, allowed, contribution, high, fp16)[-1]
        assert most_int8(units, allowed, contribution, high, fp16) == last
        assert last.precisions["u3"] == ("fp16" if high == "fp16" else "fp32")
        assert last.int8_mac_share == pytest.approx(
            sum(u.macs for u in units if u.name not in allowed) / sum(u.macs for u in units))


def test_solve_equals_brute_force_with_contributions_over_many_decades():
    """Contributions from 1e-13 to 1 (fits with a prior leave such spreads): the MILP's
    choice is at least as good as the best subset by exhaustive search, and over the
    budget by at most HiGHS's feasibility tolerance (1e-7) on the constraint scaled to
    the largest contribution, summed over the units: 1e-6 of the largest. Unscaled,
    HiGHS returned choices over the budget by far more."""
    import itertools

    rng = np.random.default_rng(5)
    count = 12
    macs = rng.integers(1_000, 1_000_000, count)
    weights = 10.0 ** rng.uniform(-13, 0, count)
    units = [plan.Unit(f"u{i}", [f"u{i}"], [f"u{i}"], [], [], int(m)) for i, m in enumerate(macs)]
    contribution = {u.name: float(w) for u, w in zip(units, weights, strict=True)}
    subsets = [np.array(bits, bool) for bits in itertools.product([0, 1], repeat=count)]
    for budget in [0.0, *np.sort(weights)[:: 2].cumsum(), weights.sum() / 3]:
        best = max(macs[s].sum() for s in subsets if weights[s].sum() <= budget)
        point = plan.solve(units, {}, contribution, float(budget), "fp32")
        chosen = np.array([point.precisions[u.name] == "int8" for u in units])
        assert weights[chosen].sum() <= budget + 1e-6 * weights.max()
        assert macs[chosen].sum() >= best


def test_front_checks_measure_front_plans_the_trials_could_not_and_the_refit_learns():
    """Saturated trials (every one runs the big unit u0 in INT8; output noise tops
    out at 0.3) say nothing about the nine small units: the fit keeps them at their
    prior (no local figures here: the noise split evenly, 0.03 each, 7x too much).
    The checks measure front plans (unsaturated there: 0.004 per small unit), and
    the refit predicts every checked plan within the factor 2 the planner stops at."""
    names = [f"u{i}" for i in range(10)]
    true = np.array([1.0, *[0.004] * 9])
    units = [plan.Unit(n, [n], [n], [], [], 100) for n in names]
    masks = np.array([[True] * 10, [True] * 5 + [False] * 5, [True] + [False] * 4 + [True] * 5])
    fit = plan.OutputSensitivity(names, masks, np.minimum(masks @ true, 0.3), np.zeros(10))
    fit = fit.with_trials(np.zeros((0, 10), bool), np.zeros(0))  # the fit of these trials
    assert fit.contribution[1:].min() > 2 * true[1]
    points = plan.front(units, {}, dict(zip(names, fit.contribution, strict=True)), "fp32")
    checks = front_masks(points, fit)
    assert 0 < len(checks) <= plan.FRONT_CHECKS
    assert not any((c == m).all() for c in checks for m in masks)  # only plans not yet run
    measured = np.minimum(checks @ true, 0.3)
    before = checks @ fit.contribution
    assert np.any((before > 2 * measured) | (measured > 2 * before))  # the fit was off there
    refit = fit.with_trials(checks, measured)
    predicted = checks @ refit.contribution
    assert np.all((predicted <= 2 * measured) & (measured <= 2 * predicted))
    assert len(refit.nsr) == len(masks) + len(checks)


def test_search_meets_the_budget_on_the_planted_model_and_certifies_real_int8(planted_case):
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g, source, fp32, run_plan, units = planted_case
    batch, _, _, _ = plan.hardest_samples(source, fp32.run, run_plan({}), count=16)
    found = plan.group_test(planted_trials(run_plan, units, batch, fp32.run(batch)), 16)
    # Output SQNR pooled over the hardest 16 (docs/metrics.md): all INT8 12.8 dB, conv5 pinned
    # 20.7, conv3 and conv5 pinned 30.0.
    floor_db = 21.5
    chosen = plan.solve(units, {}, dict(zip(found.units, found.contribution, strict=True)),
                        budget=10 ** (-floor_db / 10))
    assert {u for u, p in chosen.precisions.items() if p != "int8"} == set(PLANTED)
    assert chosen.int8_mac_share > 0.6
    # Measured on the hardest samples and certified on all of them (integer kernels).
    measured = measure_plan(run_plan, batch, fp32.run(batch))(chosen.precisions)
    assert -10 * np.log10(measured) >= floor_db
    node_plan = {n: chosen.precisions[u.name] for u in units for n in u.nodes}
    amax = {t: float(np.abs(v).max()) for t, v in fp32.run(
        {"x": np.concatenate([b["x"] for b in source])},
        qdq.activation_tensors_to_calibrate(g.model)).items()}
    int8 = OnnxRuntimeBackend(qdq.quantize_model(g.model, amax, node_plan))
    outputs, references = [int8.run(b) for b in source], [fp32.run(b) for b in source]
    result = plan.certify(plan.output_sqnr, "sqnr", outputs, references, floor=floor_db)
    assert result.certified and result.interval[0] >= 0 and result.samples == 64
    assert result.value >= floor_db and result.reference == float("inf")
    all_int8 = [run_plan({})(b) for b in source]
    assert not plan.certify(plan.output_sqnr, "sqnr", all_int8, references,
                            floor=floor_db).certified


def test_custom_metric_round_trip(tmp_path, monkeypatch):
    (tmp_path / "my_metric.py").write_text(
        "import numpy as np\n"
        "calls = []\n"
        "def closeness(outputs, references):\n"
        "    calls.append((len(outputs), sorted(outputs[0]), sorted(references[0])))\n"
        "    return -float(np.mean([np.abs(o['y'] - r['y']).mean()\n"
        "                           for o, r in zip(outputs, references)]))\n"
        "def broken(outputs, references):\n"
        "    return float('nan')\n"
        "def wordy(outputs, references):\n"
        "    return 'good'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    metric = plan.resolve_metric("my_metric:closeness")
    import my_metric

    rng = np.random.default_rng(0)
    references = [{"y": rng.standard_normal((4, 3))} for _ in range(3)]
    outputs = [{"y": r["y"] + 0.01} for r in references]
    result = plan.certify(metric, "my_metric:closeness", outputs, references, max_drop=0.02,
                          resamples=20)
    assert my_metric.calls[0] == (12, ["y"], ["y"])  # one entry per sample, dicts by output
    assert my_metric.calls[-1][0] == 12  # resampled: one entry per sample
    assert result.reference == 0.0 and result.value == pytest.approx(-0.01)
    assert result.certified and not result.too_small
    assert not plan.certify(metric, "m", outputs, references, max_drop=0.005,
                            resamples=20).certified
    with pytest.raises(DataError, match="metric 'my_metric:broken' returned NaN on FP32 on "
                       "evaluation samples 0..11"):
        plan.certify(plan.resolve_metric("my_metric:broken"), "my_metric:broken", outputs,
                     references, max_drop=0.1)
    with pytest.raises(DataError, match="returned 'good' on FP32 on evaluation samples 0..11; "
                       "it must return a number"):
        plan.certify(plan.resolve_metric("my_metric:wordy"), "my_metric:wordy", outputs,
                     references, max_drop=0.1)


def test_metric_and_budget_errors():
    with pytest.raises(ConfigError, match="unknown metric 'mAP50'; use one of sqnr, agreement"):
        plan.resolve_metric("mAP50")
    with pytest.raises(ConfigError, match="cannot load metric 'no_such_module:f'"):
        plan.resolve_metric("no_such_module:f")
    references = [{"y": np.eye(3)}]
    with pytest.raises(ConfigError, match="impossible even in FP32"):
        plan.certify(plan.argmax_agreement, "agreement", references, references, max_drop=-0.1)
    with pytest.raises(ConfigError, match="above its value for the FP32 model itself"):
        plan.certify(plan.argmax_agreement, "agreement", references, references, floor=1.5)
    with pytest.raises(ConfigError, match="Use a floor"):
        plan.certify(plan.output_sqnr, "sqnr", references, references, max_drop=1.0)


def test_too_small_eval_set_is_reported():
    rng = np.random.default_rng(0)
    references = [{"y": rng.standard_normal((10, 5))}]
    # Half the samples flip their argmax: the interval over 10 samples is far wider than 0.02.
    outputs = [{"y": np.where(np.arange(10)[:, None] % 2, -references[0]["y"], references[0]["y"])}]
    result = plan.certify(plan.argmax_agreement, "agreement", outputs, references, max_drop=0.02)
    assert result.too_small and not result.certified
    assert result.needed_samples > 10 * 100
    half_width = (result.interval[1] - result.interval[0]) / 2
    message = result.too_small_message()
    assert "a drop of 0.02 in agreement: on its 10 samples" in message
    assert f"+-{half_width:.3g}" in message and f"about {result.needed_samples} samples" in message
    assert "--eval" in message and "--max-drop" in message


def test_data_shortfalls_are_named_before_any_model_run():
    messages = plan.data_shortfalls(48, 64, 64, "agreement", 0.01)
    assert len(messages) == 2
    assert "calibration data hold 48 samples, fewer than the 64 hardest" in messages[0]
    assert "--hard-samples below 48" in messages[0]
    assert "less than one sample of the 64 in the evaluation set (1/64 = 0.0156)" in messages[1]
    assert "at least 100 samples with --eval" in messages[1]
    # Output SQNR is not a share of samples; 640 samples resolve a 0.01 drop.
    assert plan.data_shortfalls(64, 64, 64, "sqnr", 0.01) == []
    assert plan.data_shortfalls(64, 640, 64, "agreement", 0.01) == []


def test_make_plan_names_data_shortfalls_before_any_model_run(planted_case):
    from quantlab.calibration import qdq

    g, source, fp32, *_ = planted_case
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        {"x": np.concatenate([b["x"] for b in source])}, names).items()}
    seen = []

    def progress(items, desc):
        seen.append((desc, [str(w.message)[:40] for w in caught]))
        return items

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = planned(g.model, source, source, amax, amax, amax, metric="agreement",
                                max_drop=0.01, trials=4, hard_count=100, progress=progress)
    assert str(caught[0].message).startswith("the calibration data hold 64 samples")
    assert str(caught[1].message).startswith("a drop of 0.01 in agreement is less than one")
    # The first pass with a progress bar comes after both: the single units here (the
    # hardest samples are all 64, fewer than --hard-samples, taken without the ranking
    # pass; all-INT8 is screened out on them; FP32's evaluation runs with the first plan
    # evaluated).
    assert seen[0] == ("single units", [str(w.message)[:40] for w in caught[:2]])
    # All INT8 fails whatever the set's size (its whole interval is below the limit): its
    # width says nothing about the plans nearer the budget, so no early warning.
    first = result.evaluations[0].certificate
    assert first.too_small and first.interval[1] < 0 and not first.inconclusive
    assert len(caught) == 2


def test_inconclusive_when_the_interval_is_too_wide_and_reaches_the_budget():
    def certificate(interval):
        return plan.Certificate("map", 0.66, 0.655, 0.65, interval, 0.95, 500, False, True, 2103)

    assert certificate((-0.004, 0.016)).inconclusive
    assert not certificate((-0.03, -0.01)).inconclusive
    assert not plan.Certificate("map", 0.66, 0.66, 0.65, (0.001, 0.02), 0.95, 500, True, False,
                                None).inconclusive


def test_pinned_tensors_leave_the_calibration_cache():
    g = residual_block()
    units = plan.find_units(g, {"x": [2, 3, 8, 8]})
    decided = plan.Plan.from_rules(units, {})
    assert plan.pinned_tensors(decided, g) == set()
    decided.units["conv1"].precision = "fp16"
    decided.units["conv3"].precision = "fp32"
    # conv1's unit reads r, writes b; its Add reads c and r, writes s; side writes e; conv3 p -> d.
    assert plan.pinned_tensors(decided, g) == {"r", "b", "c", "s", "e", "p", "d"}


def test_make_plan_on_the_planted_model(planted_case):
    from quantlab.calibration import calibrate, collect, qdq

    g, source, fp32, run_plan, units = planted_case
    stats = collect.collect(g.model, source, qdq.activation_tensors_to_calibrate(g.model),
                            progress=False)
    amax = calibrate.calibrate(stats, "max").amax
    p9999 = calibrate.calibrate(stats, "percentile").amax
    result = planned(g.model, source, source, amax, amax, p9999, min_sqnr=24.0,
                            trials=16, hard_count=16)
    assert result.certificate.certified and result.certificate.value >= 24.0
    assert result.model_runs <= 4
    assert result.outside_units == []  # with every unit out of INT8, nothing is quantized
    assert not result.evaluations[0].certificate.certified  # all-INT8 misses 24 dB
    predicted = [p.predicted for p in result.front]
    assert predicted == sorted(predicted)
    pinned = {u for u, d in result.plan.units.items() if d.precision != "int8"}
    assert pinned == set(PLANTED)
    assert {result.plan.units[u].evidence["output_rank"] for u in PLANTED} == {1, 2}
    assert all([r.code for r in result.plan.units[u].reasons] == ["M-SEARCH"] for u in PLANTED)
    assert "rank" in result.plan.units["conv5"].reasons[0].evidence
    local = {u: d.evidence["local_sqnr_int8_db"] for u, d in result.plan.units.items()}
    assert set(sorted(local, key=local.get)[:2]) == set(PLANTED)
    # The planted units' FP16 error is tiny: the budget INT8 leaves holds them in FP16.
    assert all(result.plan.units[u].precision == "fp16" for u in PLANTED)
    assert all(d.evidence["local_sqnr_fp16_db"] > d.evidence["local_sqnr_int8_db"] + 20 and
               0 <= d.evidence["fp16_nsr_contribution"] < 1e-4 * d.predicted
               for u, d in result.plan.units.items() if u in PLANTED)
    # The written Q/DQ model is the plan: planted units read FP16 casts, the others Q/DQ.
    types = {n.name: [i for i in n.input] for n in result.qdq_model.graph.node}
    assert all(name.endswith("_fp16") for name in types["conv3"][:2])
    assert types["conv4"][0].endswith("_dequantized")
    assert plan.read_back(result.qdq_model, units) == {
        u: d.precision for u, d in result.plan.units.items()}
    with pytest.raises(ConfigError, match="does not go with --metric agreement"):
        planned(g.model, source, source, amax, amax, p9999, metric="agreement",
                       min_sqnr=10.0)


def test_all_int8_that_certifies_first_needs_no_other_trial(planted_case):
    """A floor all-INT8 holds: the plan is all-INT8, certified on its first evaluation, from
    the all-INT8 trial alone (the trials and front checks that could not change it are not
    run). Under a floor it misses, the trials run after it and the same all-INT8 trial is
    trial 0 of the fit, not run again."""
    from quantlab.calibration import qdq

    g, source, fp32, run_plan, units = planted_case
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        next(iter(source)), qdq.activation_tensors_to_calibrate(g.model)).items()}
    loose = planned(g.model, source, source, amax, amax, amax, min_sqnr=10.0, trials=8,
                    hard_count=16)
    assert loose.plan.int8_mac_share() == 1.0 and loose.certificate.certified
    assert len(loose.sensitivity.nsr) == 1 and loose.model_runs == 1
    assert "trials" not in loose.phases and "front checks" not in loose.phases
    tight = planned(g.model, source, source, amax, amax, amax, min_sqnr=24.0, trials=8,
                    hard_count=16)
    assert "trials" in tight.phases
    # The first trials are group_test's draws (seed 0, row 0 all-INT8), all-INT8 not
    # repeated: all 8, or from 2 where the floor lies far below their noise
    # (least_random_trials).
    count = tight.trial_cost["random_trials"]
    assert 2 <= count <= 8
    drawn = np.random.default_rng(0).random((8, len(tight.sensitivity.units))) < 0.5
    drawn[0] = True
    np.testing.assert_array_equal(tight.sensitivity.masks[:count], drawn[:count])
    assert tight.sensitivity.nsr[0] == pytest.approx(loose.sensitivity.nsr[0], rel=1e-12)


def test_make_plan_screens_out_all_int8_failing_beyond_doubt_on_calibration_data(planted_case):
    """A metric of outputs alone: the all-INT8 plan, far below the floor on the
    calibration samples drawn (here all 16, as --hard-samples is 16), is judged on them
    instead of evaluated.

    The screened value is the output SQNR of the separately built all-INT8 Q/DQ model
    (ONNX Runtime) on those samples, to 1e-3 dB: the planner runs that model. It is
    no model run on the evaluation set, and the search still certifies a plan there.
    """
    from quantlab import data
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g, source, fp32, run_plan, units = planted_case
    samples = np.concatenate([b["x"] for b in source])[:16]
    calibration = data.open_data(samples, g.inputs, batch_size=8)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        {"x": samples}, qdq.activation_tensors_to_calibrate(g.model)).items()}
    result = planned(g.model, calibration, source, amax, amax, amax, min_sqnr=24.0,
                            trials=8, hard_count=16, bias_correction=False)
    first = result.evaluations[0]
    assert first.screened and not first.model_run and first.int8_mac_share == 1.0
    assert first.certificate.samples == 16 and first.certificate.interval[1] < 0
    nodes = {n: result.front[-1].precisions[u.name] for u in units for n in u.nodes}
    int8 = OnnxRuntimeBackend(qdq.quantize_model(g.model, result.amax, nodes))
    want = plan.output_sqnr([int8.run({"x": samples})], [fp32.run({"x": samples})])
    assert want < 24.0 and first.certificate.value == pytest.approx(want, abs=1e-3)
    assert result.model_runs == len(result.evaluations) - 1
    assert result.certificate.certified and not result.evaluations[result.chosen].screened


def test_all_int8_screen_reads_the_outputs_bias_correction_made_of_the_same_plan(planted_case):
    """A metric of outputs (agreement) with all the calibration samples hard: the all-INT8
    screen reads the outputs that bias correction's weighing made of the kept variant (the
    same plan on the same samples), not a run of its own. Reference: the agreement of the
    separately built all-INT8 Q/DQ model, with the bias shifts that repairs.bias_shifts
    measures applied where the plan kept them, on those samples: equal to float rounding
    (1e-12: the same outputs, one sample at a time or all at once)."""
    from quantlab.calibration import qdq, repairs
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g, source, fp32, *_ = planted_case
    names = qdq.activation_tensors_to_calibrate(g.model)
    samples = np.concatenate([b["x"] for b in source])
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run({"x": samples}, names).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the data shortfalls, tested above
        result = planned(g.model, source, source, amax, amax, amax, metric="agreement",
                         max_drop=0.01, trials=4, hard_count=100)
    first = result.evaluations[0]
    assert first.screened and first.certificate.samples == len(samples)
    record = next(r for r in result.plan.repairs if r["repair"] == "bias_correction")
    built = qdq.quantize_model(g.model, result.amax)
    if record["chosen"]:
        shifts, _ = repairs.bias_shifts(g.model, built, source)
        built = repairs.shift_biases(g.model, built, shifts)
    want = plan.argmax_agreement([OnnxRuntimeBackend(built).run({"x": samples})],
                                 [fp32.run({"x": samples})])
    assert first.certificate.value == pytest.approx(want, rel=1e-12)


def noisy_outputs(seed: int = 4):
    rng = np.random.default_rng(seed)
    references = [{"y": rng.standard_normal((6, 5, 2)), "z": rng.standard_normal((6, 3))}
                  for _ in range(3)]
    outputs = [{k: v + 0.3 * rng.standard_normal(v.shape) for k, v in r.items()}
               for r in references]
    return outputs, references


def test_certify_resamples_output_sqnr_as_per_sample_numbers():
    """Output SQNR pools each output's noise and signal energy over the samples: the
    bootstrap resamples per-sample energies. Reference: the energies in float64 from scratch
    and the same seeded resamples (pooled per output, the ratios averaged over the outputs);
    equal to float64 rounding."""
    outputs, references = noisy_outputs()

    def energies(o, r):
        return np.array([[((o[k] - r[k]) ** 2).reshape(len(r[k]), -1).sum(axis=1),
                          (r[k] ** 2).reshape(len(r[k]), -1).sum(axis=1)] for k in r])

    per_sample = np.concatenate([energies(o, r) for o, r in zip(outputs, references,
                                                                strict=True)], axis=2)

    def sqnr(pick):  # per_sample: [outputs, (noise, power), samples]
        noise, power = per_sample[:, 0, pick].sum(axis=1), per_sample[:, 1, pick].sum(axis=1)
        return -10 * np.log10(np.mean(noise / power))

    result = plan.certify(plan.output_sqnr, "sqnr", outputs, references, floor=10.0,
                          resamples=300)
    rng = np.random.default_rng(0)
    margins = [sqnr(rng.integers(0, 18, 18)) - 10.0 for _ in range(300)]
    np.testing.assert_allclose(result.interval, np.quantile(margins, [0.05, 0.95]), rtol=1e-12)
    assert result.value == pytest.approx(sqnr(np.arange(18)), rel=1e-12)


def test_certify_resamples_agreement_as_per_sample_numbers_exactly():
    """Argmax agreement is a share of samples: the bootstrap resamples the per-sample 0/1.
    The certificate equals the one that calls the metric on every resample (the same
    metric behind another function object takes that path), to the last bit."""
    outputs, references = noisy_outputs()
    fast = plan.certify(plan.argmax_agreement, "m", outputs, references, max_drop=0.1,
                        resamples=300)
    slow = plan.certify(lambda o, r: plan.argmax_agreement(o, r), "m", outputs, references,
                        max_drop=0.1, resamples=300)
    assert fast == slow and 0 < fast.value < fast.reference


def test_fp32_scores_kept_across_plans_give_the_same_certificates_scoring_fp32_once():
    """The planner certifies every plan against the same FP32 outputs with the same seed, so
    the same resamples: FP32's score on each is kept (``fp32_scores``) and computed once.
    Reference: each candidate certified on its own, without the kept scores; equal to the
    last bit, for a metric called on every resample and for one with a resampler. FP32
    against itself is scored once on all samples and once per resample, whatever the
    number of candidates."""
    outputs, references = noisy_outputs()
    rng = np.random.default_rng(5)
    candidates = [outputs, [{k: v + 0.2 * rng.standard_normal(v.shape) for k, v in r.items()}
                            for r in references]]
    draws = np.random.default_rng(0)  # certify's seed: its resamples
    resamples = {draws.integers(0, 18, 18).tobytes() for _ in range(120)}
    fp32_calls = []

    def per_sample(o, r):
        return np.concatenate([-np.abs(a["y"] - b["y"]).reshape(len(b["y"]), -1).mean(axis=1)
                               for a, b in zip(o, r, strict=True)])

    def closeness(o, r):
        if o is r:
            fp32_calls.append("metric")
        return float(per_sample(o, r).mean())

    def resampler(o, r):
        if o is r:
            fp32_calls.append("resampler")
        figures = per_sample(o, r)
        return lambda pick: float(figures[pick].mean())

    for with_resampler in (False, True):
        if with_resampler:
            closeness.resampler = resampler
        kept: dict[bytes, float] = {}
        fp32_calls.clear()
        shared = [plan.certify(closeness, "m", c, references, max_drop=0.05, resamples=120,
                               fp32_scores=kept) for c in candidates]
        calls = list(fp32_calls)
        alone = [plan.certify(closeness, "m", c, references, max_drop=0.05, resamples=120)
                 for c in candidates]
        assert shared == alone and shared[0] != shared[1]
        assert len(kept) == 1 + len(resamples)  # all samples, and each resample
        # Without a resampler the metric scores FP32 on all samples and on each resample;
        # with one, on all samples, and FP32's resampler is made once.
        assert calls == (["metric", "resampler"] if with_resampler
                         else ["metric"] * len(kept))


def test_a_metric_resampler_gives_the_certificate_of_calling_the_metric_on_every_resample():
    """A user metric may carry ``resampler`` (per-sample figures once, a resample is a sum):
    the certificate is the one of the metric called on every resample, to float rounding
    (the same means, summed in another order). A resampler that does not reproduce the
    metric on all samples, or fails, is refused with the metric's name."""
    outputs, references = noisy_outputs()

    def per_sample(o, r):
        return np.concatenate([-np.abs(a["y"] - b["y"]).reshape(len(b["y"]), -1).mean(axis=1)
                               for a, b in zip(o, r, strict=True)])

    def closeness(o, r):
        return float(per_sample(o, r).mean())

    def plain(o, r):
        return closeness(o, r)

    def resampler(o, r):
        figures = per_sample(o, r)
        return lambda pick: float(figures[pick].mean())

    closeness.resampler = resampler
    fast = plan.certify(closeness, "m", outputs, references, max_drop=0.05, resamples=300)
    slow = plan.certify(plain, "m", outputs, references, max_drop=0.05, resamples=300)
    np.testing.assert_allclose(fast.interval, slow.interval, rtol=1e-12, atol=1e-15)
    assert (fast.value, fast.reference, fast.certified) == pytest.approx(
        (slow.value, slow.reference, slow.certified), rel=1e-12)

    def off_by_one(o, r):
        return lambda pick: resampler(o, r)(pick) + 1.0

    closeness.resampler = off_by_one
    with pytest.raises(DataError, match="metric 'm': its resampler scores .* but the metric "
                       "itself gives"):
        plan.certify(closeness, "m", outputs, references, max_drop=0.05)

    def fails(o, r):
        raise KeyError("boxes")

    closeness.resampler = fails
    with pytest.raises(DataError, match="metric 'm': its resampler failed on .*KeyError"):
        plan.certify(closeness, "m", outputs, references, max_drop=0.05)


def test_sqnr_floor_certifies_outputs_without_noise():
    """The FP32 plan under --min-sqnr: infinite SQNR on every resample is a margin of
    +inf, certified (quantiles of infinities once interpolated to NaN: never certified)."""
    outputs = [{"y": np.arange(6, dtype=np.float32).reshape(3, 2) + 1}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        certificate = plan.certify(plan.output_sqnr, "sqnr", outputs, outputs, floor=24.0)
    assert certificate.certified and certificate.interval == (np.inf, np.inf)


def test_make_plan_falls_back_to_fp32_when_no_int8_plan_certifies(planted_case, monkeypatch):
    """A metric every INT8 plan fails: the plan without INT8 is returned, certified.

    With --high-precision fp32 that plan is the FP32 model itself, so it is certified
    without a model run (before, the most conservative plan evaluated was returned,
    uncertified, even where that still ran most units in INT8).
    """
    from quantlab.calibration import qdq
    from quantlab.planner import certify

    g, source, fp32, run_plan, units = planted_case
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        next(iter(source)), qdq.activation_tensors_to_calibrate(g.model)).items()}

    def identical(outputs, references):  # share of samples whose outputs are bit-identical
        return float(np.mean([all(np.array_equal(o[k], r[k]) for k in r)
                              for o, r in zip(outputs, references, strict=True)]))

    monkeypatch.setitem(certify.METRICS, "identical", identical)
    result = planned(g.model, source, source, amax, amax, amax, metric="identical",
                            max_drop=0.01, trials=8, hard_count=16, max_evaluations=2,
                            high_precision="fp32")
    # Reached by the search's guess or after its evaluations run out; never run.
    chosen = result.evaluations[result.chosen]
    failed = [e for i, e in enumerate(result.evaluations) if i != result.chosen]
    assert failed and not any(e.certificate.certified for e in failed)
    assert not chosen.model_run and not chosen.screened
    assert result.certificate.certified
    assert result.certificate.value == result.certificate.reference == 1.0
    assert result.front[0].int8_mac_share == 0.0
    assert {d.precision for d in result.plan.units.values()} == {"fp32"}
    assert all(any(r.code == "M-SEARCH" for r in d.reasons) or any(r.hard for r in d.reasons)
               for d in result.plan.units.values())


class FlatDrop:
    """A two-part metric whose drop grows as the output NSR to the power 1/4: flatter than
    any law the search assumes (power 1/2 to 1), so from all-INT8's shortfall it predicts
    plans nearer FP32 to hold the budget that do not."""

    def record(self, outputs, references):
        return plan.sample_energies(outputs, references)

    def score(self, records):
        from quantlab.evaluation.compare import output_nsr

        return -output_nsr(sum(n.sum(axis=0) for n, _ in records),
                           sum(p.sum(axis=0) for _, p in records)) ** 0.25


def test_a_search_the_noise_law_mispredicts_still_certifies_int8(planted_case, monkeypatch):
    """The planted model under FlatDrop at a 0.13 drop: plans the fitted law aims at miss
    the budget one after the other. With evaluations cheap (a two-part metric: a forward
    pass and sums) the search goes on past max_evaluations, each evaluation noted with what
    it taught, and certifies a plan with INT8; held to max_evaluations it falls back to
    all-FP16, the answer it gave before."""
    from quantlab.calibration import calibrate, collect, qdq
    from quantlab.planner import certify

    g, source, _, _, _ = planted_case
    stats = collect.collect(g.model, source, qdq.activation_tensors_to_calibrate(g.model),
                            progress=False)
    amax = calibrate.calibrate(stats, "max").amax
    monkeypatch.setitem(certify.METRICS, "flat", FlatDrop())
    result = planned(g.model, source, source, amax, amax, amax, metric="flat", max_drop=0.13,
                     trials=8, hard_count=16)
    assert result.certificate.certified and result.fallback is None
    assert result.plan.int8_mac_share() > 0
    ran = [e for e in result.evaluations if not e.screened]
    assert len(ran) > 2 and not any(e.certificate.certified for e in ran[:-1])
    assert all("drop ~ noise^" in e.note and "against the limit" in e.note
               for e in result.evaluations)
    monkeypatch.setattr(evaluate, "CHEAP_PASSES", 0)
    monkeypatch.setattr(evaluate, "CHEAP_SECONDS", 0.0)
    held = planned(g.model, source, source, amax, amax, amax, metric="flat", max_drop=0.13,
                   trials=8, hard_count=16)
    assert held.plan.int8_mac_share() == 0 and held.fallback == "all-FP16"


class CertifiedByNoise(evaluate.PairedScore):
    """A stand-in for the planner's scorer deciding by output noise: FP32 certifies, noisy
    plans (under 15 dB) fail outright, the others score inside the budget but are
    inconclusive (their interval reaches below the limit; 400 samples needed)."""

    def update(self, outputs, references):
        super().update(outputs, references)
        self.__dict__.setdefault("noisy", []).append((outputs, references))

    def certificate(self, max_drop=None, floor=None, **_):
        kept = self.__dict__.get("noisy", [])
        noise = (plan.output_sqnr(*map(list, zip(*kept, strict=True))) if kept else np.inf)
        low, high = ((max_drop, max_drop) if noise == np.inf else
                     (-0.5, -0.1) if noise < 15 else (-0.2, 0.9))
        return plan.Certificate(self.metric.name, 1.0, 1.0 - max_drop + (low + high) / 2,
                                1.0 - max_drop, (low, high), 0.95, 64, low >= 0,
                                high - low > max_drop, 400)


def test_make_plan_warns_when_a_better_plan_was_only_inconclusive(planted_case, monkeypatch):
    """Certification outcomes set by a stand-in for certify (by output noise): all-INT8
    fails outright, plans with a little noise are inconclusive (interval too wide,
    reaching the budget), only FP32 certifies. The written plan is the FP32 one and
    the warning names the better plan and what the data lack."""
    from quantlab.calibration import qdq

    g, source, fp32, run_plan, units = planted_case
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        next(iter(source)), qdq.activation_tensors_to_calibrate(g.model)).items()}

    monkeypatch.setattr(evaluate, "PairedScore", CertifiedByNoise)
    with pytest.warns(UserWarning, match=r"scored .* but could not be certified: the "
                      r"evaluation set is too small.* The plan written keeps 0.0% in INT8 "
                      r"\([0-9.]+ points of the MACs fewer\)"):
        # A drop of the stand-in's figure: any metric but sqnr (which takes a floor) does.
        result = planned(g.model, source, source, amax, amax, amax, metric="agreement",
                                max_drop=0.5, trials=8, hard_count=16, high_precision="fp32")
    assert result.plan.int8_mac_share() == 0.0 and result.certificate.certified
    assert any(e.certificate.inconclusive for e in result.evaluations)
    # The better plan is kept, not lost: the most-INT8 plan that scored inside the budget,
    # its Q/DQ model running its units as its plan says.
    kept_plan, kept_model, kept = result.uncertified
    inside = [e for e in result.evaluations if e.certificate.inconclusive and
              e.certificate.value >= e.certificate.limit]
    assert kept.int8_mac_share == max(e.int8_mac_share for e in inside) > 0.0
    assert kept_plan.int8_mac_share() == pytest.approx(kept.int8_mac_share)
    assert plan.read_back(kept_model, units) == {
        u: d.precision for u, d in kept_plan.units.items()}


def test_shortfall_power_through_the_two_largest_drops():
    # drop = 2 * noise ** 0.75 through (0.16, 0.5657) and (0.01, 0.0632): p = 0.75.
    points = [(0.16, 2 * 0.16 ** 0.75), (0.01, 2 * 0.01 ** 0.75), (0.001, -0.1)]
    assert evaluate._shortfall_power(points) == pytest.approx(0.75)
    assert evaluate._shortfall_power(points[:1]) == 0.5  # one failure: the cautious amplitude law
    assert evaluate._shortfall_power([(0.1, 1.0), (0.01, 0.01)]) == 1.0  # p = 2, clamped
    assert evaluate._shortfall_power([(0.1, 1.0), (0.1, 2.0)]) == 0.5  # same noise: no fit


def test_budget_limit_and_margin_are_the_certificates():
    """A Budget's limit and margin are those scoring's certificate computes with the same
    drop or floor; its shortfall is the drop from FP32, or the noise power under a floor."""
    rng = np.random.default_rng(0)
    candidate, fp32 = rng.random(300) < 0.9, rng.random(300) < 0.93
    score = lambda pick: (float(candidate[pick].mean()), float(fp32[pick].mean()))  # noqa: E731
    for budget in (Budget("top1", drop=0.05), Budget("top1", floor=0.8)):
        scored = plan.certify_paired("top1", score, 300, max_drop=budget.drop,
                                     floor=budget.floor)
        assert budget.limit(scored.reference) == scored.limit
        assert budget.margin(scored.value, scored.reference) == scored.value - scored.limit
    drop = plan.certify_paired("top1", score, 300, max_drop=0.05)
    assert Budget("top1", drop=0.05).shortfall(drop) == pytest.approx(
        fp32.mean() - candidate.mean())
    assert Budget("top1", drop=0.05).amount == 0.05 and Budget("sqnr", floor=20.0).amount == 20.0
    floor = Budget("sqnr", floor=20.0)
    assert floor.shortfall(plan.Certificate("sqnr", np.inf, 30.0, 20.0, (9.0, 11.0), 0.95, 64,
                                            True, False, None)) == pytest.approx(1e-3)
    # Under a floor the spread raises it in dB: 20 dB + 1 dB of spread is an NSR of 10**-2.1.
    assert floor.allowed_shortfall(1e-3, 1.0) == pytest.approx(10 ** -2.1)
    assert Budget("m", drop=1.0).allowed_shortfall(0.25, 0.5) == certifiable_drop(1.0, 0.25, 0.5)


def test_certifiable_drop_leaves_room_for_the_sampling_spread():
    # d + a sqrt(d) = 1 with a = 0.5 / sqrt(0.25) = 1: sqrt(d) = (sqrt(5) - 1) / 2.
    d = certifiable_drop(1.0, 0.25, 0.5)
    assert d == pytest.approx(((5 ** 0.5 - 1) / 2) ** 2)
    assert d + 0.5 * np.sqrt(d / 0.25) == pytest.approx(1.0)  # the margin's lower end is 0
    assert certifiable_drop(1.0, 0.25, 0.0) == 1.0  # no spread: the whole budget
    assert certifiable_drop(1.0, 0.0, 0.3) == 1.0  # no drop to scale the spread from


@pytest.fixture
def layout_front():
    """The front and the all-INT8 evaluation of the layout detector at a 1-point budget
    on 16 pages (predicted noise as measured; all-INT8 dropped 46.9 points)."""
    from quantlab.planner.search import FrontPoint

    predicted = [0.0, 3.3e-6, 7.96e-6, 4.587e-5, 1.958e-4, 2.097e-4, 5.42e-4, 0.3647]
    points = [FrontPoint(p, p, i / 7, {}) for i, p in enumerate(predicted)]

    def evaluation(index, value, interval):
        low, high = interval
        return plan.Evaluation(index / 7, predicted[index], plan.Certificate(
            "agreement-map", 100.0, value, 99.0, interval, 0.95, 16, low >= 0,
            (high - low) / 2 > 0.5, 22), 1.0)

    return points, evaluation, {7: evaluation(7, 53.08, (-51.07, -39.50))}


def test_search_on_the_layout_run_certifies_the_plan_below_the_inconclusive_one(layout_front):
    """The whole search with the layout run's measured outcomes per plan: all-INT8
    fails, the law's first guess (plan 3) scores inside the budget but is
    inconclusive, plan 2 certifies. Three evaluations, plan 2 chosen, and the warning
    names plan 3 and how little INT8 the written plan gives up."""
    points, evaluation, evaluated = layout_front
    outcomes = {7: evaluated[7], 3: evaluation(3, 99.533, (-0.162, 1.0)),
                2: evaluation(2, 99.973, (0.945, 1.0))}
    with pytest.warns(UserWarning, match=r"the plan with 42.9% of MACs in INT8 scored 99.53 "
                      r"\(limit 99\) but could not be certified: the evaluation set is too "
                      r"small.* The plan written keeps 28.6% in INT8 \(14 points"):
        found, chosen = evaluate.search(lambda: points, lambda p: outcomes[points.index(p)],
                                        4, Budget("m", 1.0))
        evaluate.warn_undecided([e for _, e in found], found[chosen][1])
    assert [points.index(p) for p, _ in found] == [7, 3, 2]
    assert points.index(found[chosen][0]) == 2
    # Plan 3 scoring below the limit, its interval still reaching above it (the layout
    # detector's 93 % plan at a 2-point AP50 drop: 96.63 against 98, up to +0.68): not
    # "could not be certified" of a plan inside the budget.
    below = evaluation(3, 98.9, (-0.8, 0.4))
    with pytest.warns(UserWarning, match=r"the plan with 42.9% of MACs in INT8 scored 98.9, "
                      r"below the limit 99, and could be neither certified nor ruled out: the "
                      r"evaluation set is too small"):
        evaluate.warn_undecided([evaluated[7], below, outcomes[2]], outcomes[2])


def test_search_spends_no_evaluation_on_a_plan_a_hair_above_the_certified_one():
    """Plan 2 adds 1e-6 of the MACs to plan 1: once plan 1 certifies, the search stops
    (below MIN_GAIN) instead of evaluating plan 2, as it does when the gap is 0.1.

    The guesses by the law, by hand: all-INT8 drops 47, power 0.5, noise
    0.36 * (1/47)^2 = 1.6e-4: plan 3 (drop 3); through it, 1e-4 * (1/3)^2 = 1.1e-5:
    plan 1."""
    from quantlab.planner.search import FrontPoint

    predicted = [0.0, 1e-5, 2e-5, 1e-4, 0.36]

    def run(shares):
        points = [FrontPoint(p, p, s, {}) for p, s in zip(predicted, shares, strict=True)]
        values = {4: (53.0, (-51.0, -40.0)), 3: (97.0, (-2.6, -1.3)), 2: (99.9, (0.6, 1.0)),
                  1: (99.95, (0.7, 1.0))}

        def outcome(point):
            index = points.index(point)
            value, interval = values[index]
            return plan.Evaluation(shares[index], predicted[index], plan.Certificate(
                "m", 100.0, value, 99.0, interval, 0.95, 500, interval[0] >= 0, False, None),
                1.0)
        found, chosen = evaluate.search(lambda: points, outcome, 4, Budget("m", 1.0))
        return [points.index(p) for p, _ in found], points.index(found[chosen][0])

    assert run([0.0, 0.4, 0.4 + 1e-6, 0.6, 1.0]) == ([4, 3, 1], 1)
    assert run([0.0, 0.4, 0.5, 0.6, 1.0]) == ([4, 3, 1, 2], 2)


def test_search_chooses_again_on_the_new_front_when_a_plan_is_refitted_away():
    """`evaluate` returns None for the first plan it is given after all-INT8 (the noise
    model was refitted instead: the front changed). The search asks for the front again,
    keeps all-INT8's outcome in it, and evaluates a plan of the new front."""
    from quantlab.planner.search import FrontPoint

    old = [FrontPoint(p, p, s, {"u": str(s)}) for p, s in
           [(0.0, 0.0), (1e-4, 0.5), (2e-4, 0.7), (0.36, 1.0)]]
    new = [FrontPoint(p, p, s, {"u": str(s)}) for p, s in
           [(0.0, 0.0), (1e-4, 0.3), (3e-4, 0.6), (0.4, 1.0)]]
    fronts, asked = iter([old, old, new, new, new]), []

    def outcome(point):
        asked.append(point.int8_mac_share)
        if len(asked) == 2:
            return None
        good = point.int8_mac_share < 1.0
        return plan.Evaluation(point.int8_mac_share, point.predicted, plan.Certificate(
            "m", 100.0, 99.5 if good else 50.0, 99.0, (0.1, 1.0) if good else (-50, -40), 0.95,
            500, good, False, None), 1.0)

    found, chosen = evaluate.search(lambda: next(fronts), outcome, 2, Budget("m", 1.0))
    assert asked[0] == 1.0 and asked[2] in (0.3, 0.6) and len(found) == 2
    assert found[0][1].int8_mac_share == 1.0 and found[chosen][0] in new


def test_next_guess_below_a_plan_inside_the_budget_aims_at_a_certifiable_drop(layout_front):
    """Plan 3 scored 99.53 (drop 0.47, inside the budget of 1) with the margin's
    interval (-0.16, 1.0): too wide to certify. The law aimed at the budget put
    plan 3 below the guess, and bisecting went to plan 1 (no better), then FP32.
    Aimed at the drop certifiable with that spread (0.38 by _certifiable_drop), the
    law (power 0.51 through the two drops) gives 3.0e-5 of noise: plan 2."""
    points, evaluation, evaluated = layout_front
    inside = {**evaluated, 3: evaluation(3, 99.533, (-0.162, 1.0))}
    assert evaluate._next_guess(points, inside, -1, 3, Budget("m", 1.0)) == 2
    # A spread so wide that only a drop of 0.001 could certify: only plan 0 (no INT8) is
    # predicted to, which the fallback gives without a model run; the bracket is bisected
    # by share (0 to 3/7: plan 1 of the two as near), not stepped down one plan at a time.
    wide = {**evaluated, 3: evaluation(3, 99.533, (-30.0, 1.0))}
    assert certifiable_drop(1.0, 0.467, 30.533) < 0.001
    assert evaluate._next_guess(points, wide, -1, 3, Budget("m", 1.0)) == 1
    # Scored outside (drop 3): the law through it, drop ~ noise ** 0.5, aims lower.
    outside = {**evaluated, 3: evaluation(3, 97.0, (-2.6, -1.3))}
    assert evaluate._next_guess(points, outside, -1, 3, Budget("m", 1.0)) == 1


def test_next_guess_below_a_plan_aimed_at_the_budget_that_failed_leaves_room_for_its_spread():
    """The layout detector on its second page seed, at a 2-point budget (16 pages): all-INT8
    dropped 8.18 points (screened, spread 1.17), and the plan aimed at the budget (plan 3,
    2.67e-4) dropped 2.95 with a spread of 1.52 below its margin. The law through both
    (power 0.36, clamped to 0.5) puts a drop of 2 at 1.23e-4: plan 2 there scored 99.05 and
    could not be certified, the search's last evaluation, and the plan fell back to FP32.
    Plan 3's spread, measured near the budget, leaves a certifiable drop of 1.08
    (_certifiable_drop): 3.6e-5 of noise, plan 1. All-INT8's spread is not used for the
    first aim (it was measured far from the budget): that aim is the budget itself."""
    from quantlab.planner.search import FrontPoint

    predicted = [0.0, 3.0e-5, 1.2e-4, 2.67e-4, 4.69e-3]
    points = [FrontPoint(p, p, i / 4, {}) for i, p in enumerate(predicted)]

    def evaluation(index, value, interval):
        return plan.Evaluation(index / 4, predicted[index], plan.Certificate(
            "agreement-map", 100.0, value, 98.0, interval, 0.95, 16, interval[0] >= 0, False,
            None), 1.0)

    first = {4: evaluation(4, 91.82, (-7.35, -4.15))}
    # 4.69e-3 * (2 / 8.18) ** 2 = 2.8e-4: the budget's own aim, plan 3.
    assert evaluate._next_guess(points, first, -1, 4, Budget("m", 2.0)) == 3
    failed = {**first, 3: evaluation(3, 97.05, (-2.47, 0.82))}
    assert 1.0 < certifiable_drop(2.0, 2.95, 1.52) < 1.2
    assert evaluate._next_guess(points, failed, -1, 3, Budget("m", 2.0)) == 1


def test_next_guess_below_a_plan_over_an_sqnr_floor_raises_the_floor_by_the_spread():
    """Floor 20 dB; plan 4 measured 20.5 dB (NSR 8.9e-3, as predicted) with the margin's
    interval (-0.3, 1.2) dB: a spread of 0.8 dB below its value. The aim is 20.8 dB,
    NSR 8.3e-3: plan 2 (5e-3); aimed at 20 dB (1e-2) the law would pass plan 4 and the
    guess would be plan 3 (8.5e-3), which cannot certify with that spread."""
    from quantlab.planner.search import FrontPoint

    predicted = [0.0, 1e-3, 5e-3, 8.5e-3, 8.9e-3, 0.1]
    points = [FrontPoint(p, p, i / 5, {}) for i, p in enumerate(predicted)]
    value = -10 * np.log10(8.9e-3)  # 20.506 dB
    above = plan.Evaluation(0.8, 8.9e-3, plan.Certificate(
        "sqnr", float("inf"), value, 20.0, (-0.3, 1.2), 0.95, 64, False, False, None), 1.0)
    assert evaluate._next_guess(points, {4: above}, -1, 4, Budget("sqnr", floor=20.0)) == 2


def test_plan_command_writes_the_plan_folder(tmp_path, capsys):
    from quantlab.cli import main
    from quantlab.engine import cache

    g = planted_model()
    onnx_path = tmp_path / "planted.onnx"
    graph.save_model(g.model, onnx_path)
    rng = np.random.default_rng(1)
    np.save(tmp_path / "calib.npy", rng.standard_normal((48, 16, 6, 6)).astype(np.float32))
    np.save(tmp_path / "eval.npy", rng.standard_normal((64, 16, 6, 6)).astype(np.float32))
    out = tmp_path / "plan"
    argv = [str(onnx_path), "--data", str(tmp_path / "calib.npy"), "--eval",
            str(tmp_path / "eval.npy"), "--min-sqnr", "24", "--out", str(out), "--trials", "16",
            "--hard-samples", "16", "--batch-size", "16", "--no-progress", "--trt-version",
            "8.6.1", "--no-bias-correction"]
    assert main(["plan", *argv]) == 0
    printed = capsys.readouterr().out
    assert "certified at 95% on 64 samples" in printed
    written = plan.Plan.load(out / "plan.json")
    assert {d.evidence["calibrator"] for d in written.units.values()} <= {
        "entropy", "max", "percentile", "mse"}
    pinned = {u for u, d in written.units.items() if d.precision != "int8"}
    assert pinned == set(PLANTED)
    trtexec = (out / "trtexec.txt").read_text()
    # percentile scales: trtexec reads only EntropyCalibration2 caches, so a relabelled copy.
    assert "--calib=calibration.trtexec.cache" in trtexec
    assert "calibration.trtexec.cache is TRT-" in trtexec and "EntropyCalibration2" in trtexec
    # The pinned convs in FP16; with an fp16 pin, the unquantized float layers around them are
    # pinned fp32 so the FP16 flag turns nothing else to FP16 (trt-review F8).
    pins = dict(p.split(":") for p in re.search(r"--layerPrecisions=(\S+)", trtexec)[1].split(","))
    assert {n: p for n, p in pins.items() if p != "fp32"} == {"conv3": "fp16", "conv5": "fp16"}
    assert "--minShapes=x:1x16x6x6" in trtexec
    assert cache.read_calibration_cache(out / "calibration.trtexec.cache")[1] == \
        cache.read_calibration_cache(out / "calibration.cache")[1]
    _, scales = cache.read_calibration_cache(out / "calibration.cache")
    assert "r1" in scales and not {"r2", "r4", "c3", "c5"} & set(scales)
    int8 = graph.load_model(out / "model.int8.onnx")
    assert {n.op_type for n in int8.graph.node} >= {"QuantizeLinear", "Cast"}
    report = (out / "report.html").read_text()
    assert "Decision per unit" in report and "R-HEAD (soft)" in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["certificate"]["certified"] and summary["int8_mac_share"] < 1.0
    # All-INT8 (below 24 dB on the calibration samples drawn) was screened, not evaluated.
    screened = summary["evaluations"][0]
    assert screened["screened"] and not screened["model_run"] and screened["value"] < 24
    assert (f"on 48 calibration samples (every one, its noise measured in the pass that found "
            f"the hardest) it scored {screened['value']:.4g}") in report
    # The ledger says how each plan was run by a code, explained once under the table.
    ledger = report[report.index("Evaluations of the real"):report.index("<dl class=\"legend\">")]
    assert re.findall(r"<td>(int8|screened|fp32)</td>", ledger)[0] == "screened"
    assert "<dt>screened</dt><dd>not evaluated: on calibration samples (all of them" in report
    # Titled with the user's model file; every column with a unit and a line of explanation;
    # next steps computed from the plan: build it, naming the units kept out of INT8.
    assert "<title>Plan of planted.onnx</title>" in report and summary["model"] == str(onnx_path)
    assert assert_every_column_explained(report) == 2
    assert "<dt>margin_low [dB]</dt><dd>one-sided 95% paired-bootstrap lower bound" in report
    step = summary["next_steps"][0]
    assert step.startswith(f"Certified at {summary['int8_mac_share']:.1%} of MACs in INT8, with "
                           "these units out of INT8 (FP16: conv3, conv5")
    assert f"<code>quantlab build {out}</code>" in report and f"next: {step}" in printed
    # Nothing is overwritten without --force; a bad metric fails before any work.
    assert main(["plan", *argv]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["plan", *argv, "--force", "--metric", "nope"]) == 1
    assert "unknown metric 'nope'" in capsys.readouterr().err


def test_plan_command_freezes_npz_scalars_and_refuses_what_it_cannot_plan(tmp_path, capsys):
    # x * k -> Conv: the 0-d `k` of the calibration .npz is frozen into the model, as
    # calibrate freezes it; evaluation data with another k would silently run on this one.
    from quantlab.cli import main

    nodes = [helper.make_node("Mul", ["x", "k"], ["m"], name="mul"),
             helper.make_node("Conv", ["m", "w"], ["y"], name="conv")]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6]),
                     helper.make_tensor_value_info("k", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [numpy_helper.from_array(weights(4, 3, 1, 1).astype(np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    graph.save_model(model, tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((16, 3, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x, k=np.float32(2))
    np.savez(tmp_path / "eval.npz", x=x, k=np.float32(3))
    argv = ["plan", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "calib.npz"),
            "--min-sqnr", "20", "--no-progress", "--trials", "4", "--hard-samples", "8"]
    assert main([*argv, "--eval", str(tmp_path / "eval.npz"), "--out", str(tmp_path / "a")]) == 1
    assert "holds k=3.0, but the model is calibrated with input 'k' frozen to 2" in \
        capsys.readouterr().err
    np.savez(tmp_path / "eval.npz", x=x, k=np.float32(2))
    assert main([*argv, "--eval", str(tmp_path / "eval.npz"), "--out", str(tmp_path / "b")]) == 0
    assert graph.frozen_inputs(graph.load_model(tmp_path / "b" / "model.onnx")) == {"k": 2.0}
    # No linear op to quantize: said plainly, before any work.
    nodes[1] = helper.make_node("Relu", ["m"], ["y"], name="relu")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 3
    graph.save_model(model, tmp_path / "m.onnx")
    assert main([*argv, "--eval", str(tmp_path / "eval.npz"), "--out", str(tmp_path / "c")]) == 1
    assert "has no operator quantlab quantizes" in capsys.readouterr().err


@pytest.mark.parametrize("trt_version", [None, "10.3.0"])
def test_plan_completes_reused_statistics_with_what_it_reads(trt_version):
    # x -> Conv (c1) -> swish (s1 = Sigmoid(c1), m1 = c1 * s1) -> Conv (y). A calibration
    # folder holds the Q/DQ inputs x, m1; the FP16 range rule reads the conv outputs c1, y;
    # a calibration cache (--trt-version) needs s1 too.
    from quantlab import data
    from quantlab.calibration import collect
    from quantlab.planner import prepare

    g = make_graph([helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
                    helper.make_node("Sigmoid", ["c1"], ["s1"], name="sigmoid"),
                    helper.make_node("Mul", ["c1", "s1"], ["m1"], name="swish"),
                    helper.make_node("Conv", ["m1", "w2"], ["y"], name="conv2")],
                   [("x", ["N", 3, 5, 5])], {"w1": weights(4, 3, 1, 1), "w2": weights(2, 4, 1, 1)})
    expected = ["x", "c1", "s1", "m1", "y"] if trt_version else ["x", "c1", "m1", "y"]
    implicit = trt_version is not None
    assert prepare.needed_tensors(g.model, implicit) == expected
    samples = np.random.default_rng(2).standard_normal((10, 3, 5, 5)).astype(np.float32)
    source = data.open_data(samples, g.inputs, batch_size=4)
    reused = collect.collect(g.model, source, ["x", "m1"], progress=False)
    completed = prepare.statistics(g.model, source, reused, implicit, "calib", progress=False)
    direct = collect.collect(g.model, source, expected, progress=False)
    assert sorted(completed.tensors) == sorted(expected)
    assert completed.tensors["x"] is reused.tensors["x"]  # reused as they are
    for name in expected:
        mine, theirs = completed.tensors[name], direct.tensors[name]
        assert (mine.min, mine.max, mine.count) == (theirs.min, theirs.max, theirs.count)
        assert np.array_equal(mine.hist, theirs.hist), name
    assert completed.num_samples == 10
    assert prepare.statistics(g.model, source, completed, implicit, "calib",
                              progress=False) is completed  # nothing missing


def test_plan_section_escapes_names_from_the_model():
    from quantlab.experiments.report import render_report
    from quantlab.experiments.report.plan import plan_section

    unit = plan.Unit("<script>x</script>", ["<script>x</script>"], ["<script>x</script>"],
                     [], [], 100)
    reason = plan.Reason("R-HEAD", False, ("fp16", "fp32"), "head: <b>x</b>", "source")
    decided = plan.Plan.from_rules([unit], {unit.name: [reason]})
    decided.units[unit.name].precision = "fp16"
    decided.units[unit.name].predicted = 0.01
    certificate = plan.Certificate("sqnr", float("inf"), 30.0, 20.0, (9.0, 11.0), 0.95, 10, True,
                                   False, None)
    point = plan.FrontPoint(0.0, 0.0, 0.0, {unit.name: "fp16"})
    result = plan.PlanResult(
        decided, None, {}, [point, plan.FrontPoint(1.0, 0.01, 1.0, {unit.name: "int8"})],
        plan.OutputSensitivity([unit.name], np.ones((2, 1), bool), np.array([0.01, 0.01]),
                               np.array([0.01])),
        [plan.Evaluation(0.0, 0.0, certificate, 1.0)], 0, [3, 7])
    html = render_report("t", [plan_section(result)])
    assert "<script>x</script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html
    assert "<b>x</b>" not in html and "certified" in html


def test_interrupted_plan_resumes_from_its_checkpoint(planted_case, tmp_path, monkeypatch):
    from quantlab.calibration import calibrate, collect, qdq

    g, source, *_ = planted_case
    stats = collect.collect(g.model, source, qdq.activation_tensors_to_calibrate(g.model),
                            progress=False)
    amax = calibrate.calibrate(stats, "max").amax
    path = tmp_path / "progress.json"
    key = plan.fingerprint(g.model, "planted", 24.0)
    run = dict(min_sqnr=24.0, trials=16, hard_count=16)
    first = planned(g.model, source, source, amax, amax, amax,
                    checkpoint=plan.Checkpoint(path, key), **run)
    saved = plan.Checkpoint(path, key)
    # The random trials (least_random_trials), then the front checks (trials of front plans),
    # maybe a localization.
    total = len(first.sensitivity.nsr)
    assert first.trial_cost["random_trials"] < total
    # A screened all-INT8 plan is not saved: judging it again costs one trial.
    assert first.evaluations[0].screened and not any(e.screened for e in first.evaluations[1:])
    assert len(saved.trials) == total and len(saved.evaluations) == first.model_runs
    assert plan.Checkpoint(path, "another run").trials == {}
    # Interrupted halfway through the trials, after the first evaluation: the rest is
    # measured again.
    cut = total // 2
    saved.trials = {t: v for t, v in saved.trials.items() if t < cut}
    saved.evaluations = dict(list(saved.evaluations.items())[:1])
    added = []

    def recording(name):
        original = getattr(saved, name)
        return lambda index, value: added.append((name, index)) or original(index, value)

    for method in ("add_trial", "add_evaluation"):
        monkeypatch.setattr(saved, method, recording(method))
    resumed = planned(g.model, source, source, amax, amax, amax, checkpoint=saved, **run)
    np.testing.assert_array_equal(resumed.sensitivity.nsr, first.sensitivity.nsr)
    assert resumed.plan == first.plan
    assert [e.certificate for e in resumed.evaluations] == [
        e.certificate for e in first.evaluations]
    assert [i for m, i in added if m == "add_trial"] == list(range(cut, total))
    assert sum(m == "add_evaluation" for m, _ in added) == first.model_runs - 1


def test_local_sqnr_singles_out_the_planted_units_in_int8_not_fp16(planted_case):
    from quantlab.calibration import qdq

    g, source, fp32, *_ = planted_case
    batch = next(iter(source))
    units = plan.find_units(g, {"x": list(batch["x"].shape)})
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(batch, names).items()}
    local = plan.local_sqnr(g, amax, units, [batch])
    assert set(local) == {u.name for u in units}
    int8 = {u: f["int8"] for u, f in local.items()}
    # The planted units' inputs are quantized with a step ~0.16 for values ~0.3.
    worst = sorted(int8, key=int8.get)[:2]
    assert set(worst) == set(PLANTED)
    assert max(int8[u] for u in PLANTED) + 10 < min(
        v for u, v in int8.items() if u not in PLANTED)
    # FP16 rounds to 11 significant bits whatever the range: about 60-75 dB for every unit
    # (a relative error of 2**-11 per value, ~66 dB, give or take the accumulation).
    assert all(60 < f["fp16"] < 80 for f in local.values())
    assert plan.local_sqnr(g, amax, units, [batch], ("int8",))["conv3"] == {"int8": int8["conv3"]}
    # Sample by sample (bounded memory), noise and signal summed: the same figures, to
    # float32 rounding of the tensors (1e-4 dB).
    one_by_one = plan.local_sqnr(g, amax, units, plan.single_samples(source, batch))
    assert len(plan.single_samples(source, batch)) == len(batch["x"])
    assert len(plan.single_samples(source, batch, 3)) == 3
    for unit, figures in local.items():
        for precision, db in figures.items():
            assert one_by_one[unit][precision] == pytest.approx(db, abs=1e-4)


def test_local_errors_summed_in_the_graph_equal_numpy_float64_sums_within_float32(planted_case):
    # The slow reference: run the local error model on the FP32 tensors it reads, have
    # every unit's output back and sum the squared differences in numpy float64.
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.evaluation.sensitivity import local_error_model
    from quantlab.planner.measure import error_sums

    g, source, fp32, *_, units = planted_case
    batch = next(iter(source))
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(batch, names).items()}
    everything = [n for u in units for n in u.nodes]
    local = local_error_model(
        [graph.Graph(qdq.quantize_model(g.model, amax, dict.fromkeys(everything, precision)))
         for precision in ("int8", "fp16")], g)
    model, sums = error_sums(g, local.model, local.outputs)
    found = OnnxRuntimeBackend(model).run(batch)
    assert set(found) == {t for pair in sums.values() for t in pair}
    wanted = [t for t in dict.fromkeys([*local.feeds, *local.outputs.values()])
              if t not in g.input_names]
    tensors = {**fp32.run(batch, wanted), **batch}
    values = OnnxRuntimeBackend(local.model, check_inputs=False).run(
        {name: tensors[name] for name in local.feeds})
    assert len(local.outputs) >= 2 * len(units)  # every unit in both precisions
    for name, tensor in local.outputs.items():
        reference = tensors[tensor].astype(np.float64)
        noise, power = (found[t] for t in sums[name])
        # Same float32 tensors, summed in float32 by ONNX Runtime (sensitivity._Attached
        # .reduced) against float64 here: float32's rounding of a blocked sum, 1e-5.
        assert noise == pytest.approx(((values[name] - reference) ** 2).sum(), rel=1e-5)
        assert power == pytest.approx((reference ** 2).sum(), rel=1e-5)
    # Each added node comes right after the last node of the FP32 model it reads (through
    # other added nodes): the FP32 pass frees a unit's tensors as it moves on.
    position = {node.name: index for index, node in enumerate(g.model.graph.node)}
    made_by = {out: position[node.name] for node in g.model.graph.node for out in node.output}
    last = -1
    for node in model.graph.node:
        if node.name in position:
            last = position[node.name]
            continue
        needs = max((made_by.get(name, -1) for name in node.input), default=-1)
        made_by.update(dict.fromkeys(node.output, needs))
        assert needs == last, node


def behind_batchnorm_and_activation() -> tuple[graph.Graph, dict[str, np.ndarray]]:
    """A depthwise conv behind a BatchNorm and a Relu, and a decoy behind a saturated ReLU6.

    x's channels 4-7 are 30x smaller than 0-3, so the per-tensor scale of the depthwise
    input crushes them, and the BatchNorm after the depthwise conv scales them (and their
    noise) up 3x: the layout detector's failure (docs/field-reports/layout-int8.md). The
    decoy reads z through a coarse scale, but its BatchNorm shifts it to ~15, where the
    ReLU6 saturates: its noise never leaves its layer. Returns the graph and a batch.
    """
    rng = np.random.default_rng(0)

    def batchnorm(name, x, y, gamma, beta):
        values = {"g": gamma, "b": beta, "m": np.zeros(len(gamma)), "v": np.ones(len(gamma))}
        node = helper.make_node("BatchNormalization", [x, *(f"{name}_{k}" for k in values)],
                                [y], name=name, epsilon=0.0)
        return node, {f"{name}_{k}": v for k, v in values.items()}

    dw_bn, dw_values = batchnorm("dw_bn", "d", "dn", [1.0] * 4 + [3.0] * 4, [0.0] * 8)
    decoy_bn, decoy_values = batchnorm("decoy_bn", "c", "cn", [1.0] * 4, [15.0] * 4)
    nodes = [helper.make_node("Conv", ["x", "wd"], ["d"], name="dw", pads=[1] * 4, group=8),
             dw_bn, helper.make_node("Relu", ["dn"], ["dr"], name="dw_relu"),
             helper.make_node("Conv", ["dr", "wp"], ["y"], name="pw"),
             helper.make_node("Conv", ["z", "wz"], ["c"], name="decoy", pads=[1] * 4),
             decoy_bn, helper.make_node("Clip", ["cn", "lo", "hi"], ["s"], name="decoy_relu6")]
    values = {"wd": rng.standard_normal((8, 1, 3, 3)) / 3,
              "wp": rng.standard_normal((8, 8, 1, 1)) / 3,
              "wz": rng.standard_normal((4, 4, 3, 3)) / 6, "lo": np.float32(0),
              "hi": np.float32(6), **dw_values, **decoy_values}
    model = helper.make_model(helper.make_graph(
        nodes, "behind_batchnorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 12, 12]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4, 12, 12])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "s")],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in values.items()]),
        opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(1)
    spread = np.array([1.0] * 4 + [1 / 30] * 4, np.float32)[None, :, None, None]
    batch = {"x": rng.standard_normal((16, 8, 12, 12)).astype(np.float32) * spread,
             "z": rng.standard_normal((16, 4, 12, 12)).astype(np.float32)}
    return graph.Graph(graph.normalize(model)), batch


def test_local_sqnr_ranks_the_depthwise_conv_behind_batchnorm_and_relu_first():
    from numpy.lib.stride_tricks import sliding_window_view
    from onnx import numpy_helper as nh

    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g, batch = behind_batchnorm_and_activation()
    assert not any(n.op_type == "BatchNormalization" for n in g.model.graph.node)  # folded
    fp32 = OnnxRuntimeBackend(g.model)
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(batch, names).items()}
    amax["z"] *= 300  # the decoy's input: a coarse step (~9), every value rounds to 0
    units = plan.find_units(g, {"x": list(batch["x"].shape), "z": list(batch["z"].shape)})
    fused = {u: f["int8"] for u, f in plan.local_sqnr(g, amax, units, [batch], ("int8",)).items()}
    at_op = {u: f["int8"] for u, f in plan.local_sqnr(
        g, amax, units, [batch], ("int8",), fuse_activations=False).items()}
    # Each unit alone in INT8, the others in FP32: its real effect on the outputs.
    references = fp32.run(batch)
    effect = {}
    for unit in units:
        alone = {n.name: "int8" if n.name in unit.nodes else "fp32" for n in g.model.graph.node}
        run = OnnxRuntimeBackend(qdq.quantize_model(g.model, amax, alone, high_precision="fp32"))
        nsr = plan.sample_nsr(run.run(batch), references).mean()
        effect[unit.name] = -10 * np.log10(nsr) if nsr > 0 else np.inf
    assert min(effect, key=effect.get) == "dw" and effect["decoy"] == np.inf
    # Where TensorRT's layer ends (folded BN, Relu) the depthwise conv ranks first; at the
    # conv's own output the decoy does, whose noise the saturated ReLU6 removes.
    assert min(fused, key=fused.get) == "dw" and fused["decoy"] == np.inf
    assert min(at_op, key=at_op.get) == "decoy" and at_op["decoy"] + 3 < at_op["dw"]
    # The depthwise figure is relu(folded conv(INT8 x, INT8 w) + b) against the FP32 Relu
    # output, in float64.
    weights = {i.name: nh.to_array(i).astype(np.float64) for i in g.model.graph.initializer}
    dw = next(n for n in g.model.graph.node if n.name == "dw")
    w, b = weights[dw.input[1]], weights[dw.input[2]]
    w_step = np.abs(w).reshape(8, -1).max(axis=1)[:, None, None, None] / 127
    x_step = np.float64(np.float32(amax["x"]) / np.float32(127))
    x = np.clip(np.round(batch["x"] / x_step), -128, 127) * x_step
    windows = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3),
                                  axis=(2, 3))
    local = np.maximum(np.einsum("nchwij,cij->nchw", windows, (np.round(w / w_step) * w_step)[
        :, 0]) + b[None, :, None, None], 0)
    want = fp32.run(batch, ["dr"])["dr"].astype(np.float64)
    assert fused["dw"] == pytest.approx(
        10 * np.log10((want ** 2).sum() / ((local - want) ** 2).sum()), abs=0.01)


def test_fp16_overflow_gives_minus_infinite_local_sqnr():
    g = depthwise(1.0)
    batch = {"x": np.full((1, 16, 4, 4), 3e4, np.float32)}  # 9 taps of 3e4 overflow float16
    units = plan.find_units(g)
    local = plan.local_sqnr(g, {"x": 3e4, "a": 3e5}, units, [batch])
    assert local["dw"]["fp16"] == -np.inf and np.isfinite(local["dw"]["int8"])


def test_fp16_contributions_scale_the_int8_gain_to_the_fp16_local_noise():
    contribution = {"a": 0.01, "b": 0.004, "pinned": 0.0, "quiet": 0.0}
    local = {"a": {"int8": 20.0, "fp16": 70.0}, "b": {"int8": 30.0, "fp16": 60.0},
             "pinned": {"int8": 25.0, "fp16": 65.0}, "quiet": {"int8": 40.0, "fp16": -np.inf}}
    found = plan.fp16_contributions(contribution, local, unmeasured=["pinned"])
    # gains: a 0.01 / 1e-2 = 1, b 0.004 / 1e-3 = 4; the pinned unit takes their median, 2.5.
    assert found["a"] == pytest.approx(1.0 * 1e-7)
    assert found["b"] == pytest.approx(4.0 * 1e-6)
    assert found["pinned"] == pytest.approx(2.5 * 10 ** -6.5)
    assert found["quiet"] == np.inf


def test_solve_spends_the_budget_left_on_fp16_and_never_fp16_past_overflow():
    units = [plan.Unit(n, [n], [n], [], [], macs) for n, macs in
             [("a", 100), ("b", 50), ("c", 40), ("pinned", 10)]]
    contribution = {"a": 0.5, "b": 0.2, "c": 0.2, "pinned": 0.0}
    allowed = {"pinned": ("fp16", "fp32")}
    fp16 = {"a": 0.04, "b": 0.01, "c": 0.01, "pinned": 0.02}
    # b + c in INT8 (0.4); 0.05 left: a's FP16 (0.04) fits, then not the pin's (0.02).
    best = plan.solve(units, allowed, contribution, 0.45, fp16_contribution=fp16)
    assert best.precisions == {"a": "fp16", "b": "int8", "c": "int8", "pinned": "fp32"}
    assert best.predicted == pytest.approx(0.44) and best.int8_mac_share == pytest.approx(0.45)
    # FP16 never costs an INT8 unit: at 0.4 exactly, both FP16 candidates go FP32.
    assert plan.solve(units, allowed, contribution, 0.4, fp16_contribution=fp16).precisions == {
        "a": "fp32", "b": "int8", "c": "int8", "pinned": "fp32"}
    overflow = fp16 | {"pinned": np.inf}
    assert plan.solve(units, allowed, contribution, 10.0,
                      fp16_contribution=overflow).precisions["pinned"] == "fp32"
    points = plan.front(units, allowed, contribution, fp16_contribution=fp16)
    # The last plan of each INT8 share spends what is left on FP16: all INT8 + the pin in FP16.
    assert points[-1].precisions == {"a": "int8", "b": "int8", "c": "int8", "pinned": "fp16"}


def test_read_back_of_a_written_model_matches_its_plan():
    from quantlab.calibration import qdq

    g = residual_block()
    units = plan.find_units(g, {"x": [2, 3, 8, 8]})
    amax = dict.fromkeys(qdq.activation_tensors_to_calibrate(g.model), 4.0)
    wanted = {"conv0": "int8", "conv1": "fp16", "conv2": "fp32", "conv3": "int8"}
    nodes = {n: wanted[u.name] for u in units for n in u.nodes}
    assert plan.read_back(qdq.quantize_model(g.model, amax, nodes), units) == wanted
    as_fp32 = qdq.quantize_model(g.model, amax, nodes, high_precision="fp32")
    assert plan.read_back(as_fp32, units) == wanted | {"conv1": "fp32"}


def test_choose_calibrators_per_unit_from_local_error(planted_case):
    from quantlab.calibration import qdq

    g, source, fp32, *_ = planted_case
    batch = next(iter(source))
    units = plan.find_units(g, {"x": list(batch["x"].shape)})
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(batch, names).items()}
    spoiled = {u.name: {t: (amax[t] * 100 if t in u.tensors else amax[t]) for t in amax}
               for u in units[:2]}
    # Method "a" spoils the first unit's ranges, "b" the second's: each unit picks the other.
    candidates = {"a": spoiled[units[0].name], "b": spoiled[units[1].name]}
    merged, chosen = plan.choose_calibrators(g, candidates, units, [batch], amax)
    assert chosen[units[0].name] == "b" and chosen[units[1].name] == "a"
    assert all(merged[t] == amax[t] for t in units[0].tensors + units[1].tensors)
    # The methods measured side by side in one pass choose as each measured alone does.
    alone = {m: plan.local_sqnr(g, a, units, [batch], ("int8",)) for m, a in candidates.items()}
    assert chosen == {u.name: max(candidates, key=lambda m, u=u: alone[m][u.name]["int8"])
                      for u in units}


def test_choose_calibrators_replaces_the_amax_a_moved_pair_is_scaled_by():
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g = residual_block()
    batch = {"x": np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    units = plan.find_units(g, {"x": [2, 3, 8, 8]})
    names = qdq.activation_tensors_to_calibrate(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in OnnxRuntimeBackend(g.model).run(
        batch, names).items()}
    # conv3's pair sits on s (moved back across the MaxPool) but is scaled by p's amax.
    assert "p" in amax and "s" not in amax
    candidates = {"spoiled": {t: v * 100 for t, v in amax.items()}, "calibrated": amax}
    merged, chosen = plan.choose_calibrators(g, candidates, units, [batch],
                                             candidates["spoiled"])
    assert chosen["conv3"] == "calibrated"
    assert merged == amax



def unbalanced_model() -> graph.Graph:
    """conv1 writes channel 0 ~100x larger than the others, conv2 reads it with ~1/100 weights.

    The function does not care, but the per-tensor INT8 scale of r (conv1's Relu output) is
    set by channel 0, so every other channel is quantized coarsely: the case cross-layer
    equalization (Nagel et al. 2019) repairs by moving the factor into conv2's weights.
    """
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((16, 16, 3, 3)) / 12
    w1[0] *= 100
    w2 = rng.standard_normal((16, 16, 1, 1)) / 4
    w2[:, 0] /= 100
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["d"], name="conv2"),
             helper.make_node("Relu", ["d"], ["rd"], name="relu2"),
             helper.make_node("Conv", ["rd", "w3"], ["y"], name="conv3")]
    return make_graph(nodes, [("x", ["N", 16, 6, 6])],
                      {"w1": w1, "w2": w2, "w3": rng.standard_normal((16, 16, 1, 1)) / 4})


def test_make_plan_weighs_a_repair_before_pins_and_plans_the_better_model(tmp_path):
    from quantlab import data
    from quantlab.calibration import qdq, repairs
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g = unbalanced_model()
    samples = np.random.default_rng(4).standard_normal((32, 16, 6, 6)).astype(np.float32)
    source = data.open_data(samples, g.inputs, batch_size=16)

    def calibrated(model):
        names = qdq.activation_tensors_to_calibrate(model)
        return {n: float(np.abs(v).max())
                for n, v in OnnxRuntimeBackend(model).run({"x": samples}, names).items()}

    equalized, report = repairs.cross_layer_equalization(g.model)
    amax, amax_cle = calibrated(g.model), calibrated(equalized)
    # Reference: output NSR of each all-INT8 Q/DQ model on the first batch, in numpy.
    first = samples[:16]
    fp32 = OnnxRuntimeBackend(g.model).run({"x": first})["y"].astype(np.float64)

    def nsr(model, scales):  # pooled over the batch (docs/metrics.md)
        got = OnnxRuntimeBackend(qdq.quantize_model(model, scales)).run({"x": first})["y"]
        return ((got - fp32) ** 2).sum() / (fp32 ** 2).sum()

    want = {"none": nsr(g.model, amax), "cle": nsr(equalized, amax_cle)}
    assert want["cle"] < want["none"] / 4  # the repair is worth it on this model
    result = planned(
        g.model, source, source, amax, amax, amax, min_sqnr=10.0, trials=6, hard_count=16,
        repairs={"cle": plan.CalibratedModel(equalized, amax_cle, amax_cle, amax_cle,
                                           report=report.to_dict())}, bias_correction=False)
    records = {r["repair"]: r for r in result.plan.repairs}
    assert {n: r["all_int8_nsr_first_batch"] for n, r in records.items()} == pytest.approx(
        want, rel=1e-6)
    assert records["cle"]["chosen"] and not records["none"]["chosen"]
    assert records["cle"]["applied"] == len(report.applied) > 0
    # Measured where the pins are, on the hardest samples, it removes most of the noise.
    assert records["cle"]["hard_nsr_before"] > 4 * records["cle"]["hard_nsr_after"]
    assert result.model is equalized and result.amax["r"] == pytest.approx(amax_cle["r"])
    assert plan.Plan.load(result.plan.save(tmp_path / "plan.json")).repairs == \
        result.plan.repairs


def test_localize_finds_the_unit_the_fit_misses_by_halving():
    """An additive truth with one unit 1000x its prior: a plan holding it is under-predicted;
    halving finds it in 2 trials per level (32 units: 5 levels) and the refit carries its
    measured noise. Exact arithmetic: the 'model' is the truth itself."""
    count, hidden = 32, 21
    names = [f"u{i}" for i in range(count)]
    truth = np.full(count, 1e-4)
    truth[hidden] = 0.1
    trials = plan.Trials(lambda p, _: float(sum(t for n, t in zip(names, truth, strict=True)
                                              if p[n] == "int8")), names)
    prior = np.full(count, 1e-4)
    fit = plan.OutputSensitivity(names, np.ones((1, count), bool), np.array([truth.sum()]),
                                 prior.copy(), prior, ridge=1e-3)
    fit = plan.check_fit(fit, trials, np.array([[True] * 16 + [False] * 16,
                                                 [False] * 16 + [True] * 16]), "test")
    assert fit.checks[1]["factor"] > 50 and fit.checks[0]["factor"] < plan.DISAGREEMENT
    located = [c for c in fit.checks if c["why"] == "localize"]
    assert len(located) == 2 * 4  # 16 units halved down to one: 4 levels of 2 trials
    assert located[-2]["int8_units"] == located[-1]["int8_units"] == 1
    assert fit.contribution[hidden] == pytest.approx(0.1, rel=0.05)
    assert fit.ranking()[0] == names[hidden]


def amplifier_model(channels: int = 16, offset: float = 600.0) -> graph.Graph:
    """Convs, a squeeze-excitation gate and a 1x1 head whose logits carry a large common
    offset, read by a Softmax over the classes (which the offset does not change).

    The head's local INT8 SQNR is measured against logits dominated by the offset
    (~100 dB), but its error reaches the probabilities as any conv's does (~46 dB
    alone): a prior from local errors under-predicts it by ~50 dB, as the CTC
    recognizer's softmax did (issue 25)."""
    rng = np.random.default_rng(0)
    inits, nodes = {}, []

    def conv(name, x, kernel, act=True, bias=None, scale=1.0):
        inits[f"{name}_w"] = rng.standard_normal((channels, channels, kernel, kernel)) * scale / \
            np.sqrt(channels * kernel * kernel)
        inits[f"{name}_b"] = np.zeros(channels) if bias is None else bias
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [f"{name}_c"],
                                      name=name, pads=[kernel // 2] * 4))
        if not act:
            return f"{name}_c"
        nodes.append(helper.make_node("Relu", [f"{name}_c"], [f"{name}_r"], name=f"{name}_relu"))
        return f"{name}_r"

    t = conv("conv2", conv("conv1", "x", 3), 3)
    nodes.append(helper.make_node("GlobalAveragePool", [t], ["pooled"], name="se_pool"))
    nodes.append(helper.make_node("Sigmoid", [conv("se_conv", "pooled", 1, act=False)], ["gate"],
                                  name="se_sigmoid"))
    nodes.append(helper.make_node("Mul", [t, "gate"], ["gated"], name="se_mul"))
    t = conv("conv4", conv("conv3", "gated", 3), 3)
    logits = conv("head", t, 1, act=False, bias=np.full(channels, offset), scale=3.0)
    nodes.append(helper.make_node("Softmax", [logits], ["y"], name="softmax", axis=1))
    return make_graph(nodes, [("x", ["N", channels, 8, 8])], inits)


def max_calibrated(g, x, batch_size):
    """`x` as a BatchSource of `batch_size`, the FP32 backend, every calibrated tensor's max
    |x| on it, and the units (MACs of one batch)."""
    from quantlab import data
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    fp32 = OnnxRuntimeBackend(g.model)
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        {"x": x}, qdq.activation_tensors_to_calibrate(g.model)).items()}
    return (data.open_data(x, g.inputs, batch_size=batch_size), fp32, amax,
            plan.find_units(g, {"x": [batch_size, *x.shape[1:]]}))


def test_single_units_measure_the_amplified_unit_the_local_error_misses():
    """Issue 25, and the layout detector (issue 19): on the amplifier the local-error prior
    under-predicts the head by more than 40 dB. Before the trials the planner runs each
    unit alone in INT8 on a few of the hardest samples (trials.single_units). Each figure
    equals the output NSR of that unit's own Q/DQ model, built and run apart from the
    planner on the same samples (the same float32 model in ONNX Runtime, the sums in
    float64: rel 1e-6). The fit starts from them: the head's contribution stays within a
    factor 2 of its noise alone on all 64 samples, it ranks above the last, and the plan
    is certified at the floor with at least the INT8 share of the best subset those
    measurements allow (brute force; additive here, all-INT8 within 0.2 dB of their sum)."""
    import itertools

    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    g = amplifier_model()
    x = np.random.default_rng(1).standard_normal((64, 16, 8, 8)).astype(np.float32)
    source, fp32, amax, units = max_calibrated(g, x, 16)

    def nsr(int8, samples):
        nodes = {n: "int8" if u.name in int8 else "fp32" for u in units for n in u.nodes}
        run = OnnxRuntimeBackend(qdq.quantize_model(g.model, amax, nodes)).run
        return plan.pooled_nsr(run({"x": samples}), fp32.run({"x": samples}))

    alone = {u.name: nsr({u.name}, x) for u in units}
    local = plan.local_sqnr(g, amax, units, [{"x": x[i:i + 1]} for i in range(8)], ("int8",))
    assert local["head"]["int8"] + 10 * np.log10(alone["head"]) > 40  # the prior's miss, dB
    floor = 42.0
    macs = {u.name: u.macs for u in units}
    best = max(sum(macs[n] for n in chosen) for k in range(len(units) + 1)
               for chosen in itertools.combinations(alone, k)
               if sum(alone[n] for n in chosen) <= 10 ** (-floor / 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = planned(g.model, source, source, amax, amax, amax, min_sqnr=floor, trials=1,
                         hard_count=16, high_precision="fp32", bias_correction=False)
    count = result.trial_cost["single_unit_samples"]
    assert result.trial_cost["single_units"] == len(units) and 2 <= count < 16
    measured = x[sorted(result.hard_samples)[:count]]
    for u in units:
        assert result.plan.units[u.name].evidence["output_nsr_alone"] == pytest.approx(
            nsr({u.name}, measured), rel=1e-6)
    fitted = dict(zip(result.sensitivity.units, result.sensitivity.contribution, strict=True))
    assert fitted["head"] == pytest.approx(alone["head"], rel=1.0)  # within a factor 2
    assert result.sensitivity.ranking().index("head") < len(units) - 1
    assert result.certificate.certified and result.certificate.value >= floor
    assert result.plan.int8_mac_share() >= best / sum(macs.values()) - 1e-9


def test_a_plan_run_from_a_cut_equals_its_whole_q_dq_model():
    """Issue 21: each unit alone in INT8 runs only the nodes after the last cut before it
    (measure.FromCuts), fed the base plan's tensors there. Its output NSR equals that of
    the plan's whole Q/DQ model, built and run apart (the same float32 arithmetic in ONNX
    Runtime, the sums in float64: rel 1e-6), an output made before the cut (y2) and a graph
    input read after every cut (x, by the last Add) included, and the nodes before the cut
    are not run."""
    from quantlab.calibration import qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.planner import measure

    block = residual_block().model.graph
    order = ["conv0", "relu0", "side", "mean2", "conv1", "relu1", "conv2", "add", "pool",
             "conv3", "mean"]
    nodes = {n.name: n for n in block.node}
    for name, read, output in (("mean", "shifted", "y"), ("mean2", "e", "y2")):  # per sample
        nodes[name] = helper.make_node("ReduceMean", [read], [output], name=name,
                                       axes=[2, 3], keepdims=0)
    nodes["xmean"] = helper.make_node("ReduceMean", ["x"], ["xm"], name="xmean",
                                      axes=[1, 2, 3], keepdims=1)
    nodes["shift"] = helper.make_node("Add", ["d", "xm"], ["shifted"], name="shift")
    order[-1:] = ["xmean", "shift", "mean"]
    g = make_graph([nodes[n] for n in order], [("x", ["N", 3, 8, 8])],
                   {i.name: numpy_helper.to_array(i) for i in block.initializer},
                   outputs=("y", "y2"))
    x = np.random.default_rng(5).standard_normal((6, 3, 8, 8)).astype(np.float32)
    source, fp32, amax, units = max_calibrated(g, x, 6)

    def quantized(precisions, part=g):
        present = {node.name for node in part.model.graph.node}
        return qdq.quantize_model(part, amax, {n: precisions[u.name] for u in units
                                               for n in u.nodes if n in present},
                                  high_precision="fp32")

    starts = measure.unit_starts(g, units)
    cuts = measure.choose_cuts(g, starts, {u.name: u.macs for u in units},
                               g.sample_bytes({"x": (1, 3, 8, 8)}), len(x))
    assert sorted(cuts) == [2, 6, 8] and "y2" in cuts[6]
    assert all(b.count("x") == 1 for b in cuts.values())
    base = {u.name: "fp32" for u in units}
    tails = measure.FromCuts(g, quantized, lambda run: measure.in_runs(run, source, 4),
                             base, cuts, {"x": x})
    references = fp32.run({"x": x})
    for u in units[1:]:
        precisions = {**base, u.name: "int8"}
        position = max(p for p in cuts if p <= starts[u.name])
        whole = plan.pooled_nsr(OnnxRuntimeBackend(quantized(precisions)).run({"x": x}),
                                references)
        assert whole > 0
        assert tails.nsr(precisions, position, references) == pytest.approx(whole, rel=1e-6)
    tail, computed = tails.tails[8]
    assert computed == ["y"] and {n.name for n in tail.model.graph.node}.isdisjoint(order[:8])


def test_the_all_int8_trial_taken_from_bias_correction_equals_running_it(planted_case,
                                                                         monkeypatch):
    """Bias correction measures the all-INT8 plan on the hardest samples with and without
    its shifts; the trial of that plan takes the chosen figure instead of running it again
    (Trials.measured). Run again instead, the noise model (every trial's NSR, bit for bit)
    and the plan are the same."""
    from quantlab.calibration import qdq

    g, source, fp32, _, _ = planted_case
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        next(iter(source)), qdq.activation_tensors_to_calibrate(g.model)).items()}
    settings = dict(min_sqnr=24.0, trials=16, hard_count=16, high_precision="fp32")
    taken = planned(g.model, source, source, amax, amax, amax, **settings)
    assert any(r["repair"] == "bias_correction" for r in taken.plan.repairs)
    again = []

    def run_it(self, nsr):
        again.append(nsr)
        return float(self.run(np.array([[u not in self.fixed for u in self.units]]))[0])

    monkeypatch.setattr(plan.Trials, "measured", run_it)
    ran = planned(g.model, source, source, amax, amax, amax, **settings)
    assert len(again) == 1
    np.testing.assert_array_equal(ran.sensitivity.nsr, taken.sensitivity.nsr)
    assert ran.sensitivity.nsr[0] == again[0]
    assert ran.plan == taken.plan


def test_make_plan_weighs_bias_correction_and_applies_it_to_the_int8_units(planted_case):
    """The shifts are measured once on the all-INT8 model and follow each unit's precision.

    Reference: repairs.bias_shifts run directly on the all-INT8 model of the plan's
    scales; the written Q/DQ model must carry exactly those shifts in the biases of
    its INT8 convs (float32 storage: 1e-6 relative) and none in its other units.
    """
    from onnx import numpy_helper

    from quantlab.calibration import qdq, repairs

    g, source, fp32, run_plan, units = planted_case
    amax = {n: float(np.abs(v).max()) for n, v in fp32.run(
        next(iter(source)), qdq.activation_tensors_to_calibrate(g.model)).items()}
    result = planned(g.model, source, source, amax, amax, amax, min_sqnr=24.0,
                     trials=16, hard_count=16, high_precision="fp32")
    record = next(r for r in result.plan.repairs if r["repair"] == "bias_correction")
    assert record["chosen"] == (record["hard_nsr_after"] < record["hard_nsr_before"])
    assert record["applied"] == sum(len(u.linear) for u in units)
    shifts, _ = repairs.bias_shifts(g.model, qdq.quantize_model(g.model, result.amax), source)
    original = {i.name: numpy_helper.to_array(i) for i in g.model.graph.initializer}
    written = {i.name: numpy_helper.to_array(i) for i in result.qdq_model.graph.initializer}
    convs = {n.name: n for n in result.qdq_model.graph.node if n.op_type == "Conv"}
    checked = 0
    for name, decision in result.plan.units.items():
        conv = convs[name]
        bias = written[conv.input[2]] if len(conv.input) > 2 else 0.0
        before = original[f"b{name[4:]}"] if name.startswith("conv") else 0.0
        if decision.precision == "int8" and record["chosen"]:
            np.testing.assert_allclose(bias, before + shifts[name], rtol=1e-6, atol=1e-7)
            assert decision.evidence["bias_shift_max"] == pytest.approx(
                np.abs(shifts[name]).max(), rel=1e-6)
            checked += 1
        else:
            np.testing.assert_array_equal(bias, before)
            assert "bias_shift_max" not in decision.evidence
    assert checked or not record["chosen"]
    assert plan.read_back(result.qdq_model, units) == {
        u: d.precision for u, d in result.plan.units.items()}


def test_plan_command_writes_the_uncertified_better_plan_beside_the_certified(tmp_path, capsys,
                                                                            monkeypatch):
    """The stand-in certify of the test above, through the command: the certified plan is the
    folder's, the better plan that could not be certified is in uncertified/ with its score,
    and summary.json says which is which."""
    from quantlab.cli import main

    monkeypatch.setattr(evaluate, "PairedScore", CertifiedByNoise)
    g = planted_model()
    graph.save_model(g.model, tmp_path / "planted.onnx")
    rng = np.random.default_rng(1)
    np.save(tmp_path / "calib.npy", rng.standard_normal((32, 16, 6, 6)).astype(np.float32))
    np.save(tmp_path / "eval.npy", rng.standard_normal((16, 16, 6, 6)).astype(np.float32))
    out = tmp_path / "plan"
    main(["plan", str(tmp_path / "planted.onnx"), "--data", str(tmp_path / "calib.npy"),
          "--eval", str(tmp_path / "eval.npy"), "--metric", "agreement", "--max-drop", "0.5",
          "--out", str(out), "--trials", "8", "--hard-samples", "16", "--high-precision",
          "fp32", "--calibrators", "percentile", "--no-bias-correction", "--no-progress"])
    summary = json.loads((out / "summary.json").read_text())
    kept = summary["uncertified"]
    assert summary["certificate"]["certified"] and not kept["certified"]
    assert kept["int8_mac_share"] > summary["int8_mac_share"] and kept["value"] >= kept["limit"]
    assert kept["needed_samples"] == 400
    written = plan.Plan.load(out / "uncertified" / "plan.json")
    assert written.int8_mac_share() == pytest.approx(kept["int8_mac_share"])
    assert graph.load_model(out / "uncertified" / "model.int8.onnx").graph.node
    assert "written to" in capsys.readouterr().out


def test_concurrently_measures_in_order_on_a_share_of_the_cores(monkeypatch):
    """Five plans on 8 cores: 4 sessions at once, 2 threads each, the figures in the plans'
    order although the later ones finish first; one plan, or one core: one session of
    ONNX Runtime's default threads. Stopped early (an error, an interrupt), the plans not
    yet started are dropped."""
    import threading
    import time

    from quantlab.planner import measure as measure_module

    monkeypatch.setattr(measure_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    threads, names = [], set()

    def measure(item, count):
        threads.append(count)
        names.add(threading.current_thread().name)
        time.sleep(0.02 * (5 - item))
        return item * item

    assert list(measure_module.concurrently(measure, range(5))) == [0, 1, 4, 9, 16]
    assert threads == [2] * 5 and len(names) == 4
    threads.clear()
    assert list(measure_module.concurrently(measure, [3])) == [9] and threads == [None]
    monkeypatch.setattr(measure_module.os, "sched_getaffinity", lambda pid: {0})
    threads.clear()
    assert list(measure_module.concurrently(measure, range(3))) == [0, 1, 4]
    assert threads == [None] * 3
    monkeypatch.setattr(measure_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    started = []
    figures = measure_module.concurrently(lambda item, _: started.append(item) or
                                          time.sleep(0.05), range(100))
    next(figures)
    figures.close()
    assert len(started) < 100


def test_plan_says_a_calibration_folder_is_already_equalized(tmp_path, capsys):
    import onnx
    from test_repairs import hardswish_dw_model

    from quantlab.cli import main

    model_path, data = tmp_path / "dw.onnx", tmp_path / "calib.npy"
    onnx.save(hardswish_dw_model(), model_path)
    np.save(data, np.random.default_rng(5).standard_normal((32, 3, 8, 8)).astype(np.float32))
    assert main(["calibrate", str(model_path), "--data", str(data), "--out",
                 str(tmp_path / "calib"), "--no-progress"]) == 0
    equalized = json.loads((tmp_path / "calib" / "calibration.json").read_text())[
        "repairs"]["depthwise_equalization"]["applied"]
    assert equalized
    capsys.readouterr()
    main(["plan", str(model_path), "--data", str(tmp_path / "calib"), "--eval", str(data),
          "--min-sqnr", "10", "--trials", "2", "--resamples", "20", "--out",
          str(tmp_path / "plan"), "--no-progress"])
    printed = capsys.readouterr().out
    assert (f"repair dw-equalize: already applied: {tmp_path / 'calib'} is a calibration folder "
            f"whose model.onnx `quantlab calibrate` equalized ({len(equalized)} inputs)") \
        in printed
    assert "nothing to change" not in printed


def test_a_floor_near_miss_is_kept_with_the_samples_that_would_certify_it():
    """A ViT plan of 81 % INT8 scored 30.95 dB against a 30 dB floor, its interval reaching
    below it: never 'too small' (only a drop is), so it was dropped, `uncertified: null`.
    It is a near miss, and the samples that would certify it follow from the interval's
    lower half shrinking as 1 / sqrt(samples): 100 * ((0.95 + 0.3) / 0.95) ** 2."""
    near = plan.Certificate("sqnr", float("inf"), 30.95, 30.0, (-0.3, 1.5), 0.95, 100, False,
                            False, None)
    assert near.near_miss and not near.inconclusive
    assert near.samples_to_certify() == math.ceil(100 * (1.25 / 0.95) ** 2) == 174
    outside = plan.Certificate("sqnr", float("inf"), 29.5, 30.0, (-1.2, 0.4), 0.95, 100,
                               False, False, None)
    assert not outside.near_miss and outside.samples_to_certify() is None


def test_an_evaluation_set_too_small_for_any_int8_plan_is_said_before_the_trials():
    """All-INT8 dropped 0.05 of F1 against a budget of 0.03 with its margin 0.18 wide below
    its score on 128 samples: a plan could be certified only under a drop of ~0.001. The
    message says so with the samples a plan at half the budget needs (the spread scaled to
    a drop of 0.015 as its square root, then as 1 / sqrt(samples)); a narrow interval says
    nothing."""
    def first(low):
        return plan.Evaluation(1.0, 0.01, plan.Certificate(
            "f1", 1.0, 0.95, 0.97, (low, 0.1), 0.95, 128, False, False, None), 1.0)

    message = evaluate.unreachable(first(-0.2), Budget("m", 0.03))
    spread = 0.95 - 0.97 + 0.2
    needed = math.ceil(128 * (spread * math.sqrt(0.015 / 0.05) / 0.015) ** 2)
    assert "too small to certify a plan with INT8" in message and f"About {needed} samples" \
        in message
    assert evaluate.unreachable(first(-0.021), Budget("m", 0.03)) == ""
