"""Precision plans under an accuracy budget: the planning flow, and the planner's public API.

:func:`make_plan` runs the steps of the planner design (docs/peers.md section 12),
each in its own module of :mod:`quantlab.planner`: units and their scale groups
(``units``), rules with reason codes (``rules``), measured sensitivity
(``measure``: hardest samples, switchboard group testing, local INT8/FP16 error),
the INT8-share front (``search``), certification on held-out data
(``certify``), and the plan as plain data (``decisions``). Their public names
are importable from here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from quantlab import qdq
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.experiment import read_record, write_json
from quantlab.graph import Graph
from quantlab.planner.certify import (  # noqa: F401 (public API)
    METRICS,
    Certificate,
    Outputs,
    argmax_agreement,
    certify,
    certify_paired,
    check_budget,
    data_shortfalls,
    floor_message,
    floor_record,
    metric_value,
    output_sqnr,
    resolve_metric,
    split_samples,
    task_evaluator,
)
from quantlab.planner.decisions import (  # noqa: F401 (public API)
    PLAN_FORMAT,
    PLAN_VERSION,
    Plan,
    UnitDecision,
    pinned_tensors,
)
from quantlab.planner.measure import (  # noqa: F401 (public API)
    OutputSensitivity,
    RepairedModel,
    all_int8_nsr,
    choose_calibrators,
    fp16_contributions,
    group_test,
    hardest_samples,
    in_runs,
    local_sqnr,
    output_sample_axes,
    pooled_nsr,
    run_trials,
    sample_energies,
    sample_nsr,
    samples_per_run,
    single_samples,
)
from quantlab.planner.rules import (  # noqa: F401 (public API)
    DECODE_INPUT_OPS,
    FP16_MAX,
    POINTWISE_OPS,
    RESHAPE_OPS,
    RULES,
    DepthwiseRule,
    Fp16RangeRule,
    HeadRule,
    KernelRule,
    RangeRule,
    Reason,
    Rule,
    RuleContext,
    allowed_precisions,
    apply_rules,
)
from quantlab.planner.search import (  # noqa: F401 (public API)
    FrontPoint,
    fallback_precision,
    front,
    solve,
)
from quantlab.planner.units import (  # noqa: F401 (public API)
    Unit,
    find_units,
    linear_macs,
    read_back,
    scale_groups,
    share_scales,
)

# Front plans measured on the switchboard per round of checks before any evaluation.
FRONT_CHECKS = 4
# The least INT8 (share of MACs) an evaluation must be able to add over the certified plan.
MIN_GAIN = 1e-4
# The checkpoint key of the all-FP16 plan's evaluation (front plans are keyed by index >= 0).
FLOOR_KEY = -1
# The reason of a unit the search (not a rule) keeps out of INT8.
SEARCH_CODE = "M-SEARCH"
SEARCH_SOURCE = ("quantlab: switchboard group testing on the hardest samples, MILP front, "
                 "certified on held-out data (docs/peers.md section 12, stages B3, D, E)")


class Checkpoint:
    """What an interrupted plan run already measured, in a JSON file, so a re-run resumes.

    Holds the switchboard trials (index -> nsr) and the evaluations (front index ->
    :class:`Evaluation`) of a run identified by `fingerprint` (a hash of the model,
    the data, the scales and the settings); a file of another run is ignored and
    replaced. Every update is written atomically.
    """

    def __init__(self, path: str | os.PathLike | None, fingerprint: str):
        self.path = Path(path) if path is not None else None
        self.fingerprint = fingerprint
        self.trials: dict[int, float] = {}
        self.evaluations: dict[int, Evaluation] = {}
        # A file was there but of another run (or unreadable): it is replaced.
        self.ignored = False
        if self.path is None or not self.path.is_file():
            return
        try:
            data = read_record(self.path, "plan checkpoint")
            if data.get("fingerprint") != fingerprint:
                self.ignored = True
                return
            self.trials = {int(t): float(v) for t, v in data["trials"].items()}
            self.evaluations = {int(i): Evaluation(
                e["int8_mac_share"], e["predicted"],
                Certificate(**{**e["certificate"],
                               "interval": tuple(e["certificate"]["interval"])}),
                e["seconds"], e.get("model_run", True), e.get("screened", False))
                for i, e in data["evaluations"].items()}
        except (DataError, ValueError, KeyError, TypeError, AttributeError):
            self.trials, self.evaluations = {}, {}  # unreadable: start over
            self.ignored = True

    def add_trial(self, index: int, nsr: float) -> None:
        """Record one switchboard trial."""
        self.trials[index] = nsr
        self._save()

    def add_evaluation(self, index: int, evaluation: Evaluation) -> None:
        """Record one evaluation of the front's plan `index`."""
        self.evaluations[index] = evaluation
        self._save()

    def _save(self) -> None:
        if self.path is not None:
            write_json(self.path, {"format": "quantlab.plan-progress",
                                   "fingerprint": self.fingerprint, "trials": self.trials,
                                   "evaluations": {i: asdict(e) for i, e in
                                                   self.evaluations.items()}})


def fingerprint(model: onnx.ModelProto, *parts) -> str:
    """A hash identifying a plan run: the model and the settings and data descriptions."""
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
    # True when judged on the calibration samples' switchboard outputs, not on the
    # evaluation set: an all-INT8 plan that fails there beyond doubt (see _screen).
    screened: bool = False



@dataclass
class PlanResult:
    """Everything `make_plan` produced; ``evaluations[chosen]`` certifies ``plan``.

    The chosen plan is the certified one with the most INT8 MACs or, when none is
    certified (not even the plan without INT8: FP16 breaks it, or a budget of 0
    with FP16), the most conservative plan evaluated (its certificate says so).
    """

    plan: Plan
    qdq_model: onnx.ModelProto
    amax: dict[str, float]
    front: list[FrontPoint]
    sensitivity: OutputSensitivity
    evaluations: list[Evaluation]
    chosen: int
    hard_samples: list[int]
    # The FP32 model planned: the input model, or its repaired copy (plan.repairs says which).
    model: onnx.ModelProto | None = None
    # The plan with the most INT8 that scored inside the budget but could not be certified
    # (the evaluation set too small), with its Q/DQ model and evaluation; None if none did.
    uncertified: tuple[Plan, onnx.ModelProto, Evaluation] | None = None

    @property
    def certificate(self) -> Certificate:
        """The certificate of the chosen plan."""
        return self.evaluations[self.chosen].certificate

    @property
    def model_runs(self) -> int:
        """Evaluations that ran a model on the evaluation set (not the FP32 plan, whose
        outputs are known, nor a plan screened out on the calibration samples)."""
        return sum(e.model_run for e in self.evaluations)


def make_plan(model: onnx.ModelProto, calibration, evaluation, amax: Mapping[str, float],
              ranges: Mapping[str, float], p9999: Mapping[str, float], *,
              metric: str = "sqnr", max_drop: float | None = None,
              min_sqnr: float | None = None, trials: int = 24, hard_count: int = 64,
              max_evaluations: int = 4, high_precision: str = "fp16", task=None,
              resamples: int = 200, checkpoint: Checkpoint | None = None,
              candidates: Mapping[str, Mapping[str, float]] | None = None,
              repairs: Mapping[str, RepairedModel] | None = None,
              bias_correction: bool = True, verify_rounds: int = 2,
              progress: Callable | None = None) -> PlanResult:
    """Plan `model` (normalized) under a budget: rules, group testing, front, certification.

    `calibration` and `evaluation` are BatchSources (measurement on the former's
    hardest samples, certification on the latter); `amax` are the calibrated
    scales' amax, `ranges` max |x| and `p9999` the 99.99th percentile per tensor
    (for the rules). The budget is ``max_drop`` of `metric` from FP32, or
    ``min_sqnr`` (dB of output SQNR, metric "sqnr"). Before any evaluation, up to
    `verify_rounds` rounds measure FRONT_CHECKS plans of the front on the
    switchboard (hardest samples) and refit, until their predicted noise is
    within a factor 2 of the measured. Up to `max_evaluations` plans
    of the front are evaluated on the real INT8 model (ONNX Runtime integer
    kernels): all-INT8 first (kept when within budget; with a metric of outputs
    alone, judged instead on a random draw of `hard_count` calibration samples when
    it fails there beyond doubt, see :func:`_screen`), then the front's plan the
    fitted model predicts at the budget, re-fitted after each evaluation and
    bisected between the best certified and the smallest failed plan. When none
    of them certifies, the plan without INT8 is evaluated too (one more; with
    ``high_precision="fp32"`` it is the FP32 model, certified without a model
    run), so that a certified plan is returned wherever one exists. With a
    :class:`quantlab.tasks.Task` (labels or COCO ground truth of `evaluation`),
    `metric` may be its primary metric (``top1``, ``map``). A `checkpoint` of an
    interrupted run of the same plan skips the trials and evaluations it holds.
    `candidates` (calibration method -> amax) lets each unit take the method whose
    amax gives it the best local INT8 SQNR on the first calibration batch (a
    repair that costs no runtime, weighed before any pin). `repairs` (name ->
    :class:`RepairedModel`, e.g. cross-layer equalization) are weighed first, one
    pass each on the first calibration batch: the option whose all-INT8 model
    has the least output noise is planned (the FP32 model stays the reference),
    and ``plan.repairs`` records every option's noise and, for the chosen repair,
    its effect on the hardest samples. With `bias_correction`, each INT8 op's
    output shift is measured once (:func:`quantlab.repairs.bias_shifts`, one pass
    over the calibration data) and applied to the INT8 units of every plan (gated
    per unit in the switchboard) when it lowers the all-INT8 noise on the hardest
    samples; ``plan.repairs`` records both figures.
    """
    from quantlab import switchboard
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.repairs import bias_shifts, shift_biases

    check_budget(metric, max_drop, min_sqnr)
    for option, count in (("trials", trials), ("hard_count", hard_count),
                          ("resamples", resamples), ("max_evaluations", max_evaluations)):
        if count < 1:
            raise ConfigError(f"{option} must be at least 1, got {count}.")
    task_metric = task is not None and metric == task.primary_metric
    if task is not None:
        task.check_samples(evaluation.num_samples)
    metric_fn = None if task_metric else resolve_metric(metric)
    for message in data_shortfalls(calibration.num_samples, evaluation.num_samples, hard_count,
                                   metric, max_drop, task):
        warnings.warn(message, stacklevel=2)
    step = progress or (lambda items, **_: items)
    fp32 = OnnxRuntimeBackend(model, name="fp32")
    first = next(iter(calibration))
    g = Graph(model)
    # Every whole-model run: runs of a bounded size (a 640 px batch of 32 held 13-15 GB),
    # outputs samples first (a recurrent state [layers, N, hidden]).
    size = samples_per_run(g, first, calibration)
    axes = output_sample_axes(model, fp32.run, first, calibration)

    def runs(run: Callable) -> Callable:
        return in_runs(run, calibration, size, axes)

    fp32_run = runs(fp32.run)
    if metric_fn is not None:  # a metric that fails or returns no number fails now, not late
        first_outputs = [fp32_run(first)]
        metric_value(metric_fn, metric, first_outputs, first_outputs,
                     "FP32 against itself on the first calibration batch")
    original = RepairedModel(model, amax, ranges, p9999, candidates)
    options = {"none": original, **(repairs or {})}
    weighed = all_int8_nsr(options, first, fp32_run(first), runs) if repairs else {}
    repair = min(weighed, key=weighed.get) if weighed else "none"
    model, amax, ranges, p9999, candidates = (
        options[repair].model, options[repair].amax, options[repair].ranges,
        options[repair].p9999, options[repair].candidates)
    g = g if repair == "none" else Graph(model)
    one = calibration.slice(first, 0, 1)  # MACs per sample; shapes inference misses, run
    units = find_units(g, {name: np.shape(value) for name, value in one.items()},
                       lambda names: {n: a.shape for n, a in fp32.run(one, names).items()})
    reasons = apply_rules(units, RuleContext(g, ranges, p9999))
    allowed = {u.name: allowed_precisions(reasons.get(u.name, [])) for u in units}
    fixed = {n: fallback_precision(a, high_precision) for n, a in allowed.items()
             if "int8" not in a}

    calibrators: dict[str, str] = {}
    if candidates:
        amax, calibrators = choose_calibrators(g, candidates, units,
                                               single_samples(calibration, first), amax)
    amax = share_scales(g, amax)
    all_int8 = {u.name: fixed.get(u.name, "int8") for u in units}
    shifts, shift_report = {}, None
    if bias_correction:
        shifts, shift_report = bias_shifts(model, qdq.quantize_model(
            model, amax, {n: all_int8[u.name] for u in units for n in u.nodes}), calibration)
    board = switchboard.build(g, units, amax, shifts=shifts)
    board_backend = OnnxRuntimeBackend(board.model, name="switchboard", check_inputs=False)

    def board_run(precisions):
        flags = board.feeds(precisions)
        return runs(lambda batch: board_backend.run({**batch, **flags}))

    hard, hard_indices, drawn = hardest_samples(
        calibration, fp32_run, board_run(all_int8), hard_count,
        lambda b: step(b, desc="hardest samples"), draw=metric_fn is not None)
    references = fp32_run(hard)
    shift_record = None
    if board.bias_flag:  # weighed on the hardest samples: kept only where it lowers the noise
        noise = {}
        for on in (False, True):
            board.bias_corrected = on
            noise[on] = pooled_nsr(board_run(all_int8)(hard), references)
        board.bias_corrected = noise[True] < noise[False]
        shift_record = {"repair": "bias_correction", "chosen": board.bias_corrected,
                        "hard_nsr_before": noise[False], "hard_nsr_after": noise[True],
                        **_repair_summary(shift_report.to_dict())}
    local = local_sqnr(g, amax, units, single_samples(calibration, hard, calibration.batch_size))

    def board_nsr(batch, flags):
        return runs(lambda chunk: board_backend.run({**chunk, **flags}))(batch)

    sensitivity = group_test(
        board, board_nsr, hard, references, trials=trials, fixed=fixed,
        known=checkpoint.trials if checkpoint else None,
        on_trial=checkpoint.add_trial if checkpoint else None,
        progress=lambda r: step(r, desc="switchboard trials"),
        local_nsr={u: 10.0 ** (-f["int8"] / 10.0) for u, f in local.items() if "int8" in f})
    repair_records = [{"repair": name, "chosen": name == repair,
                       "all_int8_nsr_first_batch": nsr, **_repair_summary(options[name].report)}
                      for name, nsr in weighed.items()]
    repair_records += [shift_record] if shift_record else []
    applied = shifts if board.bias_corrected else {}

    def quantized(nodes: Mapping[str, str], **options) -> onnx.ModelProto:
        built = qdq.quantize_model(model, amax, nodes, **options)
        return shift_biases(g, built, applied) if applied else built

    if repair != "none":  # its effect where the pins' is measured: the hardest samples
        fixed_nodes = {n: fixed[u.name] for u in units if u.name in fixed for n in u.nodes}
        before = all_int8_nsr({"none": original}, hard, references, runs, fixed_nodes)
        after = shift_record["hard_nsr_before"] if shift_record else float(sensitivity.nsr[0])
        repair_records[list(weighed).index(repair)].update(
            hard_nsr_before=before["none"], hard_nsr_after=after)

    def fitted(sensitivity: OutputSensitivity):
        contribution = dict(zip(sensitivity.units, sensitivity.contribution, strict=True))
        fp16_contribution = fp16_contributions(contribution, local, fixed)
        return contribution, fp16_contribution, front(
            units, allowed, contribution, high_precision=high_precision,
            fp16_contribution=fp16_contribution)

    contribution, fp16_contribution, points = fitted(sensitivity)
    for _ in step(range(verify_rounds), desc="front checks"):
        masks = _front_checks(points, sensitivity)
        if not len(masks):
            break
        predicted = masks @ sensitivity.contribution
        measured = run_trials(board, board_nsr, hard, references, masks, fixed=fixed,
                              first=len(sensitivity.nsr),
                              known=checkpoint.trials if checkpoint else None,
                              on_trial=checkpoint.add_trial if checkpoint else None)
        sensitivity = sensitivity.with_trials(masks, measured)
        contribution, fp16_contribution, points = fitted(sensitivity)
        if np.all((measured <= 2 * predicted) & (predicted <= 2 * measured)):
            break

    screened = {}
    if drawn is not None:  # (inputs, FP32 outputs): no other name holds them, del frees them
        verdict = _screen(points[-1], board_run(points[-1].precisions), *drawn, metric_fn,
                          metric, max_drop, min_sqnr, resamples)
        screened = {len(points) - 1: verdict} if verdict else {}
    del drawn
    fp32_outputs = [fp32_run(batch) for batch in step(evaluation, desc="FP32 evaluation")]

    def evaluate_plan(point: FrontPoint, key: int) -> Evaluation:
        """`point` evaluated on the evaluation set (checkpointed as `key`)."""
        if checkpoint and key in checkpoint.evaluations:
            return checkpoint.evaluations[key]
        start = time.perf_counter()
        model_run = any(p != "fp32" for p in point.precisions.values())
        if model_run:
            nodes = {n: point.precisions[u.name] for u in units for n in u.nodes}
            int8 = runs(OnnxRuntimeBackend(quantized(nodes), name="int8").run)
            outputs = [int8(batch) for batch in step(evaluation, desc="INT8 evaluation")]
        else:
            outputs = fp32_outputs
        if task_metric:
            certificate = certify_paired(
                metric, task_evaluator(task, outputs, fp32_outputs), evaluation.num_samples,
                max_drop=max_drop, floor=min_sqnr, resamples=resamples)
        else:
            certificate = certify(metric_fn, metric, outputs, fp32_outputs, max_drop=max_drop,
                                  floor=min_sqnr, resamples=resamples)
        result = Evaluation(point.int8_mac_share, point.predicted, certificate,
                            time.perf_counter() - start, model_run)
        if checkpoint:
            checkpoint.add_evaluation(key, result)
        return result

    def evaluate_point(index: int) -> Evaluation:
        return screened[index] if index in screened else evaluate_plan(points[index], index)

    # The noise floor of the budget: every unit that may run FP16 in FP16, no INT8. It is
    # also the fallback when no plan with INT8 certifies (FP16 before FP32).
    all_fp16 = FrontPoint(0.0, sum(fp16_contribution.values()), 0.0,
                          {u.name: fallback_precision(allowed[u.name], high_precision)
                           for u in units})
    floor = None
    if any(p == "fp16" for p in all_fp16.precisions.values()):
        floor = evaluate_plan(all_fp16, FLOOR_KEY)
        message = floor_message(floor.certificate, metric, max_drop)
        if message:
            warnings.warn(message, stacklevel=2)

    evaluated, index = _search(points, evaluate_point, max_evaluations, max_drop, min_sqnr)
    chosen = points[index]
    if floor is not None:
        evaluated[FLOOR_KEY] = floor
        if chosen.int8_mac_share == 0.0 and floor.certificate.certified:
            # No plan with INT8 certified: FP16 everywhere it may run holds the budget.
            chosen, index = all_fp16, FLOOR_KEY
    decided = Plan.from_rules(units, reasons)
    uncertified = None
    promising = [i for i, e in evaluated.items() if i >= 0 and not e.screened and
                 e.certificate.inconclusive and e.certificate.value >= e.certificate.limit and
                 points[i].int8_mac_share > chosen.int8_mac_share]
    if promising:
        best = max(promising, key=lambda i: points[i].int8_mac_share)
        kept = Plan.from_rules(units, reasons)
        for unit in units:
            kept.units[unit.name].precision = points[best].precisions[unit.name]
        kept.metric = metric
        kept.budget = max_drop if max_drop is not None else min_sqnr
        uncertified = (kept, quantized(kept.node_precisions(), high_precision=high_precision),
                       evaluated[best])
    rank = {u: i + 1 for i, u in enumerate(sensitivity.ranking())}
    for unit in units:
        decision = decided.units[unit.name]
        decision.precision = chosen.precisions[unit.name]
        decision.predicted = contribution.get(unit.name, 0.0)
        decision.evidence["output_nsr_contribution"] = decision.predicted
        decision.evidence["output_rank"] = rank[unit.name]
        for precision, figure in local.get(unit.name, {}).items():
            decision.evidence[f"local_sqnr_{precision}_db"] = figure
        if unit.name in fp16_contribution:
            decision.evidence["fp16_nsr_contribution"] = fp16_contribution[unit.name]
        if unit.name in calibrators:
            decision.evidence["calibrator"] = calibrators[unit.name]
        if decision.precision == "int8" and any(n in applied for n in unit.linear):
            decision.evidence["bias_shift_max"] = max(float(np.abs(applied[n]).max())
                                                      for n in unit.linear if n in applied)
        if decision.precision != "int8" and not any(r.hard for r in decision.reasons):
            decision.reasons.append(Reason(
                SEARCH_CODE, False, (decision.precision,),
                f"rank {rank[unit.name]} of {len(units)} by output-noise contribution "
                f"{decision.predicted:.3g} (all INT8: {sensitivity.predicted_nsr(contribution):.3g}"
                "); " + ("the certified plan of the front keeps it out of INT8"
                         if chosen.int8_mac_share > 0 else
                         f"no plan with INT8 held the budget ({len(evaluated)} evaluated)"),
                SEARCH_SOURCE))
        if decision.precision == "fp32" and "fp16" in allowed[unit.name] and \
                high_precision == "fp16":
            if chosen.int8_mac_share > 0 or floor is None:
                why = (f"FP16 would add predicted output NSR "
                       f"{fp16_contribution.get(unit.name, 0.0):.3g} (local FP16 SQNR "
                       f"{local.get(unit.name, {}).get('fp16', float('nan')):.3g} dB); the "
                       "budget left by the INT8 units does not hold it")
            else:
                why = (f"all-FP16 scored {floor.certificate.value:.4g} against the limit "
                       f"{floor.certificate.limit:.4g} and could not be certified, so the plan "
                       "of last resort is the FP32 model")
            decision.reasons.append(Reason(SEARCH_CODE, False, ("fp32",), why, SEARCH_SOURCE))
    decided.metric = metric
    decided.repairs = repair_records
    decided.floor = None if floor is None else floor_record(floor.certificate)
    decided.budget = max_drop if max_drop is not None else min_sqnr
    qdq_model = quantized(decided.node_precisions(), high_precision=high_precision)
    differ = {u: p for u, p in read_back(qdq_model, units).items()
              if p != decided.units[u].precision}
    if differ:
        raise ModelError(f"the Q/DQ model runs units {sorted(differ)[:5]} as {differ} although "
                         "the plan says otherwise; this is a bug, please report it with the model.")
    return PlanResult(decided, qdq_model, dict(amax), points, sensitivity,
                      list(evaluated.values()), list(evaluated).index(index),
                      hard_indices.tolist(), model, uncertified)


def _search(points: list[FrontPoint], evaluate: Callable[[int], Evaluation],
            max_evaluations: int, max_drop: float | None,
            min_sqnr: float | None) -> tuple[dict[int, Evaluation], int]:
    """Evaluate plans of the front; the evaluations by front index, in order, and the chosen.

    All-INT8 first (kept when certified), then up to `max_evaluations` in all
    (not counting a plan `evaluate` screened out on the calibration samples), each
    chosen by :func:`_next_guess` between the most-INT8 certified plan and
    the least-INT8 failed one, among the plans that add at least MIN_GAIN of the
    MACs to the certified one (a layout front holds plans 5e-6 apart: a whole
    evaluation is wasted on them). When none certifies, the plan without INT8 too (a
    last resort). The chosen plan is the certified one with the most INT8, else
    the most conservative evaluated. Warns when the evaluation set is too small
    to decide, and when a plan with more INT8 than the chosen was inconclusive.
    """
    last = len(points) - 1
    evaluated = {last: evaluate(last)}
    if evaluated[last].certificate.inconclusive:  # said now, not after the other evaluations
        warnings.warn(evaluated[last].certificate.too_small_message(), stacklevel=3)
    low, high = -1, last  # highest certified index, lowest failed index
    if evaluated[last].certificate.certified:
        low = last
    while sum(not e.screened for e in evaluated.values()) < max_evaluations:
        # Plans that add less than MIN_GAIN of the MACs to the certified one are not tried.
        floor = low if low < 0 else max(i for i in range(low, high + 1) if (
            points[i].int8_mac_share < points[low].int8_mac_share + MIN_GAIN))
        if floor >= high - 1:
            break
        guess = _next_guess(points, evaluated, floor, high, max_drop, min_sqnr)
        evaluated[guess] = evaluate(guess)
        if evaluated[guess].certificate.certified:
            low = guess
        else:
            high = guess
    if low < 0 and 0 not in evaluated:  # nothing certified: the plan without INT8, last resort
        evaluated[0] = evaluate(0)

    certified = [i for i in evaluated if evaluated[i].certificate.certified]
    index = max(certified) if certified else min(evaluated)
    undecided = [i for i in evaluated if i > index and evaluated[i].certificate.inconclusive]
    if undecided and not evaluated[last].certificate.inconclusive:  # else said already
        best = evaluated[max(undecided)]
        warnings.warn(f"the plan with {best.int8_mac_share:.1%} of MACs in INT8 scored "
                      f"{best.certificate.value:.4g} (limit {best.certificate.limit:.4g}) but "
                      f"could not be certified: {best.certificate.too_small_message()} The plan "
                      f"written keeps {evaluated[index].int8_mac_share:.1%} in INT8 "
                      f"({(best.int8_mac_share - evaluated[index].int8_mac_share) * 100:.2g} "
                      "points of the MACs fewer).",
                      stacklevel=3)
    return evaluated, index


def _screen(point: FrontPoint, run: Callable, inputs: Mapping[str, np.ndarray],
            references: Mapping[str, np.ndarray], metric_fn: Callable, metric: str,
            max_drop: float | None, min_sqnr: float | None,
            resamples: int) -> Evaluation | None:
    """The all-INT8 `point` judged on calibration samples, if it fails there beyond doubt.

    `run` runs it on the switchboard (in bounded runs); `inputs` are a random draw
    of calibration samples (drawn in the pass that finds the hardest, whose drop
    they would overstate), `references` FP32's outputs on them. It
    fails beyond doubt when the whole bootstrap interval of its margin lies below
    the limit: the evaluation-set pass it would take is spared, and the search's
    law is fitted on this measurement instead. Otherwise None: it is evaluated as
    any other plan. Only for metrics that read outputs alone: a task metric needs
    labels the calibration data lack.
    """
    start = time.perf_counter()
    certificate = certify(metric_fn, metric, [run(inputs)], [references],
                          max_drop=max_drop, floor=min_sqnr, resamples=resamples,
                          what="random calibration samples")
    if certificate.interval[1] >= 0:
        return None
    return Evaluation(point.int8_mac_share, point.predicted, certificate,
                      time.perf_counter() - start, model_run=False, screened=True)


def _front_checks(points: list[FrontPoint], sensitivity: OutputSensitivity,
                  count: int = FRONT_CHECKS) -> np.ndarray:
    """INT8 masks of up to `count` front plans to measure on the switchboard, evenly spread.

    Plans strictly between no INT8 and all INT8 whose set of INT8 units no trial ran
    yet. Measured and refitted (:meth:`OutputSensitivity.with_trials`), they test the
    fit where the search will look: random half-and-half trials cannot tell many
    small contributors apart, and a fit that calls them free puts them all in INT8.
    """
    seen = {mask.tobytes() for mask in sensitivity.masks}
    masks = []
    for point in points:
        mask = np.array([point.precisions.get(u) == "int8" for u in sensitivity.units])
        if mask.any() and not mask.all() and mask.tobytes() not in seen:
            seen.add(mask.tobytes())
            masks.append(mask)
    picked = np.unique(np.linspace(0, len(masks) - 1, min(count, len(masks))).astype(int))
    return np.array([masks[i] for i in picked]).reshape(-1, len(sensitivity.units))


def _repair_summary(report: Mapping) -> dict:
    """The plain figures of a RepairReport dict that plan.json keeps: places changed, skipped."""
    return {"applied": len(report.get("applied", [])), "skipped": len(report.get("skipped", [])),
            "passes": report.get("passes", 0), **report.get("summary", {})}


def _next_guess(points: list[FrontPoint], evaluated: Mapping[int, Evaluation], low: int,
                high: int, max_drop: float | None, min_sqnr: float | None) -> int:
    """The front index to evaluate next, strictly between `low` and `high`.

    The metric's shortfall is taken to grow as a power of the predicted noise
    (:func:`_shortfall_power`; proportional for an SQNR floor), its factor fitted on
    the evaluation nearest the bracket's middle (re-fitting, not assuming, AIMET's
    monotone curve); bisection when that guess leaves the open interval. When the
    plan at `high` scored inside the budget but was not certified (its bootstrap
    interval reaches below the limit), the factor is fitted on it and the aim is
    the largest shortfall that can still be certified, the budget less the
    interval's spread (:func:`_certifiable_drop`; for a floor, the floor raised by
    the spread in dB): that spread was measured near the budget, where it applies.
    Failing that, the plan just below: plans with less noise are the likeliest to
    certify, and a guess further down would give up INT8 no measurement ruled out.
    """
    def shortfall(e: Evaluation) -> float:  # noise power for a floor (dB -> NSR), else the drop
        c = e.certificate
        return 10 ** (-c.value / 10) if min_sqnr is not None else c.reference - c.value

    above, spread = evaluated.get(high), 0.0
    if above is not None and above.certificate.value >= above.certificate.limit:
        c = above.certificate
        nearest, guess, spread = above, high - 1, max(c.value - c.limit - c.interval[0], 0.0)
    else:
        nearest = evaluated[min(evaluated, key=lambda i: abs(i - (low + high) / 2))]
        guess = (low + high) // 2
    measured = shortfall(nearest)
    allowed = (10 ** (-(min_sqnr + spread) / 10) if min_sqnr is not None
               else _certifiable_drop(max_drop, measured, spread))
    if measured > 0 and nearest.predicted > 0:
        power = 1.0 if min_sqnr is not None else _shortfall_power(
            [(e.predicted, shortfall(e)) for e in evaluated.values()])
        budget = nearest.predicted * (allowed / measured) ** (1.0 / power)
        fitting = [i for i, p in enumerate(points) if p.predicted <= budget]
        if fitting and low < fitting[-1] < high:
            guess = fitting[-1]
    return min(max(guess, low + 1), high - 1)


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
