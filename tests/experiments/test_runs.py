"""Runs: experiment folders recognized, compared on known differences, indexed; the gate."""

import os
import re
import shutil

import numpy as np
import pandas as pd
import pytest
from helpers import assert_every_column_explained

from quantlab import graph, zoo
from quantlab.calibration import pipeline, qdq
from quantlab.calibration.calibrate import Scales
from quantlab.cli import main
from quantlab.errors import ConfigError
from quantlab.experiments import runs
from quantlab.experiments.experiment import read_json, write_json

CALIBRATION = "calibration_data/digits/calibration.npy"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Runs of digits-cnn: A (percentile) and B (max), each validated inside, and eval.npy."""
    root = tmp_path_factory.mktemp("runs")
    model = pipeline.export_zoo_model("digits-cnn")
    np.save(root / "eval.npy", zoo.get("digits-cnn").eval_set().inputs[:96])
    for name, method in (("a", "percentile"), ("b", "max")):
        pipeline.run_calibration(model, CALIBRATION, root / name, method=method, progress=False)
        assert main(["validate", "--from", str(root / name), "--data", str(root / "eval.npy"),
                     "--out", str(root / name / "validate"), "--no-progress"]) == 0
    os.utime(root / "b" / "calibration.json", (2e9, 2e9))  # B is the newest run
    return root


def test_compare_finds_the_known_differences(folders):
    a, b = runs.load_run(folders / "a"), runs.load_run(folders / "b")
    assert (a.kind, b.kind) == ("calibrate", "calibrate")
    comparison = runs.compare_runs(a, b)
    differ = {row.setting: (row.a, row.b) for row in comparison.settings.itertuples()}
    assert differ == {"method": ("percentile", "max"), "params.percentile": ("99.99", "")}
    amax_a = Scales.load(folders / "a" / "scales.json").amax
    amax_b = Scales.load(folders / "b" / "scales.json").amax
    ratios = comparison.scales.set_index("tensor")["ratio"].to_dict()
    assert ratios == pytest.approx({n: amax_b[n] / amax_a[n] for n in amax_a})
    changes = np.abs(np.log(comparison.scales["ratio"].to_numpy()))
    assert np.all(np.diff(changes) <= 0)  # largest change first
    assert all(r >= 1.0 for r in ratios.values())  # max never clips below a percentile
    layers_a = pd.read_csv(folders / "a" / "validate" / "layers_onnx_fp32_vs_engine_int8.csv")
    layers_b = pd.read_csv(folders / "b" / "validate" / "layers_onnx_fp32_vs_engine_int8.csv")
    expected = (layers_b.set_index("tensor")["sqnr_db"] - layers_a.set_index("tensor")["sqnr_db"])
    got = comparison.layers.set_index("tensor")["difference"]
    assert sorted(got.index) == sorted(expected.index)
    # inf - inf (the graph input, not quantized in either) is NaN in both
    np.testing.assert_allclose(got[expected.index], expected, equal_nan=True)


def test_compare_command_writes_a_self_contained_page(folders, tmp_path, capsys):
    out = tmp_path / "ab.html"
    assert main(["compare", str(folders / "a"), str(folders / "b"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "setting method: percentile -> max" in printed
    html = out.read_text()
    assert "data:image/png;base64," in html and "<script" not in html and "src=\"http" not in html
    # settings that differ, accuracy, key figures, scales, layers
    assert assert_every_column_explained(html) == 5


def test_report_indexes_every_run_newest_first_with_links(folders, tmp_path, capsys):
    out = tmp_path / "index.html"
    assert main(["report", str(folders), "--out", str(out)]) == 0
    assert "report: 4 runs (2 calibrate, 2 validate)" in capsys.readouterr().out
    found = runs.find_runs([folders])
    assert found[0].path == folders / "b"
    assert [r.time for r in found] == sorted((r.time for r in found), reverse=True)
    links = re.findall(r'href="([^"#]+)"', out.read_text())
    assert sorted(links) == sorted(os.path.relpath(folders / f / "report.html", tmp_path)
                                   for f in ("a/validate", "b/validate"))
    for link in links:
        assert (tmp_path / link).is_file()


def test_a_folder_that_is_not_an_experiment_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a quantlab experiment folder"):
        runs.load_run(tmp_path / "empty")
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "not a quantlab experiment folder" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "is not a folder" in capsys.readouterr().err


def _regressed(folders, out):
    """A copy of A whose INT8 model uses 8x coarser activation scales (a planted regression)."""
    shutil.copytree(folders / "a", out, ignore=shutil.ignore_patterns("validate"))
    model = graph.load_model(out / "model.onnx")
    amax = {n: 8 * v for n, v in Scales.load(out / "scales.json").amax.items()}
    graph.save_model(qdq.quantize_model(model, amax), out / "model.int8.onnx")


def test_gate_passes_on_the_baseline_itself(folders, capsys):
    assert main(["check", str(folders / "a"), "--baseline", str(folders / "a"),
                 "--eval", str(folders / "eval.npy"), "--no-progress"]) == 0
    assert "check: passed" in capsys.readouterr().out


def test_gate_fails_on_a_planted_regression_with_one_paragraph(folders, tmp_path, capsys):
    _regressed(folders, tmp_path / "c")
    assert main(["check", str(tmp_path / "c"), "--baseline", str(folders / "a"),
                 "--eval", str(folders / "eval.npy"), "--max-drop", "1.0", "--min-sqnr", "30",
                 "--no-progress"]) == 1
    lines = capsys.readouterr().out.splitlines()
    base, cand = (float(re.search(r"INT8 sqnr ([\d.]+)", line).group(1)) for line in lines[:2])
    assert base - cand > 1.0
    failed = [line for line in lines if line.startswith("check: FAILED")]
    assert len(failed) == 1
    assert "a drop of" in failed[0] and "more than --max-drop 1" in failed[0]
    assert "under --min-sqnr 30 dB" in failed[0]
    # the same candidate within a looser budget passes
    assert main(["check", str(tmp_path / "c"), "--baseline", str(folders / "a"),
                 "--eval", str(folders / "eval.npy"), "--max-drop", str(base - cand + 0.01),
                 "--no-progress"]) == 0


def test_gate_calibrates_a_model_candidate_as_the_baseline_was(folders, capsys):
    assert main(["check", "digits-cnn", "--baseline", str(folders / "b"),
                 "--eval", str(folders / "eval.npy"), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(":", 2)[2].strip() == lines[1].split(":", 2)[2].strip()


def test_gate_refuses_a_validate_folder_as_baseline(folders, capsys):
    assert main(["check", str(folders / "a"), "--baseline", str(folders / "a" / "validate"),
                 "--eval", str(folders / "eval.npy")]) == 1
    assert "is a validate run" in capsys.readouterr().err


@pytest.fixture(scope="module")
def plain_and_default(tmp_path_factory):
    """digits-cnn calibrated with the defaults (validated inside) and with the plain per-tensor
    options (validated beside the folder, with --metric agreement)."""
    root = tmp_path_factory.mktemp("plain")
    data = ["--data", CALIBRATION, "--max-samples", "64", "--no-progress"]
    assert main(["calibrate", "digits-cnn", *data, "--out", str(root / "default")]) == 0
    assert main(["calibrate", "digits-cnn", *data, "--method", "percentile", "--weight-amax",
                 "max", "--no-bias-correction", "--no-equalize", "--out",
                 str(root / "plain")]) == 0
    for folder, out in (("default", "default/validate"), ("plain", "plain-validated")):
        assert main(["validate", "--from", str(root / folder), *data, "--metric", "agreement",
                     "--out", str(root / out)]) == 0
    return root


def _validated(folder):
    summary = read_json(folder / "summary.json")
    pair = next(p for p in summary["pairs"] if p["test"] == "engine_int8")
    return pair["output_sqnr_db"], summary["metric"]["engine_int8"]


def test_compare_names_every_option_and_both_accuracies(plain_and_default, capsys):
    root = plain_and_default
    assert main(["compare", str(root / "default"), str(root / "plain"),
                 "--out", str(root / "compare.html")]) == 0
    printed = capsys.readouterr().out
    for line in ("setting method: mse -> percentile", "setting weight_amax: local -> max",
                 "setting repairs_requested.bias_correction: True -> False",
                 "setting repairs_requested.depthwise_equalization: True -> False"):
        assert line in printed, line
    comparison = runs.compare_runs(runs.load_run(root / "default"), runs.load_run(root / "plain"))
    accuracy = comparison.accuracy.set_index("figure")
    for column, folder in (("a", root / "default" / "validate"), ("b", root / "plain-validated")):
        sqnr, agreement = _validated(folder)
        assert accuracy.loc["output_sqnr_db", column] == runs.as_text(sqnr)
        assert accuracy.loc["agreement", column] == runs.as_text(agreement)
        assert accuracy.loc["measured in", column] == str(folder)
    # the per-layer table is read from the validation beside "plain" too
    assert comparison.layers is not None and len(comparison.layers) > 0


def test_a_new_field_of_a_record_is_compared_without_code(plain_and_default, tmp_path):
    shutil.copytree(plain_and_default / "plain", tmp_path / "edited")
    record = read_json(tmp_path / "edited" / "calibration.json")
    record["some_new_option"] = 7
    record["repairs"]["new_repair"] = {"applied": [{"node": "x"}, {"node": "y"}], "rounds": 2}
    write_json(tmp_path / "edited" / "calibration.json", record)
    comparison = runs.compare_runs(runs.load_run(plain_and_default / "plain"),
                                   runs.load_run(tmp_path / "edited"))
    differ = {row.setting: (row.a, row.b) for row in comparison.settings.itertuples()}
    assert differ == {"some_new_option": ("", "7"),
                      "repairs.new_repair": ("", "applied 2, rounds 2")}


def test_index_shows_the_accuracy_of_every_run_or_the_command_to_measure_it(
        plain_and_default, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(plain_and_default, root, ignore=shutil.ignore_patterns("plain-validated"))
    out = tmp_path / "index.html"
    assert main(["report", str(root), "--out", str(out)]) == 0
    html = out.read_text()
    rows = {re.sub(r"<.*?>", "", row.split("</td><td>")[2]): row
            for row in re.findall(r"<tr><td>.*?</tr>", html, flags=re.S)}
    sqnr, agreement = _validated(root / "default" / "validate")
    for folder in ("default", "default/validate"):  # the calibration row reads its validation
        assert f"output_sqnr_db {runs.as_text(sqnr)}; agreement {agreement:g}" in \
            rows[str(root / folder)]
    assert f"<code>quantlab validate --from {root / 'plain'}" in rows[str(root / "plain")]


def test_a_plan_without_int8_is_named_a_fallback(tmp_path):
    summary = {"metric": "top1", "budget": {"max_drop": 0.01}, "int8_mac_share": 0.0,
               "calibration": {"data": "d", "method": "mse"}, "eval": {"data": "e",
                                                                        "num_samples": 9},
               "certificate": {"metric": "top1", "value": 0.9, "reference": 0.91,
                               "certified": True, "interval": [0.0, 0.01]}}
    write_json(tmp_path / "summary.json", summary)
    write_json(tmp_path / "plan.json", {"units": {"a": {"precision": "fp16"},
                                                       "b": {"precision": "fp32"}}})
    run = runs.load_run(tmp_path)
    assert run.figures["plan"] == "fallback: all-FP16/FP32, no INT8"
    summary["int8_mac_share"] = 0.5
    write_json(tmp_path / "summary.json", summary)
    assert "plan" not in runs.load_run(tmp_path).figures


def test_the_index_and_the_comparison_show_each_calibration_phase(plain_and_default, tmp_path):
    """Issue 41: each phase's seconds, samples and model runs, as calibration.json records
    them, on the index page and the comparison page (the plain options run the statistics alone, the
    defaults four: digits-cnn has no input to equalize, so no channel ranges are read)."""
    root = plain_and_default
    out = tmp_path / "index.html"
    assert main(["report", str(root / "default"), "--out", str(out)]) == 0
    html = out.read_text()
    recorded = read_json(root / "default" / "calibration.json")["phases"]
    assert [p["phase"] for p in recorded] == ["statistics", "weight amax", "bias shifts",
                                              "output noise"]
    for phase in recorded:
        assert (f"{phase['phase']} {phase['seconds']:.1f} s ({phase['samples']} samples, "
                f"{phase['model_runs']} runs)") in html
    assert f"seconds: {runs.as_text(round(sum(p['seconds'] for p in recorded), 1))}<br>" in html
    comparison = runs.compare_runs(runs.load_run(root / "default"), runs.load_run(root / "plain"))
    figures = comparison.figures.set_index("figure")
    assert figures.loc["phases", "a"].startswith("statistics ")
    assert "output noise " in figures.loc["phases", "a"]
    assert "weight amax" not in figures.loc["phases", "b"]
