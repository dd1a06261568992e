"""Sweeps: snapshot statistics, the bootstrap interval, the command, resume, bad input."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_every_column_explained
from onnx import TensorProto, helper
from scipy import stats as scipy_stats

from quantlab import zoo
from quantlab.calibration import collect, pipeline, qdq
from quantlab.cli import main
from quantlab.data import open_data
from quantlab.errors import ConfigError
from quantlab.experiments import sweep
from quantlab.experiments.experiment import read_json
from quantlab.graph import input_specs
from quantlab.planner.certify import output_sqnr, split_samples

SWEEP_ARGS = ["--data", "zoo", "--eval", "zoo", "--metric", "top1", "--max-samples", "64",
              "--methods", "max", "percentile", "--percentiles", "99.9", "99.99",
              "--calib-sizes", "16", "64", "--resamples", "100", "--no-progress"]


@pytest.fixture(scope="module")
def digits():
    """(digits-cnn normalized ONNX model, its calibration samples)."""
    return pipeline.export_zoo_model("digits-cnn"), zoo.get("digits-cnn").calibration_set()


def test_snapshot_at_n_equals_a_collection_over_the_first_n_samples(digits):
    model, samples = digits
    tensors = qdq.activation_tensors_to_calibrate(model)
    # Batches of 7 straddle every size: the chunks are cut inside batches.
    source = open_data(samples, input_specs(model), batch_size=7)
    seen = []
    collected = sweep.snapshots(model, source, tensors, [10, 24, 50], 16, progress=False,
                                on_block=lambda a, b, s: seen.append((a, b)))
    assert seen == [(0, 10), (10, 24), (24, 40), (40, 50)]  # cut at every size, <= 16 each
    assert [b.num_samples for b in collected.blocks] == [10, 14, 16, 10]
    for n, snapshot in collected.snapshots.items():
        alone = collect.collect(model, open_data(samples[:n], input_specs(model), 32), tensors,
                                progress=False)
        assert snapshot.num_samples == alone.num_samples == n
        for name in tensors:
            got, want = snapshot.tensors[name], alone.tensors[name]
            assert (got.min, got.max, got.count, got.exponent, got.max_sample) == \
                (want.min, want.max, want.count, want.exponent, want.max_sample)
            np.testing.assert_array_equal(got.hist, want.hist)


def test_known_snapshots_are_used_and_only_the_rest_collected(digits, monkeypatch):
    model, samples = digits
    tensors = qdq.activation_tensors_to_calibrate(model)
    source = open_data(samples, input_specs(model), batch_size=16)
    full = collect.collect(model, source.subset(0, 40), tensors, progress=False)
    block = collect.collect(model, source.subset(0, 10), tensors, progress=False)
    calls = []
    real = collect.collect
    monkeypatch.setattr(collect, "collect", lambda m, s, *a, **k: calls.append(s.num_samples)
                        or real(m, s, *a, **k))
    result = sweep.snapshots(model, source, tensors, [20, 40], 10, known={40: full},
                             known_blocks={(0, 10): block}, progress=False)
    assert calls == [10]  # samples 10..20; 0..10 resumed, 40 from `known`
    assert result.snapshots[40] is full
    assert result.blocks[0] is block and len(result.blocks) == 2


def _identity_model(width: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bootstrap_interval_of_agreement_matches_the_binomial_closed_form():
    # n samples, k of which change their argmax: the paired bootstrap of the agreement's
    # difference to FP32 is Binomial(n, k/n)/n - 1 exactly; its 5 % and 95 % quantiles are
    # known in closed form (up to the resampling error of B draws, far below 2 samples).
    n, changed, resamples = 400, 80, 2000
    rng = np.random.default_rng(1)
    data = rng.standard_normal((n, 6)).astype(np.float32)
    model = _identity_model(6)
    evaluation = open_data(data, input_specs(model), batch_size=64)
    evaluator = sweep.Evaluator(model, evaluation, "agreement", resamples=resamples)
    outputs = [{"y": batch["y"].copy()} for batch in evaluator.references]
    flat = np.concatenate([o["y"] for o in outputs])
    flips = rng.choice(n, changed, replace=False)
    flat[flips] = -flat[flips]  # argmax moves to the former argmin
    start = 0
    for o in outputs:
        o["y"][:] = flat[start:start + len(o["y"])]
        start += len(o["y"])
    certificate = evaluator.against_fp32(outputs)
    p = (n - changed) / n
    assert certificate.value == pytest.approx(p)
    assert certificate.reference == 1.0
    expected = scipy_stats.binom.ppf([0.05, 0.95], n, p) / n - 1.0
    np.testing.assert_allclose(certificate.interval, expected, atol=2.0 / n)
    assert certificate.interval[1] - certificate.interval[0] > 10.0 / n  # not degenerate


def test_fast_output_sqnr_resamples_equal_the_metric_on_the_resampled_samples(digits):
    model, samples = digits
    evaluation = open_data(samples[:48], input_specs(model), batch_size=16)
    evaluator = sweep.Evaluator(model, evaluation, "sqnr")
    rng = np.random.default_rng(0)
    noisy = [{k: v + rng.normal(0, 0.05 * np.abs(v).mean(), v.shape).astype(v.dtype)
              for k, v in batch.items()} for batch in evaluator.references]
    score = evaluator.scored(noisy).score()
    chosen, refs = split_samples(noisy), split_samples(evaluator.references)
    for _ in range(5):
        pick = rng.integers(0, 48, 48)
        assert score(pick) == pytest.approx(output_sqnr([chosen[i] for i in pick],
                                                        [refs[i] for i in pick]), rel=1e-12)
        assert evaluator.reference.score(pick) == np.inf


def test_sweep_command_writes_a_consistent_folder(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "digits-cnn", *SWEEP_ARGS, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = read_json(out / "sweep.json")
    records = result["configurations"]
    assert [r["label"] for r in records] == [
        "max @16", "percentile 99.9 @16", "percentile 99.99 @16",
        "max @64", "percentile 99.9 @64", "percentile 99.99 @64"]
    assert result["collection_passes"] == 1
    full = [r for r in records if r["size"] == 64]  # the best is one of the largest size
    best = full[int(np.argmax([r["value"] for r in full]))]
    assert result["best"] == best["label"]
    default = next(r for r in records if r["label"] == "percentile 99.99 @64")
    assert best["value"] >= default["value"]  # calibrate's percentile is in the grid
    for r in records:
        assert r["interval"][0] <= r["value"] <= r["interval"][1]
        assert r["delta"] == pytest.approx(r["value"] - r["fp32"])
    # best/ is a calibration folder of the best configuration, with its size's statistics
    calibration = read_json(out / "best" / "calibration.json")
    assert calibration["method"] == best["method"]
    assert calibration["num_samples"] == best["size"]
    assert collect.Statistics.load(out / "best" / "stats.npz").num_samples == best["size"]
    movement = (out / "amax_movement.csv").read_text().splitlines()
    assert movement[0] == "setting,tensor,amax_32,amax_64,movement,bootstrap_spread"
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3
    assert assert_every_column_explained(html) == 1
    for sentence in result["sufficiency"].values():
        assert sentence in printed
    assert not (out / ".sweep-progress").exists()


def test_interrupted_sweep_resumes_without_collecting_again(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    calls = {"evaluate": 0, "collect": 0}
    real_evaluate, real_collect = sweep.Evaluator.against_fp32, collect.collect

    def evaluate(self, outputs):
        calls["evaluate"] += 1
        if calls["evaluate"] == 3:
            raise KeyboardInterrupt
        return real_evaluate(self, outputs)

    def counted_collect(*args, **kwargs):
        calls["collect"] += 1
        return real_collect(*args, **kwargs)

    monkeypatch.setattr(sweep.Evaluator, "against_fp32", evaluate)
    monkeypatch.setattr(collect, "collect", counted_collect)
    assert main(["sweep", "digits-cnn", *SWEEP_ARGS, "--out", str(out)]) == 130
    assert not (out / "sweep.json").exists()
    saved = read_json(out / ".sweep-progress" / "records.json")["records"]
    assert len(saved) == 2
    collected = calls["collect"]
    assert collected == 4  # blocks of 16 samples: every sample once
    assert main(["sweep", "digits-cnn", *SWEEP_ARGS, "--out", str(out)]) == 0
    assert calls["collect"] == collected  # the snapshots came from the checkpoint
    assert calls["evaluate"] == 3 + 4  # the 4 configurations left
    assert "resuming: 2 configuration(s) and 64 samples' statistics" in capsys.readouterr().out
    records = read_json(out / "sweep.json")["configurations"]
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(sweep.Evaluator, "against_fp32", real_evaluate)
    assert main(["sweep", "digits-cnn", *SWEEP_ARGS, "--out", str(fresh)]) == 0
    assert [(r["label"], r["value"], r["interval"]) for r in records] == \
        [(r["label"], r["value"], r["interval"]) for r in
         read_json(fresh / "sweep.json")["configurations"]]


def test_resume_key_is_the_data_content_not_its_path_size_or_date(tmp_path, monkeypatch,
                                                                   capsys):
    data = tmp_path / "calib.npy"
    samples = np.load("calibration_data/digits/calibration.npy")[:64]
    np.save(data, samples)
    size = data.stat().st_size
    calls = {"evaluate": 0, "collect": 0}
    interrupt = []
    real_evaluate, real_collect = sweep.Evaluator.against_fp32, collect.collect

    def evaluate(self, outputs):
        calls["evaluate"] += 1
        if interrupt and calls["evaluate"] == 3:
            raise KeyboardInterrupt
        return real_evaluate(self, outputs)

    def counted_collect(*args, **kwargs):
        calls["collect"] += 1
        return real_collect(*args, **kwargs)

    def sweep_into(out: Path, interrupted: bool) -> int:
        calls.update(evaluate=0, collect=0)
        interrupt[:] = [True] if interrupted else []
        return main(["sweep", "digits-cnn", "--data", str(data), *SWEEP_ARGS[2:],
                     "--out", str(out)])

    monkeypatch.setattr(sweep.Evaluator, "against_fp32", evaluate)
    monkeypatch.setattr(collect, "collect", counted_collect)
    # The same content written again (another modification time): resumed.
    assert sweep_into(tmp_path / "same", interrupted=True) == 130
    np.save(data, samples.copy())
    capsys.readouterr()
    assert sweep_into(tmp_path / "same", interrupted=False) == 0
    assert "resuming: 2 configuration(s) and 64 samples' statistics" in capsys.readouterr().out
    assert calls == {"evaluate": 4, "collect": 0}
    # The same path, shape, dtype and file size, other content: started over.
    assert sweep_into(tmp_path / "changed", interrupted=True) == 130
    np.save(data, samples[::-1].copy())
    assert data.stat().st_size == size
    capsys.readouterr()
    assert sweep_into(tmp_path / "changed", interrupted=False) == 0
    printed = capsys.readouterr().out
    assert "resuming" not in printed and "from a sweep of another model, data" in printed
    assert calls == {"evaluate": 6, "collect": 4}  # every configuration, every block again
    assert sweep_into(tmp_path / "fresh", interrupted=False) == 0
    changed, fresh = (read_json(tmp_path / name / "sweep.json")["configurations"]
                      for name in ("changed", "fresh"))
    assert [(r["label"], r["value"], r["interval"]) for r in changed] == \
        [(r["label"], r["value"], r["interval"]) for r in fresh]


@pytest.mark.parametrize("options, message", [
    (["--methods", "max", "kl"], "calibration method 'kl' is not one of"),
    (["--calib-sizes", "16", "500"], "--calib-sizes 500 is larger than the calibration data"),
    (["--metric", "nosuch"], "unknown metric 'nosuch'"),
    # The metric is checked as plan checks it (commands.options.check_metric).
    (["--metric", "map"], "--metric map does not fit digits-cnn, a classification model"),
])
def test_bad_sweep_options_are_one_clear_error(tmp_path, capsys, options, message):
    args = ["sweep", "digits-cnn", "--data", "zoo", "--eval", "zoo", "--out",
            str(tmp_path / "out"), "--no-progress", *options]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_long_sweep_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "estimate_seconds", lambda *args: 7200.0)
    assert main(["sweep", "digits-cnn", *SWEEP_ARGS, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "6 configurations" in err and "--allow-long" in err and "2.0 h on this machine" in err
    assert not (tmp_path / "out").exists()


def test_configurations_and_sizes():
    configs = sweep.configurations(["entropy", "percentile"], [99.9, 99.99], [16, 32])
    assert [c.label for c in configs] == [
        "entropy @16", "percentile 99.9 @16", "percentile 99.99 @16",
        "entropy @32", "percentile 99.9 @32", "percentile 99.99 @32"]
    assert sweep.default_sizes(200) == [16, 32, 64, 128, 200]
    assert sweep.default_sizes(128) == [16, 32, 64, 128]
    assert sweep.snapshot_points([16, 100]) == [16, 50, 100]
    with pytest.raises(ConfigError, match="multiples of 4"):
        sweep.check_sizes([16, 30], 64, "data", step=4)
    assert json.dumps(sweep.amax_movement({"a": 1.0}, {"a": 1.25})) == '{"a": 0.2}'


def test_help_states_the_library_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    percentiles = " ".join(f"{p:g}" for p in sweep.DEFAULT_PERCENTILES)
    assert f"(default: {percentiles})" in text
    assert f"(default: {sweep.TOLERANCE:g})" in text


@pytest.mark.parametrize("name", [
    "digits-cnn", pytest.param("shapes-det", marks=pytest.mark.slow)])
def test_task_metric_of_the_evaluator_equals_the_streamed_task_score(name):
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.evaluation.tasks import PRIMARY_METRIC, Task, evaluate

    entry = zoo.get(name)
    model = pipeline.export_zoo_model(name)
    eval_set = entry.eval_set(40)
    task = Task.from_zoo(entry, eval_set)
    metric = PRIMARY_METRIC[entry.task]
    evaluation = open_data(eval_set.inputs, input_specs(model), batch_size=16)
    evaluator = sweep.Evaluator(model, evaluation, metric, task, resamples=20)
    stats = collect.collect(model, evaluation, qdq.activation_tensors_to_calibrate(model),
                            progress=False)
    int8 = pipeline.calibrate_from_stats(model, stats, evaluation, "max").qdq_model
    certificate = evaluator.against_fp32(evaluator.outputs(int8, "int8"))
    for value, tested in ((certificate.value, int8), (certificate.reference, model)):
        streamed = evaluate(task, OnnxRuntimeBackend(tested).run, evaluation)[metric]
        assert value == pytest.approx(streamed, abs=1e-12)


def test_amax_spread_is_zero_for_identical_blocks_and_grows_with_their_differences(digits):
    model, samples = digits
    tensors = qdq.activation_tensors_to_calibrate(model)
    specs = input_specs(model)
    same = collect.collect(model, open_data(samples[:8], specs, 8), tensors, progress=False)
    assert set(sweep.amax_spread([same] * 4, "max", {}).values()) == {0.0}
    blocks = [collect.collect(model, open_data(samples[i:i + 8] * (1 + i / 8), specs, 8),
                              tensors, progress=False) for i in range(0, 32, 8)]
    # max of merged blocks = the largest block's max: the spread of a bootstrap of maxima
    rng = np.random.default_rng(0)
    maxima = np.array([[b.tensors[n].amax for n in tensors] for b in blocks])
    draws = np.array([maxima[rng.integers(0, 4, 4)].max(axis=0) for _ in range(50)])
    expected = draws.std(axis=0) / draws.mean(axis=0)
    np.testing.assert_allclose([sweep.amax_spread(blocks, "max", {})[n] for n in tensors],
                               expected, rtol=1e-12)



def test_best_folder_records_the_data_and_serves_as_a_check_baseline(tmp_path, capsys):
    data = "calibration_data/digits/calibration.npy"
    out = tmp_path / "sweep"
    assert main(["sweep", "digits-cnn", "--data", data, "--eval", "zoo", "--metric", "top1",
                 "--methods", "max", "--calib-sizes", "16", "32", "--max-samples", "32",
                 "--resamples", "20", "--no-progress", "--out", str(out)]) == 0
    best = read_json(out / "sweep.json")["best"]
    calibration = read_json(out / "best" / "calibration.json")
    # Recorded absolute (experiment folders hold absolute paths), and the size chosen.
    assert (calibration["data"], calibration["num_samples"]) == (
        str(Path(data).resolve()), int(best.split("@")[1]))
    capsys.readouterr()
    # a model candidate is calibrated from the recorded data, as the best configuration was
    assert main(["check", "digits-cnn", "--baseline", str(out), "--eval", "zoo", "--metric",
                 "top1", "--max-samples", "32", "--resamples", "20", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(":", 2)[2] == lines[1].split(":", 2)[2]


@pytest.mark.parametrize("interval, expected", [
    ((0.1, 0.9), "tells the top two configurations apart"),
    ((-0.5, 1.5), "about 4000 samples (4x these) would separate"),  # 1000 * ((0.5 + 0.5) / 0.5)^2
    ((-60.0, 61.0), "about 14641000 samples (1.46e+04x these)"),  # ((0.5 + 60) / 0.5)^2
])
def test_evaluation_sentence(interval, expected):
    from quantlab.planner.certify import Certificate

    # best 30.5 vs runner-up 30.0 on 1000 samples; the difference's interval varies
    certificate = Certificate("sqnr", 30.0, 30.5, 30.0, interval, 0.95, 1000, False, False, None)
    records = [{"label": "a @8", "value": 30.5}, {"label": "b @8", "value": 30.0}]
    result = sweep.SweepResult(records, {}, {}, 4, 8, 0.02, 0, certificate, 1, {}, 0, 0)
    assert expected in sweep.evaluation_sentence(result)


def test_a_calibration_folder_serves_its_size_from_stats_npz(tmp_path, monkeypatch, capsys):
    data = "calibration_data/digits/calibration.npy"
    folder = tmp_path / "calib"
    assert main(["calibrate", "digits-cnn", "--data", data, "--out", str(folder),
                 "--no-progress"]) == 0
    collected = []
    real = collect.collect
    monkeypatch.setattr(collect, "collect", lambda m, s, *a, **k: collected.append(
        s.num_samples) or real(m, s, *a, **k))
    common = ["--eval", "zoo", "--metric", "top1", "--methods", "max", "entropy",
              "--calib-sizes", "100", "200", "--resamples", "20", "--no-progress"]
    assert main(["sweep", "digits-cnn", "--data", str(folder), *common,
                 "--out", str(tmp_path / "reused")]) == 0
    assert collected == [100]  # samples 100..200 are the folder's stats.npz
    collected.clear()
    assert main(["sweep", "digits-cnn", "--data", data, *common,
                 "--out", str(tmp_path / "fresh")]) == 0
    assert collected == [100, 100]
    reused, fresh = (read_json(tmp_path / name / "sweep.json") for name in ("reused", "fresh"))
    assert [(r["label"], r["value"]) for r in reused["configurations"]] == \
        [(r["label"], r["value"]) for r in fresh["configurations"]]
    assert reused["max_movement"] == fresh["max_movement"]


@pytest.mark.parametrize("equalize", [True, False])
def test_sweep_quantizes_the_model_calibrate_does_depthwise_inputs_equalized(tmp_path, capsys,
                                                                             equalize):
    from test_repairs import hardswish_dw_model

    model_path, data, val = tmp_path / "dw.onnx", tmp_path / "calib.npy", tmp_path / "val.npy"
    onnx.save(hardswish_dw_model(), model_path)
    rng = np.random.default_rng(5)
    np.save(data, rng.standard_normal((32, 3, 8, 8)).astype(np.float32))
    np.save(val, rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    flag = [] if equalize else ["--no-equalize"]
    # the sweep's configurations: scales alone, weights max |w|, no bias correction
    assert main(["calibrate", str(model_path), "--data", str(data), "--out",
                 str(tmp_path / "calib"), "--no-progress", "--method", "percentile",
                 "--weight-amax", "max", "--no-bias-correction", *flag]) == 0
    assert main(["sweep", str(model_path), "--data", str(data), "--eval", str(val),
                 "--methods", "percentile", "--percentiles", "99.99", "--calib-sizes", "32",
                 "--resamples", "20", "--out", str(tmp_path / "sweep"), "--no-progress",
                 *flag]) == 0
    result = read_json(tmp_path / "sweep" / "sweep.json")
    assert result["equalized"] == (["h"] if equalize else [])
    calibrated, best = (read_json(tmp_path / name / "calibration.json")
                        for name in ("calib", "sweep/best"))
    assert bool(calibrated["repairs"]) == bool(best["repairs"]) == equalize
    scales, swept = (read_json(tmp_path / name / "scales.json")["tensors"]
                     for name in ("calib", "sweep/best"))
    assert ("h_equalized" in swept) == equalize
    # The same model: every tensor's scale equal, but the equalized input's. calibrate takes
    # the statistics of its first 64 samples from its input's channel histograms
    # (pipeline.equalized_statistics), the sweep collects it from the equalized model:
    # the percentile's amax then differs by a fraction of a channel bin (1 % allowed).
    assert set(swept) == set(scales)
    for name in swept:
        if name == "h_equalized":
            assert swept[name]["amax"] == pytest.approx(scales[name]["amax"], rel=1e-2)
        else:
            assert swept[name] == scales[name], name
    # the sweep's record is its best INT8 model (calibrate's, but for that scale) scored
    # the separate way
    fp32 = onnx.load(tmp_path / "calib" / "model.onnx")
    evaluator = sweep.Evaluator(fp32, open_data(str(val), input_specs(fp32), 32), "sqnr",
                                resamples=20)
    separate = evaluator.against_fp32(evaluator.outputs(
        onnx.load(tmp_path / "sweep" / "best" / "model.int8.onnx"), "INT8")).value
    (swept_record,) = result["configurations"]
    assert swept_record["value"] == pytest.approx(separate, abs=1e-9)


def test_the_best_is_ranked_at_the_largest_size_not_a_lucky_small_one():
    configs = sweep.configurations(["max", "percentile"], [99.9], [16, 64])
    values = {"max @16": 0.99, "percentile 99.9 @16": 0.90, "max @64": 0.97,
              "percentile 99.9 @64": 0.98}
    records = [{"value": values[c.label]} for c in configs]
    order = sweep.ranking(configs, records)
    assert [configs[i].label for i in order] == [
        "percentile 99.9 @64", "max @64", "max @16", "percentile 99.9 @16"]


def test_the_printed_calibrate_command_reproduces_best(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "digits-cnn", "--data", "calibration_data/digits/calibration.npy",
                 *SWEEP_ARGS[2:], "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("sweep: ")
    command = read_json(out / "sweep.json")["reproduce"]
    assert f"`{command}`" in printed
    argv = command.replace("DIR", str(tmp_path / "again")).split()[1:]
    assert main([*argv, "--no-progress"]) == 0
    best = json.loads((out / "best" / "scales.json").read_text())
    again = json.loads((tmp_path / "again" / "scales.json").read_text())
    assert again == best
    from quantlab.experiments import runs
    comparison = runs.compare_runs(runs.load_run(out / "best"), runs.load_run(tmp_path / "again"))
    assert comparison.settings.empty, comparison.settings
