"""The planner's first steps (docs/planner.md, statistics and repairs): the model and the data
as a plan (or a sweep) is given them, the statistics, their calibration, and the repaired
copies of the model the planner weighs (:class:`RepairOptions`); then, in the planning flow,
the first stage: the options weighed and one chosen (:func:`weigh_repairs` -> :class:`Prepared`).

--data may be a calibration folder written by `quantlab calibrate`: its ``stats.npz`` is
reused, its ``model.onnx`` planned, and its data re-read with the recorded preprocessing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx

from quantlab import graph
from quantlab.calibration import calibrate, collect, qdq, repairs
from quantlab.calibration.repairs import quietest
from quantlab.choices import PREPROCESS_OPTIONS
from quantlab.data import BatchSource, DataOptions, Preprocess, open_data
from quantlab.engine import trt_ranges
from quantlab.errors import ConfigError, DataError
from quantlab.planner.context import Context
from quantlab.planner.measure import CalibratedModel, all_int8_nsr


def calibration_record(data: str) -> dict | None:
    """``calibration.json`` of `data` when it is a calibration folder (with ``stats.npz``),
    read and checked by :func:`quantlab.experiments.records.read_calibration_record`."""
    from quantlab.experiments.records import read_calibration_record

    folder = Path(data)
    if (folder / "stats.npz").is_file() and (folder / "calibration.json").is_file():
        return read_calibration_record(folder)
    return None


def equalized_by_calibrate(recorded: dict | None) -> list:
    """The inputs `quantlab calibrate` equalized in a calibration folder's model.onnx (its
    calibration.json, `recorded`), or [] when --data is no calibration folder."""
    repaired = (recorded or {}).get("repairs") or {}
    return (repaired.get("depthwise_equalization") or {}).get("applied") or []


def check_overrides(data: str, recorded: dict, preprocess: Preprocess) -> None:
    """Refuse preprocessing options that contradict the calibration folder `data` whose
    statistics are reused: stats.npz holds tensors of images read the recorded way, while the
    calibration and evaluation images would be read the new way."""
    folder_data = Path(recorded["data"])
    if recorded["preprocess"] is None or not (folder_data.is_dir()
                                              or folder_data.suffix.lower() == ".json"):
        return  # arrays (.npy, .npz) are not preprocessed
    before, after = recorded["preprocess"].to_dict(), preprocess.to_dict()
    changed = [f"{PREPROCESS_OPTIONS[k]} {after[k]} (recorded: {before[k]})"
               for k in before if before[k] != after[k]]
    if changed:
        raise ConfigError(
            f"{', '.join(changed)} contradicts the preprocessing {data}/stats.npz was "
            f"collected with ({data}/calibration.json): its statistics would not match "
            "the images read now. Drop the option to plan with the recorded preprocessing, or "
            f"pass the calibration data itself ({folder_data}) with --data to collect "
            "statistics with the new one.")


def calibration_source(model_name: str, data: str, model: onnx.ModelProto,
                       recorded: dict | None, preprocess: Preprocess, options: DataOptions,
                       who: str = "plan") -> tuple[BatchSource, collect.Statistics | None]:
    """(calibration BatchSource, Statistics or None) from `data` (`recorded`: its
    calibration.json when it is a calibration folder, whose reuse `who` reports)."""
    from quantlab.data import data_files, files_stamp

    inputs = graph.input_specs(model)
    if data == "zoo":
        from quantlab import zoo

        return open_data(zoo.get(model_name).calibration_set(), inputs, options.batch_size,
                         options.max_samples), None
    if recorded is None:
        return open_data(data, inputs, options.batch_size, options.max_samples,
                         preprocess), None
    if not Path(recorded["data"]).exists():
        raise DataError(f"{data}/calibration.json names data {recorded['data']}, which "
                        "no longer exists; pass the calibration data itself with --data.")
    if recorded["data_stamp"] not in (None, files_stamp(data_files(recorded["data"]))):
        raise DataError(
            f"{recorded['data']} changed since `quantlab calibrate` collected "
            f"{data}/stats.npz from it (a file's size or modification time differs, or "
            "files were added or removed), so those statistics no longer describe it. "
            "Calibrate again, or pass the data itself with --data to collect them here.")
    source = open_data(recorded["data"], inputs, options.batch_size, options.max_samples,
                       preprocess)
    unchanged = " (unchanged since)" if recorded["data_stamp"] else ""
    print(f"{who}: reusing {data}/stats.npz, collected from {recorded['data']}"
          f"{unchanged} with its recorded preprocessing.")
    return source, collect.Statistics.load(Path(data) / "stats.npz")


def evaluation_source(model_name: str, evaluation: str, model: onnx.ModelProto,
                      preprocess: Preprocess, options: DataOptions):
    """(`evaluation` opened for the normalized `model`, its Task or None): ``zoo`` is the zoo
    model `model_name`'s held-out split with its ground truth, anything else data read as
    the calibration data are (same batch size, max_samples and preprocessing)."""
    inputs = graph.input_specs(model)
    if evaluation != "zoo":
        return open_data(evaluation, inputs, options.batch_size, options.max_samples,
                         preprocess), None
    from quantlab import zoo
    from quantlab.evaluation.tasks import Task

    entry = zoo.get(model_name)
    eval_set = entry.eval_set(options.max_samples)
    return open_data(eval_set.inputs, inputs, options.batch_size), Task.from_zoo(entry, eval_set)


def check_eval_shapes(model: onnx.ModelProto, evaluation: BatchSource, name: str) -> None:
    """Refuse evaluation data whose dynamic dimensions (image size, audio length) differ
    from the calibration data's: the plan would be certified on shapes that trtexec.txt's
    TensorRT profile (the calibration data's, graph.record_data_shapes) does not build."""
    recorded = graph.data_shapes(model)
    if not recorded:
        return
    batch = next(iter(evaluation))
    for tensor, shape in recorded.items():
        fed = [None if d is None else int(e) for d, e in zip(shape, np.shape(batch[tensor]),
                                                             strict=True)]
        if fed != shape:
            raise DataError(
                f"--eval {name} feeds input '{tensor}' samples of shape {fed} (None: the "
                f"sample axis), but the calibration data {shape}: trtexec.txt's TensorRT "
                "profile takes the calibration data's shape, so the plan would be certified "
                "on shapes the engine is not built for. Pass evaluation data of the "
                "calibration data's shape (--resize H W for images).")


def prepared_model(model_name: str, data: str, evaluation: str, recorded: dict | None,
                   options: DataOptions) -> onnx.ModelProto:
    """The normalized model, fed as the calibration data say: the 0-d arrays of an ``.npz``
    (``sr``) frozen as `quantlab calibrate` freezes them, or a calibration folder's
    (`recorded`) frozen inputs and sample axes; the `options`' constants and batch axes on
    top. Refused when `evaluation` holds another value for a frozen input (the model would
    silently run on this one)."""
    from quantlab.calibration.pipeline import prepare_model
    from quantlab.data import scalar_arrays

    given = {"constants": dict(options.constants), "batch_axes": dict(options.batch_axes)}
    source = model_name
    if recorded is not None:
        # The folder's statistics belong to its model.onnx (repaired as calibration.json says).
        source = Path(data) / "model.onnx"
        for key, record_field, option in (("constants", "frozen_inputs", "--input"),
                                          ("batch_axes", "sample_axes", "--batch-axis")):
            for name, value in given[key].items():  # stats.npz was collected the recorded way
                if name in recorded[record_field] and not np.array_equal(
                        value, recorded[record_field][name]):
                    raise ConfigError(
                        f"{option} {name}={value} contradicts {data}/calibration.json "
                        f"({name}={recorded[record_field][name]}), with which its stats.npz "
                        "was collected. Drop the option, or pass the calibration data itself "
                        "with --data to collect statistics here.")
            given[key] = {**recorded[record_field], **given[key]}
    model = prepare_model(source, None if recorded is not None or data == "zoo" else data,
                          **given)
    if recorded is not None:
        check_same_model(model, model_name, f"--data {data}")
    frozen = graph.frozen_inputs(model)
    for name, value in scalar_arrays(evaluation).items():
        if name in frozen and not np.array_equal(value, frozen[name]):
            raise DataError(f"{evaluation} holds {name}={value.tolist()}, but the model is "
                            f"calibrated with input '{name}' frozen to {frozen[name]}; plan on "
                            f"evaluation data of the same {name}.")
    return model


def check_same_model(model: onnx.ModelProto, given: str, where: str) -> None:
    """ConfigError unless `model` (a folder's model.onnx) was made from the model `given`
    (file or zoo name), compared by content digest (pipeline.model_digest)."""
    from quantlab.calibration.pipeline import model_digest

    if graph.source_digest(model) != model_digest(given):
        raise ConfigError(
            f"{where} holds another model than {given}: it was made from "
            f"{graph.source_model(model) or 'a model of unknown origin'} (content digest "
            f"{graph.source_digest(model) or 'not recorded'}, {given}'s is "
            f"{model_digest(given)}). Pass that folder's model, or calibration data of {given}.")


def needed_tensors(model: onnx.ModelProto, implicit: bool) -> list[str]:
    """Tensors the planner needs statistics of: the Q/DQ inputs, the linear ops' float outputs
    (the FP16 range rule reads them) and, for a calibration cache (`implicit`), every float
    tensor TensorRT <= 10's implicit INT8 needs a range for."""
    index = qdq.indexed(model)
    wanted = set(trt_ranges.tensors_to_calibrate(index) if implicit
                 else qdq.activation_tensors_to_calibrate(index))
    wanted.update(out for node in index.model.graph.node if node.op_type in qdq.LINEAR_OPS
                  for out in node.output if out in index.floats)
    return [name for name in index.order if name in wanted]


def statistics(model: onnx.ModelProto, source: BatchSource, stats: collect.Statistics | None,
               implicit: bool, data: str, progress: bool, repaired: bool = False,
               channels: Sequence[str] = ()) -> collect.Statistics:
    """Statistics of every tensor :func:`needed_tensors` lists (`implicit`: a calibration
    cache's too): `stats` (reused from the calibration folder `data`, or None) completed by
    one collection pass over the ones it lacks, which also keeps per-channel statistics of
    the `channels` it collects (an equalization's inputs). For a `repaired` copy, `stats` are
    the model's own: a repair renames every tensor whose values it changes, so the tensors
    of the same name keep their statistics and only the renamed ones are collected."""
    needed = needed_tensors(model, implicit)
    if repaired:
        stats = collect.Statistics({name: stats.tensors[name] for name in needed
                                    if name in stats.tensors}, stats.num_samples,
                                   stats.num_bins)
    missing = [name for name in needed if stats is None or name not in stats.tensors]
    if not missing:
        return stats
    if stats is not None and not repaired:
        print(f"plan: {data}'s statistics lack {len(missing)} tensor(s) the planner reads "
              "(linear-op outputs for the FP16 range rule, or the cache's ranges); collecting "
              "them in one pass over its data.")
    extra = collect.collect(model, source, missing, progress=progress,
                            channels=[name for name in channels if name in missing],
                            **({"num_bins": stats.num_bins} if stats is not None else {}))
    if stats is None:
        return extra
    if repaired:  # in the order a collection of the whole model gives
        return collect.Statistics({name: (extra.tensors[name] if name in extra.tensors else
                                          stats.tensors[name]) for name in needed},
                                  stats.num_samples, stats.num_bins)
    return collect.Statistics({**stats.tensors, **extra.tensors}, stats.num_samples,
                              stats.num_bins, extra.channels)


class Calibration(NamedTuple):
    """What :func:`calibrated` makes of statistics."""

    scales: calibrate.Scales  # of the starting method
    ranges: dict[str, float]  # max |x|
    p9999: dict[str, float]  # 99.99th percentile
    candidates: dict[str, dict[str, float]]  # calibrator -> amax

    def calibrated_model(self, model: onnx.ModelProto, report: dict | None = None
                         ) -> CalibratedModel:
        """`model` with this calibration, as the planner takes it (`report`: a repair's)."""
        return CalibratedModel(model, self.scales.amax, self.ranges, self.p9999,
                               self.candidates if len(self.candidates) > 1 else None,
                               report or {})


def calibrated(stats: collect.Statistics, method: str, calibrators: Sequence[str],
               known: Calibration | None = None) -> Calibration:
    """The calibration of statistics by `method` and each of `calibrators`. With `known`
    (that of statistics sharing tensors with these: the model before a repair), the tensors
    it has keep its figures; only the others are calibrated."""
    fresh = stats if known is None else collect.Statistics(
        {name: tensor for name, tensor in stats.tensors.items() if name not in known.ranges},
        stats.num_samples, stats.num_bins)
    scales = calibrate.calibrate(fresh, method)
    ranges = {name: tensor.amax for name, tensor in stats.tensors.items()}
    p9999 = calibrate.calibrate(fresh, "percentile").amax
    candidates = {m: scales.amax if m == method else calibrate.calibrate(fresh, m).amax
                  for m in dict.fromkeys(calibrators)}
    if known is not None:
        def merged(own: dict, theirs: dict) -> dict:
            return {name: own[name] if name in own else theirs[name] for name in stats.tensors}

        scales.amax = merged(scales.amax, known.scales.amax)
        p9999 = merged(p9999, known.p9999)
        candidates = {m: merged(amax, known.candidates[m]) for m, amax in candidates.items()}
    return Calibration(scales, ranges, p9999, candidates)


@dataclass
class RepairOptions:
    """The model with its calibration, and each repaired copy the planner weighs (by repair
    name), with the seconds of the statistics and repairs steps."""

    calibration: Calibration
    model: CalibratedModel
    repaired: dict[str, CalibratedModel] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)


def prepare(model: onnx.ModelProto, source: BatchSource, stats: collect.Statistics | None,
            method: str, calibrators: Sequence[str], repair_names: Sequence[str],
            implicit: bool, data: str, recorded: dict | None, progress: bool) -> RepairOptions:
    """Statistics (`stats` reused and completed), their calibration, and the copies of `model`
    each of `repair_names` makes, recalibrated; a repair that changes nothing is said and
    left out (`recorded`: --data's calibration.json, which may have applied it already)."""
    started = time.perf_counter()
    chosen = [repairs.REGISTRY[name] for name in repair_names]
    # The inputs whose channel ranges the repairs read (in the order first read).
    channels = list(dict.fromkeys(t for repair in chosen for t in repair.channel_inputs(model)))
    stats = statistics(model, source, stats, implicit, data, progress, channels=channels)
    # The equalizations' per-channel ranges; their statistics (8 KB a channel) let go of
    # before the planner's peak.
    kept_ranges = repairs.channel_percentiles(stats.channels)
    stats.channels.clear()
    calibration = calibrated(stats, method, calibrators)
    phases = {"statistics": time.perf_counter() - started}
    started = time.perf_counter()
    repaired = {}
    for repair in chosen:
        name, renames = repair.name, repair.renames
        # The statistics pass kept the inputs' channel ranges (else: a pass of its own).
        changed, report = repair.apply(model, source if repair.needs_data else None,
                                       kept_ranges)
        if not report.applied:
            done = equalized_by_calibrate(recorded) if renames else []
            print(f"repair {name}: " + (
                f"already applied: {data} is a calibration folder whose model.onnx "
                f"`quantlab calibrate` equalized ({len(done)} inputs); not weighed again."
                if done else f"nothing to change in this model ({len(report.skipped)} "
                "candidates skipped); not weighed."))
            continue
        # Equalization renames every tensor whose values it changes: the others keep their
        # statistics and calibration (cle rescales tensors in place: all collected again).
        changed_stats = statistics(changed, source, stats if renames else None, implicit, data,
                                   progress, repaired=renames)
        repaired[name] = calibrated(changed_stats, method, calibrators,
                                    calibration if renames else None
                                    ).calibrated_model(changed, report.to_dict())
    phases["repairs"] = time.perf_counter() - started
    return RepairOptions(calibration, calibration.calibrated_model(model), repaired, phases)


@dataclass
class Prepared:
    """The planner's first record: its context, the model as given and the option planned
    (the model as given, or the quietest repaired copy) with its graph, and a record per
    option weighed for plan.json."""

    context: Context
    original: CalibratedModel
    chosen: CalibratedModel
    repair: str  # "none": the model as given
    repair_records: dict[str, dict]
    g: graph.Graph


def weigh_repairs(context: Context, original: CalibratedModel,
                  repairs: Mapping[str, CalibratedModel]) -> Prepared:
    """The option (the model as given, or a repair) whose all-INT8 model has the least output
    noise on the first batch, with a record per option; timed as "weigh repairs"."""
    with context.phases("weigh repairs"):
        chosen, repair, records = original, "none", {}
        if repairs:
            options = {"none": original, **repairs}
            weighed = all_int8_nsr(options, context.first, context.fp32_run(context.first),
                                   context.runs)
            repair = quietest(weighed)
            chosen = options[repair]
            records = {name: {"repair": name, "chosen": name == repair,
                              "all_int8_nsr_first_batch": nsr,
                              **repair_summary(options[name].report)}
                       for name, nsr in weighed.items()}
    return Prepared(context, original, chosen, repair, records, graph.Graph(chosen.model))


def repair_summary(report: Mapping) -> dict:
    """The plain figures of a RepairReport dict that plan.json keeps: places changed, skipped."""
    return {"applied": len(report.get("applied", [])), "skipped": len(report.get("skipped", [])),
            "passes": report.get("passes", 0), **report.get("summary", {})}
