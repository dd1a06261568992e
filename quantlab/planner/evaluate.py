"""Evaluations of plans on the evaluation set: the evaluator, the ledger, its checkpoint, and
the search.

The :class:`Evaluator` runs plans on the real INT8 model (ONNX Runtime integer kernels)
over the evaluation set and certifies each on held-out data; the search
(:func:`search`, :func:`evaluate_front` with the fallback) chooses the plans of the front
it runs; the ledger (:class:`Evaluation`) and the checkpoint of an interrupted run live
here with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx

from quantlab.evaluation.scoring import Metric, PairedScore, Reference
from quantlab.experiments import experiment
from quantlab.planner.certify import (
    Budget,
    Certificate,
    certifiable_drop,
    certify_paired,
    floor_message,
    pooled_sqnr,
)
from quantlab.planner.context import Context
from quantlab.planner.measure import Draw, Runner
from quantlab.planner.rules import Rules
from quantlab.planner.search import FrontPoint, fallback_precision

# The least INT8 (share of MACs) an evaluation must be able to add over the certified plan.
MIN_GAIN = 1e-4
# Evaluations the search may spend, past `max_evaluations`, while they are cheap (see
# search) and no plan with INT8 is certified or a plan with more INT8 scored inside the
# budget: on a 416 px YOLOX at a 0.03 F1 drop, 2 evaluations ended on all-FP16 after a
# 86 % plan scored inside the budget uncertified; 6 certified 76 %.
MOST_EVALUATIONS = 8
# An evaluation is cheap (the search may spend more, MOST_EVALUATIONS) when it takes at most
# this many FP32 passes over the evaluation set plus this many seconds.
CHEAP_PASSES = 4
CHEAP_SECONDS = 1.0


class Checkpoint(experiment.Checkpoint):
    """What an interrupted plan run already measured
    (:class:`quantlab.experiments.experiment.Checkpoint`): its trials (index -> nsr) and evaluations
    (plan key, :func:`plan_key` -> :class:`Evaluation`)."""

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
    """A hash identifying a resumable run (a plan's or a sweep's checkpoint: api.run_fingerprint):
    the model and the settings and data descriptions."""
    digest = hashlib.sha256(model.SerializeToString())
    digest.update(json.dumps([str(p) for p in parts]).encode())
    return digest.hexdigest()


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
           budget: Budget, cheap: Callable[[float], bool] = lambda seconds: False,
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
        _learn(done, budget)
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
        guess = _next_guess(points, evaluated, floor, high, budget)
        result = evaluate(points[guess])
        if result is not None:
            done.append((points[guess], result))
            _learn(done, budget)
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


def _learn(done: list[tuple[FrontPoint, Evaluation]], budget: Budget) -> None:
    """The last evaluation's ``note`` (:func:`_lesson`), on the evaluations made so far."""
    evaluation = done[-1][1]
    if not evaluation.note:
        evaluation.note = _lesson(evaluation, [e for _, e in done], budget)


def _lesson(evaluation: Evaluation, evaluated: list[Evaluation], budget: Budget) -> str:
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
    if budget.floor is not None:
        return head
    power = _shortfall_power([(e.predicted, budget.shortfall(e.certificate)) for e in evaluated])
    aim = allowed_noise(evaluation, evaluated, budget)
    law = f"; drop ~ noise^{power:.2f} fitted on {len(evaluated)} evaluation(s)"
    return head + law + ("" if aim is None else
                         f", the budget's drop expected at predicted noise {aim:.3g}")


def unreachable(first: Evaluation, budget: Budget) -> str:
    """A message when the evaluation set is too small to certify any plan with INT8, known
    from all-INT8's evaluation `first`: the largest drop it could certify
    (:func:`quantlab.planner.certify.certifiable_drop`) is under a tenth of the budget. Says
    how many samples would certify a plan at half the budget. '' otherwise."""
    c, max_drop = first.certificate, budget.drop
    drop = c.reference - c.value
    spread = max(budget.margin(c.value, c.reference) - c.interval[0], 0.0)
    if max_drop is None or first.screened or c.certified or drop <= 0 or spread <= 0:
        return ""
    if certifiable_drop(max_drop, drop, spread) >= max_drop / 10:
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


def screen(point: FrontPoint, run: Callable, draw: Draw, metric: Metric, budget: Budget,
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
                                     len(draw.energies[0]), floor=budget.floor,
                                     resamples=resamples)
    else:
        known = draw.outputs is not None and draw.outputs_of == plan_key(point.precisions)
        outputs = draw.outputs if known else run(draw.inputs)
        scored = PairedScore(metric, resamples=resamples, what="random calibration samples")
        scored.update(outputs, draw.references)
        certificate = budget.certificate(scored)
    if certificate.interval[1] >= 0:
        return None
    return Evaluation(point.int8_mac_share, point.predicted, certificate,
                      time.perf_counter() - start, model_run=False, screened=True)


def _next_guess(points: list[FrontPoint], evaluated: Mapping[int, Evaluation], low: int,
                high: int, budget: Budget) -> int:
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
    spread (:meth:`Budget.allowed_shortfall`; for a floor, the
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
        spread = max(budget.margin(c.value, c.reference) - c.interval[0], 0.0)
    aim = allowed_noise(nearest, evaluated.values(), budget, spread)
    if aim is not None:
        fitting = [i for i, p in enumerate(points)
                   if p.predicted <= aim and p.int8_mac_share > 0]
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


def allowed_noise(nearest: Evaluation, evaluated: Iterable[Evaluation], budget: Budget,
                  spread: float = 0.0) -> float | None:
    """The predicted noise at which a plan is expected to score the largest shortfall that
    can still be certified, extrapolated from the evaluation `nearest` (see
    :func:`_next_guess`: the shortfall a power of the noise, :func:`_shortfall_power`
    fitted on `evaluated`; `spread`, the bootstrap spread measured near the budget); None
    when `nearest` has no shortfall or no predicted noise to scale."""
    measured = budget.shortfall(nearest.certificate)
    if not (measured > 0 and nearest.predicted > 0):
        return None
    allowed = budget.allowed_shortfall(measured, spread)
    power = 1.0 if budget.floor is not None else _shortfall_power(
        [(e.predicted, budget.shortfall(e.certificate)) for e in evaluated])
    return nearest.predicted * (allowed / measured) ** (1.0 / power)


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


class Evaluator:
    """Whole evaluation-set passes of plans against FP32's outputs, each kept in the checkpoint.

    FP32's pass runs once, with the first plan evaluated: its records (:class:`Reference`)
    and, for a metric that reads them, its outputs. A plan's outputs stream through its
    :class:`PairedScore` batch by batch and are dropped once recorded: a user's two-part
    metric decodes each sample once per evaluation, and the bootstrap reduces records.
    """

    def __init__(self, context: Context, runner: Runner, checkpoint: Checkpoint | None):
        self.context, self.runner, self.checkpoint = context, runner, checkpoint
        self.reference: Reference | None = None
        self.fp32_outputs: list[dict[str, np.ndarray]] = []
        self.fp32_seconds = 0.0  # FP32's pass over the evaluation set

    def cheap(self, seconds: float) -> bool:
        """Whether an evaluation taking `seconds` is cheap: at most CHEAP_PASSES FP32 passes
        over the evaluation set, plus CHEAP_SECONDS to build the plan's model and session.
        A metric decoded once per sample keeps it so (a YOLOX's F1 called on every
        bootstrap resample took 20-40 forward passes' time)."""
        return seconds <= CHEAP_PASSES * self.fp32_seconds + CHEAP_SECONDS

    def _fp32(self) -> Reference:
        """FP32's records on the evaluation set (and its outputs where the metric reads
        them), made when first needed: not where every evaluation is in the checkpoint."""
        context = self.context
        if self.reference is None:
            self.reference = Reference(context.metric)
            start = time.perf_counter()
            for batch in context.step(context.evaluation, desc="FP32 evaluation"):
                outputs = context.fp32_run(batch)
                self.reference.update(outputs)
                if not context.metric.labels:
                    self.fp32_outputs.append(outputs)
            self.fp32_seconds = time.perf_counter() - start
        return self.reference

    def _scored(self, precisions: Mapping[str, str], model_run: bool) -> PairedScore:
        """The plan's records on the evaluation set (FP32's own when it runs no model). Not
        side by side with FP32's pass: held with the plan's, the second session's memory came
        on top (the orientation model's plan peaked 250 MB higher)."""
        context = self.context
        reference = self._fp32()
        if not model_run:
            return PairedScore.of_reference(reference, context.settings.resamples)
        scored = PairedScore(context.metric, resamples=context.settings.resamples,
                             reference=reference)
        run = self.runner(precisions, "int8")
        batches = context.step(context.evaluation, desc="INT8 evaluation")
        if context.metric.labels:
            for batch in batches:
                scored.update(run(batch), {})
        else:
            for batch, fp32 in zip(batches, self.fp32_outputs, strict=True):
                scored.update(run(batch), fp32)
        return scored

    def __call__(self, point: FrontPoint) -> Evaluation:
        settings = self.context.settings
        key = plan_key(point.precisions)
        if self.checkpoint and key in self.checkpoint.evaluations:
            return self.checkpoint.evaluations[key]
        start = time.perf_counter()
        model_run = any(p != "fp32" for p in point.precisions.values())
        certificate = settings.budget.certificate(self._scored(point.precisions, model_run))
        result = Evaluation(point.int8_mac_share, point.predicted, certificate,
                            time.perf_counter() - start, model_run)
        if self.checkpoint:
            self.checkpoint.add_evaluation(key, result)
        return result

    def first(self, point: FrontPoint, drawn: Draw | None) -> Evaluation:
        """The all-INT8 `point`: screened out on `drawn` (calibration samples that are not
        only the hardest, for a label-free metric) when it fails there beyond doubt, else
        evaluated."""
        settings = self.context.settings
        if drawn is not None:
            screened = screen(point, self.runner(point.precisions), drawn,
                              self.context.metric, settings.budget, settings.resamples)
            if screened is not None:
                return screened
        return self(point)


class NoiseFit(Protocol):
    """What the search asks of the noise model (:class:`quantlab.planner.trials.ModelFit`)."""

    def front(self) -> list[FrontPoint]: ...

    def verified(self, point: FrontPoint) -> bool: ...

    def fp16_noise(self) -> float: ...


def evaluate_front(evaluator: Evaluator, rules: Rules, fit: NoiseFit, first: Evaluation
                   ) -> tuple[list[tuple[FrontPoint, Evaluation]], int, Evaluation | None]:
    """The search over the front on the evaluation set, all-INT8 judged already (`first`;
    each other plan checked against the noise model first, :meth:`NoiseFit.verified`),
    then the fallback when no plan with INT8 certifies: all-FP16 (where units may run
    FP16), then the FP32 model. Returns the (plan, evaluation) pairs, the chosen one's
    position and the all-FP16 evaluation (or None)."""
    settings = evaluator.context.settings
    all_int8 = plan_key(fit.front()[-1].precisions)

    def checked(point: FrontPoint) -> Evaluation | None:
        if plan_key(point.precisions) == all_int8:
            return first
        return evaluator(point) if fit.verified(point) else None

    done, chosen = search(fit.front, checked, settings.max_evaluations, settings.budget,
                          evaluator.cheap)
    if done[chosen][1].certificate.certified:
        return done, chosen, None
    # No plan with INT8 certified: FP16 everywhere it may run, then the FP32 model.
    all_fp16 = FrontPoint(0.0, fit.fp16_noise(), 0.0, {
        u.name: fallback_precision(rules.allowed[u.name], settings.high_precision)
        for u in rules.units})
    floor = None
    if any(p == "fp16" for p in all_fp16.precisions.values()):
        floor = evaluator(all_fp16)
        done.append((all_fp16, floor))
        message = floor_message(floor.certificate, settings.budget)
        if message:
            warnings.warn(message, stacklevel=3)
        if floor.certificate.certified:
            return done, len(done) - 1, floor
    all_fp32 = FrontPoint(0.0, 0.0, 0.0, {u.name: fallback_precision(rules.allowed[u.name],
                                                                     "fp32")
                                          for u in rules.units})
    done.append((all_fp32, evaluator(all_fp32)))
    return done, len(done) - 1, floor


def uncertified(done: list[tuple[FrontPoint, Evaluation]], chosen: FrontPoint
                ) -> tuple[FrontPoint, Evaluation] | None:
    """The evaluated plan with the most INT8 (more than the `chosen`) that scored inside the
    budget but could not be certified (too few samples for a drop, or a score too near an
    SQNR floor), with its evaluation; None when there is none."""
    promising = [(p, e) for p, e in done if not e.screened and e.certificate.near_miss and
                 p.int8_mac_share > chosen.int8_mac_share]
    return max(promising, key=lambda pair: pair[0].int8_mac_share, default=None)
