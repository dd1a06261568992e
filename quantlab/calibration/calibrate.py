"""Statistics -> amax per tensor: entropy (TensorRT's EntropyCalibration2), max, percentile, mse.

Calibrators only decide; the statistics they read are collected by
:mod:`quantlab.calibration.collect`. docs/calibration.md explains each method and how our
entropy calibrator relates to TensorRT's, pytorch-quantization's, ONNX
Runtime's, MXNet's and TVM's.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # collect imports numba and onnxruntime: not needed to parse options
    from quantlab.calibration.collect import Statistics, TensorStats
from quantlab.choices import DEFAULT_METHOD, METHODS  # noqa: F401 (public API)
from quantlab.errors import ConfigError, DataError
from quantlab.experiments.experiment import read_artifact, write_json

# amax given to a tensor that was zero on all calibration data: any positive
# value represents 0 exactly; 1.0 keeps a usable range if deployment data differs.
SAFE_AMAX = 1.0
# A tensor's INT8 range is set by a few extreme values when its amax is over
# OUTLIER_RATIO times its 99.99th percentile, or when more than FIRST_BIN_MASS of its
# |x| falls in the first of the histogram's bins (one value of 1e6 among values of ~1
# puts them all there and wrecks every method: reliability report, case 7.3).
OUTLIER_RATIO = 10.0
FIRST_BIN_MASS = 0.99
# KL values closer than this (nats) are ties: the summation order of the
# vectorized search and of a loop differ by ~1e-15, far below real differences.
KL_TIE_TOLERANCE = 1e-12
SCALES_FORMAT = "quantlab.scales"


@dataclass
class Scales:
    """amax per tensor (scale = amax / 127) with the method and parameters that chose them."""

    amax: dict[str, float]
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 0

    @property
    def scale(self) -> dict[str, float]:
        """Symmetric int8 scale per tensor: amax / 127."""
        return {name: amax / 127.0 for name, amax in self.amax.items()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``scales.json`` atomically."""
        return write_json(path, {
            "format": SCALES_FORMAT,
            "method": self.method,
            "params": self.params,
            "num_samples": self.num_samples,
            "tensors": {name: {"amax": amax, "scale": amax / 127.0}
                        for name, amax in self.amax.items()},
        })

    @classmethod
    def load(cls, path: str | os.PathLike) -> Scales:
        """Read a ``scales.json`` written by :meth:`save`."""
        path = Path(path)
        data = read_artifact(path, SCALES_FORMAT, "scales",
                             "the scales.json written by `quantlab calibrate`")
        try:
            amax = {str(name): entry["amax"] for name, entry in data["tensors"].items()}
            for name, value in amax.items():
                if not (_is_real(value) and math.isfinite(value) and value > 0):
                    raise DataError(
                        f"{path}: tensor '{name}' has amax {value!r}; every amax must be a finite "
                        "positive number. The file is damaged or was edited; calibrate again to "
                        "rewrite it."
                    )
            amax = {name: float(value) for name, value in amax.items()}
            return cls(amax, str(data["method"]), dict(data["params"]), int(data["num_samples"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(
                f"{path} is a damaged scales file (field {exc}); calibrate again to rewrite it."
            ) from None


def calibrate(stats: Statistics, method: str = DEFAULT_METHOD, **params: Any) -> Scales:
    """Choose an amax for every tensor in `stats` with the calibrator `method` is the name of
    (:data:`CALIBRATORS`), its parameters `params` (the class's fields, defaults filled in)."""
    calibrator = make_calibrator(method, params, stats.num_bins)

    def one(name: str) -> tuple[float, tuple[str, bool] | None]:
        return _tensor_amax(name, stats.tensors[name], calibrator, stats.num_bins)

    # The searches are numpy over whole histograms and numba without the GIL: one per core.
    names = list(stats.tensors)
    with ThreadPoolExecutor(max(1, min(len(names), len(os.sched_getaffinity(0))))) as pool:
        found = list(pool.map(one, names))
    amax = {name: value for name, (value, _) in zip(names, found, strict=True)}
    empty = [name for name in names if stats.tensors[name].count == 0]
    outliers = [note for _, note in found if note]
    if empty:
        warnings.warn(
            f"{len(empty)} tensor(s) held no values in calibration ({empty[:5]}); they get amax "
            f"{SAFE_AMAX}. Check that the calibration data exercises them.",
            stacklevel=2,
        )
    if outliers:
        warnings.warn(_outlier_message(outliers, method), stacklevel=2)
    return Scales(amax, method, calibrator.params, stats.num_samples)


def _tensor_amax(name: str, tensor: TensorStats, calibrator: Calibrator,
                 num_bins: int) -> tuple[float, tuple[str, bool] | None]:
    """`tensor`'s amax by `calibrator` and its outlier note, if any (:func:`calibrate`)."""
    # Finite first: max(|min|, |max|) of a NaN range is 0 and would pass as "all zeros".
    if tensor.count and not (math.isfinite(tensor.min) and math.isfinite(tensor.max)):
        raise DataError(
            f"the statistics of tensor '{name}' have a non-finite range (min {tensor.min}, "
            f"max {tensor.max}); quantlab.calibration.collect never records NaN or Inf, so they "
            f"are "
            "damaged or were not made by it. Collect the statistics again."
        )
    if tensor.count == 0 or tensor.amax == 0.0:
        # No values (calibrate warns) or all zeros (collect.collect has warned): any
        # positive amax represents them.
        return SAFE_AMAX, None
    hist, top = tensor.histogram(num_bins)
    amax = calibrator.amax(hist, top)
    return amax, _outlier_note(name, tensor, hist, top / num_bins, amax)


class Calibrator:
    """Decides one tensor's amax from its statistics, as a torch.ao observer's
    ``calculate_qparams`` does (quantlab.calibration.collect accumulates them). A subclass is a
    dataclass whose fields are its parameters (``float`` or ``int`` numbers of bins, with defaults)
    and is registered in :data:`CALIBRATORS` under the name choices.METHODS spells."""

    # The header of a TensorRT calibration cache of its scales: TensorRT names its calibrator
    # there, and has none by the name of ours but entropy's, so they take the min-max one.
    cache_algorithm: ClassVar[str] = "MinMaxCalibration"

    def amax(self, hist: np.ndarray, top: float) -> float:
        """The amax of a tensor whose |x| histogram (TensorRT's: equal bins) spans [0, top]."""
        raise NotImplementedError

    def check(self, num_bins: int) -> None:
        """ConfigError when a parameter is out of its range for `num_bins` bins."""

    @property
    def params(self) -> dict[str, Any]:
        """The parameters, as ``scales.json`` records them."""
        return asdict(self)


@dataclass(frozen=True)
class MaxCalibrator(Calibrator):
    """max |x| (TensorRT's MinMaxCalibration of a symmetric range)."""

    def amax(self, hist: np.ndarray, top: float) -> float:
        return top


@dataclass(frozen=True)
class EntropyCalibrator(Calibrator):
    """TensorRT's EntropyCalibration2: the threshold of least KL divergence
    (:func:`entropy_threshold_bin`)."""

    cache_algorithm: ClassVar[str] = "EntropyCalibration2"
    start_bin: int = 128
    num_levels: int = 128

    def amax(self, hist: np.ndarray, top: float) -> float:
        # TensorRT puts the threshold in the middle of the bin after the kept
        # ones: (i + 0.5) * width (GTC 2017; TensorRT-written caches show
        # amax = 2048.5/2048 * max for unclipped tensors, e.g. 3c010a14 for max 1).
        return (entropy_threshold_bin(hist, self.start_bin, self.num_levels) + 0.5) \
            * (top / len(hist))

    def check(self, num_bins: int) -> None:
        _check_start_bin(self.start_bin, num_bins)
        if not 1 <= self.num_levels <= num_bins:
            raise ConfigError(f"num_levels must be in [1, {num_bins}], got {self.num_levels}.")


@dataclass(frozen=True)
class PercentileCalibrator(Calibrator):
    """The upper edge of the bin where `percentile` % of |x| is reached."""

    percentile: float = 99.99

    def amax(self, hist: np.ndarray, top: float) -> float:
        return percentile_threshold_bin(hist, self.percentile) * (top / len(hist))

    def check(self, num_bins: int) -> None:
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"percentile must be in (0, 100], got {self.percentile}.")


@dataclass(frozen=True)
class MseCalibrator(Calibrator):
    """The amax of least int8 squared error over the histogram (:func:`mse_threshold_bin`)."""

    start_bin: int = 128

    def amax(self, hist: np.ndarray, top: float) -> float:
        return mse_threshold_bin(hist, self.start_bin) * (top / len(hist))

    def check(self, num_bins: int) -> None:
        _check_start_bin(self.start_bin, num_bins)


# The calibrator of each method name the command line spells (choices.METHODS, which
# tests/calibration/test_calibrate.py checks against these keys): a new calibrator is a class and a
# line.
CALIBRATORS: dict[str, type[Calibrator]] = {
    "entropy": EntropyCalibrator,
    "max": MaxCalibrator,
    "percentile": PercentileCalibrator,
    "mse": MseCalibrator,
}


def _check_start_bin(start_bin: int, num_bins: int) -> None:
    if not 1 <= start_bin <= num_bins:
        raise ConfigError(f"start_bin must be in [1, {num_bins}], got {start_bin}.")


def _outlier_note(name: str, tensor: TensorStats, hist: np.ndarray, width: float,
                  amax: float) -> tuple[str, bool] | None:
    """(description, all-in-first-bin) of a tensor whose INT8 range a few extreme values set.

    That is the case when the chosen amax is over OUTLIER_RATIO times the 99.99th
    percentile (the method did not clip them), or when more than FIRST_BIN_MASS of
    |x| lies in the first histogram bin: with a linear histogram over [0, max |x|]
    (TensorRT's) no method can then resolve the other values.
    """
    total = hist.sum()
    if total <= 0:
        return None
    p9999 = percentile_threshold_bin(hist, 99.99) * width  # upper edge of its bin
    first_bin = hist[0] / total > FIRST_BIN_MASS
    if not first_bin and amax <= OUTLIER_RATIO * p9999:
        return None
    sample = getattr(tensor, "max_sample", None)
    where = f" in sample {sample}" if sample is not None and sample >= 0 else ""
    return (f"'{name}' amax {amax:.4g} (max |x| {tensor.amax:.4g}{where}) vs 99.99th "
            f"percentile <= {p9999:.3g}", first_bin)


def _outlier_message(notes: list[tuple[str, bool]], method: str) -> str:
    shown = "; ".join(text for text, _ in notes[:5])
    more = f"; and {len(notes) - 5} more" if len(notes) > 5 else ""
    if any(first_bin for _, first_bin in notes):
        advice = ("Nearly all their values fall in the first histogram bin, so every method "
                  "sets the range near the extreme value. Remove or fix the sample(s) holding it "
                  "and calibrate again.")
    else:
        others = " or ".join(m for m in ("percentile", "mse") if m != method)
        advice = (f"Remove or fix the sample(s) holding them and calibrate again, or use --method "
                  f"{others}, which clips them.")
    return (f"a few extreme values set the INT8 range of {len(notes)} tensor(s) ({method}), "
            f"which rounds most of their values to 0: {shown}{more}. {advice}")


def make_calibrator(method: str, params: Mapping[str, Any], num_bins: int = 2048
                    ) -> Calibrator:
    """The calibrator `method` names with `params` (defaults filled in); ConfigError if
    anything is wrong. Cheap, so callers can validate options before a long collection."""
    if method not in CALIBRATORS:
        raise ConfigError(f"calibration method '{method}' is not one of {', '.join(METHODS)}.")
    kinds = {f.name: f.type for f in fields(CALIBRATORS[method])}
    unknown = sorted(set(params) - set(kinds))
    if unknown:
        raise ConfigError(
            f"calibration method '{method}' has no parameter(s) {unknown}; it takes "
            f"{sorted(kinds) or 'none'}."
        )
    numbers = {}
    for name, value in params.items():
        if kinds[name] == "float":
            if not _is_real(value):
                raise ConfigError(f"{name} must be a number, got {value!r}.")
            numbers[name] = float(value)
        elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ConfigError(f"{name} must be an integer number of bins, got {value!r}.")
        else:
            numbers[name] = int(value)
    calibrator = CALIBRATORS[method](**numbers)
    calibrator.check(num_bins)
    return calibrator


def check_method(method: str, params: Mapping[str, Any], num_bins: int = 2048) -> dict[str, Any]:
    """The full parameter set of `method` (defaults filled in); ConfigError if anything is
    wrong (:func:`make_calibrator`)."""
    return make_calibrator(method, params, num_bins).params


def _is_real(value: Any) -> bool:
    """A real number (bool and strings are not)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_))


def entropy_threshold_bin(hist: np.ndarray, start_bin: int = 128, num_levels: int = 128) -> int:
    """Number of bins i of |x| histogram `hist` to keep that minimizes KL(P_i || Q_i).

    TensorRT's EntropyCalibration2 as published (GTC 2017) and re-implemented
    by NVIDIA's pytorch-quantization: bin 0 takes bin 1's count; for every
    i in [start_bin, len(hist)], P_i = hist[:i] with the mass of hist[i:] added
    to its last bin; Q_i = hist[:i] merged into `num_levels` levels (bin j in
    level floor(num_levels * j / i)), each level's mass spread evenly over its
    bins that are non-zero in hist[:i] (zero elsewhere); P and Q normalized;
    0 log 0 = 0 and P > 0 where Q = 0 gives infinity. Ties (within
    KL_TIE_TOLERANCE) go to the largest i. All candidates are evaluated at once
    from prefix sums (levels are contiguous runs of bins).
    """
    h = np.asarray(hist, np.float64).copy()
    n = len(h)
    h[0] = h[1]
    total = h.sum()
    if total == 0.0:
        return n
    h /= total
    kept = np.arange(start_bin, n + 1)
    nonzero = h > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        h_log_h = np.where(nonzero, h * np.log(np.where(nonzero, h, 1.0)), 0.0)
    mass_prefix = np.concatenate(([0.0], np.cumsum(h)))
    count_prefix = np.concatenate(([0], np.cumsum(nonzero)))
    plogp_prefix = np.concatenate(([0.0], np.cumsum(h_log_h)))

    # Level l of candidate i covers bins [ceil(l*i/L), ceil((l+1)*i/L)).
    bounds = -((-np.arange(num_levels + 1)[None, :] * kept[:, None]) // num_levels)
    level_mass = np.diff(mass_prefix[bounds], axis=1)
    level_count = np.diff(count_prefix[bounds], axis=1)
    # Suffix sums, not 1 - prefix: an empty tail must give exactly zero outliers.
    outliers = np.concatenate((np.cumsum(h[::-1])[::-1], [0.0]))[kept]
    last = h[kept - 1] + outliers
    with np.errstate(divide="ignore", invalid="ignore"):
        # sum_j h_j log Q_j over kept bins = sum over levels of mass * log(mass / count).
        level_q = np.where(level_mass > 0, level_mass / np.maximum(level_count, 1), 1.0)
        cross = (level_mass * np.log(level_q)).sum(axis=1)
        last_q = level_mass[:, -1] / np.maximum(level_count[:, -1], 1)
        last_plogp = np.where(last > 0, last * np.log(np.where(last > 0, last, 1.0)), 0.0)
        plogp = plogp_prefix[kept - 1] + last_plogp
        # The outlier mass sits in the last bin, where Q is the last level's share.
        outlier_cross = np.where(outliers > 0, outliers * np.log(last_q), 0.0)
        kl = plogp - cross - outlier_cross + np.log(mass_prefix[kept])
    # Outliers folded into an empty last bin meet Q = 0 there: infinite divergence.
    kl[(outliers > 0) & (h[kept - 1] == 0)] = np.inf
    kl[~np.isfinite(kl)] = np.inf
    best = kl.min()
    if not np.isfinite(best):
        return n
    return int(kept[np.flatnonzero(kl <= best + KL_TIE_TOLERANCE)[-1]])


def percentile_threshold_bin(hist: np.ndarray, percentile: float) -> int:
    """Smallest k such that bins [0, k) hold at least `percentile` % of the mass."""
    cumulative = np.cumsum(np.asarray(hist, np.float64))
    target = cumulative[-1] * percentile / 100.0
    return int(min(np.searchsorted(cumulative, target, side="left") + 1, len(cumulative)))


def mse_threshold_bin(hist: np.ndarray, start_bin: int = 128) -> int:
    """k in [start_bin, len(hist)] whose amax = k bins minimizes the histogram's int8 MSE.

    Each bin's mass sits at its centre c; with scale s = k / 127 (in bins) it
    quantizes to min(round(c / s), 127) * s. Ties go to the smallest k. The errors are
    summed bin by bin in a compiled loop (:func:`quantlab.calibration.collect.mse_errors`).
    """
    from quantlab.calibration.collect import (
        mse_errors,  # numba: compiled kernels live with collect's
    )

    errors = mse_errors(np.asarray(hist, np.float64), start_bin)
    return int(start_bin + np.argmin(errors))

