"""Every finding of docs/field-reports/reliability-r3.md (shared docs), replayed as the user
ran it, and the README flow calibrate -> plan -> build -> validate --from on a real model.

Case ids (P40, D05, B01, ...) are the field report's. The plans run on the planted model of
tests/planner/test_plan.py (16 channels at 6x6: a plan takes seconds); the finding's commands ran on
digits-cnn, which fails the same way. Each test asserts the behaviour the report expects,
and each failed at 9232738, the commit the report tested (a traceback, a certified plan, a
deleted file, rc 0), but for one parameter kept as a guard: --metric map without --eval zoo
was already refused before any data was read.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_plan import make_graph, planted_model

from quantlab import graph, plan
from quantlab.cli import build_parser, main
from quantlab.data import Preprocess
from quantlab.errors import DataError, OutputExistsError

# Node names with matplotlib mathtext in them (P61): conv3 and conv5 are the planted units the
# plan pins, so they reach the report's waterfall figure.
# Each fails matplotlib's mathtext parser unescaped (ValueError when the figure is drawn).
MATH_NAMES = {"conv3": "conv$^$3", "conv5": "conv/$\\x$"}
PLAN_OPTIONS = ["--trials", "16", "--hard-samples", "16", "--batch-size", "16", "--resamples",
                "50", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The planted model (mathtext node names), 48 calibration and 64 evaluation samples, and
    a calibration folder made from them by `quantlab calibrate`."""
    root = tmp_path_factory.mktemp("r3")
    model = planted_model().model
    for node in model.graph.node:
        node.name = MATH_NAMES.get(node.name, node.name)
    graph.save_model(model, root / "planted.onnx")
    rng = np.random.default_rng(1)
    np.save(root / "calib.npy", rng.standard_normal((48, 16, 6, 6)).astype(np.float32))
    np.save(root / "eval.npy", rng.standard_normal((64, 16, 6, 6)).astype(np.float32))
    assert main(["calibrate", str(root / "planted.onnx"), "--data", str(root / "calib.npy"),
                 "--out", str(root / "cal"), "--no-progress"]) == 0
    return {"root": root, "model": root / "planted.onnx", "calib": root / "calib.npy",
            "eval": root / "eval.npy", "cal": root / "cal"}


def plan_argv(files, out, *options, eval_path=None, data=None) -> list[str]:
    return ["plan", str(files["model"]), "--data", str(data or files["calib"]), "--eval",
            str(eval_path or files["eval"]), "--out", str(out), *PLAN_OPTIONS, *options]


@pytest.fixture(scope="module")
def planned(files) -> Path:
    """A plan folder of the planted model at a 24 dB floor (its pins carry mathtext names)."""
    out = files["root"] / "plan"
    assert main(plan_argv(files, out, "--min-sqnr", "24")) == 0
    return out


# 1. P40: a NaN in --eval made the metric +inf, which certified any plan.

def test_p40_nan_in_eval_is_refused_before_any_work(files, tmp_path, capsys):
    values = np.load(files["eval"])
    values[5, 0, 0, 0] = np.nan
    np.save(tmp_path / "eval_nan.npy", values)
    out = tmp_path / "P40"
    assert main(plan_argv(files, out, "--min-sqnr", "30", eval_path=tmp_path / "eval_nan.npy")) == 1
    err = capsys.readouterr().err
    assert "eval_nan.npy: input batch of samples 0..15: tensor 'x' contains NaN or Inf" in err
    assert not out.exists()


def test_p40_a_nan_or_infinite_metric_never_certifies():
    references = [{"y": np.ones((4, 3))}]
    broken = [{"y": np.array([[np.nan, 1, 1]] + [[1, 1, 1]] * 3)}]
    with pytest.raises(DataError, match=r"metric 'sqnr' returned NaN on evaluation samples 0\.\.3"):
        plan.certify(plan.output_sqnr, "sqnr", broken, references, floor=30.0)
    # +inf stays the SQNR of identical outputs (exact: no noise at all) ...
    assert plan.certify(plan.output_sqnr, "sqnr", references, references, floor=30.0).certified

    # ... but is refused from any other metric.
    def infinite(outputs, refs):
        return float("inf")

    with pytest.raises(DataError, match=r"metric 'inf' returned \+inf on FP32 on evaluation"):
        plan.certify(infinite, "inf", references, references, max_drop=0.1)


# 2. P54c: a resumed plan reused evaluations of an --eval file whose content had changed.

def test_p54c_a_checkpoint_is_reused_only_for_the_same_data_content(files, tmp_path, capsys,
                                                                    monkeypatch):
    eval_path = tmp_path / "eval_swap.npy"
    shutil.copy(files["eval"], eval_path)
    out = tmp_path / "P54c"
    argv = plan_argv(files, out, "--min-sqnr", "24", eval_path=eval_path)
    saved = plan.Checkpoint.add_evaluation

    def interrupted(self, index, evaluation):  # killed right after its first evaluation
        saved(self, index, evaluation)
        raise KeyboardInterrupt

    monkeypatch.setattr(plan.Checkpoint, "add_evaluation", interrupted)
    assert main(argv) == 130
    assert (out / ".plan-progress.json").is_file()
    assert main(argv) == 130  # the same file: its evaluation is reused, and said so
    assert "1 evaluation(s) of an interrupted run of the same model, data (same content)" in \
        capsys.readouterr().out
    # Same path, same sample count, other content: nothing of the checkpoint is trusted.
    np.save(eval_path, np.random.default_rng(7).standard_normal((64, 16, 6, 6)).astype(np.float32))
    monkeypatch.setattr(plan.Checkpoint, "add_evaluation", saved)
    main(argv)
    printed = capsys.readouterr().out
    assert "from a run of another model, data or options" in printed and "resuming" not in printed
    assert not (out / ".plan-progress.json").exists()


def test_reused_statistics_are_trusted_only_while_their_data_is_unchanged(files, tmp_path,
                                                                         capsys):
    data = tmp_path / "calib.npy"
    shutil.copy(files["calib"], data)
    assert main(["calibrate", str(files["model"]), "--data", str(data), "--out",
                 str(tmp_path / "cal"), "--no-progress"]) == 0
    np.save(data, np.load(data)[::-1])  # same size, new content and modification time
    os.utime(data, ns=(0, 0))
    out = tmp_path / "plan"
    assert main(plan_argv(files, out, "--min-sqnr", "24", data=tmp_path / "cal")) == 1
    assert f"{data} changed since `quantlab calibrate` collected" in capsys.readouterr().err
    assert not out.exists()


# 3. D04-D07: the demo replaced everything in --out, the user's files included.

def demo_output(staging: Path) -> None:
    (staging / "summary.json").write_text('{"generator": "quantlab demo"}')
    (staging / "report.html").write_text("new")
    (staging / "digits-cnn").mkdir()
    (staging / "digits-cnn" / "model.onnx").write_text("new")


def user_files(out: Path) -> None:
    (out / "projects" / "src").mkdir(parents=True)
    (out / "projects" / "src" / "main.py").write_text("mine")
    (out / "notes.txt").write_text("mine")


def test_d07_demo_replaces_only_its_own_files_of_an_earlier_demo(tmp_path):
    from quantlab.demo import _demo_folder

    out = tmp_path / "demo"
    out.mkdir()
    user_files(out)
    (out / "summary.json").write_text('{"generator": "quantlab demo"}')
    (out / "report.html").write_text("old")
    (out / "digits-vit").mkdir()  # a model the earlier demo ran and this one does not
    with _demo_folder(out, force=False) as staging:
        demo_output(staging)
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "projects" / "src" / "main.py").read_text() == "mine"
    assert (out / "report.html").read_text() == "new"
    assert (out / "digits-cnn" / "model.onnx").read_text() == "new"
    assert not (out / "digits-vit").exists()


def test_d05_d06_demo_force_keeps_the_users_files(tmp_path, monkeypatch):
    from quantlab.demo import _demo_folder

    work = tmp_path / "work"
    work.mkdir()
    user_files(work)
    (work / "report.html").write_text("the user's own report")
    # D04: without --force, only the demo's own names are listed as results.
    with pytest.raises(OutputExistsError, match=r"holds results \(report.html\)") as refused:
        _demo_folder(work, force=False)
    assert "notes.txt" not in str(refused.value)
    monkeypatch.chdir(work)  # D06: quantlab demo --out . --force
    with _demo_folder(Path("."), force=True) as staging:
        demo_output(staging)
    assert (work / "notes.txt").read_text() == "mine"
    assert (work / "projects" / "src" / "main.py").read_text() == "mine"
    assert (work / "report.html").read_text() == "new"


# 4. B01, B12, B15: build of a plan folder.

def test_b01_readme_plan_then_build_works_without_force(planned, tmp_path, capsys):
    folder = tmp_path / "B01"
    shutil.copytree(planned, folder)
    before = (folder / "trtexec.txt").read_text()
    assert main(["build", str(folder)]) == 0  # the plan's batch (16), not --max-batch 1
    assert (folder / "trtexec.txt").read_text() == before
    assert main(["build", str(folder), "--max-batch", "4"]) == 1
    assert "at --max-batch 4 (another plan, or another --max-batch)" in capsys.readouterr().err


def test_b12_b15_build_refuses_a_plan_folder_without_its_plan_or_with_a_damaged_model(
        planned, tmp_path, capsys):
    folder = tmp_path / "B12"
    shutil.copytree(planned, folder)
    (folder / "plan.json").unlink()
    assert main(["build", str(folder)]) == 1
    assert "written by quantlab plan but has no plan.json" in capsys.readouterr().err
    folder = tmp_path / "B15"
    shutil.copytree(planned, folder)
    (folder / "model.int8.onnx").write_bytes(b"garbage")
    (folder / "trtexec.txt").unlink()
    assert main(["build", str(folder)]) == 1
    assert "model.int8.onnx" in capsys.readouterr().err
    assert not (folder / "trtexec.txt").exists()


# 5. P10-P30, P61, D02, D03: tracebacks from options and metrics.

@pytest.mark.parametrize("argv, message", [
    (["plan", "m.onnx", "--trials", "0"], "argument --trials: must be at least 1, got 0"),
    (["plan", "m.onnx", "--trials", "-3"], "argument --trials: must be at least 1, got -3"),
    (["plan", "m.onnx", "--resamples", "-5"], "argument --resamples: must be at least 1"),
    (["plan", "m.onnx", "--resamples", "0"], "argument --resamples: must be at least 1"),
    (["plan", "m.onnx", "--hard-samples", "0"], "argument --hard-samples: must be at least 1"),
    (["plan", "m.onnx", "--hard-samples", "-1"], "argument --hard-samples: must be at least 1"),
    (["plan", "m.onnx", "--max-drop", "-1"], "argument --max-drop: must be at least 0"),
    (["plan", "m.onnx", "--max-drop", "nan"], "argument --max-drop: must be a finite number"),
    (["plan", "m.onnx", "--min-sqnr", "nan"], "argument --min-sqnr: must be a finite number"),
    (["plan", "m.onnx", "--batch-size", "0"], "argument --batch-size: must be at least 1"),
    (["calibrate", "m.onnx", "--max-samples", "0"], "argument --max-samples: must be at least 1"),
    (["validate", "--batch-size", "-2"], "argument --batch-size: must be at least 1"),
    (["build", "d", "--max-batch", "0"], "argument --max-batch: must be at least 1"),
    (["demo", "--eval-limit", "0"], "argument --eval-limit: must be at least 1"),
    (["demo", "--eval-limit", "-3"], "argument --eval-limit: must be at least 1"),
])
def test_options_are_range_checked_where_they_are_parsed(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_p26_agreement_with_a_zero_drop_says_what_the_data_can_certify():
    messages = plan.data_shortfalls(48, 64, 16, "agreement", 0.0)
    assert messages == [m for m in messages if "A drop of 0 allows no changed prediction" in m]
    assert len(messages) == 1


@pytest.mark.parametrize("function, message", [
    ("def failing(outputs, references):\n    return 1 / 0\n",
     "ZeroDivisionError: division by zero"),
    ("def failing(outputs):\n    return 0.0\n", "TypeError: failing() takes 1 positional"),
    ("def failing(outputs, references):\n    return 'good'\n", "returned 'good'"),
])
def test_p27_p30_a_failing_metric_is_one_message_before_the_measurement(
        files, tmp_path, capsys, monkeypatch, function, message):
    (tmp_path / "user_metric.py").write_text(function)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "user_metric", raising=False)
    out = tmp_path / "P27"
    # before the statistics pass (minutes on a real detector), not after it
    from quantlab.calibration import collect
    monkeypatch.setattr(collect, "collect", lambda *a, **k: pytest.fail("statistics collected "
                                                                         "before the metric ran"))
    assert main(plan_argv(files, out, "--metric", "user_metric:failing", "--max-drop", "0.1")) == 1
    err = capsys.readouterr().err
    assert "metric 'user_metric:failing'" in err and message in err
    assert "FP32 against itself on the first calibration batch" in err
    assert "Traceback" not in err and not out.exists()


def test_p61_mathtext_names_reach_the_report_figures(planned):
    decided = plan.Plan.load(planned / "plan.json")
    assert {u for u, d in decided.units.items() if d.precision != "int8"} == set(
        MATH_NAMES.values())
    assert "conv$^$3" in (planned / "report.html").read_text()


# 6. P46, P46b, F04-F06: a damaged calibration.json (its data are arrays, so it records no
# preprocessing: the damaged block is written in).

@pytest.mark.parametrize("damage, message", [
    (lambda text: text[:20], "calibration.json is not a readable calibration record file"),
    (lambda text: "[]", "calibration.json holds a JSON list, not the object"),
    (lambda text: json.dumps({**json.loads(text), "preprocess": {
        **Preprocess().to_dict(), "mean": "abc"}}),
     "field 'preprocess' cannot be used: its mean is 'abc', not a list of numbers."),
    (lambda text: json.dumps({**json.loads(text), "preprocess": {
        **Preprocess().to_dict(), "layout": 7}}),
     "field 'preprocess' cannot be used: layout '7' is not one of NCHW, NHWC."),
    (lambda text: json.dumps({**json.loads(text), "data": 3}),
     "field 'data' (3) cannot be used: expected the path of the calibration data."),
])
def test_p46_f04_f06_a_damaged_calibration_json_names_the_file_and_field(
        files, tmp_path, capsys, damage, message):
    folder = tmp_path / "cal"
    shutil.copytree(files["cal"], folder)
    record = folder / "calibration.json"
    record.write_text(damage(record.read_text()))
    assert main(plan_argv(files, tmp_path / "plan", "--min-sqnr", "24", data=folder)) == 1
    assert message in capsys.readouterr().err
    assert main(["validate", "--from", str(folder), "--data", str(files["eval"]), "--out",
                 str(tmp_path / "validate"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert message in err and str(record) in err
    assert not (tmp_path / "plan").exists() and not (tmp_path / "validate").exists()


# 7. P43, F09: preprocessing overrides and recorded values.

def test_p43_an_override_contradicting_reused_statistics_is_refused(tiny_model, tmp_path,
                                                                   capsys):
    from PIL import Image

    _, path, _ = tiny_model
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
            images / f"{i}.png")
    normalize = ["--mean", "0.5", "0.5", "0.5", "--std", "0.25", "0.25", "0.25"]
    assert main(["calibrate", str(path), "--data", str(images), "--out", str(tmp_path / "sbase"),
                 "--no-progress", *normalize]) == 0
    out = tmp_path / "P43"
    assert main(["plan", str(path), "--data", str(tmp_path / "sbase"), "--eval", str(images),
                 "--min-sqnr", "10", "--out", str(out), "--mean", "0", "0", "0", "--std", "1",
                 "1", "1", *PLAN_OPTIONS]) == 1
    err = capsys.readouterr().err
    assert "--mean (0.0, 0.0, 0.0) (recorded: (0.5, 0.5, 0.5))" in err
    assert "--std (1.0, 1.0, 1.0) (recorded: (0.25, 0.25, 0.25))" in err
    assert "stats.npz" in err and not out.exists()


def test_an_input_option_contradicting_reused_statistics_is_refused(files, tmp_path, capsys):
    out = tmp_path / "axes"
    assert main(plan_argv(files, out, "--min-sqnr", "24", "--batch-axis", "x=1",
                          data=files["cal"])) == 1
    assert "--batch-axis x=1 contradicts" in capsys.readouterr().err
    assert not out.exists()


def test_f09_an_explicit_option_wins_over_the_recorded_one_even_at_its_default():
    from quantlab.commands.options import given_preprocessing
    from quantlab.data import preprocessing

    def preprocess_from_args(args, recorded=None):  # what every command reads images with
        return preprocessing(given_preprocessing(args), recorded)

    recorded = Preprocess(channel_order="L", scale=1.0, layout="NHWC")
    parser = build_parser()
    given = parser.parse_args(["validate", "--from", "d", "--out", "o", "--channel-order", "RGB",
                               "--scale", str(1 / 255)])
    assert preprocess_from_args(given, recorded) == Preprocess(layout="NHWC")
    left_out = parser.parse_args(["validate", "--from", "d", "--out", "o"])
    assert preprocess_from_args(left_out, recorded) == recorded
    assert preprocess_from_args(left_out) == Preprocess()


# 8. P13-P25b: the budget checked late, folders left behind.

@pytest.mark.parametrize("options, message", [
    (["--max-drop", "1"], "--max-drop cannot work with --metric sqnr"),
    (["--metric", "map", "--max-drop", "0.01"], "--metric map needs ground truth"),
    (["--metric", "agreement", "--min-sqnr", "30"], "--min-sqnr is a floor on output SQNR"),
])
def test_p13_p19_the_budget_is_checked_before_any_data_is_read(files, tmp_path, capsys,
                                                               options, message):
    out = tmp_path / "P13"
    argv = plan_argv(files, out, *options)
    argv[argv.index("--data") + 1] = str(tmp_path / "missing.npy")  # never read
    assert main(argv) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_p25b_a_task_metric_of_another_kind_of_model_is_named(tmp_path, capsys):
    out = tmp_path / "P25b"
    assert main(["plan", "digits-cnn", "--data", "zoo", "--eval", "zoo", "--metric", "map",
                 "--max-drop", "0.01", "--out", str(out)]) == 1
    assert "--metric map does not fit digits-cnn, a classification model: its task metric is " \
           "top1" in capsys.readouterr().err
    assert not out.exists()


def test_p16_a_failure_after_the_measurement_leaves_no_folder(files, tmp_path, capsys,
                                                             monkeypatch):
    (tmp_path / "late_metric.py").write_text(
        "def late(outputs, references):\n"
        "    if len(outputs) > 1:  # the whole evaluation set, after the trials\n"
        "        raise ValueError('late failure')\n"
        "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "deep" / "P16"
    assert main(plan_argv(files, out, "--metric", "late_metric:late", "--max-drop", "0.1")) == 1
    assert "ValueError: late failure" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()


# 9. P45b: calibration folders record absolute paths.

def test_p45b_calibration_folders_work_from_any_directory(files, tmp_path, monkeypatch):
    from quantlab.experiments.records import read_calibration_record

    monkeypatch.chdir(files["root"])
    assert main(["calibrate", "planted.onnx", "--data", "calib.npy", "--out",
                 str(tmp_path / "rel"), "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path)
    record = read_calibration_record(tmp_path / "rel")
    assert record["data"] == str(files["calib"].resolve())
    # A folder of an older quantlab (path as typed) is read against the folder.
    text = json.loads((tmp_path / "rel" / "calibration.json").read_text())
    shutil.copy(files["calib"], tmp_path / "rel" / "data.npy")
    (tmp_path / "rel" / "calibration.json").write_text(json.dumps({**text, "data": "data.npy"}))
    assert read_calibration_record("rel")["data"] == str(tmp_path / "rel" / "data.npy")


# 10. 1.5: a custom-domain op keeps the linear ops after it in float, and says so.

def test_custom_domain_warning_lists_the_linear_ops_it_keeps_in_float():
    from quantlab.calibration import pipeline

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gemm", ["x", "w1"], ["h"], name="gemm1"),
             helper.make_node("FancyRelu", ["h"], ["r"], name="fancy", domain="com.example"),
             helper.make_node("Gemm", ["r", "w2"], ["y"], name="gemm2")]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(
                              np.float32), "w1"),
                           numpy_helper.from_array(rng.standard_normal((4, 3)).astype(
                               np.float32), "w2")]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline.prepare_model(model)
    message = " ".join(str(w.message) for w in caught)
    assert "fancy (com.example:FancyRelu)" in message
    assert "so do 1 linear op(s) after them" in message and "gemm2 (Gemm)" in message
    assert "gemm1" not in message


# Smaller: P21, P37, A4.

def test_p21_an_unreachable_floor_with_fp16_points_at_fp32(tiny_model, tmp_path, capsys):
    _, path, _ = tiny_model
    rng = np.random.default_rng(0)
    for name in ("calib", "eval"):
        np.save(tmp_path / f"{name}.npy", rng.standard_normal((32, 3, 16, 16)).astype(np.float32))
    """A floor no INT8 plan and not even all-FP16 reaches (issue 25: FP16 before FP32): the
    FP32 model is the plan, certified, and every unit's reason says what all-FP16 scored."""
    assert main(["plan", str(path), "--data", str(tmp_path / "calib.npy"), "--eval",
                 str(tmp_path / "eval.npy"), "--min-sqnr", "1000", "--out", str(tmp_path / "P21"),
                 *PLAN_OPTIONS]) == 0
    assert "reaches only" in capsys.readouterr().err  # all-FP16's warning
    written = plan.Plan.load(tmp_path / "P21" / "plan.json")
    assert {d.precision for d in written.units.values()} == {"fp32"}
    assert written.floor is not None and not written.floor["certified"]
    assert all(any("all-FP16 scored" in r.evidence for r in d.reasons)
               for d in written.units.values() if not any(r.hard for r in d.reasons))


def test_p37_evaluation_images_of_another_size_than_the_profile_are_refused(tmp_path, capsys):
    g = make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])],
                   [("x", ["N", 3, "H", "W"])], {"w": np.ones((4, 3, 3, 3))})
    graph.save_model(g.model, tmp_path / "dynamic.onnx")
    rng = np.random.default_rng(0)
    np.save(tmp_path / "calib.npy", rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    np.save(tmp_path / "eval.npy", rng.standard_normal((16, 3, 16, 16)).astype(np.float32))
    out = tmp_path / "P37"
    assert main(["plan", str(tmp_path / "dynamic.onnx"), "--data", str(tmp_path / "calib.npy"),
                 "--eval", str(tmp_path / "eval.npy"), "--min-sqnr", "20", "--out", str(out),
                 *PLAN_OPTIONS]) == 1
    err = capsys.readouterr().err
    assert "feeds input 'x' samples of shape [None, 3, 16, 16]" in err
    assert "but the calibration data [None, 3, 8, 8]" in err and not out.exists()


def test_a4_a_torch_tensor_is_data(tiny_model, tmp_path):
    import torch

    from quantlab.calibration.pipeline import run_calibration

    model, _, _ = tiny_model
    result = run_calibration(model, torch.randn(8, 3, 16, 16), tmp_path / "A4", progress=False)
    assert result.stats.num_samples == 8


# The README's flow on a real model, without --force.

def test_readme_flow_calibrate_plan_build_validate_on_a_real_model(real_models, real_data,
                                                                   tmp_path, capsys):
    """silero-vad (2.3 MB; its network inside an If that the recorded sr=16000 inlines,
    recurrent state on axis 1): the suite's cheapest model to plan (about 12 s here, the
    orientation classifier 36 s). 16 calibration and 8 evaluation samples, a floor its
    plans meet on the first evaluation, 8 trials on 8 hard samples, one calibrator, no
    bias correction: the least the planner can measure. Every step as the README writes
    it, none with --force; validate --from the calibration folder checks the plan's model."""
    model, data = real_models["vad"], real_data("vad")
    my_model = tmp_path / "reports" / "my-model"
    assert main(["calibrate", str(model), "--data", str(data["calib_npz"]), "--out",
                 str(my_model), "--max-samples", "16", "--no-progress"]) == 0
    assert main(["plan", str(model), "--data", str(my_model), "--eval", str(data["val_npz"]),
                 "--min-sqnr", "10", "--out", str(my_model / "plan"), "--max-samples", "8",
                 "--batch-size", "8", "--trials", "8", "--hard-samples", "8", "--resamples",
                 "50", "--calibrators", "entropy", "--no-bias-correction",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "reusing" in printed and "certified at 95% on 8 samples" in printed
    assert main(["build", str(my_model / "plan")]) == 0
    # The plan's batch (8), not build's default of 1: the README flow needs no --force.
    assert "--optShapes=input:8x576,state:2x8x128" in (
        my_model / "plan" / "trtexec.txt").read_text()
    assert main(["validate", "--from", str(my_model), "--engine",
                 str(my_model / "plan" / "model.int8.onnx"), "--data", str(data["val_npz"]),
                 "--max-samples", "8", "--out", str(my_model / "validate"),
                 "--no-progress"]) == 0
    summary = json.loads((my_model / "validate" / "summary.json").read_text())
    assert summary["samples"] == 8 and summary["data"] == str(data["val_npz"].resolve())
    assert os.path.isfile(my_model / "validate" / "report.html")
