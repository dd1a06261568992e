"""What every stage of the planner reads: the settings and their budget, the data, the
metric, the FP32 model's bounded runs, progress and the seconds per step."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx

from quantlab.data import BatchSource
from quantlab.errors import ConfigError
from quantlab.evaluation.scoring import Metric, metric_for
from quantlab.evaluation.tasks import Task
from quantlab.graph import Graph
from quantlab.planner.certify import Budget, data_shortfalls
from quantlab.planner.measure import in_runs, output_sample_axes, samples_per_run


@dataclass(frozen=True)
class PlanSettings:
    """How to plan: the budget, and how much to measure.

    The budget is ``max_drop`` of `metric` from FP32, or ``min_sqnr`` (dB of output
    SQNR, metric "sqnr"): :attr:`budget`. `trials` random plans on the `hard_count`
    hardest calibration samples fit the noise model; up to `verify_rounds` rounds check
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
        self.budget.check()
        for option in ("trials", "hard_count", "resamples", "max_evaluations"):
            if getattr(self, option) < 1:
                raise ConfigError(f"{option} must be at least 1, got {getattr(self, option)}.")

    @property
    def budget(self) -> Budget:
        """The user's budget as one value (the CLI's --max-drop / --min-sqnr)."""
        return Budget(self.metric, self.max_drop, self.min_sqnr)


class Phases:
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
class Context:
    """What every stage reads: the settings, the data, the FP32 model's bounded runs."""

    settings: PlanSettings
    calibration: BatchSource
    evaluation: BatchSource
    task: Task | None
    metric: Metric
    runs: Callable[[Callable], Callable]  # a backend's run -> bounded runs, samples first
    fp32_run: Callable
    # The first calibration batch; None after the calibrators, the last step to read it.
    first: Mapping[str, np.ndarray] | None
    step: Callable  # progress: (items, desc=) -> items
    phases: Phases = field(default_factory=Phases)


def fp32_runs(model: onnx.ModelProto, calibration: BatchSource
              ) -> tuple[Callable[[Callable], Callable], Callable, Mapping[str, np.ndarray]]:
    """(backend run -> bounded runs, the FP32 model's bounded run, the first calibration batch).

    Every whole-model run: runs of a bounded size (a 640 px batch of 32 held 13-15 GB),
    outputs samples first (a recurrent state [layers, N, hidden])."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    fp32 = OnnxRuntimeBackend(model, name="fp32", release_arena=True)
    first = next(iter(calibration))
    size = samples_per_run(Graph(model), first, calibration)
    axes = output_sample_axes(model, fp32.run, first, calibration)

    def runs(run: Callable) -> Callable:
        return in_runs(run, calibration, size, axes)

    return runs, runs(fp32.run), first


def try_metric(metric: Metric, fp32_run: Callable, first: Mapping[str, np.ndarray]) -> None:
    """`metric` of FP32 against itself on the `first` batch, checked."""
    outputs = fp32_run(first)
    records = metric.records(outputs, outputs, 0)
    metric.scorer(records, "FP32 against itself on the first calibration batch")(
        np.arange(len(records)))


def open_context(model: onnx.ModelProto, calibration: BatchSource, evaluation: BatchSource,
                 settings: PlanSettings, task: Task | None, progress: Callable | None
                 ) -> Context:
    """Checks of the settings against the data, the FP32 model's bounded runs, the metric
    tried once on the first batch (a metric that fails fails now, not late); timed as the
    "setup" step."""
    phases = Phases()
    with phases("setup"):
        if task is not None:
            task.check_samples(evaluation.num_samples)
        metric = metric_for(settings.metric, task)
        for message in data_shortfalls(calibration.num_samples, evaluation.num_samples,
                                       settings.hard_count, settings.metric, settings.max_drop,
                                       task):
            warnings.warn(message, stacklevel=2)
        runs, fp32_run, first = fp32_runs(model, calibration)
        if not metric.labels:
            try_metric(metric, fp32_run, first)
    return Context(settings, calibration, evaluation, task, metric, runs, fp32_run, first,
                   progress or (lambda items, **_: items), phases)
