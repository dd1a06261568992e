"""Calibration sweeps: calibrators x parameters x nested calibration sizes, one collection pass.

Statistics are mergeable (:mod:`quantlab.calibration.collect`): the calibration samples are
collected once, in blocks cut at every requested size, and the running merge is
kept at every size, so the snapshot at size n is exactly a collection over the
first n samples. Every configuration's scales come from its snapshot; its Q/DQ
model is evaluated on held-out data with ONNX Runtime's integer kernels, scored
with the metric's paired bootstrap interval against FP32
(:func:`quantlab.planner.certify.certify_paired`).

Data sufficiency: per tensor, how far each amax moves from n/2 to n samples
(:func:`amax_movement`) and its bootstrap spread over the blocks (:func:`amax_spread`);
whether the evaluation set tells the best configuration from the best of another
calibrator (:meth:`Evaluator.versus`, :func:`evaluation_sentence`).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from quantlab import graph
from quantlab.calibration import calibrate, collect, qdq
from quantlab.data import BatchSource
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.errors import ConfigError
from quantlab.evaluation.scoring import (
    Certificate,
    Outputs,
    PairedScore,
    Reference,
    metric_for,
    versus,
)
from quantlab.planner.measure import in_runs, output_sample_axes, samples_per_run

# `quantlab sweep --help` states DEFAULT_PERCENTILES and TOLERANCE (its parser imports no NumPy).
DEFAULT_PERCENTILES = (99.9, 99.99, 99.999)
# Smallest default calibration size; the defaults double from here up to all the data.
FIRST_SIZE = 16
# An amax that moves by less than this share from n/2 to n samples has converged; one
# that moves more shifts the INT8 grid by over 2.5 of its 127 steps at the range's end.
TOLERANCE = 0.02
# The scales' bootstrap: at most this many blocks of samples, resampled this many times.
MAX_BLOCKS = 16
SPREAD_RESAMPLES = 50
# A sweep estimated to run longer than this is refused unless the user allows it.
LONG_SWEEP_S = 3600.0
# INT8 Q/DQ models in ONNX Runtime on CPU take up to this many times an FP32 pass
# (quantize/dequantize and layout changes dominate small models); used in the estimate.
INT8_COST = 2.0


@dataclass(frozen=True)
class Config:
    """One configuration of a sweep: a calibrator, its parameters and the calibration size."""

    method: str
    params: tuple[tuple[str, float], ...]
    size: int

    @property
    def setting(self) -> str:
        """The calibrator and its parameters, e.g. ``percentile 99.99``."""
        return " ".join([self.method, *(f"{value:g}" for _, value in self.params)])

    @property
    def label(self) -> str:
        """The setting and the size, e.g. ``percentile 99.99 @128``."""
        return f"{self.setting} @{self.size}"


def configurations(methods: Sequence[str], percentiles: Sequence[float],
                   sizes: Sequence[int]) -> list[Config]:
    """Every method (percentile once per percentile) at every size, smallest size first."""
    settings: list[tuple[str, tuple[tuple[str, float], ...]]] = []
    for method in dict.fromkeys(methods):
        calibrate.check_method(method, {})
        if method == "percentile":
            settings += [(method, (("percentile", calibrate.check_method(
                method, {"percentile": p})["percentile"]),)) for p in dict.fromkeys(percentiles)]
        else:
            settings.append((method, ()))
    return [Config(method, params, size) for size in sizes for method, params in settings]


def default_sizes(num_samples: int) -> list[int]:
    """16, 32, 64, ... below `num_samples`, then `num_samples` itself."""
    sizes = [FIRST_SIZE << k for k in range(32) if FIRST_SIZE << k < num_samples]
    return [*sizes, num_samples]


def check_sizes(sizes: Sequence[int], num_samples: int, description: str,
                step: int = 1) -> list[int]:
    """`sizes` sorted and unique; ConfigError when one is below 2, beyond the data or (for a
    model with a fixed batch of `step` samples) not a multiple of `step`."""
    sizes = sorted(set(int(n) for n in sizes))
    if sizes[0] < 2:
        raise ConfigError(f"--calib-sizes {sizes[0]}: a calibration size must be at least 2 "
                          "samples (the sufficiency check compares n/2 with n).")
    if sizes[-1] > num_samples:
        raise ConfigError(
            f"--calib-sizes {sizes[-1]} is larger than the calibration data: {description} holds "
            f"{num_samples} samples. Pass sizes up to {num_samples}, or more calibration data "
            "with --data.")
    odd = [n for n in sizes if n % step]
    if odd:
        raise ConfigError(f"--calib-sizes {odd}: the model runs exactly {step} samples at a time; "
                          f"give sizes that are multiples of {step}.")
    return sizes


def snapshot_points(sizes: Sequence[int], step: int = 1) -> list[int]:
    """The sizes statistics are kept at: `sizes` and half the largest (for the movement)."""
    return sorted(set(sizes) | {half_size(sizes[-1], step)})


def half_size(size: int, step: int = 1) -> int:
    """n/2 for the movement of the scales, a multiple of `step` (a fixed batch)."""
    return max(step, size // 2 // step * step)


def block_size(points: Sequence[int], step: int = 1) -> int:
    """Samples per bootstrap block: the smallest size, more where the largest would make over
    MAX_BLOCKS blocks; a multiple of `step` (a fixed batch)."""
    size = max(points[0], -(-points[-1] // MAX_BLOCKS))
    return -(-size // step) * step


@dataclass
class Collected:
    """Statistics of the first n samples for every requested n, and the blocks of samples
    they merge (the units of the scales' bootstrap; those a known snapshot replaced are
    missing)."""

    snapshots: dict[int, collect.Statistics]
    blocks: list[collect.Statistics]


def snapshots(model: onnx.ModelProto | graph.Graph, source: BatchSource, tensors: Sequence[str],
              points: Sequence[int], block: int,
              known: Mapping[int, collect.Statistics] | None = None,
              known_blocks: Mapping[tuple[int, int], collect.Statistics] | None = None,
              progress: bool = True, on_block: Callable[[int, int, collect.Statistics], None]
              | None = None, **options) -> Collected:
    """Statistics of the first n samples of `source` for every n of `points` (sorted), each
    sample collected once: blocks of at most `block` samples, cut at every point, are
    collected one after another and merged into the running statistics (exact,
    :meth:`collect.Statistics.merge`).

    `known` snapshots (a calibration folder's ``stats.npz``) are taken as they are, and the
    blocks up to them are not collected; `known_blocks` (start, stop) -> statistics (a
    resumed sweep's) are not collected again; `on_block` sees every new block. `options`
    go to :func:`collect.collect`.
    """
    known, known_blocks = dict(known or {}), dict(known_blocks or {})
    index = model if isinstance(model, graph.Graph) else graph.Graph(model)
    result: dict[int, collect.Statistics] = {}
    blocks: list[collect.Statistics] = []
    running, done = None, 0
    for point in points:
        if point in known:
            running = known[point]
        for start in ([] if point in known else range(done, point, block)):
            stop = min(start + block, point)
            chunk = known_blocks.get((start, stop))
            if chunk is None:
                chunk = collect.collect(index, source.subset(start, stop), tensors,
                                        progress=progress, **options)
                if on_block:
                    on_block(start, stop, chunk)
            blocks.append(chunk)
            running = chunk if running is None else running.merge(chunk)
        result[point], done = running, point
    return Collected(result, blocks)


def amax_spread(blocks: Sequence[collect.Statistics], method: str,
                params: Mapping[str, float], resamples: int = SPREAD_RESAMPLES,
                seed: int = 0) -> dict[str, float]:
    """Per tensor, the bootstrap spread of `method`'s amax over the samples of `blocks`:
    the standard deviation over resamples of the blocks (drawn with replacement, merged)
    relative to the mean. Samples are resampled in blocks: the elements of one sample are
    not independent, and neither are neighbouring samples of a video or a document."""
    rng = np.random.default_rng(seed)
    draws = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a resample's outlier notes repeat the sweep's own
        for _ in range(resamples):
            picked = [blocks[i] for i in rng.integers(0, len(blocks), len(blocks))]
            merged = functools.reduce(collect.Statistics.merge, picked)
            draws.append(calibrate.calibrate(merged, method, **dict(params)).amax)
    names = list(draws[0])
    values = np.array([[draw[name] for name in names] for draw in draws])
    return dict(zip(names, values.std(axis=0) / values.mean(axis=0), strict=True))


def amax_movement(half: Mapping[str, float], full: Mapping[str, float]) -> dict[str, float]:
    """Per tensor, |amax(n) - amax(n/2)| / amax(n): how far the scale still moves."""
    return {name: abs(full[name] - half[name]) / full[name] for name in full}


class Evaluator:
    """Scores INT8 models on evaluation data against the FP32 model, with paired bootstrap
    (:class:`quantlab.evaluation.scoring.PairedScore`).

    Every model runs over `evaluation` in runs of a bounded size, outputs samples first
    (as the planner reads them); FP32's outputs are computed once, and its records
    (:class:`quantlab.evaluation.scoring.Reference`) scored once per resample for every
    configuration. `metric` is a label-free metric or ``module:name``, or the primary
    metric of `task` (``top1``, ``map``).
    """

    def __init__(self, model: onnx.ModelProto, evaluation: BatchSource, metric: str,
                 task=None, resamples: int = 200, progress: Callable | None = None):
        self.evaluation = evaluation
        self.metric = metric_for(metric, task)
        self.resamples = resamples
        self.progress = progress or (lambda items, **_: items)
        started = time.perf_counter()
        self.fp32 = OnnxRuntimeBackend(model, name="fp32")
        first = next(iter(evaluation))
        self.size = samples_per_run(graph.Graph(model), first, evaluation)
        self.axes = output_sample_axes(model, self.fp32.run, first, evaluation)
        self.references = self.outputs(model, "FP32 evaluation", self.fp32)
        self.reference = Reference(self.metric)
        for batch in self.references:
            self.reference.update(batch)
        self.fp32_seconds = time.perf_counter() - started

    def outputs(self, model: onnx.ModelProto, desc: str,
                backend: OnnxRuntimeBackend | None = None) -> Outputs:
        """`model`'s outputs on every evaluation batch, samples first."""
        run = in_runs((backend or OnnxRuntimeBackend(model, name=desc)).run, self.evaluation,
                      self.size, self.axes)
        return [run(batch) for batch in self.progress(self.evaluation, desc=desc)]

    def scored(self, outputs: Outputs) -> PairedScore:
        """`outputs` (one entry per evaluation batch) recorded against FP32's."""
        paired = PairedScore(self.metric, resamples=self.resamples, reference=self.reference,
                             progress=self.progress)
        for batch, reference in zip(outputs, self.references, strict=True):
            paired.update(batch, reference)
        return paired

    def scoring_seconds(self) -> float:
        """Seconds scoring one configuration takes here: its records made, scored on every
        sample and on each bootstrap resample (timed on FP32's outputs, scored as a
        candidate)."""
        started = time.perf_counter()
        score = self.scored(self.references).score()
        made = time.perf_counter() - started
        started = time.perf_counter()
        score(np.arange(self.evaluation.num_samples))
        return made + (self.resamples + 1) * (time.perf_counter() - started)

    def against_fp32(self, outputs: Outputs) -> Certificate:
        """The metric of `outputs` and its paired interval: of the difference to FP32 (margin
        over ``limit`` = FP32's value), or of the value itself where FP32's is infinite (output
        SQNR: ``limit`` 0)."""
        return self.scored(outputs).certificate()

    def versus(self, outputs: Outputs, others: Outputs) -> Certificate:
        """The paired interval of metric(outputs) - metric(others) (``interval``, margin over
        ``limit`` = metric(others))."""
        return versus(self.scored(outputs), self.scored(others), self.resamples)


def estimate_seconds(model: onnx.ModelProto, evaluation: BatchSource, metric: str, task,
                     resamples: int, calibration_samples: int, configs: int) -> float:
    """Estimated wall time of a sweep, from its first evaluation batch: one collection pass
    (about two forwards per sample), the FP32 evaluation, and per configuration a model and
    session made (about a first FP32 run, which makes its session), an INT8 evaluation and
    its scoring with the bootstrap (timed on the batch, scaled to the evaluation set)."""
    size = evaluation.length(next(iter(evaluation)))
    probe = Evaluator(model, evaluation.subset(0, size), metric, task, resamples)
    started = time.perf_counter()
    probe.outputs(model, "FP32 timing", probe.fp32)
    per_sample = (time.perf_counter() - started) / size
    scoring = probe.scoring_seconds() * evaluation.num_samples / size
    return (per_sample * (2 * calibration_samples
                          + evaluation.num_samples * (1 + INT8_COST * configs))
            + configs * (probe.fp32_seconds + scoring))


@dataclass
class SweepResult:
    """Everything a sweep measured: one record per configuration, the snapshots, every
    amax at n/2 and n per setting, and the sufficiency verdicts."""

    records: list[dict]
    snapshots: dict[int, collect.Statistics]
    # per calibrator setting: (amax at n/2, amax at n) per tensor
    amax: dict[str, tuple[dict[str, float], dict[str, float]]]
    half: int
    full: int
    tolerance: float
    best: int
    separation: Certificate | None
    runner_up: int | None
    # the best setting's amax bootstrap spread per tensor, over `spread_samples` samples
    # resampled in `spread_blocks` blocks (empty: fewer than two blocks were collected)
    spread: dict[str, float]
    spread_samples: int
    spread_blocks: int
    sentences: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def movement(self) -> dict[str, dict[str, float]]:
        """Per setting, every tensor's :func:`amax_movement` from n/2 to n samples."""
        return {setting: amax_movement(*pair) for setting, pair in self.amax.items()}

    @property
    def best_record(self) -> dict:
        """The record of the best configuration (highest metric; ties: the first)."""
        return self.records[self.best]


def record(config: Config, certificate: Certificate, seconds: float) -> dict:
    """A configuration's result as plain data (sweep.json, the checkpoint)."""
    finite = bool(np.isfinite(certificate.reference))
    low, high = certificate.interval
    return {
        "label": config.label, "setting": config.setting, "method": config.method,
        "params": dict(config.params), "size": config.size,
        "value": certificate.value, "fp32": certificate.reference,
        # interval of the value: the margin's, shifted by its limit (FP32, or 0)
        "interval": [low + certificate.limit, high + certificate.limit],
        "delta": certificate.value - certificate.reference if finite else None,
        "delta_interval": [low, high] if finite else None,
        "confidence": certificate.confidence, "samples": certificate.samples,
        "seconds": seconds,
    }


def run_sweep(model: onnx.ModelProto, source: BatchSource, evaluator: Evaluator,
              configs: Sequence[Config], *, tensors: Sequence[str] | None = None,
              known_stats: Mapping[int, collect.Statistics] | None = None,
              known_blocks: Mapping[tuple[int, int], collect.Statistics] | None = None,
              done: Mapping[str, dict] | None = None,
              on_block: Callable[[int, int, collect.Statistics], None] | None = None,
              on_record: Callable[[dict], None] | None = None,
              tolerance: float = TOLERANCE, progress: Callable | None = None,
              show_collection: bool = True, **options) -> SweepResult:
    """Collect once, calibrate and evaluate every configuration, judge the data.

    `model` is normalized; `configs` share the sizes they hold. `known_stats` (a
    calibration folder's), `known_blocks` and `done` (records by label; a resumed run's)
    are not measured again; `on_block` and `on_record` see each new block of statistics
    and record (checkpointing). `options` go to :func:`collect.collect`.
    """
    step = progress or (lambda items, **_: items)
    index = qdq.indexed(model)
    tensors = list(tensors or qdq.activation_tensors_to_calibrate(index))
    sizes = sorted({c.size for c in configs})
    fixed = graph.fixed_batch_size(index.model) or 1
    points = snapshot_points(sizes, fixed)
    started = time.perf_counter()
    collected_blocks = snapshots(index, source, tensors, points, block_size(points, fixed),
                                 known_stats, known_blocks, show_collection, on_block, **options)
    stats = collected_blocks.snapshots
    collected = time.perf_counter() - started
    done = dict(done or {})
    records: list[dict] = []
    started = time.perf_counter()
    for config in step(configs, desc="sweep"):
        if config.label in done:
            records.append(done[config.label])
            continue
        begun = time.perf_counter()
        outputs = evaluator.outputs(_quantized(index, stats[config.size], config),
                                    f"INT8 {config.label}")
        records.append(record(config, evaluator.against_fp32(outputs),
                              time.perf_counter() - begun))
        if on_record:
            on_record(records[-1])
        del outputs
    # Outputs are not kept across configurations (memory flat in their number): the best
    # and the runner-up run again for the separation test.
    order = ranking(configs, records)
    best = order[0]
    # The question is which calibrator: the runner-up is the best of another setting.
    runner_up = next((i for i in order if configs[i].setting != configs[best].setting), None)
    versus = None
    if runner_up is not None:
        pair = [evaluator.outputs(
            _quantized(index, stats[configs[i].size], configs[i]), f"INT8 {configs[i].label}")
            for i in (best, runner_up)]
        versus = evaluator.versus(*pair)
    evaluated = time.perf_counter() - started
    full = sizes[-1]
    half = half_size(full, fixed)
    amax = {}
    for setting in dict.fromkeys(c.setting for c in configs):
        config = next(c for c in configs if c.setting == setting)
        amax[setting] = tuple(calibrate.calibrate(stats[n], config.method,
                                                  **dict(config.params)).amax
                              for n in (half, full))
    blocks = collected_blocks.blocks
    spread = amax_spread(blocks, configs[best].method, dict(configs[best].params)) \
        if len(blocks) > 1 else {}
    result = SweepResult(records, stats, amax, half, full, tolerance, best, versus,
                         runner_up, spread, sum(b.num_samples for b in blocks), len(blocks),
                         seconds={"collection": collected, "evaluation": evaluated,
                                  "fp32_evaluation": evaluator.fp32_seconds})
    result.sentences = {"calibration": calibration_sentence(result),
                        "evaluation": evaluation_sentence(result)}
    return result


def ranking(configs: Sequence[Config], records: Sequence[dict]) -> list[int]:
    """Configuration indices, best first: those at the largest calibration size first (a
    smaller size that scores higher is the luck of a few samples, its scales still moving:
    not what to reproduce), then by metric; ties to the earlier setting."""
    full = max(c.size for c in configs)
    return sorted(range(len(records)),
                  key=lambda i: (configs[i].size != full, -records[i]["value"], i))


def _quantized(index: graph.Graph, stats: collect.Statistics, config: Config) -> onnx.ModelProto:
    """The Q/DQ model of `config`'s scales from `stats`."""
    scales = calibrate.calibrate(stats, config.method, **dict(config.params))
    return qdq.quantize_model(index, scales.amax)


def calibration_sentence(result: SweepResult) -> str:
    """Whether the calibration set is large enough for the best configuration's method."""
    best = result.best_record
    moves = result.movement[best["setting"]]
    moving = sorted((m, name) for name, m in moves.items() if m > result.tolerance)[::-1]
    largest = max(moves.values(), default=0.0)
    spread = ""
    if result.spread:
        spread = (f" Their bootstrap spread over {result.spread_samples} samples "
                  f"({result.spread_blocks} blocks) is at most "
                  f"{max(result.spread.values()):.1%} (median "
                  f"{float(np.median(list(result.spread.values()))):.1%}).")
    if not moving:
        return (f"The {result.full} calibration samples are enough for {best['setting']}: every "
                f"one of its {len(moves)} scales moved by at most {largest:.2%} from "
                f"{result.half} to {result.full} samples (tolerance {result.tolerance:.0%})."
                + spread)
    names = ", ".join(f"'{name}' {m:.1%}" for m, name in moving[:5])
    more = f" and {len(moving) - 5} more" if len(moving) > 5 else ""
    return (f"The {result.full} calibration samples are not enough for {best['setting']}: add "
            f"samples; the scales of {len(moving)} of its {len(moves)} tensors still move by more "
            f"than {result.tolerance:.0%} from {result.half} to {result.full} samples (up to "
            f"{largest:.1%}): {names}{more}." + spread)


def evaluation_sentence(result: SweepResult) -> str:
    """Whether the evaluation set tells the best configuration from the runner-up."""
    if result.separation is None:
        return "One configuration only: nothing to tell apart."
    best, second = result.best_record, result.records[result.runner_up]
    cert = result.separation
    low, high = cert.interval
    difference = cert.value - cert.reference
    head = (f"{best['label']} ({best['value']:.4g}) vs {second['label']} "
            f"({second['value']:.4g}): difference {difference:.3g}, {2 * cert.confidence - 1:.0%} "
            f"paired-bootstrap interval [{low:.3g}, {high:.3g}] on {cert.samples} samples")
    if low > 0:
        return f"The evaluation set tells the top two configurations apart: {head}."
    if difference > 0:
        # The interval's width shrinks as 1/sqrt(samples): its lower end, difference - low
        # below the difference now, reaches 0 at samples * ((difference - low) / difference)^2.
        needed = int(np.ceil(cert.samples * ((difference - low) / difference) ** 2))
        more = (f"; about {needed} samples ({needed / cert.samples:.3g}x these) would "
                "separate a difference this size")
    else:
        more = "; they score the same on these samples"
    return f"The evaluation set cannot tell the top two configurations apart: {head}{more}."
