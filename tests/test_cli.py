"""The command line as a user meets it: help, errors without tracebacks, a real calibration."""

import json
import subprocess
import sys

import numpy as np
import pytest

from quantlab.cache import read_calibration_cache
from quantlab.cli import main


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
    assert main(args) == 0
    scales = json.loads((out / "scales.json").read_text())
    header, cached = read_calibration_cache(out / "calibration.cache")
    assert header.algorithm == "MinMaxCalibration"
    assert set(cached) == set(scales["tensors"])
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
