"""The planning flow: :func:`make_plan` runs the planner's steps in order, timing each.

Each step is a function over plain data (docs/planner.md tells the design):

1. ``weigh repairs``: every repaired option's all-INT8 noise on the first batch;
   the quietest is planned (:func:`_weigh_repairs`).
2. ``rules``: units, the rules' reasons, the precisions each unit may take
   (:func:`_rules`).
3. ``calibrators``: per unit, the calibrator with the least local error
   (:func:`quantlab.planner.measure.choose_calibrators`), scales shared.
4. ``bias shifts``: each INT8 op's output shift, one pass (:func:`_bias_shifts`).
5. ``hardest samples``: one pass of all-INT8 over the calibration data.
6. ``bias correction``: kept where it lowers the hardest samples' noise.
7. ``local errors``: every unit's local INT8 and FP16 error, one pass.
8. ``single units``: each unit alone in INT8 on a few of the hardest samples, the
   trials' prior (:func:`_single_units`); then ``trials``: random plans on the
   hardest samples, the noise model fitted (:func:`quantlab.planner.trials.group_test`).
   Both only where all-INT8 (judged first) did not certify.
9. ``front checks``: front plans measured against the fit, refitted, disagreements
   localized (:func:`_check_front`).
10. ``evaluations``: plans of the front on the evaluation set, certified
    (:func:`quantlab.planner.evaluate.search`), FP16 then FP32 the fallback.
11. the decisions with their evidence and reasons (:func:`_decide`).

Every plan that runs, in a trial or an evaluation, is its own Q/DQ model in ONNX
Runtime (:class:`_Runner`): what is measured is what is shipped.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnx

from quantlab import qdq
from quantlab.errors import ConfigError, ModelError
from quantlab.graph import Graph
from quantlab.planner.certify import (
    Certificate,
    check_budget,
    data_shortfalls,
    floor_message,
    floor_record,
)
from quantlab.planner.decisions import Plan
from quantlab.planner.evaluate import (
    Checkpoint,
    Evaluation,
    allowed_noise,
    plan_key,
    screen,
    search,
    unreachable,
    warn_undecided,
)
from quantlab.planner.measure import (
    CalibratedModel,
    Draw,
    FromCuts,
    all_int8_nsr,
    all_samples,
    choose_calibrators,
    choose_cuts,
    concurrently,
    fp16_contributions,
    hardest_samples,
    in_runs,
    joined,
    local_sqnr,
    output_sample_axes,
    parts_nsr,
    samples_per_run,
    single_samples,
    unit_starts,
)
from quantlab.planner.rules import Reason, RuleContext, allowed_precisions, apply_rules
from quantlab.planner.search import FrontPoint, fallback_precision, front, most_int8
from quantlab.planner.trials import (
    OutputSensitivity,
    Trials,
    check_fit,
    disagreement,
    group_test,
    plan_nsr,
)
from quantlab.planner.units import Unit, find_units, read_back, share_scales
from quantlab.repairs import lowers_noise, quietest
from quantlab.scoring import Metric, PairedScore, Reference, metric_for

# Front plans measured per round of checks before any evaluation.
FRONT_CHECKS = 4
# Times the noise model may be refitted during the search, when a plan it chose for an
# evaluation measured noisier than predicted on the hardest samples.
MAX_REFITS = 3
# FP32's outputs on the hardest samples are held across the local errors up to this size, and
# made again after them when larger.
HELD_REFERENCES_BYTES = 64 << 20
# The share of `trials` that run at least when the budget lies far below their noise (see
# _least_random_trials).
FAR_TRIALS_SHARE = 0.25
# The single-unit measurements (_single_units) run each free unit alone on a few of the
# hardest samples: as many sample passes in all as this many trials, on at least
# SINGLES_LEAST_SAMPLES samples.
SINGLES_COST_IN_TRIALS = 4
SINGLES_LEAST_SAMPLES = 2
# An evaluation is cheap (the search may spend more, evaluate.MOST_EVALUATIONS) when it takes
# at most this many FP32 passes over the evaluation set plus this many seconds.
CHEAP_PASSES = 4
CHEAP_SECONDS = 1.0
# The reason of a unit the search (not a rule) keeps out of INT8.
SEARCH_CODE = "M-SEARCH"
SEARCH_SOURCE = ("quantlab: trials on the hardest samples, MILP front, certified on held-out "
                 "data (docs/planner.md)")


@dataclass(frozen=True)
class PlanSettings:
    """How to plan: the budget, and how much to measure.

    The budget is ``max_drop`` of `metric` from FP32, or ``min_sqnr`` (dB of output
    SQNR, metric "sqnr"). `trials` random plans on the `hard_count` hardest
    calibration samples fit the noise model; up to `verify_rounds` rounds check
    FRONT_CHECKS front plans against it; up to `max_evaluations` plans are evaluated
    on the evaluation set (a plan screened out on calibration samples, and the
    fallback when none certifies, not counted), each certified with a paired
    bootstrap of `resamples`. Units out of INT8 run `high_precision` where their
    rules allow. With `bias_correction` each INT8 op's output shift is measured
    once and applied where it lowers the hardest samples' noise.
    """

    metric: str = "sqnr"
    max_drop: float | None = None
    min_sqnr: float | None = None
    trials: int = 24
    hard_count: int = 64
    max_evaluations: int = 2
    high_precision: str = "fp16"
    resamples: int = 200
    bias_correction: bool = True
    verify_rounds: int = 2

    def check(self) -> None:
        check_budget(self.metric, self.max_drop, self.min_sqnr)
        for option in ("trials", "hard_count", "resamples", "max_evaluations"):
            if getattr(self, option) < 1:
                raise ConfigError(f"{option} must be at least 1, got {getattr(self, option)}.")

    @property
    def budget(self) -> float:
        return self.max_drop if self.max_drop is not None else self.min_sqnr


@dataclass
class PlanResult:
    """Everything `make_plan` produced; ``evaluations[chosen]`` certifies ``plan``.

    The chosen plan is the certified one with the most INT8 MACs or, when none
    with INT8 is certified, all-FP16 where it holds the budget, else the FP32
    model (the certificate says so).
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
    # Seconds per step of the flow (module docstring), in order.
    phases: dict[str, float] = field(default_factory=dict)
    # Each evaluated plan's predicted and measured noise on the hardest samples.
    noise_checks: list[dict] = field(default_factory=list)
    # What a trial cost against an FP32 pass over the same (hardest) samples.
    trial_cost: dict = field(default_factory=dict)
    # Times the search refitted the noise model instead of evaluating the plan it chose.
    refits: int = 0
    # The tensors still quantized with every unit out of INT8 (Q/DQ pairs outside the units
    # the plan decides); empty: the plan without INT8 units is the FP32 (or all-FP16) model
    # exactly, so every drop of a plan comes from its units (docs/planner.md).
    outside_units: list[str] = field(default_factory=list)

    @property
    def certificate(self) -> Certificate:
        """The certificate of the chosen plan."""
        return self.evaluations[self.chosen].certificate

    def largest_disagreement(self) -> float:
        """The largest factor between the noise model's prediction and a measurement, over
        the front checks, the localization and the evaluated plans (1: none)."""
        return max([self.sensitivity.largest_disagreement()] +
                   [c["factor"] for c in self.noise_checks])

    @property
    def fallback(self) -> str | None:
        """"all-FP16" or "FP32" when no plan with INT8 was certified and the plan is the
        fallback without INT8; None when the plan keeps INT8 (or no fallback was needed)."""
        if self.plan.int8_mac_share() > 0 or len(self.evaluations) < 2:
            return None
        return "all-FP16" if any(d.precision == "fp16" for d in self.plan.units.values()) \
            else "FP32"

    @property
    def model_runs(self) -> int:
        """Evaluations that ran a model on the evaluation set (not the FP32 plan, whose
        outputs are known, nor a plan screened out on the calibration samples)."""
        return sum(e.model_run for e in self.evaluations)


class _Phases:
    """Seconds per named step, in the order first entered."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass
class _Context:
    """What every step reads: the settings, the data, the FP32 model's bounded runs."""

    settings: PlanSettings
    calibration: object  # a quantlab.data.BatchSource
    evaluation: object
    task: object | None
    metric: Metric
    runs: Callable[[Callable], Callable]  # a backend's run -> bounded runs, samples first
    fp32_run: Callable
    # The first calibration batch; None after the calibrators, the last step to read it.
    first: Mapping[str, np.ndarray] | None
    step: Callable  # progress: (items, desc=) -> items


@dataclass
class _Rules:
    units: list[Unit]
    reasons: dict[str, list[Reason]]
    allowed: dict[str, tuple[str, ...]]
    fixed: dict[str, str]  # hard pins: unit -> precision


class _Runner:
    """Builds and runs a plan's Q/DQ model (unit -> precision), bias shifts applied to INT8.

    One ONNX Runtime session per plan run, dropped after it: a trial costs one forward
    pass of the plan's model plus building it.
    """

    def __init__(self, model: onnx.ModelProto, g: Graph, units: list[Unit],
                 amax: Mapping[str, float], high_precision: str, runs: Callable):
        self.model, self.g, self.units, self.amax = model, g, units, amax
        self.high_precision, self.runs = high_precision, runs
        self.shifts: dict[str, np.ndarray] = {}

    def quantized(self, precisions: Mapping[str, str], g: Graph | None = None,
                  shifts: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
        """The plan's Q/DQ model of the model, or of `g`, a part of it cut from it
        (:func:`quantlab.segments.tail_model`), with `shifts` (default: the runner's)."""
        from quantlab.repairs import shift_biases

        g = g or self.g
        shifts = self.shifts if shifts is None else shifts
        present = {node.name for node in g.model.graph.node}
        nodes = {n: precisions[u.name] for u in self.units for n in u.nodes if n in present}
        built = qdq.quantize_model(g, self.amax, nodes, high_precision=self.high_precision)
        return shift_biases(g, built, shifts) if shifts else built

    def __call__(self, precisions: Mapping[str, str], name: str = "trial",
                 threads: int | None = None,
                 shifts: Mapping[str, np.ndarray] | None = None) -> Callable:
        from quantlab.backends.onnxruntime import OnnxRuntimeBackend

        # Without ONNX Runtime's memory pattern: a session runs a few times, and its planned
        # block stayed on top of the hardest samples (a 640 px detector's trials peaked higher).
        return self.runs(OnnxRuntimeBackend(self.quantized(precisions, shifts=shifts),
                                            name=name, memory_pattern=False,
                                            threads=threads).run)


def make_plan(original: CalibratedModel, calibration, evaluation,
              settings: PlanSettings = PlanSettings(), *, task=None,
              checkpoint: Checkpoint | None = None,
              repairs: Mapping[str, CalibratedModel] | None = None,
              progress: Callable | None = None) -> PlanResult:
    """Plan `original` (a normalized model and its calibration) under `settings`' budget.

    `calibration` and `evaluation` are BatchSources (measurement on the former's
    hardest samples, certification on the latter). With a
    :class:`quantlab.tasks.Task` (labels or COCO ground truth of `evaluation`), the
    metric may be its primary metric (``top1``, ``map``). `repairs` (name -> a
    repaired copy and its calibration) are weighed first; ``plan.repairs`` records
    every option's noise. `checkpoint` (an interrupted run of the same plan) skips
    the trials and evaluations it holds. The steps are the module's, grouped in stages
    that each hand one record to the next (Prepared -> Calibrated -> HardSamples ->
    NoiseModel -> Searched -> PlanResult); their seconds are ``result.phases``.
    """
    settings.check()
    phases = _Phases()
    prepared = _prepare(original, calibration, evaluation, settings, task, repairs or {},
                        progress, phases)
    calibrated = _calibrate(prepared, phases)
    hard = _hard_samples(prepared, calibrated, phases)
    noise = _noise_model(prepared, calibrated, hard, checkpoint, phases)
    searched = _search(prepared, noise, phases)
    return _result(prepared, calibrated, hard, noise, searched, phases)


@dataclass
class _Prepared:
    """Stage 1: the context, the repair weighed and chosen, and the rules of its units."""

    context: _Context
    original: CalibratedModel
    chosen: CalibratedModel
    repair: str
    repair_records: dict[str, dict]
    g: Graph
    rules: _Rules


def _prepare(original: CalibratedModel, calibration, evaluation, settings: PlanSettings, task,
             repairs: Mapping[str, CalibratedModel], progress: Callable | None,
             phases: _Phases) -> _Prepared:
    """Setup, the repairs weighed, the rules (steps 1-2)."""
    with phases("setup"):
        context = _context(original.model, calibration, evaluation, settings, task, progress)
    with phases("weigh repairs"):
        chosen, repair, repair_records = _weigh_repairs(context, original, repairs)
    g = Graph(chosen.model)
    with phases("rules"):
        rules = _rules(context, chosen, g)
    return _Prepared(context, original, chosen, repair, repair_records, g, rules)


@dataclass
class _Calibrated:
    """Stage 2: the scales (a calibrator per unit, shared where units must share), the
    plan runner on them, and each INT8 op's bias shift (not yet weighed)."""

    amax: dict[str, float]
    calibrators: dict[str, str]
    runner: _Runner
    all_int8: dict[str, str]
    shifts: dict[str, np.ndarray]
    shift_report: object


def _calibrate(prepared: _Prepared, phases: _Phases) -> _Calibrated:
    """The calibrators chosen and the bias shifts measured (steps 3-4)."""
    context, chosen, g, rules = prepared.context, prepared.chosen, prepared.g, prepared.rules
    amax, calibrators = chosen.amax, {}
    with phases("calibrators"):
        if chosen.candidates:
            amax, calibrators = choose_calibrators(
                g, chosen.candidates, rules.units,
                single_samples(context.calibration, context.first), amax)
        amax = share_scales(g, amax)
    context.first = None  # under every later step's peak (a 640 px detector's batch: 157 MB)
    runner = _Runner(chosen.model, g, rules.units, amax, context.settings.high_precision,
                     context.runs)
    all_int8 = {u.name: rules.fixed.get(u.name, "int8") for u in rules.units}
    with phases("bias shifts"):
        shifts, shift_report = _bias_shifts(context, runner, all_int8)
    return _Calibrated(amax, calibrators, runner, all_int8, shifts, shift_report)


@dataclass
class _HardSamples:
    """Stage 3: the hardest calibration samples, FP32's outputs on them, the samples
    all-INT8 is screened on, bias correction weighed on them, every unit's local error."""

    hard: dict[str, np.ndarray]
    indices: np.ndarray
    references: dict[str, np.ndarray]
    fp32_seconds: float
    drawn: Draw | None
    shift_record: dict | None
    local: dict


def _hard_samples(prepared: _Prepared, calibrated: _Calibrated, phases: _Phases
                  ) -> _HardSamples:
    """The hardest samples, bias correction kept or dropped, the local errors (steps 5-7)."""
    context, rules = prepared.context, prepared.rules
    runner, all_int8, shifts = calibrated.runner, calibrated.all_int8, calibrated.shifts
    calibration = context.calibration
    with phases("hardest samples"):
        runner.shifts = shifts
        hard, hard_indices, energies, drawn = _hardest(context, lambda: runner(all_int8))
    references, shift_record, all_int8_outputs = None, None, None
    if shifts:
        with phases("bias correction"):
            references, fp32_seconds = _fp32_timed(context, hard)
            held = sum(v.nbytes for v in references.values()) <= HELD_REFERENCES_BYTES
            # The kept variant's outputs, where the all-INT8 screen reads them (below).
            screened_on_hard = drawn is None and context.metric.reads_outputs
            shift_record, all_int8_outputs = _weigh_bias(runner, hard, references, all_int8,
                                                         shifts, calibrated.shift_report,
                                                         held and screened_on_hard)
        if not held:
            references = None  # let go under the local errors' peak (640 px detector: 0.3 GB)
    with phases("local errors"):
        local = local_sqnr(prepared.g, calibrated.amax, rules.units,
                           single_samples(calibration, hard, calibration.batch_size))
    if references is None:
        with phases("hardest samples"):
            references, fp32_seconds = _fp32_timed(context, hard)
    drawn = _screen_samples(context, drawn, energies,
                            Draw(inputs=hard, references=references, outputs=all_int8_outputs,
                                 outputs_of=plan_key(all_int8)),
                            shifts_kept=bool(runner.shifts) == bool(shifts))
    return _HardSamples(hard, hard_indices, references, fp32_seconds, drawn, shift_record,
                        local)


@dataclass
class _NoiseModel:
    """Stage 4: all-INT8 judged first and, where it did not certify, the noise model of the
    trials (single units, random trials, front checks), with the evaluator that goes on."""

    model_fit: _ModelFit
    first: Evaluation
    evaluator: _Evaluator
    trials: Trials
    alone: dict[str, float]
    alone_samples: int
    random_trials: int


def _noise_model(prepared: _Prepared, calibrated: _Calibrated, hard: _HardSamples,
                 checkpoint: Checkpoint | None, phases: _Phases) -> _NoiseModel:
    """All-INT8 first, then the single units, the trials and the front checks (step 8-9)."""
    context, rules, settings = prepared.context, prepared.rules, prepared.context.settings
    runner, local = calibrated.runner, hard.local
    trials = Trials(plan_nsr(runner, hard.hard, hard.references),
                    [u.name for u in rules.units], rules.fixed,
                    checkpoint.trials if checkpoint else {},
                    checkpoint.add_trial if checkpoint else None)
    local_nsr = {u: 10.0 ** (-f["int8"] / 10.0) for u, f in local.items() if "int8" in f}
    evaluator = _Evaluator(context, runner, checkpoint)
    # All-INT8 is the search's first plan in any case: judged before the other trials, a
    # plan whose all-INT8 certifies needs none of them (their fit could not change it).
    with phases("all-INT8 first"):
        # Bias correction measured it already (the same plan, samples and references).
        record = hard.shift_record
        known = None if record is None else trials.measured(record[
            "hard_nsr_after" if record["chosen"] else "hard_nsr_before"])
        model_fit = _ModelFit(context, rules, local,
                              group_test(trials, 1, prior_nsr=local_nsr, all_int8=known), trials)
        first = evaluator.first(model_fit.most_int8(), hard.drawn)
    hard.drawn = None  # the screen's samples, read by all-INT8 alone
    message = unreachable(first, settings.max_drop)
    if message:  # before the trials, which could not change it
        warnings.warn(message, stacklevel=3)
    _weigh_repair_on_hard(prepared, hard, float(model_fit.sensitivity.nsr[0]))
    noise = _NoiseModel(model_fit, first, evaluator, trials, {}, 0, 0)
    if not first.certificate.certified:
        with phases("single units"):
            noise.alone, noise.alone_samples = _single_units(context, runner, rules, hard.hard,
                                                             hard.references)
        with phases("trials"):
            sensitivity = group_test(
                trials, settings.trials, progress=lambda r: context.step(r, desc="trials"),
                prior_nsr=noise.alone, all_int8=float(model_fit.sensitivity.nsr[0]),
                least=_least_random_trials(settings, first))
        noise.random_trials = len(sensitivity.nsr)
        with phases("front checks"):
            sensitivity, fitted = _check_front(context, rules, local, sensitivity, trials)
        noise.model_fit = _ModelFit(context, rules, local, sensitivity, trials, fitted)
    return noise


def _weigh_repair_on_hard(prepared: _Prepared, hard: _HardSamples, after: float) -> None:
    """The chosen repair's effect where the pins' is measured, on the hardest samples: the
    unrepaired model's all-INT8 noise (`after`: the repaired one's) in its record."""
    if prepared.repair == "none":
        return
    context, rules = prepared.context, prepared.rules
    fixed_nodes = {n: rules.fixed[u.name] for u in rules.units if u.name in rules.fixed
                   for n in u.nodes}
    before = all_int8_nsr({"none": prepared.original}, hard.hard, hard.references,
                          context.runs, fixed_nodes)
    prepared.repair_records[prepared.repair].update(hard_nsr_before=before["none"],
                                                    hard_nsr_after=after)


@dataclass
class _Searched:
    """Stage 5: the evaluated plans, the chosen one's position, the all-FP16 evaluation
    (or None) and every evaluated plan's noise checked against the fit."""

    done: list[tuple[FrontPoint, Evaluation]]
    chosen: int
    floor: Evaluation | None
    noise_checks: list[dict]


def _search(prepared: _Prepared, noise: _NoiseModel, phases: _Phases) -> _Searched:
    """The evaluations and the noise checks (steps 10)."""
    with phases("evaluations"):
        done, chosen, floor = _evaluate(prepared.context, prepared.rules, noise.model_fit,
                                        noise.evaluator, noise.first, noise.evaluator.cheap)
    evaluations = [e for _, e in done]
    warn_undecided(evaluations, evaluations[chosen])
    with phases("noise checks"):  # every evaluated plan's prediction checked on the hard samples
        noise_checks = _noise_checks(noise.model_fit, done)
    return _Searched(done, chosen, floor, noise_checks)


def _result(prepared: _Prepared, calibrated: _Calibrated, hard: _HardSamples,
            noise: _NoiseModel, searched: _Searched, phases: _Phases) -> PlanResult:
    """The plan as plain data with its evidence, its Q/DQ model checked against it, and
    everything the stages measured (step 11)."""
    context, rules, runner = prepared.context, prepared.rules, calibrated.runner
    sensitivity, fit = noise.model_fit.sensitivity, noise.model_fit.fitted
    chosen_point = searched.done[searched.chosen][0]
    decided = _decide(context, rules, chosen_point, fit.contribution, fit.fp16_contribution,
                      hard.local, noise.alone, calibrated.calibrators, sensitivity,
                      len(searched.done), searched.floor,
                      calibrated.shifts if runner.shifts else {})
    decided.repairs = [*prepared.repair_records.values(),
                       *([hard.shift_record] if hard.shift_record else [])]
    qdq_model = runner.quantized(decided.node_precisions())
    differ = {u: p for u, p in read_back(qdq_model, rules.units).items()
              if p != decided.units[u].precision}
    if differ:
        raise ModelError(f"the Q/DQ model runs units {sorted(differ)[:5]} as {differ} although "
                         "the plan says otherwise; this is a bug, please report it with the model.")
    return PlanResult(decided, qdq_model, dict(calibrated.amax), fit.front, sensitivity,
                      [e for _, e in searched.done], searched.chosen, hard.indices.tolist(),
                      prepared.chosen.model,
                      _uncertified(context, rules, runner, searched.done, chosen_point),
                      phases.seconds, searched.noise_checks,
                      _trial_cost(noise.trials, hard.fp32_seconds, noise.random_trials,
                                  len(noise.alone), noise.alone_samples),
                      noise.model_fit.refits, _outside_units(runner, rules))


def _fp32_runs(model: onnx.ModelProto, calibration
               ) -> tuple[Callable[[Callable], Callable], Callable, Mapping[str, np.ndarray]]:
    """(backend run -> bounded runs, the FP32 model's bounded run, the first calibration batch).

    Every whole-model run: runs of a bounded size (a 640 px batch of 32 held 13-15 GB),
    outputs samples first (a recurrent state [layers, N, hidden])."""
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

    fp32 = OnnxRuntimeBackend(model, name="fp32", release_arena=True)
    first = next(iter(calibration))
    size = samples_per_run(Graph(model), first, calibration)
    axes = output_sample_axes(model, fp32.run, first, calibration)

    def runs(run: Callable) -> Callable:
        return in_runs(run, calibration, size, axes)

    return runs, runs(fp32.run), first


def check_metric_on_model(model: onnx.ModelProto, calibration, metric: str) -> None:
    """Call a ``module:name`` or built-in `metric` once, FP32 against itself on the first
    calibration batch, so that a metric that fails fails before any long pass."""
    _try_metric(metric_for(metric), *_fp32_runs(model, calibration)[1:])


def _try_metric(metric: Metric, fp32_run: Callable, first: Mapping[str, np.ndarray]) -> None:
    """`metric` of FP32 against itself on the `first` batch, checked."""
    outputs = fp32_run(first)
    records = metric.records(outputs, outputs, 0)
    metric.scorer(records, "FP32 against itself on the first calibration batch")(
        np.arange(len(records)))


def _context(model: onnx.ModelProto, calibration, evaluation, settings: PlanSettings, task,
             progress: Callable | None) -> _Context:
    """Checks of the settings against the data, the FP32 model's bounded runs, the metric
    tried once on the first batch (a metric that fails fails now, not late)."""
    if task is not None:
        task.check_samples(evaluation.num_samples)
    metric = metric_for(settings.metric, task)
    for message in data_shortfalls(calibration.num_samples, evaluation.num_samples,
                                   settings.hard_count, settings.metric, settings.max_drop,
                                   task):
        warnings.warn(message, stacklevel=3)
    runs, fp32_run, first = _fp32_runs(model, calibration)
    if not metric.labels:
        _try_metric(metric, fp32_run, first)
    return _Context(settings, calibration, evaluation, task, metric, runs, fp32_run, first,
                    progress or (lambda items, **_: items))


def _draw(context: _Context) -> bool:
    """Whether the hardest-samples pass draws random samples (and keeps FP32's outputs on
    them) for :func:`_screen_samples`: for a metric of outputs other than output SQNR,
    unless the hardest samples are all the samples."""
    return (context.metric.reads_outputs and
            context.calibration.num_samples > context.settings.hard_count)


def _fp32_timed(context: _Context, batch: Mapping[str, np.ndarray]
                ) -> tuple[dict[str, np.ndarray], float]:
    """FP32's outputs on `batch` and the pass's seconds: the floor a trial is measured
    against."""
    start = time.perf_counter()
    outputs = context.fp32_run(batch)
    return outputs, time.perf_counter() - start


def single_unit_samples(length: int, units: int) -> int:
    """How many of `length` hardest samples the single-unit step runs `units` units on: as
    many sample passes in all as SINGLES_COST_IN_TRIALS trials over all of them, at least
    SINGLES_LEAST_SAMPLES."""
    return min(length, max(SINGLES_LEAST_SAMPLES,
                           round(length * SINGLES_COST_IN_TRIALS / max(1, units))))


def _single_units(context: _Context, runner: _Runner, rules: _Rules,
                  hard: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray]
                  ) -> tuple[dict[str, float], int]:
    """Each free unit's output noise alone in INT8 (every other unit FP32, pins kept) on the
    first few of the `hard` samples (FP32's outputs on them: `references`): the trials'
    prior (:func:`quantlab.planner.trials.group_test`'s `prior_nsr`).

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


def _hardest(context: _Context, all_int8: Callable[[], Callable]):
    """:func:`quantlab.planner.measure.hardest_samples` of the all-INT8 run ``all_int8()``
    against FP32 over the calibration data; where all the samples are kept and no screen
    reads their energies (a metric other than output SQNR), all of them without the pass,
    which would rank samples that are all kept."""
    calibration, count = context.calibration, context.settings.hard_count
    if calibration.num_samples <= count and not context.metric.is_output_sqnr:
        return all_samples(calibration), np.arange(calibration.num_samples), None, None
    return hardest_samples(calibration, context.fp32_run, all_int8(), count,
                           lambda b: context.step(b, desc="hardest samples"), draw=_draw(context))


def _screen_samples(context: _Context, drawn: Draw | None,
                    energies: tuple[np.ndarray, np.ndarray] | None, hardest: Draw,
                    shifts_kept: bool) -> Draw | None:
    """The calibration samples all-INT8 is screened on (:func:`screen`), or None (it is
    evaluated): for output SQNR every sample's energies from the hardest-samples pass,
    valid while the bias-correction step keeps the shifts that pass ran with; for another
    metric of outputs the pass's random draw, or the `hardest` when they are all the
    samples; none for a task metric (labels)."""
    if context.metric.is_output_sqnr:
        return Draw(energies=energies) if shifts_kept else None
    if context.metric.labels:
        return None
    return drawn if drawn is not None else hardest


def _weigh_repairs(context: _Context, original: CalibratedModel,
                   repairs: Mapping[str, CalibratedModel]
                   ) -> tuple[CalibratedModel, str, dict[str, dict]]:
    """The option (the model as given, or a repair) whose all-INT8 model has the least output
    noise on the first batch, its name and a record per option."""
    if not repairs:
        return original, "none", {}
    options = {"none": original, **repairs}
    weighed = all_int8_nsr(options, context.first, context.fp32_run(context.first),
                           context.runs)
    repair = quietest(weighed)
    return options[repair], repair, {
        name: {"repair": name, "chosen": name == repair, "all_int8_nsr_first_batch": nsr,
               **_repair_summary(options[name].report)} for name, nsr in weighed.items()}


def _rules(context: _Context, chosen: CalibratedModel, g: Graph) -> _Rules:
    """Units (MACs per sample: shapes inference misses, so one sample runs) and their rules."""
    from quantlab.backends.onnxruntime import OnnxRuntimeBackend

    one = context.calibration.slice(context.first, 0, 1)
    fp32 = OnnxRuntimeBackend(chosen.model, name="fp32")
    units = find_units(g, {name: np.shape(value) for name, value in one.items()},
                       lambda names: {n: a.shape for n, a in fp32.run(one, names).items()})
    reasons = apply_rules(units, RuleContext(g, chosen.ranges, chosen.p9999))
    allowed = {u.name: allowed_precisions(reasons.get(u.name, [])) for u in units}
    fixed = {n: fallback_precision(a, context.settings.high_precision)
             for n, a in allowed.items() if "int8" not in a}
    return _Rules(units, reasons, allowed, fixed)


def _bias_shifts(context: _Context, runner: _Runner, all_int8: Mapping[str, str]):
    """Each INT8 op's output shift (one pass over the calibration data), or none."""
    from quantlab.repairs import bias_shifts

    if not context.settings.bias_correction:
        return {}, None
    return bias_shifts(runner.model, runner.quantized(all_int8), context.calibration)


def _weigh_bias(runner: _Runner, hard: Mapping[str, np.ndarray],
                references: Mapping[str, np.ndarray], all_int8: Mapping[str, str],
                shifts: Mapping[str, np.ndarray], shift_report, keep: bool
                ) -> tuple[dict, dict[str, np.ndarray] | None]:
    """Bias correction kept (``runner.shifts``) only where it lowers all-INT8's noise on the
    `hard` samples (FP32's outputs on them: `references`); its record for plan.json, and
    with `keep` the kept variant's outputs on `hard` (the same plan on the same samples as
    the screen of all-INT8, :func:`_screen_samples`)."""
    def measured(kept: Mapping[str, np.ndarray]) -> tuple[float, list]:
        run = runner(all_int8, shifts=kept)
        if not keep:  # summed run by run, the outputs never held (:meth:`BoundedRun.pooled_nsr`)
            return run.pooled_nsr(hard, references), []
        parts = list(run.parts(hard))
        return parts_nsr(iter(parts), references), parts

    # One after the other: side by side, the second session's memory came on top (the
    # orientation model's plan peaked 0.25 GB higher), for a few tenths of a second (two
    # all-INT8 passes over 8 layout pages: 2.0 s side by side, 2.3-2.5 s one by one).
    (with_shifts, with_parts), (without, without_parts) = measured(shifts), measured({})
    chosen = lowers_noise(without, with_shifts)
    runner.shifts = dict(shifts) if chosen else {}
    outputs = joined(with_parts if chosen else without_parts) if keep else None
    return {"repair": "bias_correction", "chosen": bool(chosen), "hard_nsr_before": without,
            "hard_nsr_after": with_shifts, **_repair_summary(shift_report.to_dict())}, outputs


def _contributions(rules: _Rules, local: Mapping, sensitivity: OutputSensitivity
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """Each unit's fitted INT8 contribution and its FP16 one."""
    contribution = dict(zip(sensitivity.units, sensitivity.contribution, strict=True))
    return contribution, fp16_contributions(contribution, local, rules.fixed)


class _Fit(NamedTuple):
    """A noise model's contributions per unit (INT8 and FP16) and the front they give."""

    contribution: dict[str, float]
    fp16_contribution: dict[str, float]
    front: list[FrontPoint]


def _fitted(rules: _Rules, local: Mapping, sensitivity: OutputSensitivity,
            high_precision: str) -> _Fit:
    contribution, fp16_contribution = _contributions(rules, local, sensitivity)
    return _Fit(contribution, fp16_contribution, front(
        rules.units, rules.allowed, contribution, high_precision=high_precision,
        fp16_contribution=fp16_contribution))


def _check_front(context: _Context, rules: _Rules, local: Mapping,
                 sensitivity: OutputSensitivity, trials: Trials
                 ) -> tuple[OutputSensitivity, _Fit]:
    """Up to ``verify_rounds`` rounds: FRONT_CHECKS plans of the front measured against the
    fit (:func:`quantlab.planner.trials.check_fit`) and refitted, until every one is within
    DISAGREEMENT of its prediction. Random half-and-half trials cannot tell many small
    contributors apart, and a fit that calls them free puts them all in INT8. Returns the
    refitted noise model and its :func:`_fitted` figures and front."""
    from quantlab.planner.trials import DISAGREEMENT

    fitted = _fitted(rules, local, sensitivity, context.settings.high_precision)
    for _ in context.step(range(context.settings.verify_rounds), desc="front checks"):
        masks = _front_masks(fitted.front, sensitivity)
        if not len(masks):
            break
        checked = len(sensitivity.checks)
        sensitivity = check_fit(sensitivity, trials, masks, "front check")
        fitted = _fitted(rules, local, sensitivity, context.settings.high_precision)
        if all(c["factor"] <= DISAGREEMENT for c in sensitivity.checks[checked:]):
            break
    return sensitivity, fitted


class _ModelFit:
    """The noise model during the search: its fit, the front it gives, and its check before
    each evaluation (:meth:`verified`)."""

    def __init__(self, context: _Context, rules: _Rules, local: Mapping,
                 sensitivity: OutputSensitivity, trials: Trials, fitted: _Fit | None = None):
        self.context, self.rules, self.local, self.trials = context, rules, local, trials
        self.sensitivity = sensitivity
        self._fitted = fitted  # of `sensitivity`, when made already
        self.refits = 0

    @property
    def fitted(self) -> _Fit:
        """The fit's contributions and its front, made when first asked for (a hundred MILPs:
        2 s on a 100-unit detector)."""
        if self._fitted is None:
            self._fitted = _fitted(self.rules, self.local, self.sensitivity,
                                   self.context.settings.high_precision)
        return self._fitted

    def front(self) -> list[FrontPoint]:
        return self.fitted.front

    def most_int8(self) -> FrontPoint:
        """The front's last plan, without the rest of the front."""
        contribution, fp16_contribution = _contributions(self.rules, self.local,
                                                         self.sensitivity)
        return most_int8(self.rules.units, self.rules.allowed, contribution,
                         self.context.settings.high_precision, fp16_contribution)

    def mask(self, point: FrontPoint) -> np.ndarray:
        return np.array([point.precisions.get(u) == "int8" for u in self.sensitivity.units])

    def verified(self, point: FrontPoint) -> bool:
        """False when `point`, run as a trial (unless one ran it), was noisier than predicted
        by more than DISAGREEMENT: the noise model was then localized and refitted, and the
        front changed (at most MAX_REFITS times; after that, True)."""
        from quantlab.planner.trials import DISAGREEMENT

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


def _front_masks(points: list[FrontPoint], sensitivity: OutputSensitivity,
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


class _Evaluator:
    """Whole evaluation-set passes of plans against FP32's outputs, each kept in the checkpoint.

    FP32's pass runs once, with the first plan evaluated: its records (:class:`Reference`)
    and, for a metric that reads them, its outputs. A plan's outputs stream through its
    :class:`PairedScore` batch by batch and are dropped once recorded: a user's two-part
    metric decodes each sample once per evaluation, and the bootstrap reduces records.
    """

    def __init__(self, context: _Context, runner: _Runner, checkpoint: Checkpoint | None):
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
        certificate = self._scored(point.precisions, model_run).certificate(
            settings.max_drop, settings.min_sqnr)
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
                              self.context.metric, settings.max_drop, settings.min_sqnr,
                              settings.resamples)
            if screened is not None:
                return screened
        return self(point)


def _evaluate(context: _Context, rules: _Rules, model_fit: _ModelFit, evaluator: _Evaluator,
              first: Evaluation, cheap: Callable[[float], bool]):
    """The search over the front on the evaluation set, all-INT8 judged already (`first`;
    each other plan checked against the noise model first, :meth:`_ModelFit.verified`),
    then the fallback when no plan with INT8 certifies: all-FP16 (where units may run
    FP16), then the FP32 model. Returns the (plan, evaluation) pairs, the chosen one's
    position and the all-FP16 evaluation (or None)."""
    settings = context.settings
    all_int8 = plan_key(model_fit.front()[-1].precisions)

    def checked(point: FrontPoint) -> Evaluation | None:
        if plan_key(point.precisions) == all_int8:
            return first
        return evaluator(point) if model_fit.verified(point) else None

    done, chosen = search(model_fit.front, checked, settings.max_evaluations,
                          settings.max_drop, settings.min_sqnr, cheap)
    if done[chosen][1].certificate.certified:
        return done, chosen, None
    # No plan with INT8 certified: FP16 everywhere it may run, then the FP32 model.
    all_fp16 = FrontPoint(0.0, sum(model_fit.fitted.fp16_contribution.values()), 0.0, {
        u.name: fallback_precision(rules.allowed[u.name], settings.high_precision)
        for u in rules.units})
    floor = None
    if any(p == "fp16" for p in all_fp16.precisions.values()):
        floor = evaluator(all_fp16)
        done.append((all_fp16, floor))
        message = floor_message(floor.certificate, settings.metric, settings.max_drop)
        if message:
            warnings.warn(message, stacklevel=3)
        if floor.certificate.certified:
            return done, len(done) - 1, floor
    all_fp32 = FrontPoint(0.0, 0.0, 0.0, {u.name: fallback_precision(rules.allowed[u.name],
                                                                     "fp32")
                                          for u in rules.units})
    done.append((all_fp32, evaluator(all_fp32)))
    return done, len(done) - 1, floor


def _noise_checks(model_fit: _ModelFit, done: list[tuple[FrontPoint, Evaluation]]
                  ) -> list[dict]:
    """Each evaluated plan with INT8: its noise predicted by the final fit against its
    measured noise on the hardest samples (from a trial when one ran it, else one more
    trial), the evaluation's measured metric beside them."""
    sensitivity = model_fit.sensitivity
    index = {m.tobytes(): t for t, m in enumerate(sensitivity.masks)}
    records = []
    for point, evaluation in done:
        mask = model_fit.mask(point)
        if not mask.any():
            continue
        measured = (sensitivity.nsr[index[mask.tobytes()]] if mask.tobytes() in index
                    else model_fit.trials.run(mask[None])[0])
        predicted = float(mask.astype(np.float64) @ sensitivity.contribution)
        records.append({"int8_mac_share": evaluation.int8_mac_share, "predicted": predicted,
                        "measured": float(measured), "factor": disagreement(predicted, measured),
                        "value": evaluation.certificate.value,
                        "certified": evaluation.certificate.certified})
    return records


def _least_random_trials(settings: PlanSettings, first: Evaluation) -> int | None:
    """None (all ``settings.trials`` random trials run), or, when the budget lies far below
    the noise they measure or all-INT8 itself scored inside the budget (uncertified), the
    least number that run before they may stop
    (:func:`quantlab.planner.trials.group_test`'s `least`: once PREDICTED_IN_A_ROW in a
    row were predicted by the fit of those before): a quarter of them, at least 1.

    A random trial runs about half the units in INT8, so its noise is about half the
    all-INT8 plan's. When the noise the budget allows, extrapolated from all-INT8's
    evaluation `first` (:func:`quantlab.planner.evaluate.allowed_noise`), is below that
    by more than DISAGREEMENT, the trials describe plans noisier than any the search will
    weigh. Measured with the local-error prior (before :func:`_single_units`): where the
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
    from quantlab.planner.trials import DISAGREEMENT

    least = max(1, round(settings.trials * FAR_TRIALS_SHARE))
    if first.certificate.near_miss:
        # All-INT8 scored inside the budget: the plans that matter keep all but a few units
        # in INT8, which the single-unit figures order; random half-and-half trials describe
        # plans twice as noisy as any the search weighs (nudenet's YOLOv8n at a 0.03 F1 drop:
        # all-INT8 0.974 against 0.97, 24 trials and 8 front checks were 450 of 880 s).
        return least
    allowed = allowed_noise(first, [first], settings.max_drop, settings.min_sqnr)
    if allowed is None or allowed * DISAGREEMENT >= first.predicted / 2:
        return None
    return least


def _trial_cost(trials: Trials, fp32_seconds: float, random_trials: int, single_units: int,
                single_unit_samples: int) -> dict:
    """Median seconds of a trial (building its Q/DQ model and session, one run over the
    hardest samples; trials measured side by side share their run's seconds) against one
    warm FP32 pass over the same samples; how many of the
    trials were random plans (all-INT8 included); how many units were measured alone
    (:func:`_single_units`), on how many samples."""
    if not trials.seconds:
        return {}
    median = float(np.median(trials.seconds))
    return {"trials_run": len(trials.seconds), "random_trials": random_trials,
            "single_units": single_units, "single_unit_samples": single_unit_samples,
            "trial_seconds_median": median,
            "fp32_pass_seconds": fp32_seconds,
            "ratio": median / fp32_seconds if fp32_seconds > 0 else float("inf")}


def _outside_units(runner: _Runner, rules: _Rules) -> list[str]:
    """The tensors the Q/DQ model of the plan with every unit in FP32 still quantizes: what
    TensorRT would run in INT8 outside the units the plan decides. A warning names them;
    none is the rule (Q/DQ pairs are placed for the units' linear ops and their shared
    scales, docs/qdq.md)."""
    built = runner.quantized({u.name: "fp32" for u in rules.units}, shifts={})
    quantized = sorted({n.input[0] for n in built.graph.node if n.op_type == "QuantizeLinear"})
    if quantized:
        warnings.warn(f"with every unit out of INT8, {len(quantized)} tensor(s) stay quantized "
                      f"({', '.join(quantized[:5])}): their INT8 error is in every plan, the "
                      "FP32 fallback's too; this is a bug of the placement, please report it "
                      "with the model.", stacklevel=3)
    return quantized


def _uncertified(context: _Context, rules: _Rules, runner: _Runner,
                 done: list[tuple[FrontPoint, Evaluation]], chosen: FrontPoint):
    """The plan with the most INT8 (more than the chosen) that scored inside the budget but
    could not be certified (too few samples for a drop, or a score too near an SQNR floor),
    with its Q/DQ model and evaluation; None when there is none."""
    promising = [(p, e) for p, e in done if not e.screened and e.certificate.near_miss and
                 p.int8_mac_share > chosen.int8_mac_share]
    if not promising:
        return None
    point, evaluation = max(promising, key=lambda pair: pair[0].int8_mac_share)
    kept = Plan.from_rules(rules.units, rules.reasons)
    for unit in rules.units:
        kept.units[unit.name].precision = point.precisions[unit.name]
    kept.metric, kept.budget = context.settings.metric, context.settings.budget
    return kept, runner.quantized(kept.node_precisions()), evaluation


def _decide(context: _Context, rules: _Rules, chosen: FrontPoint, contribution: Mapping,
            fp16_contribution: Mapping, local: Mapping, alone: Mapping[str, float],
            calibrators: Mapping, sensitivity: OutputSensitivity, evaluated: int,
            floor: Evaluation | None, applied: Mapping[str, np.ndarray]) -> Plan:
    """The plan as plain data: each unit's precision, evidence (`alone`: its output noise
    alone in INT8, :func:`_single_units`) and reasons."""
    settings = context.settings
    decided = Plan.from_rules(rules.units, rules.reasons)
    rank = {u: i + 1 for i, u in enumerate(sensitivity.ranking())}
    all_int8 = sensitivity.predicted_nsr(contribution)
    for unit in rules.units:
        decision = decided.units[unit.name]
        decision.precision = chosen.precisions[unit.name]
        decision.predicted = contribution.get(unit.name, 0.0)
        decision.evidence["output_nsr_contribution"] = decision.predicted
        decision.evidence["output_rank"] = rank[unit.name]
        for precision, figure in local.get(unit.name, {}).items():
            decision.evidence[f"local_sqnr_{precision}_db"] = figure
        if unit.name in alone:
            decision.evidence["output_nsr_alone"] = alone[unit.name]
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
                f"rank {rank[unit.name]} of {len(rules.units)} by output-noise contribution "
                f"{decision.predicted:.3g} (all INT8: {all_int8:.3g}); " + (
                    "the certified plan of the front keeps it out of INT8"
                    if chosen.int8_mac_share > 0 else
                    f"no plan with INT8 held the budget ({evaluated} evaluated)"),
                SEARCH_SOURCE))
        if decision.precision == "fp32" and "fp16" in rules.allowed[unit.name] and \
                settings.high_precision == "fp16":
            if floor is None:
                why = (f"FP16 would add predicted output NSR "
                       f"{fp16_contribution.get(unit.name, 0.0):.3g} (local FP16 SQNR "
                       f"{local.get(unit.name, {}).get('fp16', float('nan')):.3g} dB); the "
                       "budget left by the INT8 units does not hold it")
            else:
                why = (f"all-FP16 scored {floor.certificate.value:.4g} against the limit "
                       f"{floor.certificate.limit:.4g} and could not be certified, so the plan "
                       "of last resort is the FP32 model")
            decision.reasons.append(Reason(SEARCH_CODE, False, ("fp32",), why, SEARCH_SOURCE))
    decided.metric, decided.budget = settings.metric, settings.budget
    decided.floor = None if floor is None else floor_record(floor.certificate)
    return decided


def _repair_summary(report: Mapping) -> dict:
    """The plain figures of a RepairReport dict that plan.json keeps: places changed, skipped."""
    return {"applied": len(report.get("applied", [])), "skipped": len(report.get("skipped", [])),
            "passes": report.get("passes", 0), **report.get("summary", {})}

