"""quantlab's Python API: one call per command, what the command line, the demo and the
notebooks call.

:func:`calibrate_model` is `quantlab calibrate`, :func:`plan_model` `quantlab plan`,
:func:`validate_model` `quantlab validate`, :func:`sweep_model` `quantlab sweep`,
:func:`check_model` (:mod:`quantlab.evaluation.gate`) `quantlab check`;
the commands in :mod:`quantlab.commands` only map their options onto these calls and print
what they return. Each takes the model, the data, one settings value and the output folder,
and writes the folder the command writes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from quantlab import choices, graph
from quantlab.calibration import calibrate, qdq
from quantlab.calibration.collect import Statistics
from quantlab.calibration.pipeline import (
    CALIBRATION_FILES,
    CalibrationResult,
    equalized,
    prepare_model,
    quantized_inputs,
    run_calibration,
    write_results,
)
from quantlab.data import BatchSource, DataOptions, Preprocess, checked_digest, preprocessing
from quantlab.engine import cache
from quantlab.engine.backends import tensorrt as trt_backend
from quantlab.errors import ConfigError, DataError
from quantlab.experiments.experiment import check_output, recorded_path
from quantlab.experiments.records import UNCERTIFIED, CalibrationRecord, PlanSummary, SweepRecord
from quantlab.progress import progress_bar

# What only plan, sweep, validate and check use is imported where they run: `quantlab
# calibrate` then starts without the planner, the sweep, validation and the reports
# (0.3-0.4 s of imports).
if TYPE_CHECKING:
    from quantlab.evaluation.tasks import Task
    from quantlab.evaluation.validate import ValidationResult
    from quantlab.experiments.sweep import Config, SweepResult
    from quantlab.planner.certify import Certificate
    from quantlab.planner.decisions import Plan
    from quantlab.planner.flow import PlanResult, PlanSettings


# Names this API's calls take or return, defined elsewhere and imported when first asked
# for (``from quantlab.api import PlanSettings``): `quantlab check`'s call and settings,
# the planner's settings and results, the sweep's, validation's.
_IMPORTED_WHEN_ASKED = {
    "CheckOptions": "quantlab.evaluation.gate", "CheckOutcome": "quantlab.evaluation.gate",
    "check_model": "quantlab.evaluation.gate", "PlanSettings": "quantlab.planner.flow",
    "PlanResult": "quantlab.planner.flow", "Plan": "quantlab.planner.decisions",
    "Certificate": "quantlab.planner.certify", "Config": "quantlab.experiments.sweep",
    "SweepResult": "quantlab.experiments.sweep", "Task": "quantlab.evaluation.tasks",
    "ValidationResult": "quantlab.evaluation.validate",
}


def __getattr__(name: str):
    if name in _IMPORTED_WHEN_ASKED:
        import importlib

        return getattr(importlib.import_module(_IMPORTED_WHEN_ASKED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _plan_settings() -> PlanSettings:
    from quantlab.planner.flow import PlanSettings

    return PlanSettings()


@dataclass(frozen=True)
class CalibrateOptions:
    """How `quantlab calibrate` calibrates (its defaults, choices.py's): the activations'
    `method` (with `method_params`), the weight amax and rounding, bias correction, equalization of
    depthwise and 1x1-conv inputs, a TensorRT <= 10 calibration cache for `trt_version`,
    and the collection's memory budget (None: 2 GB)."""

    method: str = choices.DEFAULT_METHOD
    method_params: dict[str, float] = field(default_factory=dict)
    weight_amax: str = choices.DEFAULT_WEIGHT_AMAX
    weight_rounding: str = choices.DEFAULT_WEIGHT_ROUNDING
    bias_correction: bool = True
    equalize: bool = True
    trt_version: str | None = None
    memory: int | str | None = None


def calibrate_model(model: str | os.PathLike | onnx.ModelProto,
                    data: str | os.PathLike | BatchSource | object,
                    options: CalibrateOptions, out: str | os.PathLike, *,
                    data_options: DataOptions | None = None, force: bool = False,
                    progress: bool = True) -> CalibrationResult:
    """`quantlab calibrate`: statistics of `model` on `data`, scales, the Q/DQ model, written
    into `out` (:func:`quantlab.calibration.pipeline.run_calibration`)."""
    data_options = data_options or DataOptions()
    return run_calibration(
        model, data, out, method=options.method, method_params=options.method_params,
        batch_size=data_options.batch_size, max_samples=data_options.max_samples,
        preprocess=preprocessing(data_options.preprocess), force=force, progress=progress,
        trt_version=options.trt_version, constants=data_options.constants,
        batch_axes=data_options.batch_axes, memory_budget=options.memory,
        equalize=options.equalize, weight_criterion=options.weight_amax,
        weight_rounding=options.weight_rounding, bias_correction=options.bias_correction)


@dataclass(frozen=True)
class PlanOptions:
    """How `quantlab plan` plans (its defaults, choices.py's): the budget and how much to
    measure (`planner`), the starting calibrator `method`, the `calibrators` each unit
    chooses from, the `repairs` weighed, and a calibration cache for `trt_version`."""

    planner: PlanSettings = field(default_factory=_plan_settings)
    method: str = choices.DEFAULT_METHOD
    calibrators: tuple[str, ...] = choices.DEFAULT_PLAN_CALIBRATORS
    repairs: tuple[str, ...] = choices.DEFAULT_PLAN_REPAIRS

    trt_version: str | None = None

    def fingerprinted(self) -> dict:
        """Every setting by name, the planner's among them."""
        return {**asdict(self.planner), **{key: value for key, value in asdict(self).items()
                                           if key != "planner"}}


@dataclass
class PlanOutcome:
    """What :func:`plan_model` planned and wrote: the planner's `result`, the folder's
    summary.json (`summary`), the `folder` as given and the next steps."""

    result: PlanResult
    summary: PlanSummary
    folder: str
    steps: list[str]

    @property
    def plan(self) -> Plan:
        return self.result.plan

    @property
    def certificate(self) -> Certificate:
        return self.result.certificate

    def lines(self, notes: bool = True) -> list[str]:
        """What `quantlab plan` prints of it (`notes`: the evaluations' notes too)."""
        result, certificate, metric = self.result, self.result.certificate, self.summary.metric
        lines = [f"plan: evaluation {number}: {evaluation.note}"
                 for number, evaluation in enumerate(result.evaluations, 1)
                 if evaluation.note and notes]
        verdict = "certified" if certificate.certified else "NOT certified"
        if result.fallback is not None:
            verdict += f" (the fallback, {result.fallback}: no plan with INT8 certified)"
        runs = result.model_runs
        lines.append(
            f"plan: {result.plan.int8_mac_share():.1%} of linear-op MACs in INT8; {metric} "
            f"{certificate.value:.4g} (FP32 {certificate.reference:.4g}, limit "
            f"{certificate.limit:.4g}) {verdict} at {certificate.confidence:.0%} on "
            f"{certificate.samples} samples after {runs} evaluation{'' if runs == 1 else 's'} "
            f"of a model; wrote {self.folder}/")
        if certificate.too_small:
            lines.append(certificate.too_small_message())
        if result.uncertified is not None:
            share, kept = result.uncertified[0].int8_mac_share(), result.uncertified[2]
            lines.append(
                f"plan: a plan with {share:.1%} of MACs in INT8 scored "
                f"{kept.certificate.value:.4g} (limit {kept.certificate.limit:.4g}) but could "
                f"not be certified on {kept.certificate.samples} samples; written to "
                f"{self.folder}/{UNCERTIFIED}/ (plan.json, model.int8.onnx) beside "
                "the certified one.")
        return lines + [f"next: {step}" for step in self.steps]


def run_fingerprint(model: onnx.ModelProto, model_name: str,
                    options: PlanOptions | SweepOptions, data_options: DataOptions,
                    *parts) -> str:
    """What identifies a plan's or a sweep's run for its checkpoint: the model, every setting,
    the metric's code and `parts` (the data's content, what the run derived)."""
    from quantlab.planner.evaluate import fingerprint
    from quantlab.user_code import metric_code

    settings = options.fingerprinted()
    chosen = {**settings, **asdict(data_options), "model": model_name}
    return fingerprint(model, *parts, sorted((key, str(value)) for key, value in chosen.items()),
                       metric_code(settings["metric"]))


def plan_model(model: str, data: str, evaluation: str, options: PlanOptions,
               out: str | os.PathLike, *, data_options: DataOptions | None = None,
               force: bool = False, progress: bool = True,
               named: str | os.PathLike | None = None) -> PlanOutcome:
    """`quantlab plan`: the most INT8 MACs of `model` (an .onnx file or zoo name) whose
    accuracy on `evaluation` stays inside `options`' budget, certified, written into `out`.

    `data` is calibration data, a calibration folder (its statistics reused) or ``zoo``;
    `evaluation` is held-out data or ``zoo``. Everything is checked before the long work;
    an interrupted run resumes from the checkpoint it left in `out`, a failed one leaves
    `out` as it was. `named` is the folder the next steps name (default `out`): where the
    user will find it when `out` is a staging folder (the demo's).
    """
    from quantlab.planner import folder as plan_folder
    from quantlab.planner import prepare

    out, data_options = os.fspath(out), data_options or DataOptions()
    named = out if named is None else os.fspath(named)
    check_output(out, force=force, produces=PlanSummary.FILES)
    if options.trt_version is not None:
        cache.implicit_int8_version(options.trt_version)
    options.planner.check()
    recorded = prepare.calibration_record(data)
    # Calibration and evaluation images are read alike: a calibration folder's recorded
    # preprocessing, any field given overriding it (refused where stats.npz is reused).
    preprocess = preprocessing(data_options.preprocess, recorded and recorded["preprocess"])
    if recorded is not None:
        prepare.check_overrides(data, recorded, preprocess)
    prepared = prepare.prepared_model(model, data, evaluation, recorded, data_options)
    quantized_inputs(prepared, "plan. If an input decides a branch holding them, freeze it "
                     "with --input NAME=VALUE")
    source, stats = prepare.calibration_source(model, data, prepared, recorded, preprocess,
                                               data_options)
    graph.record_data_shapes(prepared, source)
    # Fails before the work; trtexec takes shapes of the dynamic inputs only.
    profile = trt_backend.input_profile(prepared, data_options.batch_size, dynamic_only=True)
    if stats is not None:
        missing = sorted(set(qdq.activation_tensors_to_calibrate(prepared)) - set(stats.tensors))
        if missing:
            raise DataError(f"the statistics of {data} lack tensors {missing[:5]} the Q/DQ "
                            "model quantizes; they were collected on another model. Calibrate "
                            "this model, or pass its calibration data with --data.")
    # The evaluation data are opened (and checked) before any long work.
    eval_source, task = prepare.evaluation_source(model, evaluation, prepared, preprocess,
                                                  data_options)
    prepare.check_eval_shapes(prepared, eval_source, evaluation)
    # One pass over each: NaN/Inf refused, and the content identifies the run (checkpoint).
    digests = (checked_digest(source, "--data"), checked_digest(eval_source, "--eval"))
    inputs = _PlanInputs(prepared, source, stats, eval_source, task, profile, recorded,
                         preprocess, digests)
    existed = {path for path in (Path(out), *Path(out).parents) if path.exists()}
    had_checkpoint = (Path(out) / plan_folder.PROGRESS_FILE).exists()
    try:
        return _planned(inputs, model, data, options, data_options, out, force, progress,
                        named)
    except Exception:
        # A failure, not an interruption (Ctrl-C, SIGTERM keep the checkpoint to resume
        # from): the folder is left as it was.
        if not had_checkpoint:
            (Path(out) / plan_folder.PROGRESS_FILE).unlink(missing_ok=True)
        for folder in (Path(out), *Path(out).parents):
            if folder not in existed:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


@dataclass
class _PlanInputs:
    """What :func:`plan_model` checked before the long work: the prepared model, the
    calibration data with a folder's statistics (or None), the evaluation data with its
    task, trtexec's profile, --data's calibration.json (or None), the preprocessing and the
    data's content digests."""

    model: onnx.ModelProto
    source: BatchSource
    stats: Statistics | None
    evaluation: BatchSource
    task: Task | None
    profile: dict[str, tuple]  # input name -> (min, opt, max) shapes
    recorded: dict | None
    preprocess: Preprocess
    digests: tuple[str, str]


def _planned(inputs: _PlanInputs, model_name: str, data: str, options: PlanOptions,
             data_options: DataOptions, out: str, force: bool, progress: bool,
             named: str) -> PlanOutcome:
    """The long work of :func:`plan_model` once everything is checked: statistics and
    repairs, the plan, the folder (its next steps naming `named`)."""
    from quantlab.experiments.report.plan import next_steps
    from quantlab.planner import folder as plan_folder
    from quantlab.planner import prepare
    from quantlab.planner.evaluate import Checkpoint
    from quantlab.planner.flow import check_metric_on_model, make_plan

    model, source, evaluation = inputs.model, inputs.source, inputs.evaluation
    settings = options.planner
    if ":" in settings.metric:  # the user's metric fails now, not after the statistics pass
        check_metric_on_model(model, source, settings.metric)
    prepared = prepare.prepare(model, source, inputs.stats, options.method, options.calibrators,
                               options.repairs, options.trt_version is not None, data,
                               inputs.recorded, progress)
    calibration = prepared.calibration
    # Trials and evaluations are checkpointed in `out`: an interrupted run resumes from there,
    # only when the model, the data's content, the preprocessing, the options and the metric's
    # code are the same.
    checkpoint = Checkpoint(Path(out) / plan_folder.PROGRESS_FILE, run_fingerprint(
        model, model_name, options, data_options, *inputs.digests, source.num_samples,
        evaluation.num_samples, inputs.preprocess.to_dict(),
        sorted(calibration.scales.amax.items()), sorted(calibration.candidates),
        sorted(prepared.repaired)))
    if checkpoint.trials or checkpoint.evaluations:
        print(f"plan: resuming from {checkpoint.path}: {len(checkpoint.trials)} "
              f"trial(s) and {len(checkpoint.evaluations)} evaluation(s) of an interrupted run "
              "of the same model, data (same content), preprocessing, options and metric code "
              "are reused.")
    elif checkpoint.ignored:
        print(f"plan: {checkpoint.path} is from a run of another model, data or options "
              "(or unreadable); starting over.")
    result = make_plan(prepared.model, source, evaluation, settings, task=inputs.task,
                       checkpoint=checkpoint, repairs=prepared.repaired,
                       progress=partial(progress_bar, leave=False) if progress else None)
    result.phases = {**prepared.phases, **result.phases}
    # Titled with the user's model, not a calibration folder's normalized copy of it.
    model_file = graph.source_model(model) or model_name
    steps = next_steps(result, named, UNCERTIFIED)
    run = plan_folder.PlanRun(
        model_file, settings.metric, settings.max_drop, settings.min_sqnr,
        recorded_path(source.description), calibration.scales.method,
        list(calibration.candidates), recorded_path(evaluation.description),
        evaluation.num_samples, data_options.batch_size)
    summary = plan_folder.write_plan_folder(out, result, run, inputs.profile, options.trt_version,
                                            force, steps)
    return PlanOutcome(result, summary, out, steps)


@dataclass(frozen=True)
class ValidateOptions:
    """How `quantlab validate` compares (its defaults): `mode` global (stages end to end) or
    local (each INT8 layer fed the FP32 input), the SQNR `threshold_db` of a divergence, an
    end-to-end `metric` with its bootstrap `resamples`, the `memory` budget, the engine
    stage's backend, and the calibrator `method` of an INT8 model made here."""

    mode: str = "global"
    threshold_db: float = 30.0
    metric: str | None = None
    resamples: int = 200
    memory: int | str | None = None
    engine_backend: str = "onnxruntime"
    method: str = choices.DEFAULT_METHOD


def validate_model(model: str | os.PathLike, engine: str | os.PathLike | None, data: object,
                   options: ValidateOptions, out: str | os.PathLike, *,
                   data_options: DataOptions | None = None, torch_module=None, task=None,
                   calibrate_on: object = None, from_folder: str | os.PathLike | None = None,
                   model_file: str | None = None, force: bool = False,
                   progress: bool = True) -> ValidationResult:
    """`quantlab validate`: the FP32 `model` against its INT8 `engine` (a Q/DQ model, or a
    TensorRT engine with ``engine_backend="tensorrt"``) on `data`, and `torch_module` before
    them, layer by layer and end to end (`task`: ground truth), written into `out`.

    With `engine` None, `model` is calibrated here on `calibrate_on` with `options.method` and
    the calibration folder written into ``out/calibration`` once validation succeeded.
    `from_folder` is the calibration folder the models come from: its recorded
    preprocessing reads `data` unless `data_options` say otherwise. The report is titled
    with `model_file` (default: the user's file the model was made from).
    """
    from quantlab import data as batches  # at call time: tests watch what it opens
    from quantlab.evaluation.validate import validate

    data_options = data_options or DataOptions()
    recorded = CalibrationRecord.read(from_folder).preprocessing() if from_folder else None
    fp32 = prepare_model(model, data, data_options.constants, data_options.batch_axes)
    source = batches.open_data(data, graph.input_specs(fp32), data_options.batch_size,
                               data_options.max_samples,
                               preprocessing(data_options.preprocess, recorded))
    calibration = None
    if engine is None:
        calibration_out = Path(out) / "calibration"
        check_output(out, force=force, produces=["summary.json", "report.html"])
        check_output(calibration_out, force=force, produces=CALIBRATION_FILES)
        # Calibrated aside and written into OUT/calibration only once validation succeeded:
        # a failed run leaves no partial output.
        with tempfile.TemporaryDirectory(prefix="quantlab-validate-") as scratch:
            calibration = run_calibration(fp32, calibrate_on, Path(scratch) / "calibration",
                                          method=options.method,
                                          batch_size=data_options.batch_size, progress=progress)
            fp32, stage = calibration.model, calibration.qdq_model
            if options.engine_backend == "tensorrt":  # the engine is built from the files here
                stage = _engine_stage(calibration.folder / "model.int8.onnx",
                                      calibration.folder / "model.onnx", data, options,
                                      data_options)
    else:
        stage = _engine_stage(engine, model, data, options, data_options)
    # The report names the user's model, not a normalized copy (a calibration folder's
    # model.onnx records the file it was made from).
    model_file = model_file or graph.source_model(fp32) or str(model)
    recorded_folder = from_folder or (calibration_out if calibration is not None else None)
    with warnings.catch_warnings():  # the result holds them, shown with it
        warnings.simplefilter("ignore")
        result = validate(fp32, stage, source, out, torch_module=torch_module, task=task,
                          mode=options.mode, threshold_db=options.threshold_db, force=force,
                          progress=progress, memory_budget=options.memory,
                          metric=options.metric, resamples=options.resamples,
                          title=f"Validation of {Path(model_file).name}", model_file=model_file,
                          calibration=str(Path(recorded_folder).resolve())
                          if recorded_folder else None)
    if calibration is not None:
        write_results(calibration, calibration_out, force=force)
    return result


def _engine_stage(engine: str | os.PathLike, model: str | os.PathLike, data: object,
                  options: ValidateOptions, data_options: DataOptions):
    """The engine stage: the Q/DQ model for ONNX Runtime, or a TensorRT engine backend."""
    if options.engine_backend == "tensorrt":
        # A prebuilt engine is compared on what it exposes; a built one exposes every tensor it
        # keeps, the way the installed TensorRT allows (docs/tensorrt.md, per-version strategy).
        if Path(engine).suffix.lower() in trt_backend.ENGINE_SUFFIXES:
            return trt_backend.make_engine_backend("tensorrt", engine, model=model)
        return trt_backend.make_engine_backend("tensorrt", engine,
                                               max_batch=data_options.batch_size,
                                               debug_tensors=trt_backend.LAYERS)
    with warnings.catch_warnings():  # the INT8 model's float-only parts are the FP32 one's
        warnings.simplefilter("ignore")
        return prepare_model(engine, data, data_options.constants, data_options.batch_axes)


@dataclass(frozen=True)
class SweepOptions:
    """What `quantlab sweep` sweeps (its defaults): the calibrator `methods`, the
    `percentiles` of the percentile calibrator and the calibration-set sizes `calib_sizes`
    (None: quantlab.experiments.sweep's defaults), each configuration scored by `metric` against
    FP32 with `resamples` paired bootstrap resamples; an amax moving by less than `tolerance`
    from n/2 to n samples has converged; the model `equalize`d as calibrate does."""

    metric: str = "sqnr"
    methods: tuple[str, ...] = choices.METHODS
    percentiles: tuple[float, ...] | None = None
    calib_sizes: tuple[int, ...] | None = None
    tolerance: float | None = None
    resamples: int = 200
    equalize: bool = True

    def fingerprinted(self) -> dict:
        """Every setting by name."""
        return asdict(self)


@dataclass
class SweepOutcome:
    """What :func:`sweep_model` swept and wrote: the sweep's `result`, its configurations,
    the `folder` as given, and the calibrate command that reproduces best/."""

    result: SweepResult
    configs: list[Config]
    folder: str
    metric: str
    reproduce: str

    def lines(self) -> list[str]:
        """What `quantlab sweep` prints of it."""
        best = self.result.best_record
        return [f"sweep: best {best['label']}: {self.metric} {best['value']:.4g} "
                f"(FP32 {best['fp32']:.4g}); {len(self.configs)} configurations from one "
                f"collection pass in {_duration(sum(self.result.seconds.values()))}; wrote "
                f"{self.folder}/ (best/: what `{self.reproduce}` writes)",
                *self.result.sentences.values()]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def sweep_model(model: str, data: str, evaluation: str, options: SweepOptions,
                out: str | os.PathLike, *, data_options: DataOptions | None = None,
                force: bool = False, progress: bool = True,
                allow_long: bool = False) -> SweepOutcome:
    """`quantlab sweep`: every configuration of `options` (calibrators x parameters x
    calibration sizes, one collection pass over `data`) scored on `evaluation`, the data's
    sufficiency judged, written into `out`. A sweep estimated to take over an hour is
    refused unless `allow_long`; an interrupted one resumes from its checkpoint in `out`."""
    from quantlab.experiments import sweep
    from quantlab.planner import prepare

    out, data_options = os.fspath(out), data_options or DataOptions()
    check_output(out, force=force, produces=SweepRecord.FILES)
    for method in options.methods:
        calibrate.check_method(method, {})
    recorded = prepare.calibration_record(data)
    preprocess = preprocessing(data_options.preprocess, recorded and recorded.get("preprocess"))
    prepared = prepare.prepared_model(model, data, evaluation, recorded, data_options)
    source, folder_stats = prepare.calibration_source(model, data, prepared, recorded,
                                                      preprocess, data_options, who="sweep")
    graph.record_data_shapes(prepared, source)
    sizes = sweep.check_sizes(options.calib_sizes or sweep.default_sizes(source.num_samples),
                              source.num_samples, source.description,
                              graph.fixed_batch_size(prepared) or 1)
    configs = sweep.configurations(options.methods,
                                   options.percentiles or sweep.DEFAULT_PERCENTILES, sizes)
    eval_source, task = prepare.evaluation_source(model, evaluation, prepared, preprocess,
                                                  data_options)
    # One pass over each: NaN/Inf refused, and the content identifies the run (checkpoint).
    digests = (checked_digest(source, "--data"), checked_digest(eval_source, "--eval"))
    estimate = sweep.estimate_seconds(prepared, eval_source, options.metric, task,
                                      options.resamples, sizes[-1], len(configs))
    plan_text = (f"{len(configs)} configurations ({len(configs) // len(sizes)} calibrator "
                 f"settings x {len(sizes)} sizes {sizes}) on {eval_source.num_samples} "
                 f"evaluation samples, one collection pass over {sizes[-1]} calibration samples")
    if estimate > sweep.LONG_SWEEP_S and not allow_long:
        raise ConfigError(
            f"this sweep runs {plan_text}: about {estimate / 3600:.1f} h on this machine "
            "(estimated on the first evaluation batch). Pass --allow-long to run it, or cut it "
            "down: fewer --methods, --percentiles or --calib-sizes, --max-samples, or fewer "
            "--resamples (a detector's mAP bootstrap takes most of its time).")
    print(f"sweep: {plan_text}; estimated {_duration(estimate)}.")
    repairs = {}
    if recorded is None and options.equalize:
        # The model `quantlab calibrate` quantizes by default: its inputs equalized from the
        # calibration data (here the largest size's; a calibration folder's model.onnx is
        # already as it was calibrated).
        prepared, repairs = equalized(prepared, source.subset(0, sizes[-1]))
        applied = repairs.get("depthwise_equalization", {}).get("applied", [])
        if applied:
            graph.record_data_shapes(prepared, source)
            print(f"sweep: equalized {len(applied)} depthwise-conv input(s) as `quantlab "
                  "calibrate` does (--no-equalize: not).")
    inputs = _SweepInputs(prepared, qdq.indexed(prepared), source, folder_stats, eval_source,
                          task, preprocess, digests, recorded, repairs)
    return _swept(inputs, configs, model, data, evaluation, options, data_options, out, force,
                  progress)


@dataclass
class _SweepInputs:
    """What :func:`sweep_model` prepared before the long work: the (equalized) model and its
    index, the calibration data with a folder's statistics (or None), the evaluation data
    with its task, the preprocessing, the data's content digests, --data's calibration.json
    (or None) and the repairs applied."""

    model: onnx.ModelProto
    index: graph.Graph
    source: BatchSource
    stats: Statistics | None
    evaluation: BatchSource
    task: Task | None
    preprocess: Preprocess
    digests: tuple[str, str]
    recorded: dict | None
    repairs: dict


def _swept(inputs: _SweepInputs, configs: list[Config], model_name: str, data: str,
           evaluation: str, options: SweepOptions, data_options: DataOptions, out: str,
           force: bool, progress: bool) -> SweepOutcome:
    """The long work of :func:`sweep_model`: statistics, every configuration, the folder."""
    from quantlab.experiments import sweep, sweep_folder

    tensors = qdq.activation_tensors_to_calibrate(inputs.index)
    known, stats, source = {}, inputs.stats, inputs.source
    if stats is not None:
        missing = sorted(set(tensors) - set(stats.tensors))
        if missing:
            raise DataError(f"the statistics of {data} lack tensors {missing[:5]} the Q/DQ "
                            "model quantizes; they were collected on another model. Pass its "
                            "calibration data with --data instead.")
        known[stats.num_samples] = Statistics({name: stats.tensors[name] for name in tensors},
                                              stats.num_samples, stats.num_bins)
    progress_dir = Path(out) / sweep_folder.PROGRESS_DIR
    # Statistics and records are reused only for the same model, data content (not paths,
    # sizes or dates: a file rewritten in place is other data), preprocessing, options and the
    # metric's code.
    checkpoint = sweep_folder.SweepCheckpoint(progress_dir, run_fingerprint(
        inputs.model, model_name, options, data_options, *inputs.digests,
        source.num_samples, inputs.evaluation.num_samples,
        inputs.preprocess.to_dict(), tensors,
        None if stats is None else (stats.num_samples, stats.num_bins)))
    blocks = checkpoint.blocks()
    if checkpoint.records or blocks:
        print(f"sweep: resuming: {len(checkpoint.records)} configuration(s) and "
              f"{sum(b.num_samples for b in blocks.values())} samples' statistics already in "
              f"{progress_dir}, of an interrupted sweep of the same model, data (same content), "
              "preprocessing, options and metric code.")
    elif checkpoint.ignored:
        print(f"sweep: {progress_dir} is from a sweep of another model, data, options or "
              "metric code (or unreadable); starting over.")
    evaluator = sweep.Evaluator(inputs.model, inputs.evaluation, options.metric, inputs.task,
                                options.resamples,
                                partial(progress_bar, leave=False) if progress else None)
    try:
        result = sweep.run_sweep(
            inputs.model, source, evaluator, configs, tensors=tensors, known_stats=known,
            known_blocks=blocks, done=checkpoint.records, on_block=checkpoint.add_block,
            on_record=checkpoint.add_record,
            tolerance=sweep.TOLERANCE if options.tolerance is None else options.tolerance,
            progress=partial(progress_bar, leave=True) if progress else None,
            show_collection=progress,
            **({"num_bins": stats.num_bins} if stats is not None else {}))
        reproduce = sweep_folder.reproducing_command(model_name, data, configs[result.best],
                                                     inputs.recorded, options.equalize)
        sweep_folder.write_sweep_folder(out, force, model_name, options.metric, evaluation,
                                        inputs.index, source, configs, result, inputs.repairs,
                                        options.equalize, reproduce)
    except Exception:
        # A failed run (a full disk, a metric that fails) leaves nothing in `out`; only an
        # interrupted one (KeyboardInterrupt, SIGTERM: not Exceptions) keeps its checkpoint.
        checkpoint.remove()
        raise
    checkpoint.remove()
    return SweepOutcome(result, configs, out, options.metric, reproduce)
