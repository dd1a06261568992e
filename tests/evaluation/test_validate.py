"""validate.py and `quantlab validate`: divergence localization, local errors, bad input."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pandas as pd
import pytest
import torch
from onnx import numpy_helper

from quantlab import cli, graph
from quantlab.calibration import qdq
from quantlab.data import open_data
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.evaluation import tasks
from quantlab.evaluation.sensitivity import local_error_model
from quantlab.evaluation.validate import ENGINE, FP32, TORCH, Task, validate
from quantlab.experiments.experiment import read_json


class FourConv(torch.nn.Module):
    """Four Conv+ReLU stages and a Linear head: a chain where 'first' is unambiguous."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ModuleList(
            torch.nn.Conv2d(c, 8, 3, padding=1) for c in (3, 8, 8, 8))
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        for conv in self.convs:
            x = torch.relu(conv(x))
        return self.fc(x.mean((2, 3)))


def make_four_conv() -> torch.nn.Module:
    """Factory used by the CLI test (`--torch test_validate:make_four_conv`)."""
    torch.manual_seed(0)
    return FourConv().eval()


@pytest.fixture(scope="module")
def four_conv(tmp_path_factory):
    """(module, FP32 model, path, Q/DQ model, inputs (24, 3, 8, 8), labels)."""
    folder = tmp_path_factory.mktemp("fourconv")
    module = make_four_conv()
    x = np.random.default_rng(0).standard_normal((24, 3, 8, 8)).astype(np.float32)
    model = graph.export_torch(module, x[:2], folder / "m.onnx", output_names=["logits"])
    quantized = _quantize(model, x)
    labels = np.random.default_rng(1).integers(0, 5, len(x))
    return module, model, folder / "m.onnx", quantized, x, labels


def _quantize(model: onnx.ModelProto, x: np.ndarray) -> onnx.ModelProto:
    names = qdq.activation_tensors_to_calibrate(model)
    values = OnnxRuntimeBackend(model).run({graph.input_specs(model)[0].name: x}, names)
    return qdq.quantize_model(model, {n: float(np.abs(v).max()) for n, v in values.items()})


def _source(model, x, batch_size=8):
    return open_data(x, graph.input_specs(model), batch_size=batch_size)


def _conv_nodes(model):
    return [n for n in model.graph.node if n.op_type == "Conv"]


def test_altered_weights_are_the_first_divergence(four_conv, tmp_path):
    module, model, _, _, x, _ = four_conv
    altered = onnx.ModelProto()
    altered.CopyFrom(model)
    target = _conv_nodes(altered)[2]
    weights = {i.name: i for i in altered.graph.initializer}
    weight = numpy_helper.to_array(weights[target.input[1]])
    weights[target.input[1]].CopyFrom(numpy_helper.from_array(-weight, target.input[1]))
    result = validate(altered, _quantize(altered, x), _source(model, x), tmp_path,
                      torch_module=module, progress=False)
    divergence = result.divergences[(TORCH, FP32)]
    assert divergence.node == target.name and divergence.tensor == target.output[0]
    assert divergence.op_type == "Conv" and divergence.torch_module == "convs.2"
    assert divergence.reason == "jump" and divergence.sqnr_db < 10
    summary = read_json(tmp_path / "summary.json")
    assert summary["pairs"][0]["first_divergence"]["node"] == target.name
    # Layers before the altered one agree to float32 rounding.
    table = result.tables[(TORCH, FP32)].set_index("tensor")
    assert table.loc[_conv_nodes(model)[1].output[0], "sqnr_db"] > 100


def test_bad_scale_is_the_worst_local_error(four_conv, tmp_path):
    _, model, _, quantized, x, _ = four_conv
    bad = onnx.ModelProto()
    bad.CopyFrom(quantized)
    # The activation quantizer in front of the third Conv: shrink its scale 30x so most
    # values saturate at +-127 * scale.
    target = next(n for n in _conv_nodes(bad) if n.name == _conv_nodes(model)[2].name)
    dq = graph.producers(bad)[target.input[0]]
    quantize = graph.producers(bad)[dq.input[0]]
    scales = {i.name: i for i in bad.graph.initializer}
    scale = numpy_helper.to_array(scales[dq.input[1]])
    scales[dq.input[1]].CopyFrom(numpy_helper.from_array(scale / 30, dq.input[1]))
    result = validate(model, bad, _source(model, x), tmp_path, mode="local", progress=False)
    table = result.tables[(FP32, ENGINE)]
    worst = table.sort_values("sqnr_db").iloc[0]
    assert worst["node"] == target.name
    assert worst["quantized_inputs"] == quantize.input[0]
    assert (tmp_path / "layers_onnx_fp32_vs_engine_int8_local.csv").is_file()
    written = pd.read_csv(tmp_path / "layers_onnx_fp32_vs_engine_int8_local.csv")
    assert written["sqnr_db"].to_numpy() == pytest.approx(table["sqnr_db"].to_numpy(), rel=1e-9)
    # Every other quantized node stays near the ~40 dB that 8 bits give on these inputs.
    others = table[table["node"] != target.name]["sqnr_db"]
    assert worst["sqnr_db"] < others.min() - 10
    # The next steps name it first among the units to pin, with its local SQNR.
    pin = next(s for s in result.summary["next_steps"] if s.startswith("Pin these units"))
    assert pin.startswith("Pin these units, whose own INT8 error is below 30 dB (worst first): "
                          f"{target.name} ({worst['sqnr_db']:.1f} dB)")


def test_task_metrics_match_a_direct_evaluation(four_conv, tmp_path):
    module, model, _, quantized, x, labels = four_conv
    task = Task("classification", lambda outputs, ids: outputs["logits"], labels=labels)
    result = validate(model, quantized, _source(model, x, batch_size=5), tmp_path,
                      torch_module=module, task=task, progress=False)
    # Reference: each stage's logits over the whole set at once, scored by tasks.py.
    with torch.no_grad():
        torch_logits = module(torch.from_numpy(x)).numpy()
    int8_logits = OnnxRuntimeBackend(quantized).run({"input": x})["logits"]
    assert result.metrics[TORCH] == pytest.approx(tasks.topk_accuracy(torch_logits, labels))
    assert result.metrics[ENGINE] == pytest.approx(tasks.topk_accuracy(int8_logits, labels))
    assert "SQNR per tensor" in result.report.read_text()


def test_identical_stages_give_infinite_sqnr_everywhere(four_conv, tmp_path):
    _, model, _, _, x, _ = four_conv
    result = validate(model, model, _source(model, x), tmp_path, progress=False)
    table = pd.read_csv(tmp_path / "layers_onnx_fp32_vs_engine_int8.csv")
    assert (table["sqnr_db"] == math.inf).all() and (table["cosine"] == 1.0).all()
    assert result.divergences[(FP32, ENGINE)] is None
    outputs = read_json(tmp_path / "summary.json")["pairs"][0]["outputs"]
    assert outputs["logits"]["sqnr_db"] == math.inf


def test_mismatched_tensor_names_are_named(four_conv, tmp_path):
    _, model, _, quantized, x, _ = four_conv
    renamed = onnx.ModelProto()
    renamed.CopyFrom(quantized)
    renamed.graph.output[0].name = "scores"
    for node in renamed.graph.node:
        node.output[:] = ["scores" if o == "logits" else o for o in node.output]
    with pytest.raises(ModelError, match=r"\['logits'\].*\['scores'\]"):
        validate(model, renamed, _source(model, x), tmp_path, progress=False)


class LogOfShifted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return torch.exp(torch.log(self.conv(x) - 100.0))


def test_nan_is_reported_at_the_first_tensor(tmp_path):
    torch.manual_seed(0)
    module = LogOfShifted().eval()
    x = np.random.default_rng(0).standard_normal((4, 3, 4, 4)).astype(np.float32)
    model = graph.export_torch(module, x[:1], tmp_path / "nan.onnx", output_names=["y"])
    log_output = next(n for n in model.graph.node if n.op_type == "Log").output[0]
    with pytest.raises(DataError, match=f"stage 'onnx_fp32'.*tensor '{log_output}'"):
        validate(model, model, _source(model, x), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # a failed run leaves no output folder


def test_labels_that_do_not_cover_the_data(four_conv, tmp_path):
    _, model, _, quantized, x, labels = four_conv
    task = Task("classification", lambda outputs, ids: outputs["logits"], labels=labels[:10])
    with pytest.raises(DataError, match="24 samples.*only 10"):
        validate(model, quantized, _source(model, x), tmp_path, task=task, progress=False)


def test_cli_validate_end_to_end_and_bad_input(four_conv, tmp_path, monkeypatch, capsys):
    _, model, path, quantized, x, _ = four_conv
    graph.save_model(quantized, tmp_path / "m.int8.onnx")
    np.save(tmp_path / "x.npy", x)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    common = ["validate", "--onnx", str(path), "--engine", str(tmp_path / "m.int8.onnx"),
              "--batch-size", "8", "--no-progress"]
    code = cli.main([*common, "--data", str(tmp_path / "x.npy"), "--out", str(tmp_path / "run"),
                     "--torch", "test_validate:make_four_conv", "--max-samples", "16"])
    assert code == 0
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["samples"] == 16
    pairs = [(p["reference"], p["test"]) for p in summary["pairs"]]
    assert pairs == [(TORCH, FP32), (FP32, ENGINE)]
    assert summary["pairs"][0]["first_divergence"] is None
    # The output folder is not overwritten without --force.
    assert cli.main([*common, "--data", str(tmp_path / "x.npy"),
                     "--out", str(tmp_path / "run")]) == 1
    assert "--force" in capsys.readouterr().err
    # A torch factory that cannot be imported is named.
    code = cli.main([*common, "--data", str(tmp_path / "x.npy"), "--out", str(tmp_path / "r2"),
                     "--torch", "no_such_pkg.models:build"])
    assert code == 1 and "no_such_pkg" in capsys.readouterr().err
    # Data of the wrong shape is named with the model input it does not fit.
    np.save(tmp_path / "bad.npy", x[:, :, :4])
    code = cli.main([*common, "--data", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "r3")])
    assert code == 1 and "model input 'input'" in capsys.readouterr().err


def test_load_factory_needs_module_colon_function():
    from quantlab.commands.validate import load_factory

    with pytest.raises(ConfigError, match="module:factory"):
        load_factory("just_a_module")


class ConvSigmoid(torch.nn.Module):
    """A head whose graph output comes from a node that is not quantized (Sigmoid)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.sigmoid(self.conv(x))


def test_local_mode_scores_end_to_end_outputs_of_unquantized_nodes(tmp_path):
    torch.manual_seed(0)
    x = np.random.default_rng(2).standard_normal((6, 3, 8, 8)).astype(np.float32)
    model = graph.export_torch(ConvSigmoid().eval(), x[:2], tmp_path / "m.onnx")
    result = validate(model, _quantize(model, x), _source(model, x, batch_size=4),
                      tmp_path / "out", mode="local", progress=False)
    pair = next(p for p in result.summary["pairs"] if p["test"] == ENGINE)
    (output,) = pair["outputs"].values()
    # End-to-end outputs are compared from the engine's own run: 8-bit error, not zero.
    assert 20 < output["sqnr_db"] < math.inf


# ------------------------------------------------------------ the CLI's option checks


def returns_none():
    """A --torch factory that returns nothing."""


def returns_text():
    """A --torch factory that returns a str."""
    return "not a module"


def raises():
    """A --torch factory that fails while loading its weights."""
    raise RuntimeError("factory failed while loading weights")


@pytest.mark.parametrize(("factory", "message"), [
    ("returns_none", "returned NoneType, not a torch.nn.Module"),
    ("returns_text", "returned str, not a torch.nn.Module"),
    ("raises", "the factory raised RuntimeError: factory failed while loading weights"),
])
def test_bad_torch_factories_are_one_line_errors(factory, message, monkeypatch):
    from quantlab.commands.validate import load_factory

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    with pytest.raises(ConfigError, match=f"--torch 'test_validate:{factory}'.*{message}"):
        load_factory(f"test_validate:{factory}")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_threshold_is_refused_before_any_work(four_conv, tmp_path, capsys, value):
    _, _, path, quantized, x, _ = four_conv
    graph.save_model(quantized, tmp_path / "m.int8.onnx")
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(SystemExit) as exit_:  # refused by the option's type, while parsing
        cli.main(["validate", "--onnx", str(path), "--engine", str(tmp_path / "m.int8.onnx"),
                  "--data", str(tmp_path / "x.npy"), "--out", str(tmp_path / "run"),
                  f"--threshold-db={value}", "--no-progress"])
    assert exit_.value.code == 2
    assert "argument --threshold-db: must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad, expected", [(["--max-samples", "0"], 2), (["--data", "BAD"], 1)])
def test_zoo_validation_checks_options_and_data_before_calibrating(tmp_path, capsys, bad,
                                                                    expected, monkeypatch):
    from quantlab.calibration import pipeline

    np.save(tmp_path / "bad.npy", np.zeros((4, 1, 5, 5), np.float32))
    bad = [str(tmp_path / "bad.npy") if b == "BAD" else b for b in bad]
    monkeypatch.setattr(pipeline, "run_calibration", lambda *a, **k: pytest.fail("calibrated"))
    try:
        code = cli.main(["validate", "--zoo", "digits-cnn", "--out", str(tmp_path / "run"),
                         "--no-progress", *bad])
    except SystemExit as exc:  # an option out of range is refused as it is parsed (rc 2)
        code = exc.code
    assert code == expected
    assert not (tmp_path / "run").exists()  # no partial OUT/calibration


def test_failed_zoo_validation_leaves_nothing(tmp_path, monkeypatch):
    from quantlab.evaluation import validate as validate_module

    def fail(*args, **kwargs):
        raise DataError("validation failed")

    monkeypatch.setattr(validate_module, "run_stages", fail)
    code = cli.main(["validate", "--zoo", "digits-cnn", "--out", str(tmp_path / "run"),
                     "--max-samples", "8", "--no-progress"])
    assert code == 1 and not (tmp_path / "run").exists()


def test_torch_stage_with_few_mapped_tensors_is_flagged(four_conv, tmp_path, capsys):
    module, model, _, quantized, x, _ = four_conv
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for node in bare.graph.node:  # an export without module scopes (and no TorchScript names)
        del node.metadata_props[:]
        node.name = f"n{abs(hash(node.name))}"
    with pytest.warns(UserWarning, match="could not be mapped"):
        result = validate(bare, quantized, _source(bare, x), tmp_path, torch_module=module,
                          progress=False)
    pair = result.pairs[0]
    assert pair.warnings and f"only {len(pair.table)} of" in pair.warnings[0]
    assert "Warning: only" in result.report.read_text()
    assert read_json(tmp_path / "summary.json")["pairs"][0]["warnings"] == pair.warnings


# --------------------------------------------------- the report escapes names from the model


def test_hostile_names_are_escaped_in_the_report(tmp_path):
    from quantlab.evaluation.compare import Divergence, PairResult
    from quantlab.experiments.report import write_report
    from quantlab.experiments.report.validation import validation_section

    tensor, node = "<script>alert(1)</script>getitem", "<script>alert(1)</script>node_Conv_68"
    module = "<img src=x onerror=alert(1)>"
    table = pd.DataFrame([{"tensor": tensor, "node": node, "op_type": "Conv",
                           "torch_module": module, "cosine": 0.9, "sqnr_db": 3.0,
                           "rel_l2": 0.7, "max_abs": 2.0, "frac_outside": 0.5}])
    divergence = Divergence(tensor, node, "Conv", module, 3.0, math.inf, "jump")
    pair = PairResult(FP32, ENGINE, "global", table, divergence,
                      {tensor: {"sqnr_db": 3.0, "cosine": 0.9, "rel_l2": 0.7, "max_abs": 2.0,
                                "frac_outside": 0.5}}, warnings=[f"tensor {tensor} unmapped"])
    section = validation_section([pair], {}, [tensor], 30.0, notes=[module])
    html = write_report(tmp_path / "report.html", "t", [section]).read_text()
    assert "<script>" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;getitem" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "End-to-end outputs" in html


# ------------------------------------------- local mode on a Reshape whose shape is computed


def _computed_reshape_model() -> onnx.ModelProto:
    """x.view(x.size(0), -1) as legacy torch / Paddle export it: Shape->Gather->Concat->Reshape."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal((256, 5)).astype(np.float32) * 0.1, "w2"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"]),
             helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["Concat.1"], axis=0),
             helper.make_node("Reshape", ["r", "Concat.1"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w2"], ["y"])]
    body = helper.make_graph(
        nodes, "computed_reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], initializers)
    return graph.normalize(helper.make_model(body, opset_imports=[helper.make_opsetid("", 17)]))


def test_local_mode_feeds_a_computed_reshape_shape(tmp_path):
    model = _computed_reshape_model()
    x = np.random.default_rng(1).standard_normal((6, 3, 8, 8)).astype(np.float32)
    quantized = _quantize(model, x)
    matmul = next(n for n in quantized.graph.node if n.op_type == "MatMul")
    reshape = graph.producers(quantized)[matmul.input[0]]
    assert reshape.op_type == "Reshape"  # the DQ sits before the Reshape: the case that broke
    local = local_error_model(graph.Graph(quantized), graph.Graph(model))
    assert "Concat.1" in local.feeds
    result = validate(model, quantized, _source(model, x, batch_size=4), tmp_path, mode="local",
                      progress=False)
    table = result.tables[(FP32, ENGINE)].set_index("tensor")
    # The Conv is compared where its TensorRT layer ends: after the Relu fused into it.
    assert set(table.index) == {"r", "y"}
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    assert table.loc["r", "op_type"] == "Conv" and table.loc["r", "fused_activation"] == relu.name
    # Reference: the MatMul alone on the FP32 Relu output quantized with the same scale.
    scale = numpy_helper.to_array(
        next(i for i in quantized.graph.initializer if i.name == "r_scale")).astype(np.float64)
    w2 = numpy_helper.to_array(
        next(i for i in model.graph.initializer if i.name == "w2")).astype(np.float64)
    w2_q = numpy_helper.to_array(
        next(i for i in quantized.graph.initializer if i.name == "w2_quantized"))
    w2_scale = numpy_helper.to_array(
        next(i for i in quantized.graph.initializer if i.name == "w2_scale")).astype(np.float64)
    relu = OnnxRuntimeBackend(model).run({"x": x}, ["r"])["r"].astype(np.float64).reshape(6, -1)
    fake = np.clip(np.round(relu / scale), -128, 127) * scale
    reference, test = relu @ w2, fake @ (w2_q.astype(np.float64) * w2_scale)
    expected = 10 * np.log10(np.sum(reference**2) / np.sum((test - reference) ** 2))
    assert table.loc["y", "sqnr_db"] == pytest.approx(expected, abs=0.05)


# ------------------------------------- metrics on the zoo models against an independent path


def _float64_metrics(ref: np.ndarray, test: np.ndarray, atol=1e-3, rtol=1e-3) -> dict:
    """The compare metrics of one tensor in plain float64 NumPy over the whole set at once."""
    r, t = ref.astype(np.float64).ravel(), test.astype(np.float64).ravel()
    err2 = np.sum((t - r) ** 2)
    return {
        "sqnr_db": math.inf if err2 == 0 else 10 * np.log10(np.sum(r**2) / err2),
        "cosine": 1.0 if err2 == 0 else np.dot(r, t) / np.sqrt(np.sum(r**2) * np.sum(t**2)),
        "max_abs": np.max(np.abs(t - r)),
        "frac_outside": np.mean(~np.isclose(t, r, rtol=rtol, atol=atol)),
    }


@pytest.fixture(scope="module", params=["digits-cnn", pytest.param("shapes-det",
                                                                    marks=pytest.mark.slow)])
def zoo_case(request, tmp_path_factory):
    """(zoo entry, FP32 model, Q/DQ model, evaluation set of 48 samples)."""
    from quantlab import zoo
    from quantlab.calibration import pipeline

    entry = zoo.get(request.param)
    out = tmp_path_factory.mktemp(request.param)
    result = pipeline.run_calibration(entry.name, entry.calibration_set(), out, method="entropy",
                                      progress=False)
    return entry, result.model, result.qdq_model, entry.eval_set(48)


@pytest.mark.parametrize("segmented", [False, True], ids=["whole", "segments"])
def test_zoo_metrics_equal_a_float64_whole_set_reference(zoo_case, tmp_path, segmented):
    entry, model, quantized, eval_set = zoo_case
    task = Task.from_zoo(entry, eval_set)
    source = open_data({entry.input_name: eval_set.inputs}, graph.input_specs(model), 16)
    result = validate(model, quantized, source, tmp_path / "whole", task=task, progress=False)
    if segmented:
        # A budget whose exposed half holds ~60% of one sample's tensors: a few segments.
        budget = int(1.2 * result.summary["memory"]["exposed_bytes_per_sample"])
        result = validate(model, quantized, source, tmp_path / "cut", task=task, progress=False,
                          memory_budget=budget)
        assert result.summary["memory"]["segments"] > 1
    # Reference: each model run once over all 48 samples, every compared tensor exposed.
    table = result.tables[(FP32, ENGINE)].set_index("tensor")
    feeds = {entry.input_name: eval_set.inputs}
    names = [t for t in table.index if t != entry.input_name]
    fp32 = OnnxRuntimeBackend(model).run(feeds, names)
    int8 = OnnxRuntimeBackend(quantized).run(feeds, names)
    # A one-sample slice may round a few values of a later INT8 layer differently from a
    # 16-sample batch (ONNX Runtime's kernels pick blockings by shape): 0.05 dB covers it.
    tolerance = 0.05 if segmented else 1e-9
    for name in names:
        expected = _float64_metrics(fp32[name], int8[name])
        row = table.loc[name]
        if math.isinf(expected["sqnr_db"]):
            assert row["sqnr_db"] == math.inf, name
            continue
        assert row["sqnr_db"] == pytest.approx(expected["sqnr_db"], rel=tolerance,
                                               abs=tolerance), name
        assert row["cosine"] == pytest.approx(expected["cosine"], abs=max(tolerance, 1e-12))
    if not segmented:
        for name in names:
            expected = _float64_metrics(fp32[name], int8[name])
            assert table.loc[name, "max_abs"] == pytest.approx(expected["max_abs"], rel=1e-6)
            assert table.loc[name, "frac_outside"] == pytest.approx(expected["frac_outside"],
                                                                    abs=1e-12)
    # End-to-end outputs and task metrics: the unexposed INT8 run (integer kernels).
    fp32_out = OnnxRuntimeBackend(model).run(feeds)
    int8_out = OnnxRuntimeBackend(quantized).run(feeds)
    outputs = result.pairs[-1].outputs
    for name in fp32_out:
        expected = _float64_metrics(fp32_out[name], int8_out[name])["sqnr_db"]
        # The FP32 outputs come from the exposed run, whose fusions round a little differently.
        assert outputs[name]["sqnr_db"] == pytest.approx(expected, rel=1e-6 + tolerance)
    # The outputs together: the figure plan certifies (--metric sqnr, --min-sqnr).
    from quantlab.planner.certify import output_sqnr

    assert result.summary["pairs"][-1]["output_sqnr_db"] == pytest.approx(
        output_sqnr([int8_out], [fp32_out]), rel=1e-6 + tolerance)
    for stage, values in ((FP32, fp32_out), (ENGINE, int8_out)):
        predicted = entry.postprocess(values, list(eval_set.image_ids))
        expected = (tasks.topk_accuracy(predicted, eval_set.labels) if entry.task ==
                    "classification" else tasks.coco_map(eval_set.coco, predicted))
        per_class = expected.pop("per_class", {})
        assert result.metrics[stage].pop("per_class", {}) == pytest.approx(per_class), stage
        assert result.metrics[stage] == pytest.approx(expected), stage


# ------------------------------------------------------------------------- bounded memory


class _Tracked(np.ndarray):
    """An ndarray view that can be weakly referenced (plain ndarrays cannot)."""


def test_no_array_of_a_run_outlives_its_slice(four_conv, tmp_path, monkeypatch):
    import gc
    import weakref

    from quantlab.evaluation import validate as validate_module

    _, model, _, quantized, x, _ = four_conv
    alive: list[weakref.ref] = []
    peaks: list[int] = []
    original_run = OnnxRuntimeBackend.run

    def tracked_run(self, batch, tensors=None):
        held = sum(r().nbytes for r in alive if r() is not None)
        peaks.append(held)
        values = original_run(self, batch, tensors)
        views = {name: value.view(_Tracked) for name, value in values.items()}
        alive.extend(weakref.ref(v) for v in views.values())
        return views

    original_slice = validate_module._Stream.run_slice

    def checked_slice(self, part, start, stop):
        original_slice(self, part, start, stop)
        gc.collect()
        assert not [r for r in alive if r() is not None], "an array survived its slice"

    monkeypatch.setattr(OnnxRuntimeBackend, "run", tracked_run)
    monkeypatch.setattr(validate_module._Stream, "run_slice", checked_slice)
    for mode in ("global", "local"):
        # Each mode exposes its own tensors (local: the ends of the fused layers and their feeds).
        whole = validate(model, quantized, _source(model, x), tmp_path / f"whole_{mode}",
                         mode=mode, progress=False)
        per_sample = whole.summary["memory"]["exposed_bytes_per_sample"]
        peaks.clear()
        budget = int(1.2 * per_sample)  # the exposed half holds ~60% of one sample: segments
        result = validate(model, quantized, _source(model, x[:6]), tmp_path / mode, mode=mode,
                          progress=False, memory_budget=budget)
        assert result.summary["memory"]["segments"] > 1
        assert result.summary["memory"]["slice_samples"] == 1
        # Held arrays never exceed one sample's exposed tensors of every stage.
        assert max(peaks) <= 2 * per_sample


def test_peak_memory_does_not_grow_with_samples(four_conv):
    import tracemalloc

    from quantlab.evaluation.validate import run_stages

    _, model, _, quantized, _, _ = four_conv
    x = np.random.default_rng(5).standard_normal((256, 3, 8, 8)).astype(np.float32)
    fp32, engine = OnnxRuntimeBackend(model, name=FP32), OnnxRuntimeBackend(quantized, name=ENGINE)
    peaks = {}
    for count in (32, 256):
        source = _source(model, x[:count], batch_size=8)
        run_stages(fp32, engine, source, progress=False)  # warm-up: sessions, numba
        tracemalloc.start()
        run_stages(fp32, engine, source, progress=False)
        peaks[count] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # 8x the samples: the peak is one batch's, whatever the number of batches.
    assert peaks[256] <= 1.1 * peaks[32] + (64 << 10), peaks


def test_backends_handed_in_name_the_stages(four_conv, tmp_path):
    _, model, _, quantized, x, _ = four_conv
    result = validate(OnnxRuntimeBackend(model, name="fp32"),
                      OnnxRuntimeBackend(quantized, name="int8"), _source(model, x), tmp_path,
                      progress=False)
    assert list(result.tables) == [("fp32", "int8")]
    assert (tmp_path / "layers_fp32_vs_int8.csv").is_file()
    assert read_json(tmp_path / "summary.json")["pairs"][0]["test"] == "int8"


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    """(folder, calibration folder, evaluation .npy) of TinyViT, exported with the TorchScript
    exporter and calibrated by `quantlab calibrate`."""
    from helpers import export_tiny_vit

    folder = tmp_path_factory.mktemp("vit")
    export_tiny_vit(folder / "vit.onnx")
    rng = np.random.default_rng(0)
    np.save(folder / "calib.npy", rng.standard_normal((16, 3, 12, 12)).astype(np.float32))
    np.save(folder / "eval.npy", rng.standard_normal((6, 3, 12, 12)).astype(np.float32))
    assert cli.main(["calibrate", str(folder / "vit.onnx"), "--data", str(folder / "calib.npy"),
                     "--out", str(folder / "calibration"), "--no-progress"]) == 0
    return folder, folder / "calibration", folder / "eval.npy"


def test_vit_with_in_graph_position_interpolation_validates_in_segments(tiny_vit, capsys):
    """Global mode under a small --memory cuts the ViT into segments across its shape scalars;
    every table and output figure equals the uncut run's."""
    folder, calibration, data = tiny_vit
    common = ["validate", "--from", str(calibration), "--data", str(data), "--no-progress"]
    assert cli.main([*common, "--out", str(folder / "whole")]) == 0
    # 60M: three segments (shape inference leaves the Resize's sizes open; they are counted
    # generously), and before the scalars were recomputed their cuts failed in ONNX Runtime.
    assert cli.main([*common, "--memory", "60M", "--metric", "sqnr",
                     "--out", str(folder / "cut")]) == 0
    capsys.readouterr()
    whole, cut = (read_json(folder / name / "summary.json") for name in ("whole", "cut"))
    assert whole["memory"]["segments"] == 1
    assert cut["memory"]["budget_bytes"] == 60 << 20 and cut["memory"]["segments"] > 1
    # To float32 rounding: the cut FP32 run's reference differs in the last bits (the
    # calibrated model since issue 19's defaults errs less, so its error figures feel it).
    for a, b in zip(whole["pairs"][0]["outputs"]["logits"].values(),
                    cut["pairs"][0]["outputs"]["logits"].values(), strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    tables = [pd.read_csv(folder / name / "layers_onnx_fp32_vs_engine_int8.csv")
              for name in ("whole", "cut")]
    assert list(tables[0]["tensor"]) == list(tables[1]["tensor"])
    np.testing.assert_allclose(tables[1]["sqnr_db"], tables[0]["sqnr_db"], rtol=1e-5)
    np.testing.assert_allclose(tables[1]["cosine"], tables[0]["cosine"], rtol=1e-9)
    # The shape scalars' readers are among the compared tensors: the Resize of the positions.
    assert "/Resize_output_0" in set(tables[1]["tensor"])


def test_reports_name_the_users_model_and_explain_every_column(tiny_vit, capsys):
    """`validate --from` a calibration folder: the report is titled with the model file the
    folder was calibrated from (calibration.json records it), not its copy model.onnx; every
    table column has a unit and a one-line explanation."""
    from helpers import assert_every_column_explained

    folder, calibration, data = tiny_vit
    assert read_json(calibration / "calibration.json")["model"] == str(folder / "vit.onnx")
    assert cli.main(["validate", "--from", str(calibration), "--data", str(data), "--metric",
                     "agreement", "--out", str(folder / "titled"), "--no-progress"]) == 0
    capsys.readouterr()
    report = (folder / "titled" / "report.html").read_text()
    assert "<title>Validation of vit.onnx</title>" in report
    assert f'<p class="subtitle">{folder / "vit.onnx"}; ' in report
    assert "model.onnx" not in report
    assert assert_every_column_explained(report) == 3  # metric, outputs, worst tensors
    assert "<dt>metric [name]</dt><dd>agreement: share of samples whose argmax" in report
    # Next steps with the user's paths, the model file first.
    steps = read_json(folder / "titled" / "summary.json")["next_steps"]
    assert any(f"`quantlab build {calibration}`" in s for s in steps) or any(
        f"`quantlab plan {folder / 'vit.onnx'} --data {calibration} --eval {data}" in s
        for s in steps)


def _reshaping_model() -> onnx.ModelProto:
    """x [N, L] -> Relu a -> Neg b -> Reshape to [-1, 4] c -> Relu y: runs only when N*L is a
    multiple of 4."""
    from helpers import onnx_model

    nodes = [onnx.helper.make_node("Relu", ["x"], ["a"]),
             onnx.helper.make_node("Neg", ["a"], ["b"]),
             onnx.helper.make_node("Reshape", ["b", "shape"], ["c"]),
             onnx.helper.make_node("Relu", ["c"], ["y"])]
    model = onnx_model(nodes, [("x", ["N", "L"])], ["y"], {})
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1, 4], np.int64), "shape"))
    return graph.normalize(model)


def test_a_failing_cut_is_not_blamed_on_the_data(tmp_path, monkeypatch):
    """A segment that fails where the uncut model runs is quantlab's fault: the error says so,
    names the segment and how to cut less, and names no internal tensor as a model input."""
    from quantlab.errors import InternalRunError

    model = _reshaping_model()
    x = np.ones((2, 8), np.float32)
    original = OnnxRuntimeBackend.run

    def segment_fails(self, batch, tensors=None):
        if not self.check_inputs and "c" in self.outputs:
            raise InternalRunError(f"ONNX Runtime failed to run '{self.name}' fed tensors of "
                                   "shapes {'b': (1, 8)}: Reshape went wrong")
        return original(self, batch, tensors)

    monkeypatch.setattr(OnnxRuntimeBackend, "run", segment_fails)
    with pytest.raises(ModelError) as error:
        validate(model, model, _source(model, x), tmp_path / "v", progress=False,
                 memory_budget=64)
    message = str(error.value)
    assert message.startswith("'onnx_fp32' runs uncut on samples 0..0, but segment ")
    assert "Reshape went wrong. This is a quantlab bug" in message
    assert "--memory" in message and "model's inputs" not in message


def test_data_that_the_uncut_model_cannot_run_is_blamed_with_its_real_inputs(tmp_path):
    """The same failure when the uncut model fails too: the data is the cause, and the error
    names the model's input, not the tensors a segment was fed."""
    model = _reshaping_model()
    x = np.ones((3, 6), np.float32)  # neither 6 values (one sample) nor 18 reshape to [-1, 4]
    for budget in (64, None):  # cut into a segment per tensor, and uncut
        with pytest.raises(DataError) as error:
            validate(model, model, _source(model, x), tmp_path / "v", progress=False,
                     memory_budget=budget)
        message = str(error.value)
        assert "on inputs of shapes {'x': (" in message and "model's inputs [('x'" in message
        assert "'b'" not in message and "segment" not in message


def _whole_runs(model, x, batch_size=8):
    """Each model's outputs per batch of `batch_size`, run whole (the reference of --metric)."""
    return [OnnxRuntimeBackend(model).run({"input": x[i:i + batch_size]})
            for i in range(0, len(x), batch_size)]


@pytest.mark.parametrize("metric", ["sqnr", "agreement"])
def test_metric_end_to_end_as_the_planner_certifies_it(four_conv, tmp_path, metric):
    """--metric scores the engine against FP32 as `quantlab plan` does: the same value and
    the same paired-bootstrap interval as plan.certify on whole-model runs."""
    from quantlab import plan

    _, model, _, quantized, x, _ = four_conv
    result = validate(model, quantized, _source(model, x), tmp_path, progress=False,
                      metric=metric, resamples=50)
    record = result.summary["metric"]
    fp32, int8 = _whole_runs(model, x), _whole_runs(quantized, x)
    bound = {"floor": 0.0} if metric == "sqnr" else {"max_drop": 0.0}
    expected = plan.certify(plan.resolve_metric(metric), metric, int8, fp32, resamples=50,
                            **bound)
    assert record["stages"] == [FP32, ENGINE] and record["samples"] == len(x)
    assert record[ENGINE] == pytest.approx(expected.value, rel=1e-6)
    assert record[FP32] == expected.reference and record["confidence"] == pytest.approx(0.9)
    assert record["interval"] == pytest.approx(list(expected.interval), rel=1e-6, abs=1e-12)
    if metric == "sqnr":  # FP32 against itself is +inf: the interval is the value's
        assert record["change"] is None and record["interval_of"] == "value"
    else:
        assert record["change"] == pytest.approx(expected.value - 1.0)
        assert record["interval_of"] == "change"
    report = result.report.read_text()
    assert f"--metric {metric}: engine_int8 against onnx_fp32 end to end" in report


def test_task_metric_interval_from_the_labels(four_conv, tmp_path):
    """--metric top1 with labels: FP32's and the engine's top-1 and the paired interval of the
    change, as the planner certifies a task metric."""
    from quantlab import plan

    _, model, _, quantized, x, labels = four_conv
    task = Task("classification", lambda outputs, ids: outputs["logits"], labels=labels)
    result = validate(model, quantized, _source(model, x), tmp_path, task=task, progress=False,
                      metric="top1", resamples=50)
    record = result.summary["metric"]
    fp32, int8 = _whole_runs(model, x), _whole_runs(quantized, x)
    top1 = [float(np.mean(np.argmax(np.concatenate([o["logits"] for o in runs]), 1) == labels))
            for runs in (fp32, int8)]
    assert [record[FP32], record[ENGINE]] == pytest.approx(top1)
    assert record["change"] == pytest.approx(top1[1] - top1[0])
    hits = [np.argmax(np.concatenate([o["logits"] for o in runs]), 1) == labels
            for runs in (int8, fp32)]
    expected = plan.certify_paired("top1", lambda pick: (hits[0][pick].mean(),
                                                         hits[1][pick].mean()),
                                   len(x), max_drop=0.0, resamples=50)
    assert record["interval"] == pytest.approx(list(expected.interval))
    with pytest.raises(ConfigError, match="'top1' is a task metric: it needs the ground truth"):
        validate(model, quantized, _source(model, x), tmp_path / "no", progress=False,
                 metric="top1")


def test_cli_metric_from_the_current_directory(four_conv, tmp_path, monkeypatch, capsys):
    """A module:function metric beside the user is found although the `quantlab` script's
    sys.path does not hold the current directory; a task metric without labels fails first."""
    import sys

    _, model, path, quantized, x, _ = four_conv
    graph.save_model(quantized, tmp_path / "m.int8.onnx")
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "gap_metric.py").write_text(
        "import numpy as np\n"
        "def gap(outputs, references):\n"
        "    return -float(np.mean([np.abs(o['logits'] - r['logits']).mean()\n"
        "                           for o, r in zip(outputs, references)]))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "gap_metric", raising=False)
    common = ["validate", "--onnx", str(path), "--engine", "m.int8.onnx", "--data", "x.npy",
              "--no-progress"]
    assert cli.main([*common, "--metric", "gap_metric:gap", "--out", "run"]) == 0
    assert sys.path[0] == str(tmp_path)  # first, as under `python -c`
    record = read_json(tmp_path / "run" / "summary.json")["metric"]
    fp32 = OnnxRuntimeBackend(model).run({"input": x})["logits"]
    int8 = OnnxRuntimeBackend(quantized).run({"input": x})["logits"]
    assert record[ENGINE] == pytest.approx(-np.abs(int8 - fp32).mean(), rel=1e-5)
    assert record[FP32] == 0.0 and record["change"] == record[ENGINE]
    assert record["interval"][0] <= record["change"] <= record["interval"][1] < 0
    printed = capsys.readouterr().out
    assert f"metric gap_metric:gap: engine_int8 {record[ENGINE]:.4g}, onnx_fp32 0" in printed
    sys.modules.pop("gap_metric", None)
    assert cli.main([*common, "--metric", "top1", "--out", "r2"]) == 1
    assert "--metric top1 needs ground truth: pass --zoo NAME without --data" in \
        capsys.readouterr().err
    assert cli.main([*common, "--metric", "gap_metric:nope", "--out", "r2"]) == 1
    assert "cannot load metric 'gap_metric:nope'" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def _mixed_scales_models() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """FP32: y = x * s, channels 0-1 scaled by 500 and 2-7 by 1; the engine quantizes y with
    one INT8 scale (its largest value / 127), as a per-tensor Q/DQ pair on a detector's
    concatenated boxes and scores does."""
    from helpers import onnx_model

    scale = np.array([500, 500, 1, 1, 1, 1, 1, 1], np.float32)
    fp32 = onnx_model([onnx.helper.make_node("Mul", ["x", "s"], ["y"])], [("x", ["N", 8])],
                      ["y"], {"s": scale})
    engine = onnx_model([onnx.helper.make_node("Mul", ["x", "s"], ["y_f"]),
                         onnx.helper.make_node("QuantizeLinear", ["y_f", "q", "zero"], ["y_q"]),
                         onnx.helper.make_node("DequantizeLinear", ["y_q", "q", "zero"], ["y"])],
                        [("x", ["N", 8])], ["y"], {"s": scale, "q": np.float32(4 * 500 / 127)})
    engine.graph.initializer.append(numpy_helper.from_array(np.int8(0), "zero"))
    return graph.normalize(fp32), graph.normalize(engine)


def test_an_output_that_mixes_scales_is_named_in_the_next_steps(tmp_path):
    """Per-channel errors of an output, against numpy: the small channels, a few INT8 levels
    wide, are named while the pooled output SQNR looks fine."""
    from quantlab.evaluation.compare import ChannelError

    fp32, engine = _mixed_scales_models()
    x = np.random.default_rng(0).uniform(-4, 4, (40, 8)).astype(np.float32)
    result = validate(fp32, engine, open_data(x, graph.input_specs(fp32), 16), tmp_path,
                      progress=False)
    reference = x * np.array([500, 500, 1, 1, 1, 1, 1, 1], np.float32)
    test = OnnxRuntimeBackend(engine).run({"x": x})["y"].astype(np.float64)
    noise = ((test - reference) ** 2).sum(0)
    per_channel = 10 * np.log10((reference.astype(np.float64) ** 2).sum(0) / noise)
    pooled = result.summary["pairs"][0]["outputs"]["y"]["sqnr_db"]
    spread = result.summary["pairs"][0]["output_channels"]["y"]
    assert spread["channels"] == 8 and spread["axis"] == 1
    amax = np.abs(reference).max(0)
    assert [spread["amax_min"], spread["amax_max"]] == pytest.approx([amax.min(), amax.max()])
    assert spread["worst_sqnr_db"] == pytest.approx(per_channel.min(), rel=1e-6)
    assert spread["worst_channel"] == int(np.argmin(per_channel)) >= 2
    assert pooled > 30 > spread["worst_sqnr_db"]  # the pooled figure hides it
    step = result.summary["next_steps"][0]
    assert step.startswith("Output 'y' mixes scales: along axis 1 its 8 channels' largest "
                           f"|values| run from {spread['amax_min']:.3g} to ")
    assert f"while the output as a whole is at {pooled:.1f} dB" in step
    # A probability map (N, 1, H, W) has one channel: its columns, dark and bright, are not
    # channels of different scales (the PP-OCR detector's map was named along its width).
    columns = np.linspace(1e-7, 1, 64)[None, None, None, :] * np.ones((2, 1, 8, 1))
    image = ChannelError()
    image.update(columns, columns + 1e-3)
    assert image.spread() is None
    # A one-scale output does not: channels of one range.
    same = ChannelError()
    same.update(reference[:, 2:], test[:, 2:])
    assert same.spread()["amax_max"] < 100 * same.spread()["amax_min"]
    validate(fp32, fp32, open_data(x, graph.input_specs(fp32), 16), tmp_path / "same",
             progress=False)
    assert not any("mixes scales" in s for s in read_json(tmp_path / "same" / "summary.json")[
        "next_steps"])


def test_mixed_scales_stays_quiet_on_probabilities_and_under_a_metric(tmp_path):
    """A softmax over 2000 classes quantized with one INT8 scale (1/127: every class under
    half a step reads 0) spans 1e-9..1 and its rare classes are at -inf dB, as a CTC head's
    are: not a mix of scales. A model judged by --metric is not told to pass one."""
    from helpers import onnx_model

    classes = 2000
    fp32 = graph.normalize(onnx_model([onnx.helper.make_node("Softmax", ["x"], ["p"], axis=-1)],
                                      [("x", ["N", classes])], ["p"], {}))
    engine = onnx_model([onnx.helper.make_node("Softmax", ["x"], ["p_f"], axis=-1),
                         onnx.helper.make_node("QuantizeLinear", ["p_f", "q", "zero"], ["p_q"]),
                         onnx.helper.make_node("DequantizeLinear", ["p_q", "q", "zero"], ["p"])],
                        [("x", ["N", classes])], ["p"], {"q": np.float32(1 / 127)})
    engine.graph.initializer.append(numpy_helper.from_array(np.int8(0), "zero"))
    engine = graph.normalize(engine)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (64, classes)).astype(np.float32)
    x[np.arange(64), rng.integers(0, classes, 64)] += 30  # one confident class per sample
    result = validate(fp32, engine, open_data(x, graph.input_specs(fp32), 16), tmp_path / "p",
                      progress=False)
    spread = result.summary["pairs"][0]["output_channels"]["p"]
    assert spread["amax_max"] > 1e6 * spread["amax_min"] and spread["probabilities"]
    assert spread["worst_sqnr_db"] < 10  # what made the hint fire
    assert not any("mixes scales" in s for s in result.summary["next_steps"])
    # The detector-like output of the test above keeps its hint, but not under --metric.
    fp32, engine = _mixed_scales_models()
    x = rng.uniform(-4, 4, (40, 8)).astype(np.float32)
    result = validate(fp32, engine, open_data(x, graph.input_specs(fp32), 16), tmp_path / "m",
                      progress=False, metric="sqnr")
    assert not result.summary["pairs"][0]["output_channels"]["y"]["probabilities"]
    assert not any("mixes scales" in s for s in result.summary["next_steps"])


def test_worst_tensors_show_a_decomposed_op_as_the_op_a_user_knows(tmp_path):
    """A transformer block exported with LayerNorm and GELU written out, its tensors inside
    them (Pow, Erf, ...) planted at the ViT's 5.9 dB and norm1's output at 20 dB: the inside
    tensors leave the worst-tensors table, norm1 heads it named LayerNorm, and the other rows
    are the lowest of what remains."""
    from helpers import decomposed_block

    from quantlab.engine import fusion
    from quantlab.experiments.report.validation import WORST_LAYERS, worst_tensors

    model = decomposed_block()
    x = np.random.default_rng(0).standard_normal((48, 5, 16)).astype(np.float32)
    names = qdq.activation_tensors_to_calibrate(model)
    amax = {n: float(np.abs(v).max()) for n, v in OnnxRuntimeBackend(model).run(
        {"x": x}, names).items()}
    result = validate(model, qdq.quantize_model(model, amax),
                      open_data(x, graph.input_specs(model), 16), tmp_path, progress=False)
    table = result.pairs[-1].table.copy()
    exported = fusion.decomposed_ops(graph.Graph(model))
    inside = {t for t, op in exported.items() if op.output != t}
    assert {"Pow", "Erf", "Sqrt"} <= set(table[table["tensor"].isin(inside)]["op_type"])
    norm1 = next(op for op in exported.values() if op.nodes[0].startswith("/norm1/"))
    table.loc[table["tensor"].isin(inside), "sqnr_db"] = 5.9
    table.loc[table["tensor"] == norm1.output, "sqnr_db"] = 20.0
    worst = worst_tensors(table, exported)
    assert list(worst["tensor"])[0] == norm1.output
    assert list(worst["op_type"])[0] == "LayerNorm (9 exported ops)"
    kept = table[~table["tensor"].isin(inside)].sort_values("sqnr_db", kind="stable")
    assert list(worst["tensor"]) == list(kept["tensor"][:WORST_LAYERS])
    # The validation's own table, unplanted, goes through the same grouping in the report.
    assert result.report.read_text().count("exported ops)") == sum(
        t in exported for t in worst_tensors(result.pairs[-1].table, exported)["tensor"])


def test_worst_tensors_leave_out_copies_the_console_as_the_report(tmp_path, capsys):
    """An Identity or an inference Dropout repeats its input's values (PP-OCR's recognizer
    listed two among its five worst): it leaves the worst-tensors table, and `quantlab
    validate` prints the same rows as its report's table, grouped the same way."""
    from helpers import onnx_model

    from quantlab.cli import main
    from quantlab.experiments.report.validation import worst_tensors

    w = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    model = graph.normalize(onnx_model([
        onnx.helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        onnx.helper.make_node("Dropout", ["m"], ["d"], name="drop"),
        onnx.helper.make_node("Identity", ["d"], ["i"], name="same"),
        onnx.helper.make_node("Relu", ["i"], ["y"], name="relu")],
        [("x", ["N", 6])], ["y"], {"w": w}))
    x = np.random.default_rng(1).standard_normal((32, 6)).astype(np.float32)
    amax = {n: float(np.abs(v).max()) for n, v in OnnxRuntimeBackend(model).run(
        {"x": x}, qdq.activation_tensors_to_calibrate(model)).items()}
    onnx.save(model, tmp_path / "m.onnx")
    onnx.save(qdq.quantize_model(model, amax), tmp_path / "q.onnx")
    np.save(tmp_path / "x.npy", x)
    assert main(["validate", "--onnx", str(tmp_path / "m.onnx"), "--engine",
                 str(tmp_path / "q.onnx"), "--data", str(tmp_path / "x.npy"), "--out",
                 str(tmp_path / "v"), "--no-progress"]) == 0
    printed = capsys.readouterr().out.split("worst layers")[1].split("next:")[0]
    table = pd.read_csv(next((tmp_path / "v").glob("layers_*engine_int8*.csv")))
    assert {"Dropout", "Identity"} <= set(table["op_type"])
    worst = worst_tensors(table, {})
    assert not set(worst["op_type"]) & {"Dropout", "Identity"}
    assert [line.split()[2] for line in printed.strip().splitlines()[1:]] == \
        list(worst["tensor"][:5])


def test_a_metric_bootstrap_shows_progress(four_conv, tmp_path, capsys):
    """MT09 (reliability r4): a user's metric is bootstrapped with a progress line, as the
    passes before it are, instead of minutes of silence after 'validate: done'."""
    _, model, _, quantized, x, _ = four_conv
    validate(model, quantized, _source(model, x), tmp_path, progress=True, metric="agreement",
             resamples=30)
    lines = capsys.readouterr().err.splitlines()
    assert "agreement: bootstrap: started, 30 resample" in lines
    assert any(line.startswith("agreement: bootstrap: done, 30 resample") for line in lines)


def test_test_stage_registry_matches_the_modes_the_command_line_offers():
    from quantlab import choices
    from quantlab.evaluation.validate import layers_file
    from quantlab.evaluation.validate_modes import TEST_STAGES

    assert tuple(TEST_STAGES) == choices.MODES
    # The global table keeps its name; every other mode's table is told apart by a suffix.
    assert layers_file(FP32, ENGINE, "global") == f"layers_{FP32}_vs_{ENGINE}.csv"
    assert len({layers_file(FP32, ENGINE, mode) for mode in choices.MODES}) == len(choices.MODES)
