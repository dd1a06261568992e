"""Evaluations of plans on the evaluation set: the ledger, its checkpoint, and the search.

The search (:func:`search`) evaluates plans of the front on the real INT8 model
(ONNX Runtime integer kernels) and certifies each on held-out data; the ledger
(:class:`Evaluation`) and the checkpoint of an interrupted run live here with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from quantlab import experiment
from quantlab.planner.certify import Certificate, certify_paired, pooled_sqnr
from quantlab.planner.measure import Draw
from quantlab.planner.search import FrontPoint
from quantlab.scoring import Metric, PairedScore

# The least INT8 (share of MACs) an evaluation must be able to add over the certified plan.
MIN_GAIN = 1e-4
# Evaluations the search may spend, past `max_evaluations`, while they are cheap (see
# search) and no plan with INT8 is certified or a plan with more INT8 scored inside the
# budget: on a 416 px YOLOX at a 0.03 F1 drop, 2 evaluations ended on all-FP16 after a
# 86 % plan scored inside the budget uncertified; 6 certified 76 %.
MOST_EVALUATIONS = 8


class Checkpoint(experiment.Checkpoint):
    """What an interrupted plan run already measured (:class:`quantlab.experiment.Checkpoint`):
    its trials (index -> nsr) and evaluations (plan key, :func:`plan_key` ->
    :class:`Evaluation`)."""

    def __init__(self, path: str | os.PathLike, fingerprint: str):
        super().__init__(path, "quantlab.plan-progress", fingerprint, {
            "trials": lambda trials: {int(t): float(v) for t, v in trials.items()},
            "evaluations": lambda evaluations: {str(i): Evaluation.from_json(e)
                                                for i, e in evaluations.items()}})

    @property
    def trials(self) -> dict[int, float]:
        return self.sections["trials"]

    @trials.setter
    def trials(self, trials: dict[int, float]) -> None:
        self.sections["trials"] = trials

    @property
    def evaluations(self) -> dict[str, Evaluation]:
        return self.sections["evaluations"]

    @evaluations.setter
    def evaluations(self, evaluations: dict[str, Evaluation]) -> None:
        self.sections["evaluations"] = evaluations

    def add_trial(self, index: int, nsr: float) -> None:
        """Record one trial (a plan run on the hardest samples)."""
        self.add("trials", index, nsr)

    def add_evaluation(self, key: str, evaluation: Evaluation) -> None:
        """Record one evaluation of the plan `key` (:func:`plan_key`)."""
        self.add("evaluations", key, evaluation)


def plan_key(precisions: Mapping[str, str]) -> str:
    """A plan's key in the checkpoint: a digest of its units' precisions."""
    return hashlib.sha256(json.dumps(sorted(precisions.items())).encode()).hexdigest()[:16]


def fingerprint(model: onnx.ModelProto, *parts) -> str:
    """A hash identifying a plan run: the model and the settings and data descriptions."""
    digest = hashlib.sha256(model.SerializeToString())
    digest.update(json.dumps([str(p) for p in parts]).encode())
    return digest.hexdigest()


def resume_fingerprint(model: onnx.ModelProto, options: Mapping[str, object], metric: str,
                       *parts) -> str:
    """The one fingerprint of resumable work (plan's and sweep's checkpoints): the model,
    `parts` (the data's content digests, what the run derived), every option and the
    `metric`'s code (user_code.metric_code)."""
    from quantlab.user_code import metric_code

    return fingerprint(model, *parts, sorted((key, str(value)) for key, value in options.items()),
                       metric_code(metric))



@dataclass
class Evaluation:
    """One full evaluation of a plan on the real INT8 model: the ledger entry."""

    int8_mac_share: float
    predicted: float
    certificate: Certificate
    seconds: float
    # False for the plan with every unit in FP32: it is the FP32 model, whose outputs are known.
    model_run: bool = True
    # True when judged on a random draw of calibration samples, not on the evaluation
    # set: an all-INT8 plan that fails there beyond doubt (see screen).
    screened: bool = False
    # What the search learnt from it: the law of the metric's shortfall against the
    # predicted noise refitted, and where it aims next (:func:`search`).
    note: str = ""

    @classmethod
    def from_json(cls, data: Mapping) -> Evaluation:
        """An evaluation as a checkpoint holds it (its fields; an older one lacks the last)."""
        certificate = Certificate(**{**data["certificate"],
                                     "interval": tuple(data["certificate"]["interval"])})
        return cls(data["int8_mac_share"], data["predicted"], certificate, data["seconds"],
                   data.get("model_run", True), data.get("screened", False))


def search(front: Callable[[], list[FrontPoint]],
           evaluate: Callable[[FrontPoint], Evaluation | None], max_evaluations: int,
           max_drop: float | None, min_sqnr: float | None,
           cheap: Callable[[float], bool] = lambda seconds: False,
           ) -> tuple[list[tuple[FrontPoint, Evaluation]], int]:
    """Evaluate plans of the front; the (plan, evaluation) pairs in order, and the chosen's
    position among them.

    ``front()`` is the current front (it may change: ``evaluate`` returns None when,
    instead of evaluating a plan, it refitted the noise model, and the search then
    chooses again on the new front, where the plans evaluated keep their outcomes).
    All-INT8 first (kept when certified), then up to `max_evaluations` in all (not
    counting a plan `evaluate` screened out on the calibration samples), each chosen by
    :func:`_next_guess` between the most-INT8 certified plan and the least-INT8 failed
    one, among the plans that add at least MIN_GAIN of the MACs to the certified one (a
    layout front holds plans 5e-6 apart: a whole evaluation is wasted on them). Past
    `max_evaluations`, up to MOST_EVALUATIONS while ``cheap(an evaluation's mean seconds)``
    and the search is not settled: no plan with INT8 certified, or one with more INT8
    than the certified scored inside the budget. Each evaluation's ``note`` says what it
    taught. The chosen plan is the certified one with the most INT8, else the most
    conservative evaluated (the caller then falls back to a plan without INT8). Warns when
    the evaluation set is too small to decide (:func:`warn_undecided` says more once the
    plan is chosen).
    """
    points = front()
    done: list[tuple[FrontPoint, Evaluation]] = []
    while not done:  # all-INT8: the first trial, so its prediction holds
        result = evaluate(points[-1])
        if result is None:
            points = front()
            continue
        done.append((points[-1], result))
        _learn(done, max_drop, min_sqnr)
        if result.certificate.inconclusive:  # said now, not after the other evaluations
            warnings.warn(result.certificate.too_small_message(), stacklevel=3)
    while _more(done, max_evaluations, cheap):
        points, evaluated = _merged(front(), done)
        certified = [i for i, e in evaluated.items() if e.certificate.certified]
        low = max(certified, default=-1)
        high = min((i for i, e in evaluated.items() if i > low and not e.certificate.certified),
                   default=len(points))
        # Plans that add less than MIN_GAIN of the MACs to the certified one are not tried.
        floor = low if low < 0 else max(i for i in range(low, min(high + 1, len(points))) if (
            points[i].int8_mac_share < points[low].int8_mac_share + MIN_GAIN))
        if floor >= high - 1:
            break
        guess = _next_guess(points, evaluated, floor, high, max_drop, min_sqnr)
        result = evaluate(points[guess])
        if result is not None:
            done.append((points[guess], result))
            _learn(done, max_drop, min_sqnr)
    certified = [k for k, (_, e) in enumerate(done) if e.certificate.certified]
    chosen = (max(certified, key=lambda k: done[k][1].int8_mac_share) if certified else
              min(range(len(done)), key=lambda k: done[k][1].int8_mac_share))
    return done, chosen


def _more(done: list[tuple[FrontPoint, Evaluation]], max_evaluations: int,
          cheap: Callable[[float], bool]) -> bool:
    """Whether the search evaluates another plan (see :func:`search`)."""
    evaluations = [e for _, e in done if not e.screened]
    if len(evaluations) < max_evaluations:
        return True
    if len(evaluations) >= MOST_EVALUATIONS or not cheap(
            sum(e.seconds for e in evaluations) / len(evaluations)):
        return False
    best = max((e.int8_mac_share for _, e in done if e.certificate.certified), default=0.0)
    return best == 0.0 or any(e.certificate.near_miss and e.int8_mac_share > best
                              for _, e in done)


def _learn(done: list[tuple[FrontPoint, Evaluation]], max_drop: float | None,
           min_sqnr: float | None) -> None:
    """The last evaluation's ``note`` (:func:`_lesson`), on the evaluations made so far."""
    evaluation = done[-1][1]
    if not evaluation.note:
        evaluation.note = _lesson(evaluation, [e for _, e in done], max_drop, min_sqnr)


def _lesson(evaluation: Evaluation, evaluated: list[Evaluation], max_drop: float | None,
            min_sqnr: float | None) -> str:
    """What one evaluation says: its score against the limit, the verdict, and the law of
    the shortfall against the predicted noise fitted on the evaluations made so far."""
    c = evaluation.certificate
    verdict = ("certified" if c.certified else
               "inside the budget, not certified" if c.near_miss else "outside the budget")
    where = f"{c.samples} calibration samples (screened)" if evaluation.screened else \
        f"{c.samples} samples"
    head = (f"{evaluation.int8_mac_share:.1%} INT8 (predicted noise {evaluation.predicted:.3g}) "
            f"scored {c.value:.4g} against the limit {c.limit:.4g} on {where}, margin interval "
            f"[{c.interval[0]:+.3g}, {c.interval[1]:+.3g}]: {verdict}")
    if min_sqnr is not None:
        return head
    power = _shortfall_power([(e.predicted, _shortfall(e, None)) for e in evaluated])
    aim = allowed_noise(evaluation, evaluated, max_drop, None)
    law = f"; drop ~ noise^{power:.2f} fitted on {len(evaluated)} evaluation(s)"
    return head + law + ("" if aim is None else
                         f", the budget's drop expected at predicted noise {aim:.3g}")


def unreachable(first: Evaluation, max_drop: float | None) -> str:
    """A message when the evaluation set is too small to certify any plan with INT8, known
    from all-INT8's evaluation `first`: the largest drop it could certify
    (:func:`_certifiable_drop`) is under a tenth of the budget. Says how many samples would
    certify a plan at half the budget. '' otherwise."""
    c = first.certificate
    drop = c.reference - c.value
    spread = max(c.value - c.limit - c.interval[0], 0.0)
    if max_drop is None or first.screened or c.certified or drop <= 0 or spread <= 0:
        return ""
    if _certifiable_drop(max_drop, drop, spread) >= max_drop / 10:
        return ""
    half = max_drop / 2
    needed = int(np.ceil(c.samples * (spread * np.sqrt(half / drop) / half) ** 2))
    return (f"the evaluation set is too small to certify a plan with INT8: all-INT8's margin "
            f"interval on its {c.samples} samples is {spread:.3g} below its score, so a plan "
            f"could be certified only with a drop under {max_drop / 10:.3g}, a tenth of the "
            f"budget {max_drop:g}. About {needed} samples would certify a plan at half the "
            "budget: pass them with --eval, or allow a larger --max-drop.")


def _merged(points: list[FrontPoint], done: list[tuple[FrontPoint, Evaluation]]
            ) -> tuple[list[FrontPoint], dict[int, Evaluation]]:
    """The front with every evaluated plan in it (by INT8 share; a front plan of the same
    share gives way to it), and their evaluations by index."""
    shares = {p.int8_mac_share for p, _ in done}
    merged = sorted([p for p in points if p.int8_mac_share not in shares] +
                    [p for p, _ in done], key=lambda p: (p.int8_mac_share, p.predicted))
    index = {id(p): i for i, p in enumerate(merged)}
    return merged, {index[id(p)]: e for p, e in done}


def warn_undecided(evaluations: list[Evaluation], chosen: Evaluation) -> None:
    """Warn when a plan with more INT8 than `chosen` (the plan written) scored inside the
    budget but could not be certified: what it scored and what the data lack. Not when
    the all-INT8 plan (the first evaluated) was itself inconclusive: said already."""
    if evaluations[0].certificate.inconclusive:
        return
    undecided = [e for e in evaluations if e.certificate.inconclusive and
                 e.int8_mac_share > chosen.int8_mac_share]
    if undecided:
        best = max(undecided, key=lambda e: e.int8_mac_share)
        certificate = best.certificate
        # Inconclusive: its interval straddles the limit, whichever side its score is on.
        scored = (f"scored {certificate.value:.4g} (limit {certificate.limit:.4g}) but could "
                  "not be certified" if certificate.value >= certificate.limit else
                  f"scored {certificate.value:.4g}, below the limit {certificate.limit:.4g}, "
                  "and could be neither certified nor ruled out")
        warnings.warn(f"the plan with {best.int8_mac_share:.1%} of MACs in INT8 {scored}: "
                      f"{certificate.too_small_message()} The plan "
                      f"written keeps {chosen.int8_mac_share:.1%} in INT8 "
                      f"({(best.int8_mac_share - chosen.int8_mac_share) * 100:.2g} "
                      "points of the MACs fewer).",
                      stacklevel=4)


def screen(point: FrontPoint, run: Callable, draw: Draw, metric: Metric,
           max_drop: float | None, min_sqnr: float | None,
           resamples: int) -> Evaluation | None:
    """The all-INT8 `point` judged on calibration samples, if it fails there beyond doubt.

    `draw` comes from the pass that finds the hardest samples (whose drop they would
    overstate): for output SQNR, every calibration sample's noise and signal energies
    of this plan, measured in that pass; for another metric of outputs, a random draw
    of samples and FP32's outputs on them, on which `run` (the plan's Q/DQ model, in
    bounded runs) runs now. It fails beyond doubt when the whole bootstrap interval of
    its margin lies below the limit: the evaluation-set pass it would take is spared,
    and the search's law is fitted on this measurement instead. Otherwise None: it is
    evaluated as any other plan. Only for metrics that read outputs alone: a task
    metric needs labels the calibration data lack.
    """
    start = time.perf_counter()
    if draw.energies is not None:
        score = pooled_sqnr(*draw.energies)
        certificate = certify_paired(metric.name, lambda pick: (score(pick), np.inf),
                                     len(draw.energies[0]), floor=min_sqnr,
                                     resamples=resamples)
    else:
        known = draw.outputs is not None and draw.outputs_of == plan_key(point.precisions)
        outputs = draw.outputs if known else run(draw.inputs)
        scored = PairedScore(metric, resamples=resamples, what="random calibration samples")
        scored.update(outputs, draw.references)
        certificate = scored.certificate(max_drop, min_sqnr)
    if certificate.interval[1] >= 0:
        return None
    return Evaluation(point.int8_mac_share, point.predicted, certificate,
                      time.perf_counter() - start, model_run=False, screened=True)


def _next_guess(points: list[FrontPoint], evaluated: Mapping[int, Evaluation], low: int,
                high: int, max_drop: float | None, min_sqnr: float | None) -> int:
    """The front index to evaluate next, strictly between `low` and `high`.

    The metric's shortfall is taken to grow as a power of the predicted noise
    (:func:`_shortfall_power`; proportional for an SQNR floor), its factor fitted on
    the evaluation nearest the bracket's middle (re-fitting, not assuming, AIMET's
    monotone curve); bisection when that guess leaves the open interval or no plan
    with INT8 is predicted to certify (the plan without INT8 is the fallback's, made
    without a model run). When the plan at `high` scored inside the budget but was not
    certified (its bootstrap interval reaches below the limit), the factor is fitted on
    it. Where the aim falls outside the bracket, the guess bisects it by INT8 share: one
    step down the front at a time spent 3 of 8 evaluations on the layout detector's plans
    of 51.5 %, 48.4 % and 48.2 % INT8, each scoring the limit (98.0 of a 2-point AP50
    budget, uncertifiable on 16 pages), with 30.3 % certified below them. The aim is the
    largest shortfall that can still be certified, the budget less the fitted evaluation's
    spread (:func:`_certifiable_drop`; for a floor, the
    floor raised by the spread in dB), where that evaluation was near the budget: inside
    it, or a plan the search aimed at it. Only all-INT8's spread, measured wherever
    all-INT8 falls, is not used: the first aim is the budget itself. On the layout
    detector's second page seed at a 30 dB floor, the plan aimed at the floor scored
    28.81 dB (spread 0.65 dB); aimed at the floor again, the last evaluation scored
    30.10 dB, too close to certify, and the plan fell back to FP32. Aimed at 30.65 dB,
    51.2 % of the MACs in INT8 scored 31.84 dB and were certified.
    """
    above = evaluated.get(high)
    inside = above is not None and above.certificate.value >= above.certificate.limit
    index = high if inside else min(evaluated, key=lambda i: abs(i - (low + high) / 2))
    guess = _middle_share(points, low, high)
    nearest, spread = evaluated[index], 0.0
    # The spread of a plan near the budget: inside it, or aimed at it (all plans but the
    # last, all-INT8, which is evaluated first whatever the budget).
    if inside or index < len(points) - 1:
        c = nearest.certificate
        spread = max(c.value - c.limit - c.interval[0], 0.0)
    budget = allowed_noise(nearest, evaluated.values(), max_drop, min_sqnr, spread)
    if budget is not None:
        fitting = [i for i, p in enumerate(points)
                   if p.predicted <= budget and p.int8_mac_share > 0]
        if fitting and low < fitting[-1] < high:
            guess = fitting[-1]
    return min(max(guess, low + 1), high - 1)


def _middle_share(points: list[FrontPoint], low: int, high: int) -> int:
    """The front index strictly between `low` and `high` whose INT8 share is nearest the
    middle of theirs (-1: no INT8; len(points): the most INT8): a bisection by share, not by
    position (a front is dense where many small units differ)."""
    shares = [p.int8_mac_share for p in points]
    middle = ((shares[low] if low >= 0 else 0.0) + shares[min(high, len(points) - 1)]) / 2
    # Never the plan without INT8 (the fallback's); of two as near, the one with less INT8
    # (the bisection is asked for where the law aims below the bracket or has no aim).
    inside = [i for i in range(low + 1, high) if shares[i] > 0]
    return min(inside, key=lambda i: (abs(shares[i] - middle), i)) if inside else low + 1


def allowed_noise(nearest: Evaluation, evaluated: Iterable[Evaluation], max_drop: float | None,
                  min_sqnr: float | None, spread: float = 0.0) -> float | None:
    """The predicted noise at which a plan is expected to score the largest shortfall that
    can still be certified, extrapolated from the evaluation `nearest` (see
    :func:`_next_guess`: the shortfall a power of the noise, :func:`_shortfall_power`
    fitted on `evaluated`; `spread`, the bootstrap spread measured near the budget); None
    when `nearest` has no shortfall or no predicted noise to scale."""
    measured = _shortfall(nearest, min_sqnr)
    if not (measured > 0 and nearest.predicted > 0):
        return None
    allowed = (10 ** (-(min_sqnr + spread) / 10) if min_sqnr is not None
               else _certifiable_drop(max_drop, measured, spread))
    power = 1.0 if min_sqnr is not None else _shortfall_power(
        [(e.predicted, _shortfall(e, min_sqnr)) for e in evaluated])
    return nearest.predicted * (allowed / measured) ** (1.0 / power)


def _shortfall(evaluation: Evaluation, min_sqnr: float | None) -> float:
    """The noise power for an SQNR floor (dB -> NSR), else the metric's drop from FP32."""
    c = evaluation.certificate
    return 10 ** (-c.value / 10) if min_sqnr is not None else c.reference - c.value


def _certifiable_drop(budget: float, drop: float, spread: float) -> float:
    """The largest drop d that a plan can show and still be certified within `budget`.

    Certification needs the margin's lower end, ``budget - d - spread(d)``, at or
    above 0. A drop is made of changed predictions (boxes, labels), and the
    bootstrap spread of a count grows as its square root, so the spread measured
    at `drop` is scaled as ``spread * sqrt(d / drop)``; d solves
    ``d + spread * sqrt(d / drop) = budget`` (a quadratic in sqrt(d)). The whole
    budget when there is no spread, or no drop to scale it from.
    """
    if drop <= 0 or spread <= 0:
        return budget
    a = spread / np.sqrt(drop)
    return float(((np.sqrt(a * a + 4 * budget) - a) / 2) ** 2)


def _shortfall_power(measured: list[tuple[float, float]]) -> float:
    """The power p of ``drop = k * noise ** p`` through the evaluations with a drop.

    From the two with the largest drops and distinct predicted noise, clamped to
    [0.5, 1]; 0.5 with fewer. Power 1 is a metric that degrades with the noise's
    power (SQNR-like), 0.5 one that degrades with its amplitude, as thresholded
    metrics do near their thresholds (boxes kept or lost, argmax flips): the
    cautious assumption when extrapolating down from a single failure.
    """
    found = sorted((d, n) for n, d in measured if d > 0 and n > 0)[::-1]
    for (d1, n1), (d2, n2) in zip(found, found[1:], strict=False):
        if n1 != n2:
            return float(np.clip(np.log(d1 / d2) / np.log(n1 / n2), 0.5, 1.0))
    return 0.5
