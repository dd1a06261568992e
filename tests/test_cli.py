"""The command line as a user meets it: help, errors without tracebacks, a real calibration."""

import errno
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from quantlab.calibration import qdq
from quantlab.cli import main
from quantlab.engine import trt_ranges
from quantlab.engine.cache import read_calibration_cache


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "calibrate", "validate", "zoo"):
        assert command in out


def test_missing_model_is_one_clear_line_not_a_traceback(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 16, 16), np.float32))
    result = subprocess.run(
        [sys.executable, "-m", "quantlab.cli", "calibrate", str(tmp_path / "missing.onnx"),
         "--data", str(tmp_path / "x.npy"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "missing.onnx does not exist" in result.stderr
    assert not (tmp_path / "out").exists()


def test_calibrate_command_writes_consistent_artifacts(tiny_model, tmp_path, capsys):
    _, path, _ = tiny_model
    data = np.random.default_rng(0).standard_normal((20, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "calib.npy", data)
    out = tmp_path / "run"
    args = ["calibrate", str(path), "--data", str(tmp_path / "calib.npy"), "--out", str(out),
            "--method", "max", "--batch-size", "8", "--no-progress"]
    # Without --trt-version: the Q/DQ model's inputs only, and no cache.
    assert main([*args[:5], str(tmp_path / "qdq-only"), *args[6:]]) == 0
    model = onnx.load(tmp_path / "qdq-only" / "model.onnx")
    scales = json.loads((tmp_path / "qdq-only" / "scales.json").read_text())
    assert set(scales["tensors"]) == set(qdq.activation_tensors_to_calibrate(model))
    assert not (tmp_path / "qdq-only" / "calibration.cache").exists()
    assert "calibration.cache" not in capsys.readouterr().out
    # With it: every float tensor implicit INT8 needs, in a cache with that version.
    args += ["--trt-version", "8.6.1"]
    assert main(args) == 0
    scales = json.loads((out / "scales.json").read_text())
    header, cached = read_calibration_cache(out / "calibration.cache")
    assert (header.algorithm, header.trt_version) == ("MinMaxCalibration", "8601")
    assert set(cached) == set(scales["tensors"])
    assert trt_ranges.missing_ranges(model, cached) == []
    # max calibration of the graph input is max|x| over the 20 samples, exactly.
    assert scales["tensors"]["input"]["amax"] == pytest.approx(float(np.abs(data).max()), rel=1e-6)
    assert cached["input"] == np.float32(np.abs(data).max() / np.float32(127))
    # A second run into the same folder is refused, and nothing is replaced without --force.
    before = (out / "scales.json").read_bytes()
    assert main(args) == 1
    assert "--force" in capsys.readouterr().err
    assert (out / "scales.json").read_bytes() == before
    assert main([*args, "--force"]) == 0


def test_percentile_option_needs_percentile_method(tiny_model, tmp_path, capsys):
    _, path, _ = tiny_model
    np.save(tmp_path / "calib.npy", np.ones((4, 3, 16, 16), np.float32))
    code = main(["calibrate", str(path), "--data", str(tmp_path / "calib.npy"), "--out",
                 str(tmp_path / "o"), "--method", "max", "--percentile", "99.9"])
    assert code == 1
    assert "percentile" in capsys.readouterr().err


def test_nan_in_calibration_data_names_tensor_and_batch_and_writes_nothing(tiny_model, tmp_path,
                                                                           capsys):
    _, path, _ = tiny_model
    data = np.ones((12, 3, 16, 16), np.float32)
    data[9, 1, 2, 3] = np.nan  # sample 9 lies in batch 2 (batches of 4, counted from 0)
    np.save(tmp_path / "calib.npy", data)
    code = main(["calibrate", str(path), "--data", str(tmp_path / "calib.npy"), "--out",
                 str(tmp_path / "out"), "--batch-size", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "'input'" in err and "batch 2" in err
    assert not (tmp_path / "out").exists()


def test_undecodable_image_writes_nothing(tiny_model, tmp_path, capsys):
    _, path, _ = tiny_model
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(images / "a.png")
    (images / "b.png").write_bytes(b"\x89PNG broken")
    code = main(["calibrate", str(path), "--data", str(images), "--out", str(tmp_path / "out"),
                 "--no-progress"])
    assert code == 1
    assert "b.png cannot be decoded" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _small_onnx_and_data(folder):
    """A Conv -> Relu -> Conv ONNX file built with onnx.helper (no torch) and 16 samples."""
    import onnx
    from test_pipeline import DATA, small_model

    onnx.save(small_model(), folder / "model.onnx")
    np.save(folder / "calib.npy", DATA)
    return folder / "model.onnx", folder / "calib.npy"


def _python(code, cwd):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


# What `quantlab --help` must not import: each costs from tens of ms to seconds, and
# together they made the help take over a second and 170 MB (benchmarks/startup.py).
HEAVY_MODULES = ("numpy", "pandas", "onnx", "onnxruntime", "torch", "matplotlib", "scipy",
                 "numba", "tqdm")


def test_help_of_every_command_imports_no_numeric_module(tmp_path):
    from quantlab.cli import COMMANDS

    result = _python(
        "import sys\n"
        "from quantlab.cli import COMMANDS, main\n"
        "for argv in (['--help'], *([c, '--help'] for c in COMMANDS)):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print('LOADED', [m for m in {HEAVY_MODULES!r} if m in sys.modules])\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "LOADED []"
    assert result.stdout.count("usage: quantlab") == 1 + len(COMMANDS)
    assert "digits-cnn" in result.stdout  # demo --models still lists the zoo names
    assert "{entropy,max,percentile,mse}" in result.stdout  # calibrate --method's choices



def test_zoo_names_without_torch_match_the_zoo():
    from quantlab import zoo
    from quantlab.zoo_names import ZOO_NAMES

    assert tuple(zoo.names()) == ZOO_NAMES


def test_calibrating_an_onnx_file_imports_neither_torch_nor_what_other_commands_use(tmp_path):
    """torch is for zoo models, and the planner, the sweep, validation, the reports, pandas
    and matplotlib for other commands: a default calibration of an ONNX file loads none."""
    model, data = _small_onnx_and_data(tmp_path)
    unused = ("torch", "pandas", "matplotlib", "quantlab.planner.flow",
              "quantlab.experiments.sweep", "quantlab.evaluation.validate",
              "quantlab.evaluation.gate", "quantlab.experiments.report")
    result = _python(
        "import sys\n"
        "from quantlab.cli import main\n"
        f"code = main(['calibrate', {str(model)!r}, '--data', {str(data)!r}, '--out', 'out',\n"
        "             '--no-progress'])\n"
        "assert code == 0, code\n"
        f"print('LOADED', [m for m in {unused!r} if m in sys.modules])\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "LOADED []"
    assert (tmp_path / "out" / "model.int8.onnx").is_file()


def test_what_the_api_takes_and_returns_imports_from_quantlab_api(tmp_path):
    """The settings and results of quantlab.api's calls import from it (the notebooks take
    PlanSettings from there), each the object of the module that defines it, though the
    module is loaded only when asked for."""
    result = _python(
        "import sys\n"
        "import quantlab.api as api\n"
        "print('LOADED', 'quantlab.planner.flow' in sys.modules)\n"
        "from quantlab.api import PlanSettings, CheckOptions, Config, ValidationResult\n"
        "from quantlab.planner.flow import PlanSettings as defined\n"
        "assert PlanSettings is defined\n"
        "assert api.PlanOptions().planner == defined()\n"
        "try:\n"
        "    api.NoSuchName\n"
        "except AttributeError as error:\n"
        "    print('MISSING', error)\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "LOADED False" in result.stdout
    assert "MISSING module 'quantlab.api' has no attribute 'NoSuchName'" in result.stdout


def _calibrate_args(model, data, out, *extra):
    return ["calibrate", str(model), "--data", str(data), "--out", str(out), "--method", "max",
            "--no-progress", *extra]


def test_disk_full_while_writing_is_one_line_and_keeps_old_results(tmp_path, capsys, monkeypatch):
    from quantlab import graph

    model, data = _small_onnx_and_data(tmp_path)
    out = tmp_path / "out"
    assert main(_calibrate_args(model, data, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def disk_full(model_proto, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(graph, "save_model", disk_full)
    assert main(_calibrate_args(model, data, out, "--force")) == 1
    err = capsys.readouterr().err
    assert err == (f"quantlab calibrate: error: cannot write {out / 'model.onnx'}: "
                   "No space left on device\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["calib.npy", "model.onnx", "out"]


@pytest.mark.parametrize(("out", "message"), [
    ("afile/sub", "afile is a file, not a folder"),
    # As root, a chmod 0o555 folder does not stop writes; sysfs refuses new files to anyone.
    ("/sys/quantlab-out", "creating a file in /sys fails"),
])
def test_unwritable_out_is_one_line_before_the_work(tmp_path, capsys, monkeypatch, out, message):
    from quantlab.calibration import collect

    model, data = _small_onnx_and_data(tmp_path)
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(collect, "collect", lambda *a, **k: pytest.fail("collection ran"))
    assert main(_calibrate_args(model, data, out)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"quantlab calibrate: error: cannot write {out}: ")
    assert message in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["afile", "calib.npy", "model.onnx"]


def test_os_error_from_any_command_is_one_line_not_a_traceback(tmp_path):
    # An OSError escaping a command's code, in a real process: one line, exit 1.
    model, data = _small_onnx_and_data(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c",
         "import errno, sys\n"
         "from quantlab import cli; from quantlab.calibration import pipeline\n"
         "def fail(*a, **k):\n"
         "    raise OSError(errno.EROFS, 'Read-only file system', 'ro/out')\n"
         "pipeline.run_calibration = fail\n"
         f"sys.exit(cli.main({_calibrate_args(model, data, 'ro/out')!r}))\n"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 1
    assert result.stderr == ("quantlab calibrate: error: cannot write ro/out: "
                             "Read-only file system\n")


def test_all_zero_data_warns_once(tmp_path, capsys):
    model, _ = _small_onnx_and_data(tmp_path)
    np.save(tmp_path / "zeros.npy", np.zeros((8, 3, 8, 8), np.float32))
    assert main(_calibrate_args(model, tmp_path / "zeros.npy", tmp_path / "out")) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "zeros" in err, err


def test_one_outlier_sample_is_named_in_one_warning(tmp_path, capsys):
    model, data = _small_onnx_and_data(tmp_path)
    values = np.load(data)
    values[5, 0, 3, 3] = 1e6
    np.save(tmp_path / "outlier.npy", values)
    args = _calibrate_args(model, tmp_path / "outlier.npy", tmp_path / "out")
    assert main([*args[:-3], "--method", "entropy", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert "'input' amax" in err and "Remove or fix the sample" in err


def test_sigterm_while_writing_leaves_nothing_and_exits_143(tmp_path, capsys, monkeypatch):
    import signal

    from quantlab import graph

    model, data = _small_onnx_and_data(tmp_path)

    def killed(model_proto, path):
        os.kill(os.getpid(), signal.SIGTERM)  # a CI timeout in the middle of the write phase

    monkeypatch.setattr(graph, "save_model", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert main(_calibrate_args(model, data, tmp_path / "out")) == 143
    assert capsys.readouterr().err.endswith("quantlab calibrate: terminated\n")
    assert sorted(os.listdir(tmp_path)) == ["calib.npy", "model.onnx"]
    assert signal.getsignal(signal.SIGTERM) == before


def test_every_command_takes_one_default_calibrator_and_says_where_it_comes_from(capsys):
    import re

    from quantlab import choices

    defaults = {}
    for command in ("calibrate", "plan", "validate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        block = text[text.index("--method {"):]
        defaults[command] = re.search(r"default: (\w+), from ([\w/.]+)", block).groups()
    assert set(defaults.values()) == {(choices.DEFAULT_METHOD, "quantlab/choices.py")}


def test_the_repairs_have_one_default_per_role_and_help_says_where_it_comes_from(capsys):
    from quantlab import choices
    from quantlab.cli import build_parser

    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    assert plan.parse_args(["m", "--data", "d", "--eval", "e", "--out", "o", "--min-sqnr",
                            "20"]).repairs == list(choices.DEFAULT_PLAN_REPAIRS)
    texts = {}
    for command, option in (("plan", "--repairs [REPAIR"), ("calibrate", "--no-equalize"),
                            ("sweep", "--no-equalize")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        # argparse wraps "dw-equalize" after its hyphen
        text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
        texts[command] = text[text.rindex(option):][:700]
        assert "quantlab/choices.py" in texts[command], command
    assert f"default: {' '.join(choices.DEFAULT_PLAN_REPAIRS)}, from" in texts["plan"]
    # calibrate and sweep apply the equalization plan names DEFAULT_EQUALIZATION; plan's
    # help names it as calibrate's, calibrate's names plan's default.
    for command in ("plan", "calibrate", "sweep"):
        assert choices.DEFAULT_EQUALIZATION in texts[command], command
    assert "dw-equalize alone by default" in texts["calibrate"]


def test_no_library_module_imports_the_command_line():
    """commands/ maps options onto library calls; nothing below it reaches back up (the demo
    once ran `quantlab plan` through argparse)."""
    import ast
    from pathlib import Path

    import quantlab

    root = Path(quantlab.__file__).parent
    reaching = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ("commands", "cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            reaching += [f"{path.relative_to(root)}: {name}" for name in names
                         if name.startswith(("quantlab.commands", "quantlab.cli"))]
    assert reaching == []


def test_no_import_circle_in_the_package():
    """No module of quantlab/ reaches itself through imports, function-level ones included.
    ``from package import name`` counts as importing the package (its ``__init__`` runs
    first), as an import-graph drawing shows it: zoo/__init__.py once imported shapes_det.py,
    which imported ``shapes`` from the zoo package."""
    import ast
    from pathlib import Path

    import quantlab

    root = Path(quantlab.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = {}
    for module, path in files.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                named |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        imports[module] = sorted(named & set(files) - {module})

    def circle_from(start):
        """A path of imports from `start` back to it, or None (depth first)."""
        seen, todo = set(), [(start, [start])]
        while todo:
            module, path = todo.pop()
            for target in imports[module]:
                if target == start:
                    return [*path, start]
                if target not in seen:
                    seen.add(target)
                    todo.append((target, [*path, target]))
        return None

    circles = [circle_from(module) for module in sorted(files)]
    assert [c for c in circles if c] == []
