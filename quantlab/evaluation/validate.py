"""Validation: run the stages over the data, compare adjacent stages per tensor, score the task.

Stages are backends (:class:`quantlab.engine.backends.Backend`) handed in and named by
their ``name``: optionally the original torch module, the FP32 ONNX model (the
reference, whose graph index drives everything) and the engine (the INT8 Q/DQ
model). Adjacent stages are compared per tensor (:mod:`quantlab.evaluation.compare`) and
every stage is scored on the task end to end (:mod:`quantlab.evaluation.tasks`) — like
Polygraphy's ``Comparator.run(runners)`` followed by ``compare_accuracy``.

Modes for the FP32-vs-engine pair (each a test stage of :mod:`quantlab.evaluation.validate_modes`):

* ``global``: both graphs run end to end; a tensor's error includes the error of
  every layer before it. The engine runs twice: once with the compared tensors
  exposed (ONNX Runtime then keeps the Q/DQ graph in float: fake quantization)
  and once unexposed, with its integer kernels, for the outputs and task metrics.
* ``local``: every quantized node of the engine runs alone, fed the FP32 run's
  input tensors (:mod:`quantlab.evaluation.sensitivity`), so its row is the error that
  node's quantization adds; a linear op's row is taken where TensorRT's fused layer
  ends, after the activation fused into it (its ``fused_activation`` column names
  those nodes); outputs and task metrics come from the unexposed run.

Memory is bounded by `memory_budget` whatever the data size and the model's
activation size: the data streams through in slices of samples, each slice
runs through the graphs in segments (:mod:`quantlab.evaluation.segments`) sized so their
exposed tensors fit, and every tensor is folded into the running sums of its
comparison and dropped as soon as its segment is done.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pandas as pd

from quantlab import graph
from quantlab.calibration.collect import parse_memory
from quantlab.choices import MODES
from quantlab.data import BatchSource
from quantlab.engine import fusion
from quantlab.engine.backends import Backend
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError, DataError
from quantlab.evaluation import compare, segments
from quantlab.evaluation.compare import PairResult
from quantlab.evaluation.scoring import Certificate, PairedScore
from quantlab.evaluation.tasks import Task, TaskScore
from quantlab.evaluation.validate_modes import TEST_STAGES, SegmentedRun, TestStage, drop, last_use
from quantlab.experiments.experiment import (
    atomic_write,
    check_output,
    recorded_path,
)
from quantlab.experiments.records import ENGINE_STAGE, ValidationSummary
from quantlab.experiments.report import write_report
from quantlab.experiments.report.validation import next_steps, validation_section
from quantlab.planner.measure import output_sample_axes
from quantlab.progress import progress_bar

__all__ = ["ENGINE", "FP32", "MODES", "TORCH", "Task", "ValidationResult", "layers_file",
           "validate"]

TORCH, FP32, ENGINE = "torch", "onnx_fp32", ENGINE_STAGE
STAGE_DESCRIPTIONS = {
    TORCH: "PyTorch module (forward hooks)",
    FP32: "FP32 ONNX model in ONNX Runtime",
    ENGINE: "INT8 Q/DQ model in ONNX Runtime (TensorRT is not installed here)",
}
# Default memory budget of a validation run (DESIGN.md: every pass over the data
# runs under 2 GB). Half of it is planned for exposed tensors; the other half
# leaves room for ONNX Runtime's working memory, the weights and Python.
MEMORY_BUDGET = 2 << 30
EXPOSED_SHARE = 0.5
# Below this share of float tensors compared, the torch pair is flagged as partial.
TORCH_MAPPED_WARNING = 0.5
def layers_file(reference: str, test: str, mode: str = "global") -> str:
    """File name of a pair's per-tensor table, e.g. ``layers_onnx_fp32_vs_engine_int8.csv``."""
    suffix = "" if mode == "global" else f"_{mode}"
    return f"layers_{reference}_vs_{test}{suffix}.csv"


@dataclass
class ValidationResult:
    """What `validate` wrote: the pair results, task metrics per stage, summary and report."""

    folder: Path
    pairs: list[PairResult]
    metrics: dict[str, dict]
    record: ValidationSummary
    report: Path
    # Tensors inside an op the exporter decomposed -> that op (fusion.decomposed_ops): the
    # worst-layer lists show such an op as one row (report.validation.worst_tensors).
    exported: dict = field(default_factory=dict)

    @property
    def summary(self) -> dict:
        """summary.json's content."""
        return self.record.to_json()

    @property
    def tables(self) -> dict[tuple[str, str], pd.DataFrame]:
        """Per-tensor table of each pair, keyed by (reference, test) stage names."""
        return {(p.reference, p.test): p.table for p in self.pairs}

    @property
    def divergences(self) -> dict[tuple[str, str], compare.Divergence | None]:
        """First divergence of each pair, keyed by (reference, test) stage names."""
        return {(p.reference, p.test): p.divergence for p in self.pairs}


@dataclass
class _Pair:
    """A pair being streamed: its per-tensor and per-output comparisons."""

    reference: str
    test: str
    mode: str
    comparison: compare.Comparison
    outputs: compare.Comparison
    upstream: dict[str, list[str]]
    not_compared: list[str]
    extra: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    channels: dict[str, compare.ChannelError] = field(default_factory=dict)
    # compared tensor -> the output of the linear op whose fused layer ends there (local mode)
    layers: dict[str, str] = field(default_factory=dict)


def validate(
    onnx_model: Backend | onnx.ModelProto | str | os.PathLike,
    engine_model: Backend | onnx.ModelProto | str | os.PathLike,
    data: BatchSource,
    out: str | os.PathLike,
    torch_module=None,
    task: Task | None = None,
    mode: str = "global",
    threshold_db: float = 30.0,
    min_drop_db: float = 10.0,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    force: bool = False,
    progress: bool = True,
    title: str = "Validation",
    memory_budget: int | str | None = MEMORY_BUDGET,
    metric: str | None = None,
    resamples: int = 200,
    model_file: str | None = None,
    calibration: str | None = None,
) -> ValidationResult:
    """Run every stage over `data`, compare adjacent stages per tensor, score the task.

    `onnx_model` and `engine_model` are backends (stages named by their ``name``)
    or models, which run in ONNX Runtime as ``onnx_fp32`` and ``engine_int8``;
    `torch_module` is a torch backend or an ``nn.Module`` (then mapped onto the
    FP32 graph's tensor names). Writes into `out`, all or nothing: one
    ``layers_<A>_vs_<B>.csv`` per stage pair, ``summary.json`` (task metrics per
    stage, first divergence and end-to-end output errors per pair) and
    ``report.html``. `threshold_db`/`min_drop_db` define the first divergence
    (see :func:`quantlab.evaluation.compare.first_divergence`); `atol`/`rtol` the tolerance
    of the ``frac_outside`` column. `memory_budget` is bytes or text such as ``"512M"``
    (None: 2 GiB). `metric` (as `quantlab plan` takes it: ``sqnr``, ``agreement``,
    ``module:function``, or `task`'s ``top1`` / ``map``) scores the engine's outputs against
    FP32's end to end, with a paired bootstrap interval over `resamples` resamples
    (summary.json's ``metric``). `model_file` (the user's model, for the report's
    subtitle) and `calibration` (the calibration folder) go into the next steps the
    report suggests (summary.json's ``next_steps``).
    """
    memory_budget = parse_memory(memory_budget)
    # A user's metric may be slow: its bootstrap shows progress like the passes before it.
    paired = PairedScore(metric, task, resamples, progress=partial(
        progress_bar, unit="resample", enabled=progress)) if metric is not None else None
    check_threshold(threshold_db, min_drop_db)
    torch_stage, fp32, engine, pair_files = _stages(onnx_model, engine_model, torch_module,
                                                    data, task, mode)
    check_output(out, force=force, produces=[*pair_files, *ValidationSummary.FILES])
    streamed = run_stages(fp32, engine, data, torch_stage=torch_stage, task=task, mode=mode,
                          atol=atol, rtol=rtol, progress=progress, memory_budget=memory_budget,
                          paired=paired)
    index = streamed.index
    notes = [streamed.note]
    info = index.tensor_info()
    pairs = [_pair_result(p, info, index.order, threshold_db, min_drop_db, index.floats)
             for p in streamed.pairs]
    metrics = {name: score.result() for name, score in streamed.scores.items()}
    end_to_end = metric_record(paired.certificate(), fp32.name, engine.name) if paired else None
    summary = ValidationSummary(
        samples=data.num_samples, data=recorded_path(data.description),
        calibration=calibration, mode=mode,
        stages={s.name: STAGE_DESCRIPTIONS.get(s.name, type(s).__name__)
                for s in (torch_stage, fp32, engine) if s is not None},
        task=task.kind if task else None, metrics=metrics, metric=end_to_end,
        divergence_rule={"threshold_db": threshold_db, "min_drop_db": min_drop_db},
        tolerance={"atol": atol, "rtol": rtol}, memory=streamed.memory, notes=notes,
        pairs=[_pair_record(p) for p in pairs],
        next_steps=next_steps(pairs, end_to_end, threshold_db, mode, model_file,
                              recorded_path(data.description), calibration))
    exported = fusion.decomposed_ops(index)
    section = validation_section(pairs, metrics, index.order, threshold_db, notes=notes,
                                 metric=end_to_end, steps=summary.next_steps, exported=exported)
    source = f"{model_file}; " if model_file else ""
    folder = summary.write(out, force, partial(
        _write_pairs, pairs, title, section, f"{source}{data.description}, "
                                             f"{data.num_samples} samples"), produces=pair_files)
    return ValidationResult(folder, pairs, metrics, summary, folder / "report.html", exported)


def _stages(onnx_model, engine_model, torch_module, data: BatchSource, task: Task | None,
            mode: str) -> tuple:
    """(torch stage or None, FP32 stage, engine stage, their pairs' layers csv files) of
    validate's arguments, checked: a known `mode`, `task` fits `data`, stage names differ."""
    if mode not in MODES:
        raise ConfigError(f"mode '{mode}' is not one of {', '.join(MODES)}.")
    if task is not None:
        task.check_samples(data.num_samples)
    fp32 = _stage(onnx_model, FP32)
    engine = _stage(engine_model, ENGINE)
    torch_stage = _torch_stage(torch_module, fp32, data)
    names = [s.name for s in (torch_stage, fp32, engine) if s is not None]
    if len(set(names)) != len(names):
        raise ConfigError(f"stage names must differ; got {names}.")
    pair_files = [layers_file(fp32.name, engine.name, mode)]
    if torch_stage is not None:
        pair_files.insert(0, layers_file(torch_stage.name, fp32.name))
    return torch_stage, fp32, engine, pair_files


def _write_pairs(pairs: list[PairResult], title: str, section, subtitle: str,
                 staging: Path) -> None:
    """A validation folder's files besides summary.json: each pair's layers csv, the report."""
    for pair in pairs:
        atomic_write(staging / layers_file(pair.reference, pair.test, pair.mode),
                     lambda tmp, t=pair.table: t.to_csv(tmp, index=False))
    write_report(staging / "report.html", title, [section], subtitle=subtitle)


def _pair_record(pair: PairResult) -> dict:
    """summary.json's record of one stage pair (ValidationSummary.pairs)."""
    return {
        "reference": pair.reference,
        "test": pair.test,
        "mode": pair.mode,
        "layers_csv": layers_file(pair.reference, pair.test, pair.mode),
        "tensors_compared": len(pair.table),
        "tensors_not_compared": pair.not_compared,
        "warnings": pair.warnings,
        "first_divergence": pair.divergence.to_dict() if pair.divergence else None,
        # Over the float outputs, pooled over the samples: plan's --min-sqnr figure.
        "output_sqnr_db": pair.output_sqnr_db,
        "outputs": pair.outputs,
        # Per output, on the axis whose channels' max |value| span most: that span and the
        # worst channel's SQNR (an output mixing scales, compare.ChannelError).
        "output_channels": pair.channels,
    }


def metric_record(certificate: Certificate, reference: str, test: str) -> dict:
    """summary.json's ``metric``: the `test` stage's value against the `reference` stage's,
    and the paired bootstrap interval of the change (of the value itself where the
    reference's is infinite: output SQNR of FP32 against itself)."""
    change = np.isfinite(certificate.reference)
    return {
        "name": certificate.metric,
        "stages": [reference, test],
        reference: certificate.reference + 0.0,  # + 0.0: never -0 (a metric's -mean(0))
        test: certificate.value + 0.0,
        "change": certificate.value - certificate.reference if change else None,
        "interval_of": "change" if change else "value",
        "interval": list(certificate.interval),
        # certify_paired's quantiles are one-sided bounds at `confidence`: a two-sided interval.
        "confidence": 2 * certificate.confidence - 1,
        "samples": certificate.samples,
    }


def check_threshold(threshold_db: float, min_drop_db: float) -> None:
    """Raise ConfigError unless the divergence rule's numbers are finite."""
    for label, value in (("--threshold-db", threshold_db), ("min_drop_db", min_drop_db)):
        if not np.isfinite(value):
            raise ConfigError(f"{label} must be a finite number of dB, got {value}.")


def _stage(stage: Backend | onnx.ModelProto | str | os.PathLike, name: str) -> Backend:
    if hasattr(stage, "run") and hasattr(stage, "name"):
        return stage
    model = stage if isinstance(stage, onnx.ModelProto) else graph.load_model(stage)
    return OnnxRuntimeBackend(model, name=name)


def _torch_stage(torch_module, fp32: Backend, data: BatchSource) -> Backend | None:
    if torch_module is None or (hasattr(torch_module, "run") and hasattr(torch_module, "name")):
        return torch_module
    from quantlab.engine.backends.torch import TorchBackend

    first = next(iter(data))
    return TorchBackend(torch_module, fp32.model, name=TORCH, sample=data.slice(first, 0, 1))


def _pair_result(pair: _Pair, info: pd.DataFrame, order: Sequence[str], threshold_db: float,
                 min_drop_db: float, floats: Collection[str]) -> PairResult:
    if pair.layers:
        info = info.copy()
        for tensor, layer in pair.layers.items():
            info.loc[tensor, ["node", "op_type", "torch_module"]] = \
                info.loc[layer, ["node", "op_type", "torch_module"]].to_numpy()
    table = pair.comparison.table(info)
    for column, by_tensor in pair.extra.items():
        table[column] = [" ".join(by_tensor.get(t, [])) for t in table["tensor"]]
    divergence = compare.first_divergence(table, order, pair.upstream, threshold_db, min_drop_db)
    outputs = {name: err.metrics() for name, err in pair.outputs.errors.items()}
    compared = [err for name, err in pair.outputs.errors.items() if name in floats]
    output_sqnr = (compare.output_sqnr_db([e.sum_err2 for e in compared],
                                          [e.sum_ref2 for e in compared]) if compared else None)
    return PairResult(pair.reference, pair.test, pair.mode, table, divergence, outputs,
                      pair.not_compared, pair.warnings, output_sqnr,
                      {name: c.spread() for name, c in pair.channels.items()})


# ------------------------------------------------------------------ streaming the stages


@dataclass
class StageRuns:
    """The folded result of running the stages over the data (no array of any run)."""

    index: graph.Graph
    pairs: list[_Pair]
    scores: dict[str, TaskScore]
    memory: dict
    note: str  # how the test stage ran (summary.json's notes)


def run_stages(
    fp32: Backend,
    engine: Backend,
    data: BatchSource,
    torch_stage: Backend | None = None,
    task: Task | None = None,
    mode: str = "global",
    atol: float = 1e-3,
    rtol: float = 1e-3,
    progress: bool = True,
    memory_budget: int = MEMORY_BUDGET,
    paired: PairedScore | None = None,
) -> StageRuns:
    """Stream `data` through the stages and fold every compared tensor and output as it comes.

    The comparisons and task scores are returned; no array of any run outlives
    the segment that produced it (boundary tensors live until their last reader),
    except the outputs `paired` keeps for a metric other than output SQNR.
    """
    index = graph.Graph(fp32.model)
    test = TEST_STAGES[mode](engine, index, graph.Graph(engine.model))
    pairs: list[_Pair] = []
    if torch_stage is not None:
        pairs.append(_torch_pair(torch_stage, fp32.name, index, atol, rtol))
    compared = set(test.tensors)
    pairs.append(_Pair(
        fp32.name, engine.name, test.mode,
        compare.Comparison(test.tensors, fp32.name, engine.name, atol, rtol),
        compare.Comparison(index.outputs, fp32.name, engine.name, atol, rtol),
        test.upstream(), [t for t in index.order if t in index.floats and t not in compared],
        test.extra, list(getattr(engine, "notes", [])), layers=test.layers))
    scores = {s.name: task.score() for s in (torch_stage, fp32, engine) if s is not None} \
        if task is not None else {}
    torch_tensors = pairs[0].comparison.tensors if torch_stage is not None else []
    layout = _Layout.plan(index, data, next(iter(data)), test, torch_tensors, memory_budget,
                          segmentable=isinstance(fp32, OnnxRuntimeBackend))
    # A TensorRT engine takes at most its optimization profile's batch (trt-review-r2 N2).
    engine_batch = getattr(engine, "max_batch", None)
    if engine_batch is not None and layout.fixed and layout.slice_size > engine_batch:
        raise ConfigError(
            f"the model has a fixed batch of {layout.slice_size} samples but the engine "
            f"'{engine.name}' takes at most {engine_batch}; build the engine from this model "
            "(quantlab build) so that its profile matches.")
    if engine_batch is not None:
        layout.slice_size = min(layout.slice_size, engine_batch)
    stream = _Stream(index, fp32, test, torch_stage, layout, pairs, scores)
    if paired is not None:  # outputs samples first, as the planner's metrics read them
        stream.paired = paired
        stream.output_axes = output_sample_axes(fp32.model, fp32.run, next(iter(data)), data)
    start = 0
    # Tensors are folded in parallel: the comparison kernel releases the GIL.
    with (ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as stream.pool,
          progress_bar(total=data.num_samples, desc="validate", unit="sample",
                       enabled=progress) as bar):
        for batch in data:
            size = data.length(batch)
            bad = compare.first_nonfinite(batch, index.input_names)
            if bad is not None:
                raise DataError(
                    f"input batch of samples {start}..{start + size - 1}: tensor '{bad}' "
                    "contains NaN or Inf. Fix or remove these samples in the data.")
            # A model with a fixed batch gets batches of exactly that size: never sliced.
            step = size if layout.fixed else layout.slice_size
            for offset in range(0, size, step):
                stop = min(size, offset + step)
                part = batch if step >= size else data.slice(batch, offset, stop)
                stream.run_slice(part, start + offset, start + stop)
                bar.update(stop - offset)
            start += size
    memory = {"budget_bytes": memory_budget, "slice_samples": layout.slice_size,
              "fixed_batch": layout.fixed, "segments": len(layout.groups),
              "exposed_bytes_per_sample": layout.sample_bytes}
    return StageRuns(index, pairs, scores, memory, test.note)


def _torch_pair(torch_stage: Backend, reference: str, index: graph.Graph, atol: float,
                rtol: float) -> _Pair:
    """The torch-vs-FP32 pair: the mapped tensors, and a warning when few of them map."""
    mapping = getattr(torch_stage, "mapping", {})
    inputs = set(index.input_names)
    mapped = [t for t in index.order if t in mapping]
    floats = [t for t in index.order if t in index.floats and t not in inputs]
    not_compared = [t for t in floats if t not in mapping]
    pair = _Pair(torch_stage.name, reference, "global",
                 compare.Comparison(mapped, torch_stage.name, reference, atol, rtol),
                 compare.Comparison(index.outputs, torch_stage.name, reference, atol, rtol),
                 index.upstream(mapped), not_compared)
    if floats and len(mapped) < TORCH_MAPPED_WARNING * len(floats):
        scoped = any(graph.node_module_path(n) for n in index.model.graph.node)
        why = ("their nodes are written inline in a forward() rather than being a module's "
               "output" if scoped else
               "the ONNX file records no torch module scopes (neither the dynamo exporter's "
               f"{graph.NAME_SCOPES_KEY} metadata nor the TorchScript exporter's /module/Op "
               "node names)")
        pair.warnings.append(
            f"only {len(mapped)} of {len(floats)} float tensors of the ONNX graph are compared "
            f"between {torch_stage.name} and {reference}; {len(not_compared)} could not be mapped "
            f"to a torch module output because {why}. Export with quantlab.graph.export_torch "
            "(or torch.onnx.export(..., dynamo=True)) to compare layer by layer.")
        warnings.warn(pair.warnings[-1], stacklevel=3)
    return pair


@dataclass
class _Layout:
    """How the data and the graphs are cut: samples per slice and groups of tensors per segment."""

    slice_size: int
    fixed: bool
    groups: list[list[str]]
    fp32_extra: list[str]
    sample_bytes: int

    @classmethod
    def plan(cls, index: graph.Graph, data: BatchSource, first: Mapping[str, np.ndarray],
             test: TestStage, torch_tensors: Sequence[str], budget: int, segmentable: bool
             ) -> _Layout:
        """Slices shrink to one sample (or the model's fixed batch) before the graph is cut.

        The tensors `test` holds whole (TensorRT's debug listener copies every exposed
        tensor) come off the budget first, and the engine's values are not counted again per
        segment; the FP32 tensors it is fed are exposed where they are produced.
        """
        fixed = graph.fixed_batch_size(index.model) is not None
        unit = first if fixed else data.slice(first, 0, 1)
        shapes = {name: np.shape(value) for name, value in unit.items()}
        sizes = index.sample_bytes(shapes)
        engine_held = 0
        if test.whole:
            held = test.engine_index.sample_bytes(shapes)
            engine_held = sum(held.get(t, 0) for t in test.whole)
        engine_set, torch_set = set(test.tensors), set(torch_tensors)
        compared = engine_set | torch_set
        # The engine's values are counted in engine_held already when it runs whole.
        per_segment = set() if test.whole else engine_set
        extra = [t for t in test.feeds if t not in compared]
        exposed_names = [t for t in index.order if t in compared or t in extra
                         or t in index.outputs]
        # Bytes held per tensor: the FP32 value plus each stage's value compared with it.
        cost = {t: sizes.get(t, 0) * (1 + (t in per_segment) + (t in torch_set))
                for t in exposed_names}
        per_unit = sum(cost.values())
        exposed = int(budget * EXPOSED_SHARE)
        if engine_held >= exposed:
            need = math.ceil((engine_held + per_unit) / EXPOSED_SHARE / (1 << 20))
            raise ConfigError(
                f"the engine stage holds {engine_held / (1 << 20):.0f} MiB of exposed tensors per "
                f"sample (TensorRT's debug listener copies every tensor the engine exposes on "
                f"each run), more than the memory budget leaves for them; pass --memory {need}M "
                "or more, or validate an engine built without debug tensors (quantlab build).")
        if per_unit + engine_held <= exposed or not segmentable:
            cut = [exposed_names]
            slice_size = max(1, exposed // max(1, per_unit + engine_held))
        else:
            cut = segments.group_by_bytes(exposed_names, cost, exposed - engine_held)
            slice_size = 1
        # Local feeds are exposed where they are produced, not asked for as a group's tensors.
        skipped = set(extra)
        if fixed:  # the data layer hands over exactly the model's batch: never sliced
            slice_size = graph.fixed_batch_size(index.model)
        groups = [[t for t in group if t not in skipped] for group in cut]
        groups[-1] = list(dict.fromkeys([*groups[-1], *index.outputs]))
        return cls(slice_size, fixed, groups, extra, per_unit + engine_held)

    def hint(self) -> str:
        """How to run with fewer cuts: the memory budget that exposes one sample uncut."""
        uncut = math.ceil(self.sample_bytes / EXPOSED_SHARE / (1 << 20))
        return (f"Until then, pass a larger --memory so the graph is cut less: --memory {uncut}M "
                f"or more runs it uncut ({self.sample_bytes / (1 << 20):.0f} MiB of compared "
                "tensors per sample).")


class _Stream:
    """Runs slices through the stages segment by segment and folds what they produce."""

    def __init__(self, index: graph.Graph, fp32: Backend, test: TestStage,
                 torch_stage: Backend | None, layout: _Layout, pairs: list[_Pair],
                 scores: dict[str, TaskScore]):
        self.index, self.fp32, self.test, self.torch = index, fp32, test, torch_stage
        self.engine = test.engine
        self.layout, self.scores = layout, scores
        self.torch_pair = pairs[0] if torch_stage is not None else None
        self.pool: ThreadPoolExecutor | None = None
        self.engine_pair = pairs[-1]
        self.outputs = list(index.outputs)
        self.engine_pair.channels = {o: compare.ChannelError() for o in self.outputs}
        hint = layout.hint()
        self.fp32_run = SegmentedRun(fp32, segments.plan_segments(index, layout.groups,
                                                                  extra=layout.fp32_extra),
                                     hint=hint)
        fed = test.start(layout.groups, hint)
        self.fp32_last = last_use(self.fp32_run.plan, fed)
        self.fp32_last.update(dict.fromkeys(self.outputs, len(layout.groups)))  # read at the end
        self.inputs = set(index.input_names)
        self.paired: PairedScore | None = None
        self.output_axes: dict[str, int] = {}

    def run_slice(self, part: Mapping[str, np.ndarray], start: int, stop: int) -> None:
        """Run samples `start:stop` (`part`) through every stage, folding as it goes."""
        outputs = self.outputs
        torch_values = None
        if self.torch is not None:
            torch_values = self.torch.run(part, [*self.torch_pair.comparison.tensors, *outputs])
        engine_outputs = self.test.begin(part)
        fp32_live = {name: part[name] for name in self.index.input_names}
        samples = f"samples {start}..{stop - 1}"
        for number, group in enumerate(self.layout.groups):
            fp32_live.update(self.fp32_run.run(number, fp32_live, part, samples))
            test_values = self.test.values(number, group, fp32_live, part, samples)
            # The comparison kernel counts NaN/Inf as it folds; only then are they searched.
            flagged = self.engine_pair.comparison.update(
                fp32_live, test_values, [t for t in group if t in test_values], self.pool)
            if torch_values is not None:
                folded = [t for t in group if t in self.torch_pair.comparison.errors]
                flagged += self.torch_pair.comparison.update(torch_values, fp32_live, folded,
                                                             self.pool)
                for name in folded:
                    if name not in outputs:
                        del torch_values[name]
            if flagged:
                self._blame(fp32_live, torch_values or {}, test_values, group,
                            f" ({self.engine_pair.mode} mode)")
            del test_values
            drop(fp32_live, self.fp32_last, number, self.inputs)
            self.test.done(number)
        stage_outputs = {self.fp32.name: {o: fp32_live[o] for o in outputs},
                         self.engine.name: engine_outputs}
        flagged = self.engine_pair.outputs.update(stage_outputs[self.fp32.name], engine_outputs)
        if not flagged:  # an output's channels: whether it mixes scales
            for name, channels in self.engine_pair.channels.items():
                channels.update(stage_outputs[self.fp32.name][name], engine_outputs[name])
        if torch_values is not None:
            stage_outputs[self.torch.name] = {o: torch_values[o] for o in outputs}
            flagged += self.torch_pair.outputs.update(stage_outputs[self.torch.name],
                                                      stage_outputs[self.fp32.name])
        if flagged:
            self._blame(fp32_live, torch_values or {}, engine_outputs, outputs, "")
        for name, score in self.scores.items():
            score.update(stage_outputs[name], start, stop)
        if self.paired is not None:
            first = {name: {o: np.moveaxis(v, self.output_axes[o], 0) if o in self.output_axes
                            else v for o, v in values.items()}
                     for name, values in stage_outputs.items()}
            self.paired.update(first[self.engine.name], first[self.fp32.name])

    def _blame(self, fp32: Mapping[str, np.ndarray], torch: Mapping[str, np.ndarray],
               test: Mapping[str, np.ndarray], group: Sequence[str], test_mode: str) -> None:
        """Raise DataError naming the first stage and tensor (topological order) with NaN/Inf."""
        order = [t for t in self.index.order if t in set(group) | set(fp32)]
        for values, stage in ((fp32, f"stage '{self.fp32.name}'"),
                              (torch, f"stage '{getattr(self.torch, 'name', '')}'"),
                              (test, f"stage '{self.engine.name}'{test_mode}")):
            bad = compare.first_nonfinite(values, order)
            if bad is not None:
                raise DataError(
                    f"{stage}: tensor '{bad}' contains NaN or Inf. It is the first such tensor "
                    "in topological order; check the input data and the layer that produces it.")
