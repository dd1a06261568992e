"""TensorRT calibration cache (implicit INT8, TensorRT <= 10): read and write.

The cache is text: a header ``TRT-<version>-<Algorithm>`` (version is
TensorRT's version number, e.g. 8601 for 8.6.1, 100300 for 10.3.0), then one
``<tensor name>: <hex>`` line per tensor (up to 8 digits; TensorRT does not pad),
the hex being the big-endian
IEEE-754 float32 bit pattern of the scale (amax / 127). Tensor names may hold
``:`` or ``/`` (``input_1:0``, ``/conv1/Conv_output_0``), so a line splits at
its last ``": "``. TensorRT omits tensors it has no scale for and has been
seen writing 0 and Infinity scales; the reader returns those as written.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from quantlab.errors import ConfigError, DataError
from quantlab.experiments.experiment import write_text

# trtexec's calibrator is an IInt8EntropyCalibrator2 (samples/common/sampleEngines.cpp,
# RndInt8Calibrator), so it uses only caches with that header; with a cache file present it
# allocates no calibration input, so a cache it rejects fails the build (TensorRT#3430).
# Same scales, relabelled header: the file `quantlab plan` and `quantlab build` write beside
# a calibration.cache of another algorithm.
TRTEXEC_CACHE = "calibration.trtexec.cache"
ALGORITHMS = ("EntropyCalibration2", "EntropyCalibration", "MinMaxCalibration",
              "LegacyCalibration")
_HEADER = re.compile(r"TRT-([0-9A-Za-z]+)-([A-Za-z0-9]+)")
# TensorRT prints the bit pattern as unpadded hex: 8.4 wrote a zero scale as a bare "0" (a
# published cache: "366: 0"), so a scale below 2**-100 (< 0x10000000) has fewer digits.
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")


class CacheHeader(NamedTuple):
    """The first line of a cache: TensorRT version number and calibration algorithm."""

    trt_version: str
    algorithm: str

    def __str__(self) -> str:
        return f"TRT-{self.trt_version}-{self.algorithm}"


def trt_version_number(version: str | int) -> str:
    """TensorRT's version number as written in caches: '8.6.1' -> '8601', '10.3.0' -> '100300'.

    A string of digits (or an int) is taken as already in that form.
    """
    text = str(version)
    if text.isdigit():
        return text
    parts = text.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:3]):
        raise ConfigError(
            f"TensorRT version '{version}' is neither a dotted version (8.6.1) nor a version "
            "number (8601)."
        )
    major, minor, patch = (int(p) for p in (parts + ["0"])[:3])
    # NV_TENSORRT_VERSION: major*1000 + minor*100 + patch before 10, major*10000 + ... after.
    return str(major * (10000 if major >= 10 else 1000) + minor * 100 + patch)


def trt_major(version: str | int) -> int:
    """The major version of a dotted version or version number ('8.6.1', '8601' -> 8)."""
    number = trt_version_number(version)
    return int(number) // (10000 if len(number) >= 6 else 1000)


def implicit_int8_version(version: str | int) -> str:
    """`version`'s number (:func:`trt_version_number`), refused from TensorRT 11.0 on.

    TensorRT 11 removed implicit INT8 (calibrators, BuilderFlag.INT8): no cache is read
    there, it builds from the Q/DQ model (docs/tensorrt.md).
    """
    number = trt_version_number(version)
    major = trt_major(number)
    # 10.x: major*10000 + minor*100 + patch (NV_TENSORRT_VERSION, NvInferRuntimeBase.h 10.0),
    # confirmed by a cache TensorRT 10.3 wrote (NVIDIA TrafficCamNet's TRT-100300-...; r2 N14).
    if major >= 11:
        raise ConfigError(
            f"TensorRT {version} has no implicit INT8, so it reads no calibration cache: it "
            "builds strongly typed from model.int8.onnx (Q/DQ). Leave out --trt-version; pass "
            "it only with the version of a TensorRT 8.x-10.x that builds implicit INT8 from "
            "the cache."
        )
    return number


def scale_to_hex(scale: float) -> str:
    """The 8 lowercase hex digits of `scale` as a big-endian float32 (1/127 -> '3c010204')."""
    return struct.pack(">f", np.float32(scale)).hex()


def hex_to_scale(text: str) -> np.float32:
    """Inverse of :func:`scale_to_hex`."""
    return np.float32(struct.unpack(">f", bytes.fromhex(text.rjust(8, "0")))[0])


def write_calibration_cache(
    path: str | os.PathLike,
    scales: Mapping[str, float],
    algorithm: str = "EntropyCalibration2",
    *,
    trt_version: str | int,
) -> Path:
    """Atomically write a TensorRT calibration cache of `scales` (tensor -> amax / 127).

    `trt_version` must be the version of the TensorRT that will read the cache
    (TensorRT rejects a cache whose header does not match, and the build fails: trt-review F5).
    """
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm '{algorithm}' is not one of {', '.join(ALGORITHMS)}.")
    header = CacheHeader(trt_version_number(trt_version), algorithm)
    lines = [str(header)]
    for name, scale in scales.items():
        # A zero scale is a range TensorRT writes itself (all-zero tensors, shape tensors).
        if not (np.isfinite(scale) and scale >= 0):
            raise DataError(
                f"tensor '{name}' has scale {scale}; a calibration cache needs a finite scale "
                ">= 0 for every tensor. Recalibrate, or leave the tensor out of the cache."
            )
        if "\n" in name or not name:
            raise DataError(f"tensor name {name!r} cannot be written to a calibration cache line.")
        lines.append(f"{name}: {scale_to_hex(scale)}")
    return write_text(path, "\n".join(lines) + "\n")


def read_calibration_cache(path: str | os.PathLike) -> tuple[CacheHeader, dict[str, np.float32]]:
    """Read a calibration cache (ours or TensorRT's): its header and tensor -> float32 scale."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"calibration cache {path} cannot be read as text ({exc}).") from None
    return parse_calibration_cache(data, f"calibration cache {path}")


def parse_calibration_cache(
    data: bytes, where: str = "calibration cache"
) -> tuple[CacheHeader, dict[str, np.float32]]:
    """Parse a cache's bytes (as TensorRT hands them to ``write_calibration_cache``)."""
    try:
        text = bytes(data).decode("ascii")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where} cannot be read as text ({exc}).") from None
    lines = text.splitlines()
    if not lines:
        raise DataError(f"{where} is empty.")
    match = _HEADER.fullmatch(lines[0].strip())
    if not match or match.group(2) not in ALGORITHMS:
        raise DataError(
            f"{where}, line 1: header {lines[0][:80]!r} is not "
            f"'TRT-<version>-<algorithm>' with an algorithm among {', '.join(ALGORITHMS)}."
        )
    header = CacheHeader(match.group(1), match.group(2))
    scales: dict[str, np.float32] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, sep, value = line.rstrip().rpartition(": ")
        if not sep or not name or not _HEX.fullmatch(value):
            raise DataError(
                f"{where}, line {number}: {line[:80]!r} is not "
                "'<tensor name>: <8 hex digits>'. The file is damaged; regenerate it."
            )
        if name in scales:
            raise DataError(f"{where}, line {number}: tensor '{name}' appears twice.")
        scales[name] = hex_to_scale(value)
    return header, scales
