"""TensorRT <= 10 implicit-INT8 calibrator fed by quantlab's batches and cache.

:class:`CalibrationFeeder` holds the four callbacks TensorRT's ``IInt8Calibrator``
calls (``get_batch_size``, ``get_batch``, ``read_calibration_cache``,
``write_calibration_cache``) in plain Python: batches come from a
:class:`quantlab.data.BatchSource`, the cache is read and written through
:mod:`quantlab.engine.cache`, and device memory comes from an injected allocator, so
the callbacks run (and are tested) without TensorRT. :func:`make_calibrator`
wraps a feeder into the TensorRT calibrator class its cache header names, with
device buffers from Polygraphy's ``cuda.DeviceArray`` (the calibrator shape of
Polygraphy's own ``backend/trt/calibrator.py``). Calibrators exist in TensorRT
8.x-10.x only (removed in 11.0).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from quantlab.engine import cache
from quantlab.errors import ConfigError, DataError, QuantlabError
from quantlab.experiments.experiment import write_text
from quantlab.graph import TensorSpec

# Cache header algorithm -> TensorRT calibrator class (IInt8LegacyCalibrator needs quantile and
# regression-cutoff callbacks quantlab has no values for, so LegacyCalibration caches are refused).
CALIBRATOR_CLASSES = {
    "EntropyCalibration2": "IInt8EntropyCalibrator2",
    "EntropyCalibration": "IInt8EntropyCalibrator",
    "MinMaxCalibration": "IInt8MinMaxCalibrator",
}

Allocator = Callable[[str, np.ndarray], object]


class CalibrationFeeder:
    """The calibrator callbacks over `batches` and the cache file `cache_path`.

    `inputs` are the network's inputs (``graph.input_specs``) and `batch` the
    number of samples per calibration batch: TensorRT calibrates at the OPT
    shape of the calibration profile and reads exactly its volume from each
    pointer, so a batch of another shape (the short last one) is skipped and
    counted in `skipped_samples`. :meth:`set_input_metadata` (called by
    Polygraphy's ``CreateConfig`` with the network's inputs at the OPT shape)
    gives the exact shapes and types TensorRT reads. Float inputs are handed over
    as float32 (TensorRT's calibration inputs are float32); integer inputs in the
    network's type: TensorRT 8.x's ONNX parser turns INT64 inputs into INT32
    (onnx2trt_utils.cpp, 8.6-GA). `allocate(name, array)` returns what
    ``get_batch`` hands TensorRT for one input (a device pointer; an allocator with
    ``free()`` is freed once the batches are done); without it the host arrays are
    returned. `trt_version` ('10.3.0'), when given, is checked against the cache
    header. TensorRT swallows a callback's exception (its trampoline prints it and
    goes on), so :meth:`callback` keeps the first one for :meth:`raise_error`.
    """

    def __init__(
        self,
        batches: Iterable[Mapping[str, np.ndarray]] | None,
        cache_path: str | os.PathLike,
        inputs: Sequence[TensorSpec],
        batch: int = 1,
        algorithm: str = "EntropyCalibration2",
        trt_version: str | None = None,
        allocate: Allocator | None = None,
    ):
        if algorithm not in CALIBRATOR_CLASSES:
            raise ConfigError(
                f"TensorRT calibration algorithm '{algorithm}' is not one quantlab can drive; "
                f"use one of {', '.join(CALIBRATOR_CLASSES)}."
            )
        self.batches = batches
        self.cache_path = Path(cache_path)
        self.inputs = list(inputs)
        self.batch = int(batch)
        self.algorithm = algorithm
        self.trt_version = trt_version
        self.allocate = allocate
        self.used_batches = 0
        self.skipped_samples = 0
        self.cache_reads = 0  # times TensorRT asked for the cache and got one
        self.cache_writes = 0  # times TensorRT handed a cache to write
        self.error: BaseException | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self._iterator = None

    def reset(self) -> None:
        """Start the batches again (TensorRT may calibrate more than once)."""
        self._iterator = None
        self.used_batches = self.skipped_samples = 0

    def set_input_metadata(self, metadata: Mapping[str, tuple[np.dtype, Sequence[int]]]) -> None:
        """The network's inputs as TensorRT calibrates them: ``{name: (dtype, OPT shape)}``."""
        self.dtypes = {name: np.dtype(dtype) for name, (dtype, _) in metadata.items()}
        self.shapes = {name: tuple(int(d) for d in shape) for name, (_, shape) in metadata.items()}

    def callback(self, name: str, *args: object) -> object:
        """Call the callback `name`; on an exception keep the first one and return None (what
        TensorRT's trampoline makes of it anyway), so :meth:`raise_error` can raise it."""
        try:
            return getattr(self, name)(*args)
        except Exception as exc:  # re-raised by raise_error once TensorRT returns
            self.error = self.error or exc
            return None

    def raise_error(self) -> None:
        """Raise the exception a callback hit, if any (after TensorRT returned)."""
        error, self.error = self.error, None
        if isinstance(error, QuantlabError):
            raise error
        if error is not None:
            raise DataError(
                f"the calibrator failed inside TensorRT ({type(error).__name__}: {error}); "
                "TensorRT ignored it, so calibration ended early or its cache was not written."
            ) from error

    def get_batch_size(self) -> int:
        """1: networks from ONNX have an explicit batch axis, whose size the batches carry
        (Polygraphy's calibrator returns 1 the same way; getBatchSize is deprecated since 10.0)."""
        return 1

    def get_batch(self, names: Sequence[str]) -> list | None:
        """The next batch for the inputs `names` in that order, or None when there is no more."""
        if self.batches is None:
            return None
        if self._iterator is None:
            self._iterator = iter(self.batches)
        for batch in self._iterator:
            arrays = self._arrays(batch)
            if arrays is None:
                continue
            self.used_batches += 1
            if self.allocate is None:
                return [arrays[name] for name in names]
            return [self.allocate(name, arrays[name]) for name in names]
        if hasattr(self.allocate, "free"):  # device memory is not needed past the last batch
            self.allocate.free()
        return None

    def _arrays(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        arrays = {}
        for spec in self.inputs:
            if spec.name not in batch:
                raise DataError(f"calibration batch has no array for input '{spec.name}' (it "
                                f"has {sorted(batch)[:5]}).")
            array = np.asarray(batch[spec.name])
            expected = self.shapes.get(spec.name)
            if expected is not None and array.shape != expected or (
                    expected is None and spec.batch_axis is not None
                    and array.shape[spec.batch_axis] != self.batch):
                axis = spec.batch_axis if spec.batch_axis is not None else 0
                self.skipped_samples += array.shape[axis] if array.ndim else 1
                return None
            # order="C" keeps a 0-d input 0-d (np.ascontiguousarray makes it 1-d).
            arrays[spec.name] = np.asarray(array, dtype=self._dtype(spec, array), order="C")
        return arrays

    def _dtype(self, spec: TensorSpec, array: np.ndarray) -> np.dtype:
        # The network's type first, as Polygraphy's calibrator (calibrator.py L124-137): float
        # data for an integer input goes in that integer type (trt-review-r2 N17).
        if spec.name in self.dtypes:
            return self.dtypes[spec.name]
        if np.issubdtype(array.dtype, np.floating):
            return np.dtype(np.float32)
        if spec.dtype == np.int64 and self.trt_version and cache.trt_major(self.trt_version) < 10:
            return np.dtype(np.int32)  # TensorRT < 10 has no INT64 inputs: the parser makes INT32
        return np.dtype(spec.dtype)

    def check_cache(self) -> dict[str, np.float32] | None:
        """The cache's scales if the file exists, after checking that TensorRT will use it.

        ConfigError when its header names another algorithm or TensorRT version:
        TensorRT would not use it (the calibrator class must match, and so must the
        version: DLA-SW#26 shows a mismatched version rejected).
        """
        if not self.cache_path.is_file() or not self.cache_path.stat().st_size:
            return None
        header, scales = cache.read_calibration_cache(self.cache_path)
        if header.algorithm != self.algorithm:
            raise ConfigError(
                f"calibration cache {self.cache_path} was written by {header.algorithm}, but the "
                f"calibrator is {self.algorithm}; TensorRT would ignore it. Pass "
                f"algorithm='{header.algorithm}'."
            )
        if self.trt_version and header.trt_version != cache.trt_version_number(self.trt_version):
            raise ConfigError(
                f"calibration cache {self.cache_path} is for TensorRT version number "
                f"{header.trt_version} but TensorRT {self.trt_version} is installed, which "
                "rejects it. Recalibrate with quantlab calibrate --trt-version "
                f"{self.trt_version}."
            )
        return scales

    def read_calibration_cache(self) -> bytes | None:
        """The cache file's bytes, or None (calibrate from the batches) when there is none."""
        if not self.cache_path.is_file() or not self.cache_path.stat().st_size:
            return None
        self.cache_reads += 1
        return self.cache_path.read_bytes()

    def write_calibration_cache(self, data: bytes | memoryview) -> None:
        """Check the cache TensorRT computed and write it atomically to `cache_path`."""
        text = bytes(data)
        self.cache_writes += 1
        cache.parse_calibration_cache(text, f"calibration cache written by TensorRT for "
                                            f"{self.cache_path}")
        write_text(self.cache_path, text.decode("ascii"))


class DeviceBuffers:
    """An allocator for :class:`CalibrationFeeder`: one growing device buffer per input
    (Polygraphy's ``cuda.DeviceArray``), refilled from the host array for every batch."""

    def __init__(self):
        from polygraphy import cuda

        self._cuda = cuda
        self.buffers: dict[str, object] = {}

    def __call__(self, name: str, array: np.ndarray) -> int:
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer = self.buffers.get(name)
        if buffer is None:
            buffer = self.buffers[name] = self._cuda.DeviceArray.raw((raw.nbytes,))
        buffer.resize((raw.nbytes,))
        buffer.copy_from(raw)
        return int(buffer.ptr)

    def free(self) -> None:
        """Release every device buffer."""
        for buffer in self.buffers.values():
            buffer.free()
        self.buffers.clear()


def make_calibrator(feeder: CalibrationFeeder) -> object:
    """A TensorRT calibrator (the class `feeder.algorithm` names) calling `feeder`'s callbacks,
    with device memory from :class:`DeviceBuffers`. Needs TensorRT 8.x-10.x."""
    from quantlab.engine.backends.tensorrt import check_mode, parse_version, require_tensorrt

    trt = require_tensorrt()
    from polygraphy.datatype import DataType

    check_mode("implicit", parse_version(trt.__version__))
    feeder.check_cache()
    base = getattr(trt, CALIBRATOR_CLASSES[feeder.algorithm])
    if feeder.allocate is None:
        feeder.allocate = DeviceBuffers()

    class QuantlabCalibrator(base):
        # Polygraphy's CreateConfig calls set_input_metadata of calibrators that say this, with
        # the network's inputs at the calibration profile's OPT shape (backend/trt/util.py).
        is_polygraphy_calibrator = True

        def __init__(self):
            # pybind11 trampolines need the base initialized explicitly (TensorRT's docs).
            base.__init__(self)
            self.feeder = feeder

        def set_input_metadata(self, metadata):
            feeder.set_input_metadata({name: (DataType.to_dtype(meta.dtype, "numpy"), meta.shape)
                                       for name, meta in metadata.items()})

        def get_batch_size(self):
            return feeder.get_batch_size()

        def get_batch(self, names):
            return feeder.callback("get_batch", names)

        def read_calibration_cache(self):
            return feeder.callback("read_calibration_cache")

        def write_calibration_cache(self, data):
            feeder.callback("write_calibration_cache", data)

    return QuantlabCalibrator()
