"""compare.py: metrics against known values and float64 references; first divergence."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pandas as pd
import pytest

from quantlab.errors import ModelError
from quantlab.evaluation import compare
from quantlab.experiments.experiment import read_json, write_json
from quantlab.graph import Graph


def _batches(array: np.ndarray, size: int) -> list[np.ndarray]:
    return [array[i:i + size] for i in range(0, len(array), size)]


def test_gaussian_noise_gives_expected_sqnr():
    # Signal variance 1, noise variance 0.01 -> SQNR = 10 log10(1 / 0.01) = 20 dB. With
    # 4e5 samples the estimate's standard error is ~0.01 dB, far inside the 0.2 dB tolerance.
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((400, 1000)).astype(np.float32)
    test = ref + rng.normal(0.0, 0.1, ref.shape).astype(np.float32)
    error = compare.TensorError()
    for r, t in zip(_batches(ref, 64), _batches(test, 64), strict=True):
        error.update(r, t)
    assert error.sqnr_db == pytest.approx(20.0, abs=0.2)
    # rel_l2 = 10^(-SQNR/20) by definition; cosine of x and x + n is 1/sqrt(1 + 0.01).
    assert error.rel_l2 == pytest.approx(10 ** (-error.sqnr_db / 20), rel=1e-9)
    assert error.cosine == pytest.approx(1 / math.sqrt(1.01), abs=1e-3)


def test_streaming_equals_concatenation_and_float64_reference():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((50, 3, 7)).astype(np.float32) * 5
    test = (ref + rng.standard_normal(ref.shape) * 0.05).astype(np.float32)
    streamed, whole = compare.TensorError(atol=0.01, rtol=0.01), compare.TensorError(0.01, 0.01)
    for r, t in zip(_batches(ref, 7), _batches(test, 7), strict=True):
        streamed.update(r, t)
    whole.update(ref, test)
    r64, t64 = ref.astype(np.float64).ravel(), test.astype(np.float64).ravel()
    expected = {
        "cosine": np.sum(r64 * t64) / np.sqrt(np.sum(r64**2) * np.sum(t64**2)),
        "sqnr_db": 10 * np.log10(np.sum(r64**2) / np.sum((r64 - t64) ** 2)),
        "rel_l2": np.linalg.norm(r64 - t64) / np.linalg.norm(r64),
        "max_abs": np.max(np.abs(r64 - t64)),
        "frac_outside": np.mean(~np.isclose(t64, r64, rtol=0.01, atol=0.01)),
    }
    for name, value in expected.items():
        # float64 sums in a different order agree to ~1e-15 relative; 1e-12 leaves margin.
        assert streamed.metrics()[name] == pytest.approx(value, rel=1e-12), name
        assert whole.metrics()[name] == pytest.approx(value, rel=1e-12), name


def test_identical_outputs_give_cosine_one_and_infinite_sqnr(tmp_path):
    x = np.random.default_rng(2).standard_normal((4, 10)).astype(np.float32)
    comparison = compare.Comparison(["a", "zeros"])
    comparison.update({"a": x, "zeros": np.zeros(3)}, {"a": x.copy(), "zeros": np.zeros(3)})
    table = comparison.table()
    row = table.set_index("tensor").loc["a"]
    assert row["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert row["sqnr_db"] == math.inf and row["rel_l2"] == 0.0 and row["max_abs"] == 0.0
    assert table.set_index("tensor").loc["zeros", "cosine"] == 1.0
    # The repo's JSON and CSV round-trip +inf (Python's Infinity token, pandas' "inf").
    write_json(tmp_path / "s.json", {"sqnr_db": row["sqnr_db"]})
    assert read_json(tmp_path / "s.json")["sqnr_db"] == math.inf
    table.to_csv(tmp_path / "t.csv", index=False)
    assert pd.read_csv(tmp_path / "t.csv")["sqnr_db"].tolist() == [math.inf, math.inf]


def test_shape_mismatch_and_missing_tensor_are_named():
    comparison = compare.Comparison(["conv_out"], "fp32", "int8")
    with pytest.raises(ModelError, match="conv_out.*fp32.*int8"):
        comparison.update({"conv_out": np.zeros((1, 4))}, {"conv_out": np.zeros((1, 5))})
    with pytest.raises(ModelError, match="'int8' run has no tensor.*conv_out"):
        comparison.update({"conv_out": np.zeros(1)}, {})


def _table(sqnr: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame([{"tensor": t, "node": f"n_{t}", "op_type": "Conv",
                          "torch_module": f"m.{t}", "cosine": 1.0, "sqnr_db": v,
                          "rel_l2": 0.0, "max_abs": 0.0,
                          "frac_outside": 0.0} for t, v in sqnr.items()])


def test_first_divergence_jump_gradual_and_none():
    order = ["a", "b", "c", "d"]
    upstream = {"a": [], "b": ["a"], "c": ["b"], "d": ["c"]}
    # b drops 90 dB below its input: the jump, even though c and d are lower still.
    jump = compare.first_divergence(_table({"a": 120, "b": 30, "c": 25, "d": 20}), order,
                                    upstream, threshold_db=40, min_drop_db=10)
    assert (jump.tensor, jump.node, jump.torch_module, jump.reason) == ("b", "n_b", "m.b", "jump")
    assert jump.input_sqnr_db == 120
    # Each layer loses 4 dB: no jump, first tensor under 40 dB is reported as gradual.
    gradual = compare.first_divergence(_table({"a": 48, "b": 44, "c": 40 - 1e-9, "d": 36}),
                                       order, upstream, threshold_db=40, min_drop_db=10)
    assert (gradual.tensor, gradual.reason) == ("c", "gradual")
    assert compare.first_divergence(_table({"a": math.inf, "b": 60}), order, upstream, 40) is None


def _model(outputs: list[str]) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], [outputs[0]])]
    return helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 2]) for o in outputs],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 2])]))


def test_common_tensors_names_mismatched_outputs():
    assert Graph(_model(["y"])).common_tensors(Graph(_model(["y"]))) == ["x", "r", "y"]
    with pytest.raises(ModelError, match=r"reference has \['y'\].*test model has \['out'\]"):
        Graph(_model(["y"])).common_tensors(Graph(_model(["out"])))


def test_compare_knows_no_onnx():
    # compare works on {name: array} only; graph queries live in quantlab.graph.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(compare))
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    imported = {alias.name for n in nodes for alias in n.names}
    imported |= {n.module for n in nodes if isinstance(n, ast.ImportFrom)}
    assert not {"onnx", "graph", "quantlab.graph"} & imported


def test_one_pass_kernel_equals_float64_numpy():
    # 10,007 elements: two full blocks of 4096 and a partial one.
    rng = np.random.default_rng(3)
    ref = rng.standard_normal(10_007).astype(np.float32)
    test = (ref + rng.normal(0, 0.01, ref.shape)).astype(np.float32)
    error = compare.TensorError(atol=0.01, rtol=0.01)
    error.update(ref, test)
    r64, t64 = ref.astype(np.float64), test.astype(np.float64)
    assert error.sqnr_db == pytest.approx(10 * np.log10(np.sum(r64**2) / np.sum((t64 - r64)**2)),
                                          rel=1e-12)
    assert error.max_abs == np.max(np.abs(t64 - r64))
    assert error.outside == np.count_nonzero(~np.isclose(t64, r64, rtol=0.01, atol=0.01))


def test_first_nonfinite_skips_integer_tensors():
    values = {"ids": np.array([1, 2], np.int64), "a": np.ones(2), "b": np.array([np.nan])}
    assert compare.first_nonfinite(values, ["ids", "a", "b"]) == "b"
    assert compare.first_nonfinite(values, ["ids", "a"]) is None


def test_update_names_the_tensors_holding_nan_or_inf():
    comparison = compare.Comparison(["a", "b", "c"])
    ref = {"a": np.ones(3), "b": np.array([1.0, np.inf]), "c": np.zeros(2)}
    test = {"a": np.ones(3), "b": np.ones(2), "c": np.array([np.nan, 0.0])}
    assert comparison.update(ref, test) == ["b", "c"]
    assert comparison.update({"a": np.ones(1)}, {"a": np.ones(1)}, ["a"]) == []


# Two outputs, two samples: a loud sample with little noise, a quiet one with as much noise as
# signal. Pooled over the samples, the noise is small; per sample, the quiet one dominates.
LOUD_AND_QUIET_REF = {"a": np.array([[10.0, 0.0], [0.1, 0.0]]),
                      "b": np.array([[1.0, 2.0], [2.0, 1.0]])}
LOUD_AND_QUIET_TEST = {"a": np.array([[10.1, 0.0], [0.0, 0.1]]),
                       "b": np.array([[1.0, 2.1], [2.0, 1.0]])}


def loud_and_quiet_sqnr() -> tuple[float, float]:
    """(pooled output SQNR, mean of per-sample ratios in dB) of the outputs above, written
    out in float64."""
    nsr_a = (0.1 ** 2 + 0.1 ** 2 + 0.1 ** 2) / (10.0 ** 2 + 0.1 ** 2)
    nsr_b = 0.1 ** 2 / (1 + 4 + 4 + 1)
    per_sample = [(0.1 ** 2 / 10.0 ** 2 + 0.1 ** 2 / 5) / 2, (2 * 0.1 ** 2 / 0.1 ** 2 + 0) / 2]
    return -10 * math.log10((nsr_a + nsr_b) / 2), -10 * math.log10(np.mean(per_sample))


def test_output_sqnr_pools_every_sample_and_averages_the_outputs():
    errors = {name: compare.TensorError() for name in LOUD_AND_QUIET_REF}
    for sample in range(2):  # one batch per sample: the sums stream
        for name, error in errors.items():
            error.update(LOUD_AND_QUIET_REF[name][sample], LOUD_AND_QUIET_TEST[name][sample])
    pooled, per_sample = loud_and_quiet_sqnr()
    assert pooled - per_sample > 25  # the two definitions disagree here
    got = compare.output_sqnr_db([e.sum_err2 for e in errors.values()],
                                 [e.sum_ref2 for e in errors.values()])
    assert got == pytest.approx(pooled, rel=1e-12)
    # One output: the output SQNR is that output's sqnr_db.
    assert compare.output_sqnr_db([errors["a"].sum_err2], [errors["a"].sum_ref2]) == \
        pytest.approx(errors["a"].sqnr_db, rel=1e-12)
    assert compare.output_sqnr_db([0.0, 0.0], [1.0, 2.0]) == math.inf
    assert math.isnan(compare.output_sqnr_db([math.nan, 0.0], [1.0, 2.0]))
