"""run_calibration and write_results: bad input fails before the collection, and a run's
folder is written all or nothing (reliability report, sections 3, 4 and 9)."""

import errno
import json
import os
import socket
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import zoo_held_out
from onnx import TensorProto, helper, numpy_helper

from quantlab import graph
from quantlab.calibration import collect, pipeline
from quantlab.engine import cache
from quantlab.errors import ConfigError, ModelError, OutputExistsError
from quantlab.experiments.experiment import lock_path


def small_model(relu_name: str = "relu") -> onnx.ModelProto:
    """Conv -> Relu -> Conv on 3x8x8 inputs, built without torch."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("w1", (4, 3, 3, 3)), ("w2", (2, 4, 3, 3)))]
    nodes = [
        helper.make_node("Conv", ["input", "w1"], ["conv1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["conv1"], [relu_name], name="relu1"),
        helper.make_node("Conv", [relu_name, "w2"], ["output"], pads=[1, 1, 1, 1], name="conv2"),
    ]
    graph_proto = helper.make_graph(
        nodes, "small", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 2, 8, 8])], weights)
    return helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)])


def relu_model() -> onnx.ModelProto:
    """A graph without a linear op: nothing for a Q/DQ model to quantize."""
    return helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["input"], ["output"])], "relu",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3, 8, 8])]),
        opset_imports=[helper.make_opsetid("", 17)])


# What a run without trt_version writes: everything but the TensorRT <= 10 cache.
WITHOUT_CACHE = sorted(set(pipeline.CALIBRATION_FILES) - {"calibration.cache"})
DATA = np.random.default_rng(1).standard_normal((16, 3, 8, 8)).astype(np.float32)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def _no_collection(*args, **kwargs):
    raise AssertionError("the collection ran although a check before it should have failed")


@pytest.mark.parametrize(("case", "kwargs", "error", "match"), [
    ("trt version", {"trt_version": "banana"}, ConfigError, "TensorRT version 'banana'"),
    ("num_levels", {"method_params": {"num_levels": 0}}, ConfigError, "num_levels"),
    ("str percentile", {"method": "percentile", "method_params": {"percentile": "99"}},
     ConfigError, "percentile must be a number"),
    ("out under a file", {"out": "afile/sub"}, ConfigError, r"afile/sub: .*afile is a file"),
    # We run as root: a chmod 0o555 folder would not stop us; sysfs refuses new files to all.
    ("read-only out", {"out": "/sys/quantlab-out"}, ConfigError, "cannot write /sys/quantlab-out"),
    ("trt 11", {"trt_version": "11.0"}, ConfigError, "TensorRT 11.0 has no implicit INT8"),
    ("nothing to quantize", {"model": relu_model()}, ModelError,
     "the model 'relu' has no operator quantlab quantizes.*pass --trt-version"),
    ("cache name", {"model": small_model("relu\nEVIL: 3f800000"), "trt_version": "8.6.1"},
     ModelError,
     r"'relu\\nEVIL: 3f800000' cannot be written to a TensorRT calibration cache.*Rename"),
])
def test_checks_that_can_fail_run_before_the_collection_and_write_nothing(
        tmp_path, monkeypatch, case, kwargs, error, match):
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(collect, "collect", _no_collection)
    arguments = {"model": small_model(), "data": DATA, "out": "out", "progress": False, **kwargs}
    with pytest.raises(error, match=match):
        pipeline.run_calibration(**arguments)
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_out_locked_by_a_live_run_is_refused_before_the_collection(tmp_path, monkeypatch):
    monkeypatch.setattr(collect, "collect", _no_collection)
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "started": "now"}))
    with pytest.raises(OutputExistsError, match="being written by another quantlab run"):
        pipeline.run_calibration(small_model(), DATA, out, force=True, progress=False)
    assert not out.exists()


def test_run_writes_every_file_and_write_results_keeps_its_signature(tmp_path):
    out = tmp_path / "run"
    result = pipeline.run_calibration(small_model(), DATA, out, method="max", progress=False,
                                      trt_version="8.6.1")
    assert result.folder == out
    assert sorted(os.listdir(out)) == sorted(pipeline.CALIBRATION_FILES)
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no staging folder, no lock
    again = tmp_path / "again"
    assert pipeline.write_results(result, again, force=False, trt_version="10.3.0") == again
    assert cache.read_calibration_cache(again / "calibration.cache")[0].trt_version == "100300"
    # Statistics of the Q/DQ inputs alone (no trt_version) cannot make a whole cache.
    qdq_only = pipeline.run_calibration(small_model(), DATA, tmp_path / "qdq", method="max",
                                        progress=False)
    assert "calibration.cache" not in os.listdir(tmp_path / "qdq")
    with pytest.raises(ConfigError, match=r"no calibration.cache for TensorRT 10.3.0: .* no range"
                       r" for 2 tensor\(s\)"):
        pipeline.write_results(qdq_only, tmp_path / "none", trt_version="10.3.0")
    assert not (tmp_path / "none").exists()


def _fail_on_call(number: int, failure: BaseException, real):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == number:
            raise failure
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),  # disk full
    KeyboardInterrupt(),  # Ctrl-C during the write phase
    ModelError("tensor name cannot be written"),
])
def test_force_run_failing_while_writing_keeps_the_old_results(tmp_path, monkeypatch, failure):
    out = tmp_path / "run"
    pipeline.run_calibration(small_model(), DATA, out, method="max", progress=False)
    (out / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    # The second model file is written last but one: everything before it was written.
    monkeypatch.setattr(graph, "save_model", _fail_on_call(2, failure, graph.save_model))
    with pytest.raises(type(failure)):
        pipeline.run_calibration(small_model(), DATA, out, method="entropy", force=True,
                                 progress=False)
    assert _tree(tmp_path) == before  # old results intact, no temp files, no lock


def test_interrupted_first_run_leaves_no_folder_and_the_rerun_works(tmp_path, monkeypatch):
    out = tmp_path / "new" / "run"
    real = graph.save_model
    monkeypatch.setattr(graph, "save_model", _fail_on_call(1, KeyboardInterrupt(), real))
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_calibration(small_model(), DATA, out, progress=False)
    assert _tree(tmp_path) == {}
    monkeypatch.setattr(graph, "save_model", real)
    pipeline.run_calibration(small_model(), DATA, out, progress=False)  # no --force needed
    assert sorted(os.listdir(out)) == WITHOUT_CACHE


def test_rerun_into_a_folder_a_killed_run_left_works_without_force(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".model.onnx.nwjhngot.tmp").write_bytes(b"")  # SIGKILL during a write
    (tmp_path / ".run.quantlab-tmp-k1ll3d00").mkdir()
    (tmp_path / ".run.quantlab-tmp-k1ll3d00" / "model.onnx").write_bytes(b"partial")
    lock_path(out).write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname(),
                                          "started": "then"}))  # above pid_max: not alive
    pipeline.run_calibration(small_model(), DATA, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert sorted(os.listdir(out)) == WITHOUT_CACHE


def test_default_run_records_every_choice_and_auto_chooses_per_layer(tmp_path):
    from quantlab import choices
    from quantlab.calibration import calibrate, qdq
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.experiments.experiment import read_json

    default = pipeline.run_calibration(small_model(), DATA, tmp_path / "default",
                                       progress=False)
    record = record_default = read_json(tmp_path / "default" / "calibration.json")
    assert record["method"] == choices.DEFAULT_METHOD == "mse"
    assert record["weight_amax"] == "local" and record["layer_calibrators"] == {}
    assert "bias_correction" in record["repairs"]
    assert default.scales.amax == calibrate.calibrate(default.stats, "mse").amax
    result = pipeline.run_calibration(small_model(), DATA, tmp_path / "auto", method="auto",
                                      progress=False)
    record = read_json(tmp_path / "auto" / "calibration.json")
    assert record["method"] == "auto" and record["params"] == {}
    layers = record["layer_calibrators"]
    assert layers["candidates"] == list(pipeline.AUTO_CANDIDATES)
    assert layers["samples"] == len(DATA) and set(layers["chosen"]) == {"conv1", "conv2"}
    assert set(layers["chosen"].values()) <= set(pipeline.AUTO_CANDIDATES)
    assert record["weight_amax"] == "local"
    # Each weight measured, or counted alike (its candidates agree: nothing to choose).
    tensors, summary = (record["weight_amax_choice"][k] for k in ("tensors", "summary"))
    alike = {w for w in ("w1", "w2") if np.array_equal(
        *(qdq.weight_amax(graph.initializers(result.model)[w], 0, c) for c in ("max", "mse")))}
    assert set(tensors) == {"w1", "w2"} - alike and summary["tensors_alike"] == len(alike)
    assert all(t["local_sqnr_db"]["chosen"] >= max(t["local_sqnr_db"]["max"],
                                                   t["local_sqnr_db"]["mse"])
               for t in tensors.values())
    corrected = record["repairs"]["bias_correction"]
    assert {a["node"] for a in corrected["applied"]} == {"conv1", "conv2"}
    # Kept only if, measured on each half of the data, it lowers the noise of the other half.
    folds = corrected["summary"]["folds"]
    assert [f["measured_on"] for f in folds] == ["first half", "second half"]
    assert all(pipeline.FOLD_MIN_SAMPLES <= f["samples_scored"] <= len(DATA) // 2
               for f in folds)
    # The verdict is on both folds' scored samples pooled: for one output, a ratio of sums,
    # so between the two folds' own ratios (a mediant).
    both = corrected["summary"]["both_folds"]
    for key in ("output_nsr_without", "output_nsr_with"):
        assert min(f[key] for f in folds) <= both[key] <= max(f[key] for f in folds)
    assert corrected["summary"]["kept"] == (both["output_nsr_with"] < both["output_nsr_without"])
    # Every phase recorded, in order, with what it read.
    phases = {p["phase"]: p for p in record_default["phases"]}
    assert list(phases) == ["statistics", "weight amax", "bias shifts", "output noise"]
    assert phases["statistics"]["samples"] == phases["bias shifts"]["samples"] == len(DATA)
    # Halves of 8, under BIAS_MIN_SAMPLES: each read whole.
    assert corrected["summary"]["samples_read"] == [len(DATA) // 2] * 2
    # Two Q/DQ runs a scored sample: FP32's outputs are those the bias pass computed.
    assert phases["output noise"]["model_runs"] == 2 * phases["output noise"]["samples"]
    assert all(p["seconds"] >= 0 for p in phases.values())
    # Each layer's amax is the one of the candidate it chose.
    stats = collect.Statistics.load(tmp_path / "auto" / "stats.npz")
    source = {label: calibrate.calibrate(stats, name, **params).amax
              for label, (name, params) in pipeline.AUTO_CANDIDATES.items()}
    place = qdq.place(result.model)
    for node, label in layers["chosen"].items():
        tensor = next(t for t, readers in place.readers.items() if (node, 0) in readers)
        assert result.scales.amax[tensor] == source[label][tensor]
    # The plain calibration is still one call away, and equals quantize_model of its scales.
    plain = pipeline.run_calibration(small_model(), DATA, tmp_path / "plain", method="percentile",
                                     weight_criterion="max", bias_correction=False,
                                     progress=False)
    again = qdq.quantize_model(plain.model, plain.scales.amax)
    run = {"input": DATA}
    np.testing.assert_array_equal(OnnxRuntimeBackend(plain.qdq_model).run(run)["output"],
                                  OnnxRuntimeBackend(again).run(run)["output"])
    assert read_json(tmp_path / "plain" / "calibration.json")["layer_calibrators"] == {}
    with pytest.raises(ConfigError, match="method 'auto' takes no parameters"):
        pipeline.run_calibration(small_model(), DATA, tmp_path / "bad", method="auto",
                                 method_params={"percentile": 99.9}, progress=False)


def test_a_settled_fold_verdict_is_the_verdict_of_all_its_samples():
    """The keep/drop test stops scoring a fold once its verdict is settled; scored on every
    sample of the other half, each fold reaches the same verdict, or one whose difference
    is under FOLD_NEGLIGIBLE of the noise on every sample. The noise of the samples it
    stopped at is their pooled output NSR: checked against float64 sums of the outputs of
    plain ONNX Runtime sessions. FP32's outputs of the first samples, kept by the bias
    pass, stand for FP32's runs of them: the figures are the same."""
    import onnxruntime as ort

    from quantlab.calibration import qdq, repairs
    from quantlab.engine.backends.onnxruntime import SESSION_CONFIG

    model = graph.normalize(small_model())
    data = np.random.default_rng(5).standard_normal((48, 3, 8, 8)).astype(np.float32)
    quantized = qdq.quantize_model(model, {"input": 4.0, "relu": 3.0}, weight_criterion="max")
    halves = [[{"input": x[None]} for x in data[24 * h:24 * (h + 1)]] for h in (0, 1)]
    shifts, _, _, references = repairs.bias_shift_folds(model, quantized, halves,
                                                        model_outputs=10)
    fp32 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for half, kept in zip(halves, references, strict=True):
        assert len(kept) == 10
        # Copies, not views of ONNX Runtime's buffers: held views kept its arena from reusing
        # the blocks under them (+430 MB on the layout detector).
        assert all(value.flags.owndata for outputs in kept for value in outputs.values())
        for sample, outputs in zip(half, kept, strict=False):
            np.testing.assert_allclose(outputs["output"], fp32.run(None, sample)[0],
                                       rtol=1e-6, atol=1e-6)
    for measured_on, scored_on in ((0, 1), (1, 0)):
        shifted = repairs.shift_biases(model, quantized, shifts[measured_on])
        samples = halves[scored_on]
        every, _ = pipeline._fold_noise(model, quantized, shifted, samples, settled=False)
        given, _ = pipeline._fold_noise(model, quantized, shifted, samples, settled=False,
                                        references=references[scored_on])
        for key in ("output_nsr_without", "output_nsr_with"):
            np.testing.assert_allclose(given[key], every[key], rtol=1e-6)
        settled, (noise, power) = pipeline._fold_noise(model, quantized, shifted, samples)
        assert every["samples_scored"] == given["samples_scored"] == 24
        assert pipeline.FOLD_MIN_SAMPLES <= settled["samples_scored"] <= 24
        same = (settled["output_nsr_with"] < settled["output_nsr_without"]) == \
            (every["output_nsr_with"] < every["output_nsr_without"])
        assert same or abs(every["output_nsr_with"] - every["output_nsr_without"]) < \
            pipeline.FOLD_NEGLIGIBLE * every["output_nsr_without"]
        scored = np.concatenate([s["input"] for s in samples[:settled["samples_scored"]]])
        options = ort.SessionOptions()
        for key, value in SESSION_CONFIG.items():  # int8 kernels, as quantlab runs Q/DQ
            options.add_session_config_entry(key, value)
        reference, *outputs = [
            ort.InferenceSession(m.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
            .run(None, {"input": scored})[0].astype(np.float64)
            for m in (model, quantized, shifted)]
        np.testing.assert_allclose(
            [settled["output_nsr_without"], settled["output_nsr_with"]],
            [np.sum((y - reference) ** 2) / np.sum(reference ** 2) for y in outputs],
            rtol=1e-6)
        # ... and the sums it hands on for pooling with the other fold are those sums.
        np.testing.assert_allclose(noise[:, 0], [np.sum((y - reference) ** 2) for y in outputs],
                                   rtol=1e-6)
        np.testing.assert_allclose(power, [np.sum(reference ** 2)], rtol=1e-6)


@pytest.mark.parametrize("name", ["digits-cnn", "digits-vit", "shapes-det"])
def test_folds_scored_on_a_few_samples_score_as_folds_scored_on_the_whole_half(name, monkeypatch):
    """Each fold scores at most FOLD_MAX_SAMPLES samples of its other half. On the zoo, the
    model that verdict gives is held out no more than 0.2 dB (issue 41's bound) below the
    model the folds give scored on the whole halves (output SQNR against FP32, float64,
    the worst output): the same verdict, or one of the two whose difference does not show."""
    from quantlab.calibration import calibrate, qdq

    model, source, stats, score = zoo_held_out(name, pipeline.BIAS_SAMPLES)
    quantized = qdq.quantize_model(model, calibrate.calibrate(stats, "mse").amax)

    def corrected() -> tuple[float, list]:
        found, report = pipeline._corrected_biases(model, quantized, source, pipeline.Phases(False))
        return score(found), report["bias_correction"]["summary"]["folds"]

    few, few_folds = corrected()
    limit = pipeline.FOLD_MAX_SAMPLES
    monkeypatch.setattr(pipeline, "FOLD_MAX_SAMPLES", pipeline.BIAS_SAMPLES)
    monkeypatch.setattr(pipeline, "FOLD_SETTLED_SE", np.inf)  # every sample of the half
    every, every_folds = corrected()
    assert all(f["samples_scored"] <= pipeline.BIAS_SAMPLES // 2 for f in every_folds)
    assert all(f["samples_scored"] <= limit for f in few_folds)
    assert few >= every - 0.2


def test_a_bias_correction_that_raises_the_output_noise_is_left_out(tmp_path, monkeypatch):
    from quantlab.calibration import repairs
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    def harmful(fp32_model, qdq_model, parts, **options):  # every output shifted by 10
        shifts, pooled, report, references = real(fp32_model, qdq_model, parts, **options)
        return ([{node: s + 10 for node, s in part.items()} for part in shifts],
                {node: s + 10 for node, s in pooled.items()}, report, references)

    real = repairs.bias_shift_folds
    monkeypatch.setattr(repairs, "bias_shift_folds", harmful)
    result = pipeline.run_calibration(small_model(), DATA, tmp_path / "run", progress=False)
    summary = result.repairs["bias_correction"]["summary"]
    assert not summary["kept"] and all(f["output_nsr_with"] > f["output_nsr_without"]
                                       for f in summary["folds"])
    plain = pipeline.calibrate_from_stats(result.model, result.stats, result.data, "mse",
                                          weight_criterion="local")
    run = {"input": DATA}
    np.testing.assert_array_equal(OnnxRuntimeBackend(result.qdq_model).run(run)["output"],
                                  OnnxRuntimeBackend(plain.qdq_model).run(run)["output"])


def test_calibration_json_records_only_the_preprocessing_applied_and_validate_reads_it_back(
        tmp_path, monkeypatch, capsys):
    from PIL import Image

    from quantlab import data
    from quantlab.cli import main
    from quantlab.experiments.records import read_calibration_record

    path = tmp_path / "small.onnx"
    graph.save_model(small_model(), path)
    np.save(tmp_path / "calib.npy", DATA)
    # Arrays are fed as they are: no preprocess block, and options given are said to be moot.
    assert main(["calibrate", str(path), "--data", str(tmp_path / "calib.npy"), "--out",
                 str(tmp_path / "arrays"), "--no-progress", "--mean", "0.5", "0.5", "0.5"]) == 0
    assert "--mean had no effect" in capsys.readouterr().err
    assert json.loads((tmp_path / "arrays" / "calibration.json").read_text())["preprocess"] is None
    # Images: the new modes are recorded, and `validate --from` reads the images the same way.
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (12, 3 + 2 * i, 3), dtype=np.uint8)).save(
            images / f"{i}.png")
    options = ["--resize-mode", "height-pad", "--interpolation", "area", "--pad-value", "127.5"]
    assert main(["calibrate", str(path), "--data", str(images), "--out", str(tmp_path / "cal"),
                 "--no-progress", *options]) == 0
    expected = data.Preprocess(resize_mode="height-pad", interpolation="area", pad_value=127.5)
    assert read_calibration_record(tmp_path / "cal")["preprocess"] == expected
    opened = []
    real = data.open_data
    monkeypatch.setattr(data, "open_data", lambda *args: opened.append(real(*args)) or opened[-1])
    assert main(["validate", "--from", str(tmp_path / "cal"), "--data", str(images), "--out",
                 str(tmp_path / "val"), "--no-progress"]) == 0
    assert [source.preprocess for source in opened] == [expected]


def test_a_cached_zoo_export_and_its_data_read_without_torch(tmp_path, monkeypatch):
    """With its export cached, a zoo model's ONNX graph, calibration and evaluation data and
    labels are read in a process that never imports torch (4 s of every zoo command), and
    they are the same as the exporting process's; building the module still imports it."""
    import subprocess
    import sys

    from quantlab import zoo

    monkeypatch.setenv(pipeline.CACHE_ENV, str(tmp_path / "cache"))
    exported = pipeline.export_zoo_model("digits-vit")
    entry = zoo.get("digits-vit")
    np.save(tmp_path / "expected.npy", entry.eval_set(7).labels)
    script = (
        "import sys; import numpy as np\n"
        "from quantlab import zoo; from quantlab.calibration import pipeline\n"
        "model = pipeline.export_zoo_model('digits-vit')\n"
        "entry = zoo.get('digits-vit')\n"
        f"np.save({str(tmp_path / 'labels.npy')!r}, entry.eval_set(7).labels)\n"
        f"open({str(tmp_path / 'model.onnx')!r}, 'wb').write(model.SerializeToString())\n"
        "entry.calibration_set()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')))\n"
        "entry.build()\n"
        "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout + result.stderr
    assert (tmp_path / "model.onnx").read_bytes() == exported.SerializeToString()
    assert np.array_equal(np.load(tmp_path / "labels.npy"), np.load(tmp_path / "expected.npy"))


def test_zoo_export_is_cached_under_a_key_of_its_weights(tmp_path, monkeypatch):
    """The second export of a zoo model reads quantlab's cache (no torch export) and is the
    same model, also copied to `path`; an unreadable cache file is exported again; other
    weights make another key, hence a new export of another model."""
    import torch

    from quantlab import zoo

    monkeypatch.setenv(pipeline.CACHE_ENV, str(tmp_path / "cache"))
    exports = []
    export = graph.export_torch
    monkeypatch.setattr(graph, "export_torch", lambda *a, **k: exports.append(1) or export(*a, **k))
    fresh = pipeline.export_zoo_model("digits-cnn")
    cached = pipeline.export_zoo_model("digits-cnn", tmp_path / "kept.onnx")
    assert len(exports) == 1
    assert cached.SerializeToString() == fresh.SerializeToString()
    assert graph.load_model(tmp_path / "kept.onnx").SerializeToString() == \
        fresh.SerializeToString()
    (file,) = (tmp_path / "cache" / "zoo").glob("digits-cnn-*.onnx")
    file.write_bytes(b"not a model")
    assert pipeline.export_zoo_model("digits-cnn").SerializeToString() == \
        fresh.SerializeToString() and len(exports) == 2

    weights = torch.load(zoo.get("digits-cnn").weights_path, weights_only=True)
    name = next(n for n, t in weights.items() if t.is_floating_point())
    weights[name] = weights[name] * 2
    torch.save(weights, tmp_path / "other.pt")
    monkeypatch.setattr(zoo.ZooModel, "weights_path", property(lambda self: tmp_path / "other.pt"))
    other = pipeline.export_zoo_model("digits-cnn")
    assert len(exports) == 3 and other.SerializeToString() != fresh.SerializeToString()
    assert len(list((tmp_path / "cache" / "zoo").glob("digits-cnn-*.onnx"))) == 2


def test_a_phase_shows_its_samples_and_ends_when_its_reader_stops(monkeypatch, capsys):
    """Phases.shown yields the first samples one at a time with a progress line per phase;
    a reader that stops early (a settled fold) still gets the phase's end line."""
    import sys

    from quantlab import progress
    from quantlab.data import open_data

    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    model = graph.normalize(small_model())
    source = open_data(DATA, graph.input_specs(model), 5)
    phases = pipeline.Phases()
    with phases.record("weight amax", 6, 2):
        read = list(phases.shown(model, source, "weight amax", 6))
    np.testing.assert_array_equal(np.concatenate([s["input"] for s in read]), DATA[:6])
    shown = phases.shown(model, source, "output noise")
    for _ in range(3):
        next(shown)
    shown.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "calibrate: weight amax: started, 6 sample"
    assert f"calibrate: output noise: started, {len(DATA)} sample" in lines
    assert lines[-1].startswith("calibrate: output noise: done, 3 sample in ")
    assert phases.records == [{"phase": "weight amax", "seconds": phases.records[0]["seconds"],
                               "samples": 6, "model_runs": 12}]


def test_a_fixed_batch_models_phases_count_samples_and_its_runs_batches(tmp_path, monkeypatch,
                                                                      capsys):
    """A model that takes exactly 4 samples a run: each phase records the samples it read
    and one model run per batch of 4 (per graph), and the decisions' progress bars count
    batches (the statistics pass's its samples)."""
    import sys

    from quantlab import progress

    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    model = small_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    result = pipeline.run_calibration(model, DATA, tmp_path / "run")
    phases = {p["phase"]: p for p in result.phases}
    assert list(phases) == ["statistics", "weight amax", "bias shifts", "output noise"]
    assert phases["statistics"]["samples"] == len(DATA)
    graphs = {"statistics": 1, "weight amax": 1, "bias shifts": 1, "output noise": 2}
    for name, phase in phases.items():  # weight amax reads none where no weight differs
        assert phase["samples"] % 4 == 0 and (phase["samples"] > 0 or name == "weight amax")
        assert phase["model_runs"] == phase["samples"] // 4 * graphs[name], phase
    lines = capsys.readouterr().err.splitlines()
    assert f"calibrate: statistics: started, {len(DATA)} sample" in lines  # its samples
    assert "calibrate: bias shifts, first half: started, 2 batch" in lines  # 8 samples
    assert not [line for line in lines if "shifts" in line and " sample" in line]


def test_a_bias_half_that_settles_ends_its_line_before_the_next_half_starts(monkeypatch, capsys):
    """A half of the bias pass that stops once settled closes its samples then, so its
    progress line ends before the second half's starts (not once both had run)."""
    import sys

    from quantlab import progress
    from quantlab.calibration import qdq, repairs
    from quantlab.data import open_data

    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    model = graph.normalize(small_model())
    quantized = qdq.quantize_model(model, {"input": 4.0, "relu": 3.0}, weight_criterion="max")
    source = open_data(DATA, graph.input_specs(model), 5)
    half = len(DATA) // 2
    phases = pipeline.Phases()
    _, _, report, _ = repairs.bias_shift_folds(model, quantized, [
        phases.shown(model, source.subset(start, start + half), f"bias shifts, {label}")
        for start, label in ((0, "first half"), (half, "second half"))],
        settle=repairs.Settle(float("inf"), 3))  # settled as soon as 3 are read
    assert report.summary["samples_read"] == [3, 3]
    lines = [line for line in capsys.readouterr().err.splitlines()
             if ": started, " in line or ": done, " in line]
    assert lines[0] == f"calibrate: bias shifts, first half: started, {half} sample"
    assert lines[1].startswith("calibrate: bias shifts, first half: done, 3 sample in ")
    assert lines[2] == f"calibrate: bias shifts, second half: started, {half} sample"
    assert lines[3].startswith("calibrate: bias shifts, second half: done, 3 sample in ")


def test_equalization_decided_inside_the_statistics_pass_gives_the_pass_of_its_own():
    """Issue 41: the equalization is decided from the statistics pass's first
    EQUALIZE_SAMPLES (the model as it is, channels kept), the rest run the equalized model.
    Reference: the ranges pass of its own (`equalized`), then every sample through the
    equalized model. The same model and report; tensors the equalization did not divide
    hold the same values in both models (to float32 rounding: min/max to 1e-5, calibrated
    amax to 0.1 %); a divided one's first share comes from its input's channel histograms
    (test_collect: mse amax to 0.5 % on its share); and the held-out SQNR of the mse Q/DQ
    model within issue 41's 0.2 dB."""
    from quantlab.calibration import calibrate, qdq
    from quantlab.engine import trt_ranges

    count = pipeline.EQUALIZE_SAMPLES + 32
    model, source, _, score = zoo_held_out("shapes-det", count)
    phases = pipeline.Phases(progress=False)
    index, applied, stats = pipeline.equalized_statistics(
        model.model, source, qdq.activation_tensors_to_calibrate, phases)
    equalized, reference_applied = pipeline.equalized(model.model, source)
    assert index.model.SerializeToString() == equalized.SerializeToString()
    # The same decisions; none of its own passes (the ranges came with the statistics).
    assert applied["depthwise_equalization"].pop("passes") == 0
    assert reference_applied["depthwise_equalization"].pop("passes") == 1
    assert applied == reference_applied
    divided = {entry["equalized_tensor"] for entry in
               applied["depthwise_equalization"]["applied"]}
    assert divided  # shapes-det has depthwise inputs the equalization divides
    reference = collect.collect(equalized, source, qdq.activation_tensors_to_calibrate(equalized),
                                progress=False)
    assert list(stats.tensors) == list(reference.tensors)
    assert stats.num_samples == reference.num_samples == count
    assert [(p["phase"], p["samples"]) for p in phases.records] == [
        ("statistics, channel ranges", pipeline.EQUALIZE_SAMPLES), ("statistics", 32)]
    amax, want = (calibrate.calibrate(s, "mse").amax for s in (stats, reference))
    for name, ours in stats.tensors.items():
        exact = reference.tensors[name]
        assert ours.count == exact.count
        np.testing.assert_allclose([ours.min, ours.max], [exact.min, exact.max], rtol=1e-5)
        if name not in divided:
            assert amax[name] == pytest.approx(want[name], rel=1e-3), name
    ours_db, exact_db = (score(qdq.quantize_model(equalized, a, weight_criterion="max"))
                         for a in (amax, want))
    assert ours_db >= exact_db - 0.2
    # A calibration cache's tensors include those on the way into the producer that took the
    # division: neither name nor channels give them, so the first share runs once more.
    phases = pipeline.Phases(progress=False)
    _, _, stats = pipeline.equalized_statistics(model.model, source,
                                                trt_ranges.tensors_to_calibrate, phases)
    assert [(p["phase"], p["samples"]) for p in phases.records] == [
        ("statistics, channel ranges", pipeline.EQUALIZE_SAMPLES),
        ("statistics, changed tensors", pipeline.EQUALIZE_SAMPLES), ("statistics", 32)]
    reference = collect.collect(equalized, source, trt_ranges.tensors_to_calibrate(equalized),
                                progress=False)
    amax, want = (calibrate.calibrate(s, "mse").amax for s in (stats, reference))
    assert set(amax) == set(want)
    for name in set(amax) - divided:
        assert amax[name] == pytest.approx(want[name], rel=1e-3), name
