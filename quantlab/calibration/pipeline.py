"""The calibration flow as one call: collect -> calibrate -> Q/DQ model + cache, into a folder.

This is what ``quantlab calibrate`` and ``quantlab demo`` run, and what a
notebook calls directly::

    from quantlab.calibration import pipeline
    result = pipeline.run_calibration("model.onnx", "calibration_data/digits/calibration.npy",
                                      out="reports/my-run", method="entropy")
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from quantlab import choices, graph
from quantlab.calibration import calibrate, collect, folding, qdq
from quantlab.choices import AUTO_CANDIDATES, AUTO_DEFAULT
from quantlab.data import (
    BatchSource,
    Preprocess,
    data_files,
    files_stamp,
    open_data,
    scalar_arrays,
)
from quantlab.engine import cache, trt_ranges
from quantlab.engine.backends.onnxruntime import SESSION_CONFIG, OnnxRuntimeBackend
from quantlab.errors import ConfigError, ModelError
from quantlab.evaluation import compare
from quantlab.experiments.experiment import check_output, output_folder, recorded_path
from quantlab.experiments.records import CalibrationRecord
from quantlab.progress import progress_bar
from quantlab.zoo_names import ZOO_NAMES

# Files a calibration run writes; a folder holding any of them is refused unless forced.
CALIBRATION_FILES = CalibrationRecord.FILES
# TensorRT names the algorithm in the cache header: each calibrator's (calibrate.Calibrator);
# auto's with the min-max header, as TensorRT has no calibrator of that name.
CACHE_ALGORITHM = {**{name: calibrator.cache_algorithm
                      for name, calibrator in calibrate.CALIBRATORS.items()},
                   choices.AUTO_METHOD: calibrate.Calibrator.cache_algorithm}
AUTO = choices.AUTO_METHOD
# Samples the per-layer choices (method "auto", weight amax "local") measure on: the
# planner chooses on 8; more steady the choice, each a local pass per candidate.
CHOICE_SAMPLES = 32
# The decisions measured on a bounded share of the calibration data, its first samples
# (one pass over all of them stays the rule for the statistics alone; zoo and layout
# figures before/after in benchmarks/README.md):
# - the weight amax per channel: up to CHOICE_SAMPLES, from 16 on stopping once settled
#   (weights.SETTLE_*: the expected loss of choosing now under 1 % of every layer's noise).
#   A fixed 8 cost digits-vit 0.35 dB of held-out output SQNR (an 8x8 input: few values per
#   sample); on the layout detector the choice on 8 pages differed from the one on 16 on 43
#   of 13,896 channels;
# - the equalization's per-channel ranges: the statistics pass's first EQUALIZE_SAMPLES
#   (equalized_statistics). Its decision and factors are ratios of per-channel 99.99th
#   percentiles, and the statistics of the equalized model still cover every sample. On the
#   PP-OCRv3 detector (128 pages, 32 held out) ranges from 16 / 32 / 64 / 128 pages gave
#   16.5 / 19.0 / 19.5 / 19.4 dB of output SQNR: a channel's 99.99th percentile needs about
#   64 pages of a sparse text map to settle;
# - bias correction's shifts and folds: halves of BIAS_SAMPLES, each read until its shifts
#   are settled: after BIAS_MIN_SAMPLES, once the shifts' sampling noise (their squared
#   standard errors, summed over every INT8 layer's channels) is under BIAS_SETTLED_NOISE
#   of their squares, the bias energy they remove (repairs.Settle). Fixed halves of 16 (a
#   share of 32) turned onet's verdict from kept to dropped (-0.8 dB held out), where that
#   ratio is 0.18 on 16 samples and 0.09 on 32: onet and the ViTs read all 32. The
#   PP-OCRv3 detector's halves settle at 16-18 pages (0.13 on 8, 0.07-0.09 on 16), YOLOv8n's
#   after the minimum (0.004 on 16); 8 would do for YOLOv8n's shifts, but the folds' verdict
#   on them is noisier than the shifts: its map F1 moved by -0.009 with halves of 8.
BIAS_SAMPLES = 64
BIAS_MIN_SAMPLES = 16
BIAS_SETTLED_NOISE = 0.08
# Bias correction's keep/drop test scores a fold on at least FOLD_MIN_SAMPLES samples and
# stops once the mean per-sample change of output noise (with / without, as a log ratio) is
# FOLD_SETTLED_SE standard errors from zero: more samples then no longer change its sign
# (a t of 4 on 3 degrees of freedom is p < 0.03 two-sided; on the layout detector the
# difference was 6-10 standard errors after 4 pages). Each sample costs two whole-model
# Q/DQ runs (without, with; FP32's outputs come from the bias pass, which ran the FP32 model
# on the same samples): over 3 s on a layout page. The log ratio: the PP-OCRv3 detector's
# pages differ 10x in noise, so the plain differences of 16 pages, every one of them lowered
# by about a third, were still under 4 standard errors.
FOLD_MIN_SAMPLES = 4
FOLD_SETTLED_SE = 4.0
# ... or once the difference is surely (two standard errors) under 1 % of the output noise:
# then the verdict moves the output SQNR by under 0.05 dB either way.
FOLD_NEGLIGIBLE = 0.01
# A fold scores at most FOLD_MAX_SAMPLES samples of its other half (two whole-model runs
# each, among the costliest phases on a 640 px detector). The PP-OCRv3 detector's pages change
# their noise by -76 % to +78 % with the shifts, so no count settles it by the t test; on 8
# pages both folds keep the shifts, as on 16 (tests/calibration/test_pipeline.py holds the zoo
# within 0.2 dB of folds scored on the whole halves).
FOLD_MAX_SAMPLES = 8
EQUALIZE_SAMPLES = 64
# Weight rounding "gptq" fits each layer's rounding to its inputs' second moments on the
# first ROUNDING_SAMPLES samples (rounding.POSITIONS rows each): on the PP-OCRv3 detector,
# 4 samples gave 19.83 dB held out and 8 gave 20.09 (both before the bias column).
ROUNDING_SAMPLES = 8
WEIGHT_CRITERIA = choices.CALIBRATE_WEIGHT_CRITERIA
WEIGHT_ROUNDINGS = choices.WEIGHT_ROUNDINGS
DEFAULT_WEIGHT_CRITERION = choices.DEFAULT_WEIGHT_AMAX
# "local" chooses between these two qdq criteria; quantize_model takes the chosen amax.
_QDQ_CRITERION = {"local": "max"}


@dataclass
class CalibrationResult:
    """Everything a calibration produced; `folder` is where it was written (None until then)."""

    model: onnx.ModelProto
    qdq_model: onnx.ModelProto
    stats: collect.Statistics
    scales: calibrate.Scales
    data: BatchSource
    folder: Path | None = None
    preprocess: Preprocess | None = None
    # Repairs applied to the FP32 model before collection (name -> RepairReport.to_dict()).
    repairs: dict = field(default_factory=dict)
    # How the weights' per-channel amax was chosen (qdq.WEIGHT_CRITERIA), and with "local"
    # per weight tensor what was chosen (weights.WeightChoice.tensors).
    weight_criterion: str = "max"
    weight_choice: dict = field(default_factory=dict)
    # method "auto": the candidates, the samples measured and layer (unit) -> the candidate
    # its amax came from.
    layer_calibrators: dict = field(default_factory=dict)
    # The repairs asked for, on or off (those applied are in `repairs`): what compare reads.
    repairs_requested: dict = field(default_factory=dict)
    # Each phase as it ran: name, seconds, samples read, model runs (Phases.record).
    phases: list[dict] = field(default_factory=list)
    # How the int8 weights were rounded (choices.WEIGHT_ROUNDINGS) and, with "gptq", per
    # weight tensor whether it was and its output error against nearest rounding.
    weight_rounding: str = "nearest"
    rounding: dict = field(default_factory=dict)


class Phases:
    """The phases of one calibration, timed as they run, for ``calibration.json``.

    `model_runs` counts forward passes: one per sample (per batch of a fixed-batch model)
    and graph run, a whole model or a cut-out with its layers' copies attached alike.
    `batch` is the samples one run takes: a fixed-batch model's batch size, else 1; the
    progress bars of such a model count its batches.
    """

    def __init__(self, progress: bool = True, batch: int = 1):
        self.progress = progress
        self.batch = batch
        self.records: list[dict] = []

    @contextmanager
    def record(self, name: str, samples: int, graphs: int = 1) -> Iterator[None]:
        """Time the block as phase `name`, reading `samples` through `graphs` graphs each."""
        start = time.perf_counter()
        yield
        self.records.append({"phase": name, "seconds": round(time.perf_counter() - start, 2),
                             "samples": samples, "model_runs": -(-samples // self.batch) * graphs})

    @contextmanager
    def reading(self, name: str, model: onnx.ModelProto, source: BatchSource, limit: int
                ) -> Iterator[Iterator[dict]]:
        """Time the block as phase `name`, reading up to `limit` samples of `source` one at a
        time with a progress bar (:meth:`shown`), the samples it yields."""
        count = min(sample_count(model, source), limit)
        with self.record(name, count * self.batch):
            yield self.shown(model, source, name, limit)

    def read(self, runs: int, graphs: int = 1, more: int = 0) -> None:
        """What the phase just recorded read, once known (a decision that stops once
        settled): `runs` runs (samples, a fixed-batch model's batches) through `graphs`
        graphs each, and `more` runs of other graphs."""
        self.records[-1].update(samples=runs * self.batch, model_runs=runs * graphs + more)

    def shown(self, model: onnx.ModelProto, source: BatchSource, name: str,
              limit: int | None = None) -> Iterator[dict]:
        """The samples of `source` (up to `limit`), one at a time (a fixed-batch model's
        batches), with a progress bar named ``calibrate: <name>`` that shows the time left
        (:func:`samples`)."""
        total = min(sample_count(model, source), limit or source.num_samples)
        unit = "sample" if graph.fixed_batch_size(model) is None else "batch"
        with progress_bar(total=total, desc=f"calibrate: {name}", unit=unit,
                          enabled=self.progress) as bar:
            try:
                for sample in samples(model, source, total):
                    yield sample
                    bar.update(1)
            except GeneratorExit:  # the reader had enough (a settled verdict) with this one
                bar.update(1)
                bar.close()
                raise


def resolve_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """An ONNX model from a path, a zoo model name, or a ModelProto (normalized); a file's
    absolute path or the zoo name is recorded in it (:func:`graph.record_source`)."""
    if isinstance(model, onnx.ModelProto):
        import hashlib

        digest = hashlib.sha256(model.SerializeToString()).hexdigest()[:16]
        return graph.record_source(graph.normalize(model), None, digest)
    if Path(model).exists():
        loaded = graph.load_model(model)
        return graph.record_source(loaded, str(Path(model).resolve()), _file_digest(model))
    # Only a name that is not a file may be a zoo model (importing the zoo imports torch).
    if str(model) in ZOO_NAMES:
        return graph.record_source(export_zoo_model(str(model)), str(model),
                                   model_digest(str(model)))
    return graph.load_model(model)


def model_digest(model: str | os.PathLike) -> str:
    """The content digest of a model file or zoo name, as :func:`resolve_model` records it:
    a quantlab copy (a folder's model.onnx) keeps its first model's digest, so a folder and
    the model it was made from compare equal. Cheap: no export, no normalization."""
    if not Path(model).exists() and str(model) in ZOO_NAMES:
        from quantlab import zoo

        return _zoo_export_key(zoo.get(str(model)))
    recorded = graph.source_digest(onnx.load(str(model), load_external_data=False))
    return recorded or _file_digest(model)


def _file_digest(path: str | os.PathLike) -> str:
    """sha256 (16 hex digits) of a file's bytes."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def prepare_model(
    model: str | os.PathLike | onnx.ModelProto,
    data: object = None,
    constants: Mapping[str, object] | None = None,
    batch_axes: Mapping[str, int | None] | None = None,
) -> onnx.ModelProto:
    """The normalized model, fed as the data and options say, with warnings for float-only parts.

    Inputs given a constant value (`constants`, or a 0-d array in the ``.npz`` /
    dict `data` for a model input) are frozen into the model and the control
    flow they decide is inlined (:func:`graph.freeze_inputs`); `batch_axes` is
    recorded in the model (:func:`graph.set_batch_axes`), so the written
    ``model.onnx`` carries both to every later command.
    """
    model = resolve_model(model)
    names = {spec.name for spec in graph.input_specs(model)}
    values = {k: v for k, v in scalar_arrays(data).items() if k in names}
    values.update(constants or {})
    model = graph.freeze_inputs(model, values)
    if batch_axes:
        graph.set_batch_axes(model, batch_axes)
    left = qdq.float_only_nodes(model)
    if left["control_flow"]:
        warnings.warn(
            f"{len(left['control_flow'])} control-flow node(s) hold linear ops that stay in "
            f"float, because quantlab does not quantize inside If/Loop/Scan bodies: "
            f"{left['control_flow'][:5]}. If an input decides the branch (a sample rate, a "
            "mode flag), freeze it with --input NAME=VALUE so the branch is inlined and "
            "quantized.", stacklevel=2)
    kept = folding.kept_batchnorms(model)
    if kept:
        name, reason = next(iter(kept.items()))
        warnings.warn(
            f"{len(kept)} BatchNormalization node(s) could not be folded into the layer before "
            f"them and stay separate layers (TensorRT runs such a BN as a scale layer, outside "
            f"the INT8 conv): '{name}': {reason}.", stacklevel=2)
    if left["custom_domain"]:
        after = untyped_linear_ops(model)
        also = (f"; so do {len(after)} linear op(s) after them, whose inputs have no type "
                f"ONNX shape inference can give (a custom op's output): {after[:5]}. Express "
                "the custom op in standard ONNX ops to quantize those"
                if after else "")
        warnings.warn(
            f"{len(left['custom_domain'])} node(s) of a custom op domain stay in float (their "
            f"math is unknown to quantlab): {left['custom_domain'][:5]}{also}.", stacklevel=2)
    return model


def untyped_linear_ops(model: onnx.ModelProto) -> list[str]:
    """Linear ops downstream of custom-domain nodes that stay in float because an input
    has no inferred float type (``"name (op)"``, in graph order)."""
    floats = graph.float_tensors(model) | {
        init.name for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT}
    consumers = graph.consumers(model)
    frontier = [out for node in model.graph.node if node.domain not in qdq._ONNX_DOMAINS
                for out in node.output]
    reached: set[str] = set()
    while frontier:
        for node in consumers.get(frontier.pop(), []):
            if node.name not in reached:
                reached.add(node.name)
                frontier.extend(node.output)
    return [f"{node.name} ({node.op_type})" for node in model.graph.node
            if node.name in reached and node.op_type in qdq.LINEAR_OPS
            and not all(name in floats for name in node.input[:2])]


def export_zoo_model(name: str, path: str | os.PathLike | None = None) -> onnx.ModelProto:
    """Export a zoo model to ONNX; the file is kept at `path` if one is given.

    The export (seconds of torch.export) is cached in :func:`cache_folder`, under a key of
    everything it is made from (:func:`_zoo_export_key`); a cache that cannot be read or
    written only costs the export.
    """
    import shutil

    from quantlab import zoo

    entry = zoo.get(name)
    if not entry.weights_path.is_file():
        entry.build()  # raises a ModelError that names the file and how to make it
    key = _zoo_export_key(entry)
    cached = cache_folder() / "zoo" / f"{name}-{key}.onnx"
    try:
        model = graph.load_model(cached)
    except (OSError, ModelError):  # not cached yet, or unreadable: exported again
        model = None
    if model is not None:
        if path:
            shutil.copyfile(cached, path)
        return model
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(path) if path else Path(scratch) / f"{name}.onnx"
        model = graph.record_source(graph.export_torch(
            entry.build(), entry.calibration_set()[:2], target, output_names=entry.output_names),
            name, key)
        graph.save_model(model, target)  # with its source and digest, also in the cache
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.part")
            shutil.copyfile(target, partial)
            os.replace(partial, cached)  # whole or absent for a concurrent reader
        except OSError:
            pass
        return model


CACHE_ENV = "QUANTLAB_CACHE"


def cache_folder() -> Path:
    """Where quantlab keeps what it can make again (zoo exports): ``$QUANTLAB_CACHE``, else
    ``$XDG_CACHE_HOME/quantlab``, else ``~/.cache/quantlab``. Safe to delete."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantlab"


def _zoo_export_key(entry) -> str:
    """sha256 (16 hex digits) of what a zoo export is made from: the weights, the zoo's and
    the exporter's sources, the torch/onnx/onnxscript versions, the opset, the input shape
    and the output names (not the calibration samples it traces: reading shapes-det's
    costs 1 s, and only their shape matters)."""
    import hashlib
    from importlib import metadata

    import quantlab.zoo

    digest = hashlib.sha256(entry.weights_path.read_bytes())
    sources = sorted(Path(quantlab.zoo.__file__).parent.glob("*.py")) + [Path(graph.__file__)]
    for source in sources:
        digest.update(source.read_bytes())
    for package in ("torch", "onnx", "onnxscript"):
        try:
            digest.update(f"{package} {metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} none".encode())
    digest.update(f"{graph.EXPORT_OPSET} {entry.input_shape} {entry.output_names}".encode())
    return digest.hexdigest()[:16]


def run_calibration(
    model: str | os.PathLike | onnx.ModelProto,
    data: str | os.PathLike | BatchSource | object,
    out: str | os.PathLike,
    method: str = choices.DEFAULT_METHOD,
    method_params: Mapping[str, float] | None = None,
    batch_size: int = 32,
    max_samples: int | None = None,
    preprocess: Preprocess | None = None,
    force: bool = False,
    progress: bool = True,
    trt_version: str | None = None,
    constants: Mapping[str, object] | None = None,
    batch_axes: Mapping[str, int | None] | None = None,
    memory_budget: int | str | None = None,
    equalize: bool = True,
    weight_criterion: str = DEFAULT_WEIGHT_CRITERION,
    bias_correction: bool = True,
    weight_rounding: str = choices.DEFAULT_WEIGHT_ROUNDING,
) -> CalibrationResult:
    """Calibrate `model` on `data` and write the experiment folder `out`.

    With `equalize` (default), depthwise-conv inputs whose channels differ in range are
    equalized where their channel ranges predict a gain (:func:`repairs.depthwise_equalization`,
    FP32 function unchanged), decided inside the statistics pass
    (:func:`equalized_statistics`: still one pass over the data); ``calibration.json``
    records every depthwise input, treated or not, with the reason. `method`, the weight
    amax (`weight_criterion`), `weight_rounding` and `bias_correction` are those of
    :func:`calibrate_from_stats`; by default activations take the mse calibrator's amax,
    each weight channel max |w| or its MSE amax, whichever gives the layer TensorRT runs
    the least error, and every INT8 layer's mean error is corrected in its bias where that
    holds on data it was not measured on.

    `constants` freezes inputs shared by every sample (``{"sr": 16000}``; 0-d
    arrays of an ``.npz`` are taken the same way) and `batch_axes` sets the sample
    axis of inputs whose samples are not on axis 0 (see :func:`prepare_model`).

    Writes ``model.onnx`` (normalized FP32), ``stats.npz``, ``scales.json``,
    ``model.int8.onnx`` (Q/DQ: TensorRT 10/11 explicit quantization, ONNX Runtime) and
    ``calibration.json`` (what was run). Nothing is written if collection fails.

    With `trt_version` (8.x-10.x, the TensorRT that will read it) ``calibration.cache``
    for implicit INT8 is written too. That cache needs a range for every float tensor,
    so every float tensor is collected (ONNX Runtime loses its fusions around the
    exposed tensors; about twice the collection time of the Q/DQ inputs alone).
    """
    method_params = dict(method_params or {})
    check_options(method, method_params, weight_criterion, weight_rounding)
    model = prepare_model(model, data, constants, batch_axes)
    inputs = graph.input_specs(model)
    source = (
        data
        if isinstance(data, BatchSource)
        else open_data(data, inputs, batch_size, max_samples, preprocess)
    )
    graph.record_data_shapes(model, source)  # for TensorRT's profile (build)
    # Every check that could fail after the long work runs before it: an occupied, locked or
    # unwritable folder, the cache's version and tensor names. The folder is written all or
    # nothing (experiment.output_folder): a failed run leaves no partial output.
    check_output(out, force=force, produces=CALIBRATION_FILES)
    phases = Phases(progress, graph.fixed_batch_size(model) or 1)
    if trt_version is not None:
        cache.implicit_int8_version(trt_version)
    index, applied, stats = equalized_statistics(
        model, source, functools.partial(_calibrated_tensors, implicit=trt_version is not None),
        phases, equalize, memory_budget)
    result = calibrate_from_stats(index, stats, source, method, method_params,
                                  weight_criterion=weight_criterion, phases=phases,
                                  bias_correction=bias_correction,
                                  weight_rounding=weight_rounding)
    result.repairs = {**applied, **result.repairs}
    result.repairs_requested = {"depthwise_equalization": equalize,
                                "bias_correction": bias_correction}
    write_results(result, out, force=force, trt_version=trt_version)
    return result


def _calibrated_tensors(index: graph.Graph, implicit: bool) -> list[str]:
    """The tensors a calibration collects: the Q/DQ model's inputs, and for TensorRT <= 10's
    `implicit` INT8 (a calibration cache) every float tensor it needs a range for (names
    checked for the cache)."""
    if not implicit:
        return quantized_inputs(index, "calibrate for its Q/DQ model. For TensorRT <= 10's "
                                "implicit INT8, pass --trt-version to calibrate every float "
                                "tensor into calibration.cache")
    tensors = trt_ranges.tensors_to_calibrate(index)  # Q/DQ inputs + TensorRT <= 10 ranges
    check_cache_names(tensors)
    return tensors


def equalized_statistics(model: onnx.ModelProto, source: BatchSource,
                         tensors_of: Callable[[graph.Graph], list[str]], phases: Phases,
                         equalize: bool = True, memory_budget: int | str | None = None,
                         ) -> tuple[graph.Graph, dict, collect.Statistics]:
    """The statistics pass, with the equalization decided inside it: `model` equalized where
    that helps (as :func:`equalized`; not without `equalize`), indexed, ``{repair name:
    report}``, and the statistics of its tensors `tensors_of(index)` over all of `source`.

    Still one pass over the data. Its first EQUALIZE_SAMPLES run the model as it is,
    keeping per-channel statistics of the depthwise inputs, from which the equalization is
    decided; the rest run the equalized model. An equalized tensor's statistics over the
    first share are its input's per channel, divided as the equalization divides them
    (:meth:`collect.ChannelStats.divided`); the other tensors' values are the same in both
    models. A tensor neither gives (one changed on the way into a producer that took the
    division: a calibration cache's) is collected over the first share once more.
    """
    from quantlab.calibration import repairs

    repair = repairs.REGISTRY[choices.DEFAULT_EQUALIZATION]
    inputs = repair.channel_inputs(model) if equalize else []
    desc = "calibrate: statistics"
    if not inputs:
        index = graph.Graph(model)
        with phases.record("statistics", source.num_samples):
            return index, {}, collect.collect(index, source, tensors_of(index),
                                              progress=phases.progress,
                                              memory_budget=memory_budget, desc=desc)
    share = decision_share(model, source, EQUALIZE_SAMPLES)
    index = graph.Graph(model)
    with phases.record("statistics, channel ranges", share.num_samples):
        first = collect.collect(index, share, list(dict.fromkeys(tensors_of(index) + inputs)),
                                progress=phases.progress, memory_budget=memory_budget,
                                channels=inputs, desc=f"{desc}, channel ranges", zeros=False)
    from quantlab.calibration.repairs.equalize import channel_percentiles

    model, report = repair.apply(model, None, channel_percentiles(first.channels))
    index = graph.Graph(model)
    tensors = tensors_of(index)
    fine = first.num_bins * collect.OVERSAMPLE
    known = {name: first.tensors[name] if name in first.tensors else
             first.channels[report.divided[name][0]].divided(report.divided[name][1], fine)
             for name in tensors if name in first.tensors or name in report.divided}
    missing = [name for name in tensors if name not in known]
    if missing:
        with phases.record("statistics, changed tensors", share.num_samples):
            known.update(collect.collect(index, share, missing, progress=phases.progress,
                                         memory_budget=memory_budget, zeros=False,
                                         desc=f"{desc}, changed tensors").tensors)
    stats = collect.Statistics({name: known[name] for name in tensors}, share.num_samples,
                               first.num_bins)
    if share.num_samples < source.num_samples:
        rest = source.subset(share.num_samples, source.num_samples)
        with phases.record("statistics", rest.num_samples):
            stats = stats.merge(collect.collect(index, rest, tensors, progress=phases.progress,
                                                memory_budget=memory_budget, zeros=False,
                                                desc=desc))
    collect.warn_zeros(stats)
    return index, _equalization_record(report), stats


def equalized(model: onnx.ModelProto, source: BatchSource) -> tuple[onnx.ModelProto, dict]:
    """`model` with its conv inputs equalized where that helps (choices.DEFAULT_EQUALIZATION
    of :data:`repairs.REGISTRY`: :func:`repairs.depthwise_equalization`, one FP32 pass over
    the first EQUALIZE_SAMPLES of `source`), normalized again, and its
    :func:`_equalization_record` (the sweep's equalization; calibrate decides it inside its
    statistics pass, :func:`equalized_statistics`)."""
    from quantlab.calibration import repairs

    repair = repairs.REGISTRY[choices.DEFAULT_EQUALIZATION]
    model, report = repair.apply(
        model, samples(model, decision_share(model, source, EQUALIZE_SAMPLES)), {})
    return model, _equalization_record(report)


def _equalization_record(report) -> dict:
    """``{repair name: report}`` for ``calibration.json``; empty where the model has no
    input to equalize."""
    return {report.repair: report.to_dict()} if report.applied or report.skipped else {}


def quantized_inputs(model: onnx.ModelProto | graph.Graph, what: str) -> list[str]:
    """The activations the Q/DQ model quantizes; a ModelError when there are none, saying
    there is nothing to `what`."""
    tensors = qdq.activation_tensors_to_calibrate(model)
    if not tensors:
        model = model.model if isinstance(model, graph.Graph) else model
        raise ModelError(
            f"{_describe(model)} has no operator quantlab quantizes (Conv, ConvTranspose, "
            "Gemm, MatMul with float inputs, outside If/Loop bodies), so there is nothing to "
            f"{what}.")
    return tensors


def _describe(model: onnx.ModelProto) -> str:
    """The model as a message names it: its graph name."""
    return f"the model '{model.graph.name}'" if model.graph.name else "the model"


def check_options(method: str, method_params: Mapping[str, float],
                  weight_criterion: str, weight_rounding: str = "nearest") -> None:
    """ConfigError unless `method` (with its parameters), `weight_criterion` and
    `weight_rounding` are known."""
    if method != AUTO:
        calibrate.check_method(method, dict(method_params))
    elif method_params:
        raise ConfigError(f"method 'auto' takes no parameters (got {dict(method_params)}): it "
                          f"chooses per layer among {', '.join(AUTO_CANDIDATES)}. Pass "
                          "--method percentile to set the percentile.")
    if weight_criterion not in WEIGHT_CRITERIA:
        raise ConfigError(f"weight criterion '{weight_criterion}' is not one of "
                          f"{', '.join(WEIGHT_CRITERIA)}.")
    if weight_rounding not in WEIGHT_ROUNDINGS:
        raise ConfigError(f"weight rounding '{weight_rounding}' is not one of "
                          f"{', '.join(WEIGHT_ROUNDINGS)}.")


def calibrate_from_stats(
    model: onnx.ModelProto | graph.Graph,
    stats: collect.Statistics,
    source: BatchSource,
    method: str = calibrate.DEFAULT_METHOD,
    method_params: Mapping[str, float] | None = None,
    weight_criterion: str = "max",
    bias_correction: bool = False,
    phases: Phases | None = None,
    weight_rounding: str = "nearest",
) -> CalibrationResult:
    """Scales by `method` from statistics already collected, and the Q/DQ model they give.

    `method` is a calibrator of :mod:`quantlab.calibration.calibrate`, or ``"auto"``: each layer (a
    unit of :func:`quantlab.plan.find_units`) takes the amax of the candidate of
    AUTO_CANDIDATES that gives it the least local error where TensorRT's fused layer
    ends (:func:`quantlab.plan.choose_calibrators`, one local pass per candidate over up
    to CHOICE_SAMPLES samples), tensors of no layer the percentile's. Weight amax by
    `weight_criterion`: ``"max"``, ``"mse"`` (:func:`qdq.weight_amax`) or ``"local"``
    (per output channel the one of the two with the least layer error,
    :func:`quantlab.calibration.weights.choose_weight_amax`, one pass over the same samples).
    `weight_rounding` ``"gptq"`` rounds the int8 weights on those scales for each layer's
    output on the first ROUNDING_SAMPLES samples, refitting a conv's bias
    (:func:`quantlab.calibration.rounding.round_weights`); ``"nearest"`` rounds each weight
    to its nearest step. With `bias_correction`, every INT8 layer's mean output error on
    the first BIAS_SAMPLES of `source` is subtracted from its bias (local mode) when it
    holds on data it was not measured on: measured on each half of them, it must lower the
    output noise of samples of the other half, both folds pooled (:func:`_corrected_biases`:
    one local pass and a few whole-model runs; the report in ``repairs`` gives the figures
    and the verdict).
    The result's `preprocess` is the one `source` applied (None for arrays); its `phases`
    those of `phases` (a :class:`Phases` that shows and times each one) and these.

    `stats` must cover :func:`qdq.activation_tensors_to_calibrate` of the normalized
    `model` (and :func:`trt_ranges.tensors_to_calibrate` for a calibration cache); one
    collection serves every method (the demo compares them all).
    """
    check_options(method, dict(method_params or {}), weight_criterion, weight_rounding)
    index = qdq.indexed(model)
    phases = phases or Phases(progress=False, batch=graph.fixed_batch_size(index.model) or 1)
    chosen: dict = {}
    if method == AUTO:
        measured = _choice_samples(index, source)
        with phases.record("layer calibrators", len(measured) * phases.batch,
                           len(AUTO_CANDIDATES) + 1):
            scales, chosen = _auto_scales(index, stats, measured)
    else:
        scales = calibrate.calibrate(stats, method, **dict(method_params or {}))
    weight_amax, weight_choice = None, {}
    if weight_criterion == "local":
        from quantlab.calibration import weights

        with phases.reading("weight amax", index.model, source, CHOICE_SAMPLES) as batches:
            choice = weights.choose_weight_amax(index, batches)
        phases.read(choice.samples)  # its runs (a fixed-batch model's batches)
        weight_amax, weight_choice = choice.amax, {"summary": choice.summary(),
                                                   "tensors": choice.tensors}
    quantized = qdq.quantize_model(index, scales.amax, weight_criterion=_QDQ_CRITERION.get(
        weight_criterion, weight_criterion), weight_amax=weight_amax)
    rounding_report: dict = {}
    if weight_rounding == "gptq":
        from quantlab.calibration import rounding

        with phases.reading("weight rounding", index.model, source, ROUNDING_SAMPLES
                            ) as batches:
            quantized, rounded = rounding.round_weights(index, quantized, batches)
        rounding_report = {"summary": rounded.summary(), "tensors": rounded.tensors}
    corrected = {}
    if bias_correction:
        quantized, corrected = _corrected_biases(index, quantized, source, phases)
    return CalibrationResult(index.model, quantized, stats, scales, source,
                             preprocess=source.preprocess, repairs=corrected,
                             weight_criterion=weight_criterion, weight_choice=weight_choice,
                             layer_calibrators=chosen, phases=phases.records,
                             weight_rounding=weight_rounding, rounding=rounding_report)


def _corrected_biases(index: graph.Graph, quantized: onnx.ModelProto, source: BatchSource,
                      phases: Phases) -> tuple[onnx.ModelProto, dict]:
    """Bias correction where it holds on data it was not measured on: `quantized` with its
    INT8 layers' biases shifted (or as it is) and ``{repair name: report}``.

    Two folds: the shifts measured on each half of `source` (one local pass over all of
    it, :func:`repairs.bias_shift_folds`, which pools them into the whole data's shifts),
    and the output noise without and with them on up to FOLD_MAX_SAMPLES samples of the
    other half, fewer once the verdict is settled (:func:`_fold_noise`). Kept when it
    lowers the two folds' output noise pooled over all the samples they scored (two-fold
    cross-validation); a `source` that cannot be halved (one sample, or one batch of a
    fixed-batch model) gives no folds and keeps nothing.

    Not "when both folds lower it": on the PP-OCRv3 detector (page seed 11) one fold's 8
    pages rose by 3 % with the shifts of 32 pages and the shifts were dropped, while the
    shifts pooled from all 64 pages, the ones applied, were worth +0.7 dB held out.

    Measured on its own data, the correction looks better: on silero-vad with entropy
    scales it lowered the output noise of calibration samples it was measured on by 14 %
    and cost 1.9-2.3 dB of held-out output SQNR; the folds reject it there (noise 0.019
    -> 0.066 and 0.013 -> 0.159) and keep it on the layout detector (-28 % to -46 %, both
    folds, both page seeds; benchmarks/README.md).
    """
    from quantlab.calibration import repairs

    source = decision_share(index.model, source, BIAS_SAMPLES)
    fixed = graph.fixed_batch_size(index.model) or 1
    half = source.num_samples // 2 // fixed * fixed
    halves = ([source.subset(0, half), source.subset(half, source.num_samples)] if half
              else [source])
    labels = ("first half", "second half")
    with phases.record("bias shifts", source.num_samples):
        # The pass runs the FP32 model on the samples the folds score (each half's first
        # FOLD_MAX_SAMPLES, the first it reads): its outputs are the folds' references.
        shifts, pooled, report, references = repairs.bias_shift_folds(index.model, quantized, [
            phases.shown(index.model, part, f"bias shifts, {label}")
            for part, label in zip(halves, labels, strict=False)],
            settle=repairs.Settle(BIAS_SETTLED_NOISE, BIAS_MIN_SAMPLES),
            model_outputs=FOLD_MAX_SAMPLES if half else 0)
    phases.read(sum(report.summary["samples_read"]) // phases.batch)
    folds, energies = [], []
    if half:
        with phases.record("output noise", 0, 2):
            # The model without the shifts is the same in both folds: one session.
            without = OnnxRuntimeBackend(quantized, name="int8", spinning=False)
            for measured_on, scored_on in ((0, 1), (1, 0)):
                shifted = repairs.shift_biases(index, quantized, shifts[measured_on])
                scored = phases.shown(index.model, halves[scored_on],
                                      f"output noise, {labels[measured_on]}'s shifts",
                                      FOLD_MAX_SAMPLES)
                fold, found = _fold_noise(index.model, without, shifted, scored,
                                          references=references[scored_on])
                folds.append({"measured_on": labels[measured_on], **fold})
                energies.append(found)
        # Each scored run (a fixed-batch model's batch) ran both Q/DQ models, and FP32 those
        # past the references.
        phases.read(sum(f["samples_scored"] for f in folds), 2,
                    sum(max(f["samples_scored"] - len(references[scored_on]), 0)
                        for f, scored_on in zip(folds, (1, 0), strict=True)))
    report.summary["folds"] = folds
    kept = False
    if folds:
        noise, power = (sum(found[k] for found in energies) for k in (0, 1))
        both = {"output_nsr_without": compare.output_nsr(noise[0], power),
                "output_nsr_with": compare.output_nsr(noise[1], power)}
        kept = repairs.lowers_noise(both["output_nsr_without"], both["output_nsr_with"])
        report.summary["both_folds"] = both
    report.summary["kept"] = kept
    shifted = repairs.shift_biases(index, quantized, pooled) if kept else quantized
    return shifted, {report.repair: report.to_dict()}


def _fold_noise(model: onnx.ModelProto | OnnxRuntimeBackend,
                without: onnx.ModelProto | OnnxRuntimeBackend,
                with_it: onnx.ModelProto | OnnxRuntimeBackend,
                samples: Iterable[dict], settled: bool = True,
                references: Sequence[dict[str, np.ndarray]] = (),
                ) -> tuple[dict, tuple[np.ndarray, np.ndarray]]:
    """One fold's output noise without and with the shifts, pooled over the samples scored
    (:func:`compare.output_nsr` of their summed energies, as the held-out output SQNR and
    the planner read it), and how many were scored: all of `samples`, or with `settled`
    fewer once the verdict is (:func:`_fold_settled`, on the per-sample ratios); and those
    sums (noise [without / with, outputs], signal [outputs]), which pool with another
    fold's. FP32's outputs of the first samples may be given (`references`)."""
    noise, power, ratios = 0.0, 0.0, []
    for candidates, signal in output_energies(model, [without, with_it], samples,
                                              references):
        noise, power = noise + candidates, power + signal
        ratios.append([compare.output_nsr(candidates[k], signal) for k in (0, 1)])
        pooled = [compare.output_nsr(noise[k], power) for k in (0, 1)]
        if settled and _fold_settled(np.array(ratios), pooled):
            break
    return ({"samples_scored": len(ratios), "output_nsr_without": pooled[0],
             "output_nsr_with": pooled[1]}, (noise, power))


def _fold_settled(ratios: np.ndarray, pooled: Sequence[float]) -> bool:
    """Whether a fold's verdict is settled on the samples scored so far (`ratios`: each one's
    output NSR, sample x (without, with); `pooled`: the same pooled over them), after
    FOLD_MIN_SAMPLES: the per-sample change is FOLD_SETTLED_SE standard errors from zero,
    read as a log ratio (pages of ten times the noise then weigh no more than the others),
    with the pooled difference of the same sign; or the difference is surely below
    FOLD_NEGLIGIBLE of the noise (either verdict costs less than 0.05 dB)."""
    if len(ratios) < FOLD_MIN_SAMPLES:
        return False
    difference = ratios[:, 1] - ratios[:, 0]
    error = difference.std(ddof=1) / np.sqrt(len(difference))
    if abs(difference.mean()) + 2 * error < FOLD_NEGLIGIBLE * ratios[:, 0].mean():
        return True
    tiny = np.finfo(np.float64).tiny
    change = np.log(np.maximum(ratios[:, 1], tiny) / np.maximum(ratios[:, 0], tiny))
    spread = change.std(ddof=1) / np.sqrt(len(change))
    return bool(abs(change.mean()) > FOLD_SETTLED_SE * spread and
                np.sign(change.mean()) == np.sign(pooled[1] - pooled[0]))


def output_energies(model: onnx.ModelProto | OnnxRuntimeBackend,
                    candidates: Sequence[onnx.ModelProto | OnnxRuntimeBackend],
                    samples: Iterable[dict],
                    references: Sequence[dict[str, np.ndarray]] = (),
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per sample, each candidate Q/DQ model's output noise energy against `model` (FP32)
    and the signal energy, float64: ([candidates, outputs] of |y - r|^2, [outputs] of
    |r|^2), per float output (whatever axis holds the sample: one per run). Each model
    may be given as a session already made (the folds share the unshifted model's, made
    without spinning); FP32's outputs of the first samples may be given (`references`,
    one dict per sample, in order: bias correction's pass computed them), and FP32 runs
    for the samples after them only.

    The sessions take turns, so none spins waiting for a next run of its own: on the
    PP-OCRv3 detector a sample's three runs took 0.26-0.28 s so, 0.37 s with the other
    two sessions' idle ONNX Runtime threads spinning on the cores."""

    def session(given, name: str) -> OnnxRuntimeBackend:
        return given if isinstance(given, OnnxRuntimeBackend) else \
            OnnxRuntimeBackend(given, name=name, spinning=False)

    fp32 = None
    backends = [session(candidate, "int8") for candidate in candidates]
    for index, sample in enumerate(samples):
        if index < len(references):
            fp32_outputs = references[index]
        else:
            fp32 = fp32 if fp32 is not None else session(model, "fp32")
            fp32_outputs = fp32.run(sample)
        reference = {name: want.astype(np.float64) for name, want in fp32_outputs.items()
                     if np.issubdtype(want.dtype, np.floating)}
        yield (np.array([[np.sum((outputs[name] - want) ** 2) for name, want in reference.items()]
                         for outputs in (backend.run(sample) for backend in backends)]),
               np.array([np.sum(want ** 2) for want in reference.values()]))


def decision_share(model: onnx.ModelProto, source: BatchSource, limit: int) -> BatchSource:
    """The first `limit` samples of `source` (whole batches of a fixed-batch model)."""
    fixed = graph.fixed_batch_size(model) or 1
    return source.subset(0, min(source.num_samples, max(limit // fixed, 1) * fixed))


def sample_count(model: onnx.ModelProto, source: BatchSource) -> int:
    """How many items :func:`samples` yields from all of `source`: its samples, or its
    batches for a model of fixed batch size."""
    return len(source) if graph.fixed_batch_size(model) is not None else source.num_samples


def samples(model: onnx.ModelProto, source: BatchSource, limit: int | None = None
            ) -> Iterator[dict]:
    """Up to `limit` samples of `source`, one batch each (a fixed-batch model's batches
    whole), read batch by batch."""
    fixed = graph.fixed_batch_size(model) is not None
    limit = source.num_samples if limit is None else limit
    count = 0
    for batch in source:
        parts = [batch] if fixed else (source.slice(batch, i, i + 1)
                                       for i in range(source.length(batch)))
        for part in parts:
            if count >= limit:
                return
            count += 1
            yield part


def _choice_samples(index: graph.Graph, source: BatchSource,
                    limit: int = CHOICE_SAMPLES) -> list[dict]:
    """Up to `limit` samples of `source`, one batch each (a fixed-batch model's batches
    whole): what the per-layer choices measure on."""
    return list(samples(index.model, source, limit))


def _auto_scales(index: graph.Graph, stats: collect.Statistics, samples: list[dict],
                 ) -> tuple[calibrate.Scales, dict]:
    """Method "auto": per layer the candidate amax with the least local error (see
    :func:`calibrate_from_stats`), Concat-joined pairs at their widest member's; and the
    record of the choice (candidates, samples, layer -> the candidate taken)."""
    from quantlab.planner.measure import choose_calibrators
    from quantlab.planner.units import find_units, share_scales

    candidates = {label: calibrate.calibrate(stats, name, **params).amax
                  for label, (name, params) in AUTO_CANDIDATES.items()}
    first = samples[0]
    fp32 = OnnxRuntimeBackend(index.model, name="fp32")
    units = find_units(index, {name: np.shape(value) for name, value in first.items()},
                       lambda names: {n: a.shape for n, a in fp32.run(first, names).items()})
    amax, chosen = choose_calibrators(index, candidates, units, samples,
                                      candidates[AUTO_DEFAULT])
    amax = share_scales(index, amax)
    return calibrate.Scales(amax, AUTO, {}, stats.num_samples), {
        "candidates": list(AUTO_CANDIDATES), "samples": len(samples), "chosen": chosen}


def write_results(
    result: CalibrationResult,
    out: str | os.PathLike,
    force: bool = False,
    trt_version: str | None = None,
) -> Path:
    """Write a calibration's files into `out` (refused if it holds results, unless `force`).

    ``calibration.cache`` is written for TensorRT `trt_version` when given; the
    statistics must then hold a range for every tensor implicit INT8 needs.

    All or nothing: the files are written into a staging folder next to `out` and
    replace the old ones only once all are complete (:func:`experiment.output_folder`).
    """
    scales = result.scales
    if trt_version is not None:
        cache.implicit_int8_version(trt_version)
        missing = trt_ranges.missing_ranges(result.model, scales.scale)
        if missing:
            raise ConfigError(
                f"no calibration.cache for TensorRT {trt_version}: the statistics have no range "
                f"for {len(missing)} tensor(s) implicit INT8 needs ({missing[:3]}...); they hold "
                "the Q/DQ model's inputs only. Calibrate again with --trt-version (statistics "
                "of every float tensor)."
            )
    with output_folder(out, force=force, produces=CALIBRATION_FILES) as folder:
        graph.save_model(result.model, folder / "model.onnx")
        result.stats.save(folder / "stats.npz")
        scales.save(folder / "scales.json")
        if trt_version is not None:
            cache.write_calibration_cache(
                folder / "calibration.cache",
                scales.scale,
                algorithm=CACHE_ALGORITHM[scales.method],
                trt_version=trt_version,
            )
        graph.save_model(result.qdq_model, folder / "model.int8.onnx")
        _calibration_record(result, trt_version).save(folder)
    result.folder = Path(out)
    return result.folder


def _calibration_record(result: CalibrationResult, trt_version: str | None = None
                       ) -> CalibrationRecord:
    """``calibration.json`` of `result`: what was run, on what, with every choice made."""
    scales = result.scales
    return CalibrationRecord(
        model=graph.source_model(result.model),
        # Absolute: a later command (plan --data DIR) may run from anywhere.
        data=recorded_path(result.data.description),
        data_stamp=files_stamp(data_files(result.data.description)),
        num_samples=result.data.num_samples,
        batch_size=result.data.batch_size,
        method=scales.method,
        params=scales.params,
        tensors=len(scales.amax),
        trt_version=trt_version,
        # So `validate --from` reads the images the same way.
        preprocess=result.preprocess.to_dict() if result.preprocess else None,
        frozen_inputs=graph.frozen_inputs(result.model),
        sample_axes={spec.name: spec.batch_axis for spec in graph.input_specs(result.model)},
        # Run model.int8.onnx in ONNX Runtime with these session config entries to get the
        # numbers quantlab reports (see backends/onnxruntime.py).
        onnxruntime_session_config=SESSION_CONFIG,
        # FP32-preserving rewrites of model.onnx before collection, with what each treated
        # and left alone (and why).
        repairs=result.repairs,
        repairs_requested=result.repairs_requested,
        weight_amax=result.weight_criterion,
        # weight_amax "local": per weight tensor, the channels taking max |w| or the MSE amax
        # and the local SQNR each gives.
        weight_amax_choice=result.weight_choice,
        # weight_rounding "gptq": per weight tensor, whether GPTQ rounded it (and refitted a
        # conv's bias) and its output error against nearest rounding.
        weight_rounding=result.weight_rounding,
        weight_rounding_choice=result.rounding,
        # method "auto": the candidates, the samples the choice measured, and per layer
        # (unit, named by its first linear op) the candidate whose amax it took.
        layer_calibrators=result.layer_calibrators,
        # Each phase in order: seconds, samples read, model runs (forward passes: one per
        # sample and graph, whole model or cut-out).
        phases=result.phases,
    )


# Characters str.splitlines() breaks at: a cache line (and its reader) cannot hold them.
_LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def check_cache_names(names: Iterable[str]) -> None:
    """ModelError unless every tensor name fits on one calibration cache line (cheap)."""
    for name in names:
        if not name or _LINE_BREAKS.intersection(name):
            raise ModelError(
                f"tensor name {name!r} cannot be written to a TensorRT calibration cache: a "
                "cache line holds one non-empty, single-line name. Rename the tensor in the "
                "model (its producer's output) and calibrate again."
            )
