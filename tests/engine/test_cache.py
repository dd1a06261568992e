"""TensorRT calibration cache: exact float32 round trips and real TensorRT-written files."""

import numpy as np
import pytest

from quantlab.engine.cache import (
    CacheHeader,
    hex_to_scale,
    parse_calibration_cache,
    read_calibration_cache,
    scale_to_hex,
    trt_version_number,
    write_calibration_cache,
)
from quantlab.errors import ConfigError, DataError

# Lines as TensorRT 8.5 wrote them for a small ONNX CNN (published in a public
# repository): ONNX names with '/', TensorRT-internal unnamed tensors, and an
# unclipped 0..255 input whose amax is 255 * 2048.5 / 2048.
TRT_CACHE = """TRT-8510-EntropyCalibration2
x: 4000890a
/conv1/Conv_output_0: 3f9db09c
/relu1/Relu_output_0: 3fb6163c
(Unnamed Layer* 8) [Constant]_output: 39137939
/fc1/Gemm_output_0: 3e5312f6
y: 3e1338d5
"""


def test_known_bit_patterns():
    # IEEE-754: 1/127 = 0x3C010204; 1.0 = 0x3F800000.
    assert scale_to_hex(1 / 127) == "3c010204"
    assert scale_to_hex(1.0) == "3f800000"
    # What TensorRT writes for a tensor with max 1.0 (sigmoid output, [0, 1]
    # input): EntropyCalibration2 keeps all 2048 bins, amax = 2048.5 / 2048.
    assert scale_to_hex(2048.5 / 2048 / 127) == "3c010a14"


def test_round_trip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    values = (10.0 ** rng.uniform(-30, 30, 200)).astype(np.float32)
    scales = {f"/layer{i}/Conv_output_0": float(v) for i, v in enumerate(values)}
    scales["input_1:0"] = 1 / 127
    path = write_calibration_cache(tmp_path / "model.cache", scales, trt_version="8.6.1")
    header, loaded = read_calibration_cache(path)
    assert header == CacheHeader("8601", "EntropyCalibration2")
    assert list(loaded) == list(scales)
    expected = np.array(list(scales.values()), np.float32)
    assert np.array_equal(np.array(list(loaded.values())).view(np.uint32), expected.view(np.uint32))
    lines = path.read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    assert lines[-1] == "input_1:0: 3c010204"


def test_reads_tensorrt_written_cache(tmp_path):
    path = tmp_path / "calib.cache"
    path.write_text(TRT_CACHE)
    header, scales = read_calibration_cache(path)
    assert str(header) == "TRT-8510-EntropyCalibration2"
    assert len(scales) == 6
    assert scales["x"] * 127 == pytest.approx(255 * 2048.5 / 2048, rel=1e-6)
    assert scales["(Unnamed Layer* 8) [Constant]_output"] == hex_to_scale("39137939")
    assert all(isinstance(v, np.float32) for v in scales.values())


def test_reads_colons_zero_and_infinity_scales(tmp_path):
    # TensorFlow-style names hold ':'; TensorRT has written 0 and Infinity scales.
    path = tmp_path / "tf.cache"
    path.write_bytes(b"TRT-100300-MinMaxCalibration\r\ninput_1:0: 3c010a14\r\n"
                     b"dead:0: 00000000\r\nhuge: 7f800000\r\n\r\n")
    header, scales = read_calibration_cache(path)
    assert header == CacheHeader("100300", "MinMaxCalibration")
    assert scales["input_1:0"] == np.float32(2048.5 / 2048 / 127)
    assert scales["dead:0"] == 0 and np.isinf(scales["huge"])


@pytest.mark.parametrize("text, where", [
    ("", "empty"),
    ("TRT-8601-KLCalibration\nx: 3c010204\n", "line 1"),
    ("x: 3c010204\n", "line 1"),
    ("TRT-8601-EntropyCalibration2\nx: 3c0102040\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\nx 3c010204\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\nx: 3c010204\ny: zz010204\n", "line 3"),
    ("TRT-8601-EntropyCalibration2\nx: 3c010204\nx: 3c010204\n", "line 3"),
])
def test_bad_cache_names_file_and_line(tmp_path, text, where):
    path = tmp_path / "bad.cache"
    path.write_text(text)
    with pytest.raises(DataError, match=f"bad.cache.*{where}"):
        read_calibration_cache(path)


def test_binary_file_is_rejected(tmp_path):
    path = tmp_path / "engine.cache"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match="engine.cache"):
        read_calibration_cache(path)


def test_version_numbers_and_writer_checks(tmp_path):
    assert trt_version_number("8.6.1") == "8601"
    assert trt_version_number("7.1.3") == "7103"
    assert trt_version_number("10.3.0") == "100300"
    assert trt_version_number(8510) == "8510"
    with pytest.raises(ConfigError):
        trt_version_number("eight")
    with pytest.raises(DataError, match="'bad'"):
        write_calibration_cache(tmp_path / "c.cache", {"bad": -1.0}, trt_version="8.6.1")
    with pytest.raises(DataError, match="'nan'"):
        write_calibration_cache(tmp_path / "c.cache", {"nan": float("nan")}, trt_version="8.6.1")
    with pytest.raises(ConfigError):
        write_calibration_cache(tmp_path / "c.cache", {"x": 1.0}, algorithm="KL",
                                trt_version="8.6.1")
    assert not (tmp_path / "c.cache").exists()


def test_reads_tensorrt_84_bare_zero_scale():
    # TensorRT 8.4 wrote zero scales (shape tensors) as a bare "0": lines from a published
    # EntropyCalibration2 cache of SegFormer (TRT Hackathon 2022 write-up, TensorRT 8401).
    text = (b"TRT-8401-EntropyCalibration2\ninput: 3caa54fc\n371: 3caa54fc\n"
            b"(Unnamed Layer* 64) [Shuffle]_output: 0\n366: 0\n395: 3cbe52af\n")
    header, scales = parse_calibration_cache(text)
    assert header == CacheHeader("8401", "EntropyCalibration2")
    assert scales["366"] == 0 and scales["(Unnamed Layer* 64) [Shuffle]_output"] == 0
    assert scales["395"] == hex_to_scale("3cbe52af")


def test_unpadded_hex_and_zero_scales(tmp_path):
    # trt-review F21/F15: TensorRT prints the bit pattern unpadded (8.4's bare "0"), so a
    # scale below 2**-100 has fewer than 8 digits; a zero scale is a range TensorRT writes.
    header, scales = parse_calibration_cache(b"TRT-8601-EntropyCalibration2\ntiny: 1a\n")
    assert scales["tiny"] == np.array([0x1a], np.uint32).view(np.float32)[0]
    path = write_calibration_cache(tmp_path / "c.cache", {"mask": 0.0, "x": 1 / 127},
                                   trt_version="8.6.1")
    assert read_calibration_cache(path)[1] == {"mask": 0.0, "x": np.float32(1 / 127)}


def test_tensorrt_10_header_and_11_refused():
    # trt-review question 4, settled (r2 N14): TensorRT 10.3 itself wrote TRT-100300; the
    # no-warning side is
    # tests/engine/test_tensorrt.py::test_tensorrt_10_cache_header_is_not_doubted.
    from quantlab.engine.cache import implicit_int8_version

    assert implicit_int8_version("10.3.0") == "100300"
    with pytest.raises(ConfigError, match="no implicit INT8"):
        implicit_int8_version("11.0.0")
