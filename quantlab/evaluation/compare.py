"""Per-tensor error metrics between two runs, streamed over batches; first divergence.

Everything here works on ``{tensor_name: array}`` dicts and never knows which
backend produced them (Polygraphy's comparator design). Sums are accumulated in
float64, so the metrics over N batches equal the metrics over their
concatenation up to float64 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numba
import numpy as np

from quantlab.errors import ModelError

if TYPE_CHECKING:  # pandas (0.2 s of imports) only where a table is made: not in calibrate
    import pandas as pd

METRICS = ("cosine", "sqnr_db", "rel_l2", "max_abs", "frac_outside")
TABLE_COLUMNS = ("tensor", "node", "op_type", "torch_module", *METRICS)
# Elements summed per block before the block sums are added up: two-level summation keeps
# the float64 rounding error near (BLOCK + n / BLOCK) ulps instead of n ulps.
BLOCK = 4096


class TensorError:
    """Streaming error statistics of one tensor pair (reference vs test).

    `update` accumulates float64 sums in one pass; the properties decide the metrics. An
    element is *outside* the tolerance when ``|test - ref| > atol + rtol * |ref|``
    (the ``numpy.isclose`` rule).
    """

    def __init__(self, atol: float = 1e-3, rtol: float = 1e-3):
        self.atol, self.rtol = atol, rtol
        self.count = 0
        self.sum_ref2 = 0.0
        self.sum_test2 = 0.0
        self.sum_dot = 0.0
        self.sum_err2 = 0.0
        self.max_abs = 0.0
        self.outside = 0
        self.nonfinite = 0

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        """Add one batch of a tensor (arrays of equal shape)."""
        ref = np.ascontiguousarray(ref).reshape(-1)
        test = np.ascontiguousarray(test).reshape(-1)
        sums = _error_sums(ref, test, float(self.atol), float(self.rtol))
        self.count += ref.size
        self.sum_ref2 += sums[0]
        self.sum_test2 += sums[1]
        self.sum_dot += sums[2]
        self.sum_err2 += sums[3]
        self.max_abs = max(self.max_abs, sums[4])
        self.outside += int(sums[5])
        self.nonfinite += int(sums[6])

    @property
    def cosine(self) -> float:
        """Cosine similarity; exactly 1 for identical tensors (also all-zero), 0 if one is zero."""
        if self.sum_err2 == 0.0:
            return 1.0
        norms = math.sqrt(self.sum_ref2) * math.sqrt(self.sum_test2)
        if norms == 0.0:
            return 0.0
        # sqrt rounding can push |dot| / norms one ulp past 1.
        return min(1.0, max(-1.0, self.sum_dot / norms))

    @property
    def sqnr_db(self) -> float:
        """10 log10(sum ref^2 / sum (ref - test)^2), the sums over every element of every
        batch (pooled, docs/metrics.md); +inf for identical tensors."""
        if self.sum_err2 == 0.0:
            return math.inf
        if self.sum_ref2 == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.sum_ref2 / self.sum_err2)

    @property
    def rel_l2(self) -> float:
        """||test - ref|| / ||ref||; 0 when identical, +inf when only ref is all-zero."""
        if self.sum_err2 == 0.0:
            return 0.0
        if self.sum_ref2 == 0.0:
            return math.inf
        return math.sqrt(self.sum_err2 / self.sum_ref2)

    @property
    def frac_outside(self) -> float:
        """Fraction of elements outside atol + rtol * |ref|."""
        return self.outside / self.count if self.count else 0.0

    def metrics(self) -> dict[str, float]:
        """The five metrics as a dict (keys in :data:`METRICS`)."""
        return {name: getattr(self, name) for name in METRICS}


# Reassociation lets LLVM vectorize the float64 sums (1.7x faster, measured); no flag that
# assumes finite values, since NaN/Inf must still show in the block sums.
@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract", "nsz"})
def _error_sums(ref, test, atol, rtol):
    """sum ref^2, sum test^2, sum ref*test, sum err^2, max |err|, count outside, NaN/Inf blocks.

    Each element is widened to float64 as it is read (no float64 copy of the
    tensor); numpy would need a dozen passes and two float64 temporaries. A NaN or
    Inf in either input makes its block's sums non-finite, which is counted.
    """
    totals = np.zeros(5)
    outside = nonfinite = 0
    for start in range(0, ref.size, BLOCK):
        ref2 = test2 = dot = err2 = largest = 0.0
        count = 0
        for i in range(start, min(start + BLOCK, ref.size)):
            r = np.float64(ref[i])
            t = np.float64(test[i])
            e = t - r
            ref2 += r * r
            test2 += t * t
            dot += r * t
            err2 += e * e
            magnitude = abs(e)
            largest = max(largest, magnitude)
            count += magnitude > atol + rtol * abs(r)
        if not (np.isfinite(err2) and np.isfinite(ref2) and np.isfinite(test2)):
            nonfinite += 1
        outside += count
        totals[0] += ref2
        totals[1] += test2
        totals[2] += dot
        totals[3] += err2
        totals[4] = max(totals[4], largest)
    return totals[0], totals[1], totals[2], totals[3], totals[4], outside, nonfinite


def output_nsr(noise: Sequence[float] | np.ndarray, power: Sequence[float] | np.ndarray) -> float:
    """A model's output noise-to-signal ratio from one total per float output: each output's
    noise energy ``sum (test - ref)^2`` over its signal energy ``sum ref^2``, both summed
    over every sample and element (pooled), averaged over the outputs (docs/metrics.md).

    0 without noise; NaN when a total is NaN. A silent reference output (``sum ref^2`` 0)
    counts its noise against the smallest positive float64.
    """
    noise, power = np.asarray(noise, np.float64), np.asarray(power, np.float64)
    return float(np.mean(noise / np.maximum(power, np.finfo(np.float64).tiny)))


def output_sqnr_db(noise: Sequence[float] | np.ndarray,
                   power: Sequence[float] | np.ndarray) -> float:
    """quantlab's output SQNR in dB, ``-10 log10`` of :func:`output_nsr`: with one output,
    that output's :attr:`TensorError.sqnr_db`; +inf without noise, NaN with a NaN total.
    `validate`'s output SQNR and `plan`'s ``--min-sqnr`` and ``--metric sqnr`` are this."""
    nsr = output_nsr(noise, power)
    if np.isnan(nsr):
        return math.nan
    return -10.0 * math.log10(nsr) if nsr > 0 else math.inf


_FLOAT64_ROWS_BYTES = 32 << 20  # sample_energies' float64 working copies


def sample_energies(outputs: Mapping[str, np.ndarray],
                    references: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample noise and signal energy of every float output, in float64: (noise, power),
    each [samples, outputs], ``sum (y - r)^2`` and ``sum r^2`` over one sample's elements.

    Samples are on axis 0 of every output. Summed over samples they give the output NSR
    (:func:`output_nsr`); per sample, how hard a sample is
    (:func:`quantlab.planner.measure.sample_nsr`).
    """
    noises, powers = [], []
    for name, reference in references.items():
        reference = np.asarray(reference)
        if not np.issubdtype(reference.dtype, np.floating):
            continue
        count = len(reference)
        ref = reference.reshape(count, -1)
        out = np.asarray(outputs[name]).reshape(count, -1)
        noise, power = np.empty(count), np.empty(count)
        # In float64, a few samples at a time: a whole batch of a detector's outputs in
        # float64 (4 copies of 48 x 12828 x 91 values) held 1.2 GB.
        rows = max(1, _FLOAT64_ROWS_BYTES // max(1, 8 * ref.shape[1]))
        for start in range(0, count, rows):
            part = ref[start:start + rows].astype(np.float64)
            diff = out[start:start + rows].astype(np.float64) - part
            noise[start:start + rows] = np.einsum("ij,ij->i", diff, diff)
            power[start:start + rows] = np.einsum("ij,ij->i", part, part)
        noises.append(noise)
        powers.append(power)
    if not noises:
        raise ModelError(f"the model has no float outputs to compare ({sorted(references)}); "
                         "pass a metric that reads its outputs (--metric module:function).")
    return np.stack(noises, axis=1), np.stack(powers, axis=1)


def joined_energies(parts: Sequence[tuple[np.ndarray, np.ndarray]],
                    ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sample_energies` of several batches as one (noise, power), samples in order."""
    return np.concatenate([n for n, _ in parts]), np.concatenate([p for _, p in parts])


# How far from 1 the sum of one position's values along an axis may be for them to count as a
# distribution (float32 softmax over thousands of classes sums to 1 within ~1e-6).
PROBABILITY_SUM_TOLERANCE = 1e-3


class ChannelError:
    """Per-channel signal and noise power and largest |reference| of one tensor pair, along
    axis 1 and a sequence's last axis (samples on axis 0), folded batch by batch: whether the
    tensor mixes scales (:meth:`spread`), which one pooled SQNR hides."""

    def __init__(self):
        self.sums: dict[int, np.ndarray] = {}  # axis -> rows signal, noise, max |ref|
        # axis -> whether every reference so far holds probabilities along it (in [0, 1],
        # summing to 1: a softmax over classes, a CTC's per-step distribution).
        self.probabilities: dict[int, bool] = {}

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        """Add one batch (arrays of equal shape; nothing for fewer than 2 axes).

        The channels are on axis 1 or, for a sequence (3 axes or fewer: tokens by features,
        a CTC's steps by classes), on the last axis; an image's last axis is its width, and
        the columns of a probability map are not channels of different scales."""
        if np.ndim(ref) < 2:
            return
        for axis in dict.fromkeys((1, np.ndim(ref) - 1) if np.ndim(ref) <= 3 else (1,)):
            r = np.moveaxis(ref, axis, 0).reshape(np.shape(ref)[axis], -1).astype(np.float64)
            e = np.moveaxis(test, axis, 0).reshape(r.shape).astype(np.float64) - r
            got = np.stack([(r * r).sum(1), (e * e).sum(1), np.abs(r).max(1, initial=0.0)])
            self.probabilities[axis] = self.probabilities.get(axis, True) and bool(
                r.min(initial=0.0) >= 0.0 and r.max(initial=0.0) <= 1.0
                and np.allclose(r.sum(0), 1.0, atol=PROBABILITY_SUM_TOLERANCE))
            old = self.sums.get(axis)
            self.sums[axis] = got if old is None else np.stack(
                [old[0] + got[0], old[1] + got[1], np.maximum(old[2], got[2])])

    def spread(self) -> dict | None:
        """On the axis whose channels' largest |values| span the widest factor: the axis, the
        channel count, the smallest and largest max |value| (channels not all zero), the
        worst channel with its SQNR in dB, and whether the values are probabilities along that
        axis. None for a tensor of fewer than 2 channels."""
        best = None
        for axis, (signal, noise, amax) in self.sums.items():
            live = amax > 0
            if live.sum() < 2:
                continue
            ratio = amax[live].max() / amax[live].min()
            if best is None or ratio > best[0]:
                best = ratio, axis, signal, noise, amax, live
        if best is None:
            return None
        _, axis, signal, noise, amax, live = best
        with np.errstate(divide="ignore"):
            sqnr = np.where(noise > 0, 10 * np.log10(signal / np.where(noise > 0, noise, 1)),
                            np.inf)
        worst = int(np.argmin(np.where(live, sqnr, np.inf)))
        return {"axis": axis, "channels": len(amax), "amax_min": float(amax[live].min()),
                "amax_max": float(amax[live].max()), "worst_channel": worst,
                "worst_sqnr_db": float(sqnr[worst]), "probabilities": self.probabilities[axis]}


class Comparison:
    """Compare two runs tensor by tensor, batch after batch, keeping only sums in memory."""

    def __init__(self, tensors: Sequence[str], reference: str = "reference", test: str = "test",
                 atol: float = 1e-3, rtol: float = 1e-3):
        self.tensors = list(tensors)
        self.reference, self.test = reference, test
        self.errors = {name: TensorError(atol, rtol) for name in self.tensors}

    def update(self, reference: Mapping[str, np.ndarray], test: Mapping[str, np.ndarray],
               tensors: Sequence[str] | None = None, pool: Executor | None = None) -> list[str]:
        """Add one batch of `tensors` (default: every compared tensor), present in both dicts.

        A run streamed in segments updates each tensor once per batch, with the
        segment that produced it. With `pool`, tensors are folded in parallel (the
        kernel releases the GIL; each tensor's sums are updated by one thread).
        Returns the tensors whose values in this batch hold NaN or Inf in either
        run (their metrics are then meaningless).
        """
        names = self.tensors if tensors is None else [t for t in tensors if t in self.errors]
        for side, values in ((self.reference, reference), (self.test, test)):
            missing = [t for t in names if t not in values]
            if missing:
                raise ModelError(
                    f"the '{side}' run has no tensor(s) {missing[:5]} to compare; compare only "
                    "tensors both models produce (see quantlab.graph.Graph.common_tensors)."
                )
        for name in names:
            if np.shape(reference[name]) != np.shape(test[name]):
                raise ModelError(
                    f"tensor '{name}' has shape {np.shape(reference[name])} in "
                    f"'{self.reference}' but {np.shape(test[name])} in '{self.test}'; the two "
                    "models do not compute the same tensor under this name. Check that both "
                    "come from the same export."
                )

        def fold(name: str) -> bool:
            error = self.errors[name]
            before = error.nonfinite
            error.update(reference[name], test[name])
            return error.nonfinite > before

        flags = pool.map(fold, names) if pool is not None else map(fold, names)
        return [name for name, flagged in zip(names, flags, strict=True) if flagged]

    def table(self, info: pd.DataFrame | None = None) -> pd.DataFrame:
        """One row per tensor (compared order): tensor, node, op_type, torch_module, metrics."""
        import pandas as pd

        rows = []
        for name in self.tensors:
            described = info.loc[name] if info is not None and name in info.index else None
            rows.append({
                "tensor": name,
                "node": "" if described is None else described["node"],
                "op_type": "" if described is None else described["op_type"],
                "torch_module": "" if described is None else described["torch_module"],
                **self.errors[name].metrics(),
            })
        return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def first_nonfinite(values: Mapping[str, np.ndarray], order: Sequence[str]) -> str | None:
    """The first tensor of `order` in `values` that holds NaN or Inf (float tensors only)."""
    for name in order:
        value = values.get(name)
        if value is not None and np.issubdtype(np.asarray(value).dtype, np.floating) and \
                not np.isfinite(value).all():
            return name
    return None


@dataclass(frozen=True)
class Divergence:
    """Where the error between two runs first jumps past the threshold."""

    tensor: str
    node: str
    op_type: str
    torch_module: str
    sqnr_db: float
    input_sqnr_db: float
    reason: str

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def first_divergence(table: pd.DataFrame, order: Sequence[str],
                     upstream: Mapping[str, Sequence[str]] | None = None,
                     threshold_db: float = 30.0, min_drop_db: float = 10.0) -> Divergence | None:
    """The earliest tensor (in `order`) whose error jumps past `threshold_db`.

    A tensor *jumps* when its SQNR is below `threshold_db` and at least
    `min_drop_db` below the lowest SQNR of its `upstream` tensors (graph inputs
    count as +inf dB): the node producing it adds the error rather than passing
    on error from before. If no tensor jumps but some fall below the threshold
    (error accumulating gradually over many layers), the first of those is
    returned with reason "gradual". None when every tensor is above the threshold.
    """
    sqnr = dict(zip(table["tensor"], table["sqnr_db"], strict=True))
    rows = table.set_index("tensor", drop=False)
    upstream = upstream or {}
    below = [t for t in order if t in sqnr and sqnr[t] < threshold_db]
    if not below:
        return None
    for tensor in below:
        before = min((sqnr.get(u, math.inf) for u in upstream.get(tensor, ())), default=math.inf)
        if sqnr[tensor] < before - min_drop_db:
            return _divergence(rows.loc[tensor], before, "jump")
    first = below[0]
    before = min((sqnr.get(u, math.inf) for u in upstream.get(first, ())), default=math.inf)
    return _divergence(rows.loc[first], before, "gradual")


def _divergence(row: pd.Series, before: float, reason: str) -> Divergence:
    return Divergence(row["tensor"], row["node"], row["op_type"], row["torch_module"],
                      float(row["sqnr_db"]), float(before), reason)


@dataclass
class PairResult:
    """The comparison of one stage pair: per-tensor table, first divergence, output errors.

    `mode` is ``global`` (both stages end to end) or ``local`` (each test layer fed
    the reference's inputs); `outputs` maps each model output to its metrics (from
    the end-to-end runs); `not_compared` lists float tensors left out, and
    `warnings` says why a reader should not trust the pair as complete.
    `output_sqnr_db` is the model's output SQNR over its float outputs
    (:func:`output_sqnr_db`, the figure `plan --min-sqnr` bounds; None without one);
    `channels` maps each output to its :meth:`ChannelError.spread` (where it was measured).
    """

    reference: str
    test: str
    mode: str
    table: pd.DataFrame
    divergence: Divergence | None
    outputs: dict[str, dict[str, float]]
    not_compared: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    output_sqnr_db: float | None = None
    channels: dict[str, dict | None] = field(default_factory=dict)
