"""Trials: plans run on the hardest samples, the additive noise model fitted from them, and
its check; the planner's fifth stage (:func:`noise_model` -> :class:`NoiseModel`).

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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from quantlab.planner.context import Context, PlanSettings
from quantlab.planner.evaluate import (
    Checkpoint,
    Evaluation,
    Evaluator,
    allowed_noise,
    unreachable,
)
from quantlab.planner.hard_samples import HardSamples
from quantlab.planner.measure import (
    BoundedRun,
    FromCuts,
    Runner,
    all_int8_nsr,
    choose_cuts,
    concurrently,
    fp16_contributions,
    side_by_side,
    unit_starts,
)
from quantlab.planner.prepare import Prepared
from quantlab.planner.rules import Rules
from quantlab.planner.scales import Calibrated
from quantlab.planner.search import FrontPoint, front, most_int8

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
    in INT8 on a few samples, :func:`single_units`, or its local
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
    (:func:`least_random_trials` says when).
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
    # scipy.optimize takes 0.3 s to import: only the planner's solves need it.
    from scipy import optimize

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


# Front plans measured per round of checks before any evaluation.
FRONT_CHECKS = 4
# Times the noise model may be refitted during the search, when a plan it chose for an
# evaluation measured noisier than predicted on the hardest samples.
MAX_REFITS = 3
# The share of `trials` that run at least when the budget lies far below their noise (see
# least_random_trials).
FAR_TRIALS_SHARE = 0.25
# The single-unit measurements (single_units) run each free unit alone on a few of the
# hardest samples: as many sample passes in all as this many trials, on at least
# SINGLES_LEAST_SAMPLES samples.
SINGLES_COST_IN_TRIALS = 4
SINGLES_LEAST_SAMPLES = 2


class Fit(NamedTuple):
    """A noise model's contributions per unit (INT8 and FP16) and the front they give."""

    contribution: dict[str, float]
    fp16_contribution: dict[str, float]
    front: list[FrontPoint]


def _contributions(rules: Rules, local: Mapping, sensitivity: OutputSensitivity
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """Each unit's fitted INT8 contribution and its FP16 one."""
    contribution = dict(zip(sensitivity.units, sensitivity.contribution, strict=True))
    return contribution, fp16_contributions(contribution, local, rules.fixed)


def fitted(rules: Rules, local: Mapping, sensitivity: OutputSensitivity,
           high_precision: str) -> Fit:
    """The noise model's contributions per unit and the front they give (`local`: each
    unit's local SQNR per precision, for the FP16 contributions)."""
    contribution, fp16_contribution = _contributions(rules, local, sensitivity)
    return Fit(contribution, fp16_contribution, front(
        rules.units, rules.allowed, contribution, high_precision=high_precision,
        fp16_contribution=fp16_contribution))


def check_front(context: Context, rules: Rules, local: Mapping,
                sensitivity: OutputSensitivity, trials: Trials
                ) -> tuple[OutputSensitivity, Fit]:
    """Up to ``verify_rounds`` rounds: FRONT_CHECKS plans of the front measured against the
    fit (:func:`check_fit`) and refitted, until every one is within DISAGREEMENT of its
    prediction. Random half-and-half trials cannot tell many small contributors apart, and
    a fit that calls them free puts them all in INT8. Returns the refitted noise model and
    its :func:`fitted` figures and front."""
    high_precision = context.settings.high_precision
    fit = fitted(rules, local, sensitivity, high_precision)
    for _ in context.step(range(context.settings.verify_rounds), desc="front checks"):
        masks = front_masks(fit.front, sensitivity)
        if not len(masks):
            break
        checked = len(sensitivity.checks)
        sensitivity = check_fit(sensitivity, trials, masks, "front check")
        fit = fitted(rules, local, sensitivity, high_precision)
        if all(c["factor"] <= DISAGREEMENT for c in sensitivity.checks[checked:]):
            break
    return sensitivity, fit


def front_masks(points: list[FrontPoint], sensitivity: OutputSensitivity,
                count: int = FRONT_CHECKS) -> np.ndarray:
    """INT8 masks of up to `count` front plans no trial ran yet, evenly spread, strictly
    between no INT8 and all INT8."""
    seen = {mask.tobytes() for mask in sensitivity.masks}
    masks = []
    for point in points:
        mask = np.array([point.precisions.get(u) == "int8" for u in sensitivity.units])
        if mask.any() and not mask.all() and mask.tobytes() not in seen:
            seen.add(mask.tobytes())
            masks.append(mask)
    picked = np.unique(np.linspace(0, len(masks) - 1, min(count, len(masks))).astype(int))
    return np.array([masks[i] for i in picked]).reshape(-1, len(sensitivity.units))


class ModelFit:
    """The noise model during the search: its fit, the front it gives, and its check before
    each evaluation (:meth:`verified`); the search's :class:`quantlab.planner.evaluate.NoiseFit`."""

    def __init__(self, rules: Rules, local: Mapping, sensitivity: OutputSensitivity,
                 trials: Trials, high_precision: str, fit: Fit | None = None):
        self.rules, self.local, self.trials = rules, local, trials
        self.sensitivity, self.high_precision = sensitivity, high_precision
        self._fitted = fit  # of `sensitivity`, when made already
        self.refits = 0

    @property
    def fitted(self) -> Fit:
        """The fit's contributions and its front, made when first asked for (a hundred MILPs:
        2 s on a 100-unit detector)."""
        if self._fitted is None:
            self._fitted = fitted(self.rules, self.local, self.sensitivity, self.high_precision)
        return self._fitted

    def front(self) -> list[FrontPoint]:
        return self.fitted.front

    def fp16_noise(self) -> float:
        """The predicted output noise of every unit in FP16."""
        return sum(self.fitted.fp16_contribution.values())

    def most_int8(self) -> FrontPoint:
        """The front's last plan, without the rest of the front."""
        contribution, fp16_contribution = _contributions(self.rules, self.local,
                                                         self.sensitivity)
        return most_int8(self.rules.units, self.rules.allowed, contribution,
                         self.high_precision, fp16_contribution)

    def mask(self, point: FrontPoint) -> np.ndarray:
        return np.array([point.precisions.get(u) == "int8" for u in self.sensitivity.units])

    def verified(self, point: FrontPoint) -> bool:
        """False when `point`, run as a trial (unless one ran it), was noisier than predicted
        by more than DISAGREEMENT: the noise model was then localized and refitted, and the
        front changed (at most MAX_REFITS times; after that, True)."""
        mask = self.mask(point)
        seen = {m.tobytes() for m in self.sensitivity.masks}
        if self.refits >= MAX_REFITS or not mask.any() or mask.tobytes() in seen:
            return True
        checked = len(self.sensitivity.checks)
        self.sensitivity = check_fit(self.sensitivity, self.trials, mask[None],
                                     "before evaluation")
        if self.sensitivity.checks[checked]["measured"] <= \
                DISAGREEMENT * self.sensitivity.checks[checked]["predicted"]:
            return True
        self.refits += 1
        self._fitted = None
        return False


@dataclass
class NoiseModel:
    """The planner's fifth record: all-INT8 judged first (`first`) and, where it did not
    certify, the noise model of the trials (single units alone, random trials, front
    checks); the evaluator, which goes on with the search."""

    model_fit: ModelFit
    first: Evaluation
    evaluator: Evaluator
    trials: Trials
    # Each free unit's output noise alone in INT8 (single_units), on how many samples.
    alone: dict[str, float] = field(default_factory=dict)
    alone_samples: int = 0
    random_trials: int = 0

    def trial_cost(self, fp32_seconds: float) -> dict:
        """Median seconds of a trial (building its Q/DQ model and session, one run over the
        hardest samples; trials measured side by side share their run's seconds) against one
        warm FP32 pass over the same samples (`fp32_seconds`); how many of the trials were
        random plans (all-INT8 included); how many units were measured alone, on how many
        samples."""
        if not self.trials.seconds:
            return {}
        median = float(np.median(self.trials.seconds))
        return {"trials_run": len(self.trials.seconds), "random_trials": self.random_trials,
                "single_units": len(self.alone), "single_unit_samples": self.alone_samples,
                "trial_seconds_median": median,
                "fp32_pass_seconds": fp32_seconds,
                "ratio": median / fp32_seconds if fp32_seconds > 0 else float("inf")}


def noise_model(prepared: Prepared, rules: Rules, calibrated: Calibrated, hard: HardSamples,
                checkpoint: Checkpoint | None) -> NoiseModel:
    """All-INT8 first ("all-INT8 first"), then, where it did not certify, the single units,
    the trials and the front checks. `checkpoint` (an interrupted run of the same plan)
    skips the trials and evaluations it holds."""
    context, runner, local = prepared.context, calibrated.runner, hard.local
    settings = context.settings
    trials = Trials(plan_nsr(runner, hard.inputs, hard.references),
                    [u.name for u in rules.units], rules.fixed,
                    checkpoint.trials if checkpoint else {},
                    checkpoint.add_trial if checkpoint else None)
    noise = _all_int8_first(prepared, rules, calibrated, hard, trials, checkpoint)
    _weigh_repair_on_hard(prepared, rules, hard, float(noise.model_fit.sensitivity.nsr[0]))
    if noise.first.certificate.certified:
        return noise
    with context.phases("single units"):
        noise.alone, noise.alone_samples = single_units(context, runner, rules, hard.inputs,
                                                        hard.references)
    with context.phases("trials"):
        sensitivity = group_test(
            trials, settings.trials, progress=lambda r: context.step(r, desc="trials"),
            prior_nsr=noise.alone, all_int8=float(noise.model_fit.sensitivity.nsr[0]),
            least=least_random_trials(settings, noise.first))
    noise.random_trials = len(sensitivity.nsr)
    with context.phases("front checks"):
        sensitivity, fit = check_front(context, rules, local, sensitivity, trials)
    noise.model_fit = ModelFit(rules, local, sensitivity, trials, settings.high_precision, fit)
    return noise


def _all_int8_first(prepared: Prepared, rules: Rules, calibrated: Calibrated,
                    hard: HardSamples, trials: Trials, checkpoint: Checkpoint | None
                    ) -> NoiseModel:
    """All-INT8, the search's first plan in any case, judged before the other trials: a plan
    whose all-INT8 certifies needs none of them (their fit could not change it). The noise
    model of that one trial, with all-INT8's evaluation and the evaluator that made it."""
    context, local = prepared.context, hard.local
    local_nsr = {u: 10.0 ** (-f["int8"] / 10.0) for u, f in local.items() if "int8" in f}
    evaluator = Evaluator(context, calibrated.runner, checkpoint)
    with context.phases("all-INT8 first"):
        # Bias correction measured it already (the same plan, samples and references).
        record = hard.shift_record
        known = None if record is None else trials.measured(record[
            "hard_nsr_after" if record["chosen"] else "hard_nsr_before"])
        model_fit = ModelFit(rules, local,
                             group_test(trials, 1, prior_nsr=local_nsr, all_int8=known),
                             trials, context.settings.high_precision)
        first = evaluator.first(model_fit.most_int8(), hard.drawn)
    hard.drawn = None  # the screen's samples, read by all-INT8 alone
    message = unreachable(first, context.settings.budget)
    if message:  # before the trials, which could not change it
        warnings.warn(message, stacklevel=4)
    return NoiseModel(model_fit, first, evaluator, trials)


def _weigh_repair_on_hard(prepared: Prepared, rules: Rules, hard: HardSamples,
                          after: float) -> None:
    """The chosen repair's effect where the pins' is measured, on the hardest samples: the
    unrepaired model's all-INT8 noise (`after`: the repaired one's) in its record."""
    if prepared.repair == "none":
        return
    fixed_nodes = {n: rules.fixed[u.name] for u in rules.units if u.name in rules.fixed
                   for n in u.nodes}
    before = all_int8_nsr({"none": prepared.original}, hard.inputs, hard.references,
                          prepared.context.runs, fixed_nodes)
    prepared.repair_records[prepared.repair].update(hard_nsr_before=before["none"],
                                                    hard_nsr_after=after)


def least_random_trials(settings: PlanSettings, first: Evaluation) -> int | None:
    """None (all ``settings.trials`` random trials run), or, when the budget lies far below
    the noise they measure or all-INT8 itself scored inside the budget (uncertified), the
    least number that run before they may stop
    (:func:`group_test`'s `least`: once PREDICTED_IN_A_ROW in a
    row were predicted by the fit of those before): a quarter of them, at least 1.

    A random trial runs about half the units in INT8, so its noise is about half the
    all-INT8 plan's. When the noise the budget allows, extrapolated from all-INT8's
    evaluation `first` (:func:`quantlab.planner.evaluate.allowed_noise`), is below that
    by more than DISAGREEMENT, the trials describe plans noisier than any the search will
    weigh. Measured with the local-error prior (before :func:`single_units`): where the
    noise is spread evenly over the units (the layout detector, 10 agreement points down
    at a 2-point budget), the fit predicted them after a few and 24 gave 5.9 % INT8 in
    118 s where 6 gave 18.0 % in 66-90 s: the front checks, which measure the front's own
    plans, do the fitting there. Where a few units wreck all-INT8 (a 640 px SSDlite at
    0.8 dB against a 20 dB floor), a draw that left them out was over-predicted 17-358x
    until the fit had seen several: 6 trials gave 70.6 % where 24 gave 73.6 %, so they go
    on while they surprise the fit (19 ran, 73.6 %; with the single-unit prior the fit
    predicts them from the start, 6 run, 73.7 %). Near the budget (a floor all-INT8 misses
    by a few dB) every trial counts: 6 instead of 24 lost 2.3 % of the MACs on a
    face-landmark net.
    """
    least = max(1, round(settings.trials * FAR_TRIALS_SHARE))
    if first.certificate.near_miss:
        # All-INT8 scored inside the budget: the plans that matter keep all but a few units
        # in INT8, which the single-unit figures order; random half-and-half trials describe
        # plans twice as noisy as any the search weighs (nudenet's YOLOv8n at a 0.03 F1 drop:
        # all-INT8 0.974 against 0.97, 24 trials and 8 front checks were 450 of 880 s).
        return least
    allowed = allowed_noise(first, [first], settings.budget)
    if allowed is None or allowed * DISAGREEMENT >= first.predicted / 2:
        return None
    return least


def single_unit_samples(length: int, units: int) -> int:
    """How many of `length` hardest samples the single-unit step runs `units` units on: as
    many sample passes in all as SINGLES_COST_IN_TRIALS trials over all of them, at least
    SINGLES_LEAST_SAMPLES."""
    return min(length, max(SINGLES_LEAST_SAMPLES,
                           round(length * SINGLES_COST_IN_TRIALS / max(1, units))))


def single_units(context: Context, runner: Runner, rules: Rules,
                  hard: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray]
                  ) -> tuple[dict[str, float], int]:
    """Each free unit's output noise alone in INT8 (every other unit FP32, pins kept) on the
    first few of the `hard` samples (FP32's outputs on them: `references`): the trials'
    prior (:func:`group_test`'s `prior_nsr`).

    How much a unit's local error is amplified on its way to the outputs differs from unit
    to unit: on the layout detector the local error ranked the units by their noise alone
    with a rank correlation of 0.43, and the fit of 16 random trials did no better. Alone on
    2 of its 16 hardest pages the rank correlation with the same figure on all 16 was 0.96.
    The samples: :func:`single_unit_samples`. Returns the figures and how many samples
    they were measured on.
    """
    free = [u.name for u in rules.units if u.name not in rules.fixed]
    length = context.calibration.length(hard)
    count = single_unit_samples(length, len(free))
    batch = hard if count == length else context.calibration.slice(hard, 0, count)
    references = {name: value[:count] for name, value in references.items()}
    measure = plan_nsr(runner, batch, references)
    others = {u.name: rules.fixed.get(u.name, "fp32") for u in rules.units}
    starts = unit_starts(runner.g, rules.units)
    cuts = choose_cuts(runner.g, starts, {u.name: u.macs for u in rules.units},
                       runner.g.sample_bytes({name: np.shape(value) for name, value in
                                              context.calibration.slice(batch, 0, 1).items()}),
                       count)
    tails = FromCuts(runner.g, runner.quantized, context.runs, others, cuts, batch) if cuts \
        else None

    def alone(name: str, threads: int | None) -> float:
        position = max((p for p in cuts if p <= starts[name]), default=None)
        precisions = {**others, name: "int8"}
        return measure(precisions, threads) if position is None else \
            tails.nsr(precisions, position, references, threads)

    figures = concurrently(alone, free)
    return {name: next(figures) for name in context.step(free, desc="single units")}, count
