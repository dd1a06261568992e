"""The regression gate (`quantlab check`): a candidate against a stored baseline folder, both
evaluated now on the same data with their real INT8 models (ONNX Runtime integer kernels),
each against its own FP32 model.

The candidate is a calibrate, sweep or plan folder, or a model calibrated here as the
baseline was (its calibration.json: method, parameters, preprocessing, frozen inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantlab import graph
from quantlab.calibration import collect, pipeline
from quantlab.data import DataOptions, Preprocess, checked_digest, open_data, preprocessing
from quantlab.errors import ConfigError, DataError
from quantlab.evaluation.scoring import Certificate, output_sqnr
from quantlab.experiments.records import PlanSummary, SweepRecord, read_calibration_record
from quantlab.experiments.runs import Run, load_run
from quantlab.experiments.sweep import Evaluator
from quantlab.planner.decisions import Plan

# Kinds of run a gate compares (they hold an FP32 and an INT8 model).
CHECKED_KINDS = ("calibrate", "sweep", "plan")


@dataclass(frozen=True)
class CheckOptions:
    """What the gate holds: the INT8 `metric` may drop from the baseline's by `max_drop` at
    most, the candidate's output SQNR is at least `min_sqnr` dB (None: any); intervals with
    `resamples` paired bootstrap resamples."""

    metric: str = "sqnr"
    max_drop: float = 0.0
    min_sqnr: float | None = None
    resamples: int = 200


@dataclass
class CheckOutcome:
    """The gate's verdict: each side's (certificate of its INT8 metric against its FP32,
    output SQNR in dB) by "baseline" / "candidate", and why the candidate fails (none: it
    holds the line)."""

    candidate: str
    baseline: str
    evaluation: str
    metric: str
    max_drop: float
    scores: dict[str, tuple[Certificate, float]]
    failures: list[str] = field(default_factory=list)
    candidate_is_folder: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures

    def verdict(self) -> str:
        """The paragraph `quantlab check` ends with."""
        base, cand = self.scores["baseline"][0], self.scores["candidate"][0]
        if self.passed:
            return (f"check: passed: {self.candidate} holds the line of {self.baseline} (INT8 "
                    f"{self.metric} {cand.value:.4g} vs {base.value:.4g}, allowed drop "
                    f"{self.max_drop:g}).")
        compare = (f"`quantlab compare {self.baseline} {self.candidate}` (settings, scales) "
                   "and " if self.candidate_is_folder else "")
        return (f"check: FAILED: {self.candidate} falls behind the baseline {self.baseline} on "
                f"{self.evaluation} ({cand.samples} samples): {'; and '.join(self.failures)}. "
                "Both were evaluated now on the same data with their real INT8 models (ONNX "
                f"Runtime integer kernels). Inspect the change with {compare}`quantlab "
                "validate --from` (the layer that diverges first), or update the baseline if "
                "the change is intended.")


def check_model(candidate: str, baseline: str, evaluation: str, options: CheckOptions, *,
                data: str | None = None, data_options: DataOptions | None = None,
                progress: bool = True) -> CheckOutcome:
    """`quantlab check`: evaluate `baseline` (a calibrate, sweep or plan folder) and
    `candidate` (such a folder, or a model calibrated here on `data`, default the
    baseline's calibration data) on `evaluation` (data, or ``zoo`` with a zoo model name as
    `candidate`), and say whether the candidate holds the baseline's line."""
    from functools import partial

    from quantlab.progress import progress_bar

    data_options = data_options or DataOptions()
    baseline_run = load_run(baseline)
    if baseline_run.kind not in CHECKED_KINDS:
        raise ConfigError(f"--baseline {baseline} is a {baseline_run.kind} run; a baseline is "
                          f"a folder of {', '.join(CHECKED_KINDS)} (it holds the INT8 model).")
    base_folder = baseline_run.model_folder
    recorded = _recorded(base_folder)
    preprocess = preprocessing(data_options.preprocess, recorded and recorded.get("preprocess"))
    bars = partial(progress_bar, leave=False) if progress else None
    candidate_run = None
    if Path(candidate).is_dir():
        candidate_run = load_run(candidate)
        if candidate_run.kind not in CHECKED_KINDS:
            raise ConfigError(f"{candidate} is a {candidate_run.kind} run; check a folder of "
                              f"{', '.join(CHECKED_KINDS)}, or a model.")
        models = _folder_models(candidate_run.model_folder)
    else:
        if baseline_run.kind == "plan":
            raise ConfigError(
                f"--baseline {baseline} is a plan: plan the new model first (quantlab plan "
                f"{candidate} ... --out DIR) and check DIR against it, so the INT8 shares "
                "of both plans are compared.")
        models = _calibrated(candidate, data, recorded, preprocess, data_options, progress)
    base_models = _folder_models(base_folder)
    _check_like_with_like(candidate, baseline, baseline_run, base_models[0], models[0],
                          options.metric)
    task = _task(candidate, evaluation, data_options.max_samples)
    scores = {}
    for name, (fp32, int8) in (("baseline", base_models), ("candidate", models)):
        scores[name] = _score(fp32, int8, evaluation, options, data_options, preprocess, task,
                              bars)
        cert, sqnr = scores[name]
        print(f"check: {name} {baseline if name == 'baseline' else candidate}: INT8 "
              f"{options.metric} {cert.value:.4g} (FP32 {cert.reference:.4g}; "
              f"{2 * cert.confidence - 1:.0%} interval [{cert.interval[0] + cert.limit:.4g}, "
              f"{cert.interval[1] + cert.limit:.4g}]), output SQNR {sqnr:.1f} dB, "
              f"{cert.samples} samples")
    outcome = CheckOutcome(candidate, baseline, evaluation, options.metric, options.max_drop,
                           scores, candidate_is_folder=candidate_run is not None)
    outcome.failures = _failures(outcome, options, baseline_run, candidate_run)
    return outcome


def _failures(outcome: CheckOutcome, options: CheckOptions, baseline_run: Run,
              candidate_run: Run | None) -> list[str]:
    """Why the candidate falls behind (none: it holds the line); DataError for a NaN
    baseline, which would let any candidate pass."""
    base, cand = outcome.scores["baseline"][0], outcome.scores["candidate"][0]
    if math.isnan(base.value):
        raise DataError(f"the baseline {outcome.baseline} scores INT8 {options.metric} NaN on "
                        f"{outcome.evaluation}: its INT8 model outputs NaN or Inf, and a NaN "
                        "baseline lets any candidate pass. Make the baseline again.")
    failures = []
    if math.isnan(cand.value):
        failures.append(f"its INT8 {options.metric} is NaN: its INT8 model outputs NaN or Inf")
    # Equal scores are no drop, also +inf vs +inf (an exact SQNR), whose difference is NaN.
    drop = 0.0 if base.value == cand.value else base.value - cand.value
    if drop > options.max_drop:
        failures.append(f"its INT8 {options.metric} is {cand.value:.4g} against the baseline's "
                        f"{base.value:.4g}, a drop of {drop:.4g}, more than --max-drop "
                        f"{options.max_drop:g}")
    sqnr = outcome.scores["candidate"][1]
    if options.min_sqnr is not None and not sqnr >= options.min_sqnr:
        failures.append(f"its INT8 output SQNR is {sqnr:.1f} dB, under --min-sqnr "
                        f"{options.min_sqnr:g} dB")
    if baseline_run.kind == "plan" and candidate_run is not None and candidate_run.kind == "plan":
        shares = [Plan.load(run.path / "plan.json").int8_mac_share()
                  for run in (baseline_run, candidate_run)]
        print(f"check: INT8 share of MACs {shares[0]:.2%} (baseline) -> {shares[1]:.2%}")
        if shares[1] < shares[0] - 1e-12:
            failures.append(f"its plan keeps {shares[1]:.2%} of the MACs in INT8, less than the "
                            f"baseline plan's {shares[0]:.2%}")
    return failures


def _check_like_with_like(candidate: str, baseline: str, baseline_run: Run, base_fp32,
                          candidate_fp32, metric: str) -> None:
    """ConfigError unless baseline and candidate hold the same model and the baseline, when it
    records a metric (plan, sweep), was made with `metric`. The same model: the same content
    (digest of the FP32 model each was made from), or the same network with other weights (a
    retrained or rebuilt model, what the CI recipe checks), which is said."""
    digests = graph.source_digest(base_fp32), graph.source_digest(candidate_fp32)
    same_network = graph.architecture_digest(base_fp32) == graph.architecture_digest(
        candidate_fp32)
    if same_network and digests[0] != digests[1]:
        print(f"check: {candidate} is the network of the baseline with other weights "
              f"(content digest {digests[1]}, the baseline's {digests[0]}).")
    elif not same_network:
        raise ConfigError(
            f"--baseline {baseline} and {candidate} hold different models: "
            f"{graph.source_model(base_fp32)} (content digest {digests[0]}) and "
            f"{graph.source_model(candidate_fp32)} (content digest {digests[1]}), whose ops or "
            "shapes differ; check compares a new calibration, plan or build of the baseline's "
            "network (its weights may differ). Make a baseline of this model first.")
    record = {"plan": PlanSummary, "sweep": SweepRecord}.get(baseline_run.kind)
    recorded = record and record.read(baseline_run.path).metric
    if recorded and recorded != metric:
        raise ConfigError(f"--baseline {baseline} was made with --metric {recorded}; "
                          f"check it with --metric {recorded}, not {metric}.")


def _recorded(folder: Path) -> dict | None:
    """The folder's calibration.json, read and checked (a plan folder has none)."""
    return read_calibration_record(folder) if (folder / "calibration.json").is_file() else None


def _folder_models(folder: Path):
    """(FP32 model, INT8 model) of an experiment folder."""
    return graph.load_model(folder / "model.onnx"), graph.load_model(folder / "model.int8.onnx")


def _calibrated(candidate: str, data: str | None, recorded: dict, preprocess: Preprocess,
                data_options: DataOptions, progress: bool):
    """(FP32 model, INT8 model) of a model candidate, calibrated as the baseline recorded."""
    # The baseline's data and sample count, unless `data` (and max_samples) say otherwise.
    data, limit = ((data, data_options.max_samples) if data else
                   (recorded["data"], recorded["num_samples"]))
    if data == "zoo":
        from quantlab import zoo

        data = zoo.get(candidate).calibration_set()
    elif not Path(data).exists():
        raise ConfigError(f"the baseline's calibration data {data} cannot be read here; pass "
                          "the calibration data of the new model with --data.")
    model = pipeline.prepare_model(
        candidate, data, {**recorded.get("frozen_inputs", {}), **data_options.constants},
        {**recorded.get("sample_axes", {}), **data_options.batch_axes})
    source = open_data(data, graph.input_specs(model), data_options.batch_size, limit,
                       preprocess)
    stats = collect.collect(model, source, pipeline.quantized_inputs(model, "check"),
                            progress=progress)
    method = recorded["method"]
    result = pipeline.calibrate_from_stats(
        model, stats, source, method, {} if method == pipeline.AUTO else recorded["params"],
        weight_criterion=recorded.get("weight_amax") or "max",
        bias_correction="bias_correction" in (recorded.get("repairs") or {}))
    return result.model, result.qdq_model


def _task(candidate: str, evaluation: str, max_samples: int | None):
    """(zoo task, its evaluation inputs) of ``zoo`` `evaluation` (`candidate` must then be a
    zoo name), else (None, None)."""
    from quantlab.zoo_names import ZOO_NAMES

    if evaluation != "zoo":
        return None, None
    if candidate not in ZOO_NAMES:
        names = ", ".join(ZOO_NAMES)
        raise ConfigError(f"--eval zoo needs a zoo model name as MODEL_OR_DIR ({names}), not "
                          f"{candidate}; pass evaluation data instead.")
    from quantlab import zoo
    from quantlab.evaluation.tasks import Task

    entry = zoo.get(candidate)
    eval_set = entry.eval_set(max_samples)
    return Task.from_zoo(entry, eval_set), eval_set.inputs


def _score(fp32, int8, evaluation: str, options: CheckOptions, data_options: DataOptions,
           preprocess: Preprocess, task, progress) -> tuple[Certificate, float]:
    """(certificate of the INT8 metric against FP32, INT8 output SQNR in dB) on `evaluation`;
    `task` is :func:`_task`'s, `progress` a bar factory or None."""
    task, zoo_inputs = task
    if task is not None:
        source = open_data(zoo_inputs, graph.input_specs(fp32), data_options.batch_size)
    else:
        source = open_data(evaluation, graph.input_specs(fp32), data_options.batch_size,
                           data_options.max_samples, preprocess)
    checked_digest(source, "--eval")
    evaluator = Evaluator(fp32, source, options.metric, task, options.resamples, progress)
    outputs = evaluator.outputs(int8, "INT8 evaluation")
    if not all(np.isfinite(v).all() for batch in outputs for v in batch.values()
               if np.issubdtype(v.dtype, np.floating)):
        # The scorer refuses NaN outputs; for the gate they are a score of NaN: a failed
        # candidate, or a baseline to make again (run's verdicts).
        fp32_value = evaluator.reference.score(np.arange(source.num_samples))
        nan = math.nan
        return Certificate(options.metric, fp32_value, nan, nan, (nan, nan), 0.95,
                           source.num_samples, False, False, None), nan
    certificate = evaluator.against_fp32(outputs)
    sqnr = certificate.value if options.metric == "sqnr" else output_sqnr(outputs,
                                                                          evaluator.references)
    return certificate, sqnr
