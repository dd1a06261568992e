"""Trials: plans run on the hardest samples, the additive noise model fitted from them, and
its check.

A trial is one plan (unit -> precision) built as its own Q/DQ model, the model an
evaluation would run, and run once over the hardest calibration samples in ONNX
Runtime (integer kernels where the plan has INT8): no more than a forward pass of
that model. The output noise of the trials fits each unit's contribution
(:class:`OutputSensitivity`), and every fit is checked on the plans the search
will use (:func:`check_fit`): where a plan's measured noise exceeds its prediction
by more than DISAGREEMENT, its INT8 units are halved until the unit or pair that
the additive model misses is found and measured alone (:func:`localize`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize

from quantlab.planner.measure import BoundedRun, concurrently, side_by_side

# Bound of the log-gains of the fitted contributions (exp(30) ~ 1e13 either way).
LOG_GAIN_LIMIT = 30.0
# A plan whose measured noise differs from the fit's prediction by more than this factor
# (either way) is a disagreement: reported, and, when the noise is under-predicted,
# localized.
DISAGREEMENT = 2.0
# Random trials may stop once this many in a row were predicted (see group_test's `least`).
PREDICTED_IN_A_ROW = 5
# A check's record names its INT8 units when there are this many or fewer.
NAMED_UNITS = 4


@dataclass
class OutputSensitivity:
    """Each unit's contribution to the output noise when it runs INT8, fitted from trials.

    ``masks[t, i]`` is True when unit ``units[i]`` ran INT8 in trial ``t``, ``nsr[t]``
    the measured output noise-to-signal ratio of that trial, ``contribution`` the
    nonnegative a_i of nsr ~ sum of a_i over the INT8 units. ``checks`` records
    every check of the fit: a plan's predicted and measured noise, and why it ran.
    """

    units: list[str]
    masks: np.ndarray
    nsr: np.ndarray
    contribution: np.ndarray
    # What the fit is pulled to where the trials leave it free (see group_test), and how hard.
    prior: np.ndarray | None = None
    ridge: float = 1e-3
    checks: list[dict] = field(default_factory=list)

    def with_trials(self, masks: np.ndarray, nsr: np.ndarray) -> OutputSensitivity:
        """These trials added (rows of INT8 masks and their measured noise), refitted."""
        masks = np.vstack([self.masks, masks])
        nsr = np.concatenate([self.nsr, nsr])
        prior = self.prior if self.prior is not None else np.zeros(len(self.units))
        return OutputSensitivity(self.units, masks, nsr, _fit(masks, nsr, prior, self.ridge),
                                 prior, self.ridge, self.checks)

    def predicted_nsr(self, int8) -> float:
        """Predicted output noise-to-signal ratio when the units `int8` run INT8."""
        chosen = set(int8)
        return float(sum(a for u, a in zip(self.units, self.contribution, strict=True)
                         if u in chosen))

    def ranking(self) -> list[str]:
        """Units, largest contribution first."""
        return [self.units[i] for i in np.argsort(-self.contribution, kind="stable")]

    def largest_disagreement(self) -> float:
        """The largest factor between a checked plan's measured and predicted noise (1: none)."""
        return max((c["factor"] for c in self.checks), default=1.0)


@dataclass
class Trials:
    """Runs trials: ``measure(precisions, threads)`` is a plan's mean output NSR on the hard
    samples, measured on a session of `threads` intra-op threads (None: all the cores).

    Units left out of a plan run FP32; units in `fixed` (hard pins) keep their
    precision in every trial. `known` (index -> nsr, from an interrupted run) are
    not run again; ``on_trial(index, nsr)`` is called after each trial run. The plans of
    one :meth:`run` are measured side by side (:func:`quantlab.planner.measure.concurrently`).
    """

    measure: Callable[[Mapping[str, str], int | None], float]
    units: list[str]
    fixed: Mapping[str, str] = field(default_factory=dict)
    known: Mapping[int, float] = field(default_factory=dict)
    on_trial: Callable[[int, float], None] | None = None
    count: int = 0
    # Wall seconds of each trial run here (not those taken from `known`): a run's seconds
    # shared evenly among the trials it measured side by side.
    seconds: list[float] = field(default_factory=list)

    def measured(self, nsr: float) -> float:
        """A plan measured elsewhere on the same samples (all-INT8, while bias correction was
        weighed) taken as the next trial: its index is used and recorded, nothing runs."""
        index, self.count = self.count, self.count + 1
        if index in self.known:
            return self.known[index]
        self._record(index, nsr)
        return nsr

    def run(self, masks: np.ndarray) -> np.ndarray:
        """The output NSR of each plan of `masks` (rows: INT8 where True, else FP32)."""
        first, self.count = self.count, self.count + len(masks)
        nsr = np.array([self.known.get(first + t, np.nan) for t in range(len(masks))])
        todo = [t for t in range(len(masks)) if first + t not in self.known]
        plans = [{**{u: "int8" if m else "fp32" for u, m in zip(self.units, masks[t],
                                                               strict=True)}, **self.fixed}
                 for t in todo]
        start = time.perf_counter()
        for t, value in zip(todo, concurrently(self.measure, plans), strict=True):
            nsr[t] = float(value)
            self._record(first + t, nsr[t])
        self.seconds += [(time.perf_counter() - start) / len(todo)] * len(todo) if todo else []
        return nsr

    def _record(self, index: int, nsr: float) -> None:
        if self.on_trial:
            self.on_trial(index, nsr)


def plan_nsr(run: Callable[..., BoundedRun], batch: Mapping[str, np.ndarray],
             references: Mapping[str, np.ndarray]) -> Callable[..., float]:
    """``measure`` for :class:`Trials`: the output NSR of the plan on `batch`, pooled over its
    samples (docs/metrics.md); ``run(precisions, threads=threads)`` gives the plan's bounded
    runs on a session of that many intra-op threads (None: ONNX Runtime's default)."""
    return lambda precisions, threads=None: run(precisions, threads=threads).pooled_nsr(
        batch, references)


def group_test(trials: Trials, count: int = 24, int8_share: float = 0.5, ridge: float = 1e-3,
               seed: int = 0, progress: Callable | None = None,
               prior_nsr: Mapping[str, float] | None = None,
               all_int8: float | None = None, least: int | None = None) -> OutputSensitivity:
    """Output-aware sensitivity from `count` random plans run as trials.

    Each trial runs a random plan (each unit INT8 with probability `int8_share`,
    else FP32) and measures its output noise. Quantization noise of separate
    layers adds in power to first order, so nsr(S) ~ sum of a_i over the INT8
    units S. Each a_i is a prior times a gain, a_i = prior_i * exp(z_i), fitted
    (:func:`_fit`) in relative terms with a small ridge on the log-gains z
    (``ridge * trials``) so that a few trials still give a unique answer. The
    all-INT8 plan is always one of the trials.
    The prior: with `prior_nsr` (unit -> a noise-to-signal ratio: its output noise alone
    in INT8 on a few samples, :func:`quantlab.planner.flow._single_units`, or its local
    INT8 error, :func:`quantlab.planner.measure.local_sqnr`, which takes every unit's
    noise to reach the output alike) each unit's figure scaled by one gain so that the
    priors add up to the all-INT8 trial's noise, else that noise split evenly. With fewer
    trials than units the trials cannot tell most units apart; they then keep one
    common gain, ranked by their own error. An additive fit (nonnegative least
    squares) instead lowered them all by the same amount until the smaller ones sat
    at zero: free in every plan of the front, which then jumped from no INT8 to most
    of it. Units in ``trials.fixed`` get no contribution. Where a gain is wrong
    (a gate or a softmax amplifies one unit's error), :func:`check_fit` finds it.
    `all_int8`: the all-INT8 trial's noise when it already ran (as trial 0 of `trials`,
    ``group_test(trials, 1)``); the other trials are then run after it.
    With `least`, the trials after the first `least` stop once PREDICTED_IN_A_ROW trials in a
    row were each predicted within DISAGREEMENT by the fit of the trials before them: more
    of the same draw would not change the fit
    (:func:`quantlab.planner.flow._least_random_trials` says when).
    """
    units = trials.units
    rng = np.random.default_rng(seed)
    masks = rng.random((count, len(units))) < int8_share
    masks[0] = True
    masks[:, [i for i, u in enumerate(units) if u in trials.fixed]] = False
    nsr = [trials.run(masks[:1])[0] if all_int8 is None else all_int8]
    prior = _prior(units, trials.fixed, prior_nsr or {}, nsr[0])
    in_a_row = 0
    rows = progress(range(1, count)) if progress else range(1, count)
    for t in rows:
        if t < len(nsr):  # measured side by side with an earlier trial
            continue
        if least is not None and t >= least and in_a_row >= PREDICTED_IN_A_ROW:
            getattr(rows, "close", lambda: None)()  # a bar ends here, not at `count`
            break
        for value in trials.run(masks[t:t + _sure_trials(t, count, least, in_a_row)]):
            if least is not None:  # predicted by the fit of the trials before it
                expected = float(masks[len(nsr)] @ _fit(masks[:len(nsr)], np.array(nsr),
                                                        prior, ridge))
                in_a_row = in_a_row + 1 if disagreement(expected, value) <= DISAGREEMENT else 0
            nsr.append(float(value))
    masks, nsr = masks[:len(nsr)], np.array(nsr)
    return OutputSensitivity(units, masks, nsr, _fit(masks, nsr, prior, ridge), prior, ridge)


def _sure_trials(t: int, count: int, least: int | None, in_a_row: int) -> int:
    """How many trials from the `t`-th on run whatever they measure, up to as many as run side
    by side (:func:`quantlab.planner.measure.side_by_side`): group_test may stop before trial
    t + i only once i >= `least` and PREDICTED_IN_A_ROW trials in a row were predicted, which
    the `in_a_row` so far cannot reach in fewer than PREDICTED_IN_A_ROW - in_a_row trials.
    They are then run at once, the same trials as one by one."""
    size = 1
    while size < min(side_by_side(), count - t) and (
            least is None or t + size < least or in_a_row + size < PREDICTED_IN_A_ROW):
        size += 1
    return size


def disagreement(predicted: float, measured: float) -> float:
    """The factor between a measured noise and its prediction, either way (1: they agree;
    a zero against a positive figure: about 1e308)."""
    tiny = np.finfo(np.float64).tiny
    factor = max(measured, tiny) / max(predicted, tiny)
    return float(max(factor, 1.0 / factor))


def check_fit(sensitivity: OutputSensitivity, trials: Trials, masks: np.ndarray,
              why: str) -> OutputSensitivity:
    """Plans `masks` measured against the fit's prediction, recorded, refitted.

    Every plan becomes a trial and a record of ``sensitivity.checks`` (predicted,
    measured, their factor, `why`). The plan whose noise is under-predicted the
    most, when by more than DISAGREEMENT, is then localized (:func:`localize`).
    """
    predicted = masks.astype(np.float64) @ sensitivity.contribution
    measured = trials.run(masks)
    checks = [_check(p, m, why, mask, sensitivity.units) for p, m, mask in
              zip(predicted, measured, masks, strict=True)]
    sensitivity = sensitivity.with_trials(masks, measured)
    sensitivity.checks = [*sensitivity.checks, *checks]
    under = [i for i, c in enumerate(checks) if c["measured"] > DISAGREEMENT * c["predicted"]]
    if under:
        worst = max(under, key=lambda i: checks[i]["factor"])
        sensitivity = localize(sensitivity, trials, masks[worst])
    return sensitivity


def localize(sensitivity: OutputSensitivity, trials: Trials,
             mask: np.ndarray) -> OutputSensitivity:
    """Halve the INT8 units of an under-predicted plan down to the unit the fit misses.

    Adaptive group testing: the plan's INT8 units, in graph order (neighbours
    together: an amplifier and what feeds it), are split in two halves, each run as
    a trial; the search goes on in the half whose measured noise exceeds the
    prediction of the fit before it by the larger amount, while one does by more
    than DISAGREEMENT, down to a single unit (measured alone). Two trials per
    halving: about 2 log2(units) in all. Every trial is kept and refitted, so the
    unit found carries its measured noise, not the prior's guess.
    """
    chosen = np.flatnonzero(mask)
    while len(chosen) > 1:
        halves = np.zeros((2, len(mask)), dtype=bool)
        halves[0, chosen[:len(chosen) // 2]] = True
        halves[1, chosen[len(chosen) // 2:]] = True
        predicted = halves.astype(np.float64) @ sensitivity.contribution
        measured = trials.run(halves)
        checks = [_check(p, m, "localize", h, sensitivity.units)
                  for p, m, h in zip(predicted, measured, halves, strict=True)]
        sensitivity = sensitivity.with_trials(halves, measured)
        sensitivity.checks = [*sensitivity.checks, *checks]
        excess = measured - DISAGREEMENT * predicted
        if excess.max() <= 0:
            break  # neither half alone: the two act together
        chosen = np.flatnonzero(halves[int(np.argmax(excess))])
    return sensitivity


def _check(predicted: float, measured: float, why: str, mask: np.ndarray,
           units: Sequence[str]) -> dict:
    """A check's record; the INT8 units named when they are few (NAMED_UNITS at most)."""
    int8 = [u for u, m in zip(units, mask, strict=True) if m]
    return {"why": why, "int8_units": len(int8), "predicted": float(predicted),
            "measured": float(measured), "factor": disagreement(predicted, measured),
            **({"units": int8} if len(int8) <= NAMED_UNITS else {})}


def _fit(masks: np.ndarray, nsr: np.ndarray, prior: np.ndarray, ridge: float) -> np.ndarray:
    """a = prior * exp(z) with masks @ a ~ nsr in relative terms, z pulled to 0.

    Each trial's residual is divided by its measured noise: trials span orders of
    magnitude (half the units in INT8 against a few), and in absolute terms the
    noisiest ones would decide the fit while the search needs it where the noise
    is small. The pull is ``ridge * trials`` on the log-gains z, bounded to
    [-LOG_GAIN_LIMIT, LOG_GAIN_LIMIT]. Units with a zero prior stay at zero
    (pinned, or no local error); with no positive prior at all, the largest
    trial's noise split evenly over the units some trial ran in INT8 is used. A unit
    some trial ran alone in INT8 takes that trial's noise as its prior
    (:func:`_measured_alone`).
    """
    if not (prior > 0).any():
        ran = masks.any(axis=0)
        prior = np.where(ran, float(nsr.max(initial=0.0)) / max(int(ran.sum()), 1), 0.0)
    prior = _measured_alone(masks, nsr, prior)
    masks = masks.astype(np.float64)
    free = prior > 0
    result = np.zeros(len(prior))
    if not free.any():
        return result
    base, rows = prior[free], masks[:, free]
    scale = np.maximum(nsr, np.finfo(np.float64).tiny)
    weight = np.sqrt(ridge * len(nsr))

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.concatenate([(rows @ (base * np.exp(z)) - nsr) / scale, weight * z])

    def jacobian(z: np.ndarray) -> np.ndarray:
        return np.vstack([rows * (base * np.exp(z)) / scale[:, None],
                          weight * np.eye(len(base))])

    z = optimize.least_squares(residuals, np.zeros(len(base)), jac=jacobian,
                               bounds=(-LOG_GAIN_LIMIT, LOG_GAIN_LIMIT)).x
    result[free] = base * np.exp(z)
    return result


def _measured_alone(masks: np.ndarray, nsr: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """`prior` with each unit that a trial ran alone in INT8 set to that trial's noise (the
    mean of such trials).

    The ridge pulls the fit to the prior; a unit's own measurement is a better
    prior than its local error times the common gain, which is exactly what fails
    where a gate or a softmax amplifies its error (a head with a large common logit
    offset: 80 dB local, 46 dB at the output alone). Pulled to the local guess, one
    trial 4 decades away lost to the ridge and the fit kept the guess.
    """
    alone = masks.sum(axis=1) == 1
    if not alone.any():
        return prior
    result = prior.copy()
    units = np.argmax(masks[alone], axis=1)
    for unit in np.unique(units):
        result[unit] = float(nsr[alone][units == unit].mean())
    return result


def _prior(units: Sequence[str], fixed: Mapping[str, str], prior_nsr: Mapping[str, float],
           all_int8: float) -> np.ndarray:
    """The contributions expected before any trial: each unit's `prior_nsr` times one
    common gain.

    The gain makes the free units' priors add up to `all_int8` (the all-INT8 trial's
    noise); a free unit without a finite figure takes the median of the others'. Zero
    for pinned units, and for all when no figure is known (:func:`_fit` then splits the
    noise evenly).
    """
    free = [u not in fixed for u in units]
    known = [prior_nsr[u] for u, f in zip(units, free, strict=True)
             if f and 0 <= prior_nsr.get(u, np.nan) < np.inf]
    if not known or sum(known) <= 0 or not all_int8 > 0:
        return np.zeros(len(units))
    typical = float(np.median(known))
    figures = np.array([prior_nsr.get(u, typical) if f else 0.0
                        for u, f in zip(units, free, strict=True)], dtype=np.float64)
    figures[~(figures >= 0) | ~np.isfinite(figures)] = typical
    return figures * (all_int8 / figures.sum())
