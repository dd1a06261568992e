"""What every repair shares: the Repair protocol, its report, the keep rule, and the helpers
(a model's float weights read and written once, streamed runs, per-channel reductions)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import numpy_helper

from quantlab import graph
from quantlab.calibration.qdq import FreshNames
from quantlab.data import BatchSource, batch_length, sample_axes, slice_batch
from quantlab.errors import DataError, ModelError
from quantlab.graph import Graph

_ONNX_DOMAINS = ("", "ai.onnx")
# Ops f with f(x / s) == f(x) / s per channel for every s > 0 (positive homogeneity,
# DFQ section 4.1), acting on each channel alone: a per-channel scale passes through
# them. Clip (ReLU6) does not (its bounds are scalars), nor HardSwish, Sigmoid, etc.
HOMOGENEOUS_OPS = frozenset({"Relu", "LeakyRelu", "MaxPool", "Identity"})
# Scale factors are kept in [1 / LIMIT, LIMIT]: beyond that a channel is dead in one
# layer (range ~0) and equalizing it would only amplify float rounding.
SCALE_LIMIT = 1e5


@dataclass
class RepairReport:
    """What one repair did: the places it changed, the candidates it skipped, its cost.

    `applied` and `skipped` hold one plain dict per place (tensor and node names,
    figures before/after, the reason for a skip); `passes` is the number of forward
    passes per calibration sample the repair ran (FP32 and Q/DQ together);
    `summary` holds repair-wide figures (sweeps, rounds, samples).
    """

    repair: str
    applied: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    passes: int = 0
    summary: dict[str, Any] = field(default_factory=dict)
    # The tensors whose channels it divided, new name -> (old name, divisor per channel):
    # their statistics follow from the old one's per channel (collect.ChannelStats.divided).
    divided: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON (`divided` is not one)."""
        return {name: value for name, value in asdict(self).items() if name != "divided"}


class Repair(Protocol):
    """One repair of the FP32 model the planner weighs (registered in
    :data:`quantlab.calibration.repairs.registry.REGISTRY` under its name)."""

    name: str  # as the command line spells it (quantlab.choices.REPAIRS)
    needs_data: bool  # whether `apply` reads calibration data (else it is given None)
    # Whether it renames the tensors whose values it changes: the others keep their
    # statistics and calibration (else: all are collected again).
    renames: bool

    def channel_inputs(self, model: onnx.ModelProto) -> list[str]:
        """The tensors whose per-channel ranges `apply` reads (the statistics pass keeps them)."""

    def apply(self, model: onnx.ModelProto, source: BatchSource | None,
              channel_ranges: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto, RepairReport]:
        """The repaired copy of `model` and its report; `channel_ranges` (tensor -> range per
        channel) spare a pass where they hold every input of :meth:`channel_inputs`."""


def lowers_noise(without: float, with_it: float) -> bool:
    """The keep rule of every measured repair: kept where the output noise measured with it is
    below the noise without it (a tie, or NaN, keeps the model as it was).

    The callers differ in the data they measure on, never in the rule: the planner's
    repairs on the first batch (:func:`quietest`), the planner's bias correction on the
    hardest samples, calibrate's bias correction on two held-out folds pooled (measured on
    its own data, a correction always looks better).
    """
    return with_it < without


def quietest(noise: Mapping[str, float]) -> str:
    """The option the keep rule chooses among several (`noise`: option -> output noise, the
    model as given first): each later one taken where it lowers the noise of the one taken
    so far."""
    chosen = next(iter(noise))
    for name, value in noise.items():
        if lowers_noise(noise[chosen], value):
            chosen = name
    return chosen


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _initializer_uses(model: onnx.ModelProto) -> dict[str, int]:
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    return uses


class _Weights:
    """Float initializers of a model copy, read as float64 arrays and written back once."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.stored = {init.name: init for init in model.graph.initializer}
        self.uses = _initializer_uses(model)
        self.fresh = FreshNames(model)
        self.values: dict[str, np.ndarray] = {}

    def float_initializer(self, name: str) -> bool:
        return name in self.stored and self.stored[name].data_type == onnx.TensorProto.FLOAT

    def get(self, name: str) -> np.ndarray:
        if name not in self.values:
            value = numpy_helper.to_array(self.stored[name]).astype(np.float64)
            if not np.isfinite(value).all():
                raise ModelError(
                    f"initializer '{name}' holds NaN or Inf; a repair cannot rescale it. Fix "
                    "the weights of the exported model (re-export from a finite checkpoint).")
            self.values[name] = value
        return self.values[name]

    def own(self, node: onnx.NodeProto, index: int) -> str:
        """The name of input `index` of `node`, first copied if another node reads it too."""
        name = node.input[index]
        if self.uses.get(name, 0) > 1:
            copy = self.fresh(f"{name}_repaired")
            self.values[copy] = self.get(name).copy()
            self.stored[copy] = self._append(copy)
            self.uses[name] -= 1
            self.uses[copy] = 1
            node.input[index] = copy
            name = copy
        return name

    def add(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.values[name] = np.asarray(value, np.float64)
        self.stored[name] = self._append(name)
        self.uses[name] = 1
        return name

    def _append(self, name: str) -> onnx.TensorProto:
        # A repeated protobuf field stores a copy of what is appended: return the stored one.
        self.model.graph.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT)
        return self.model.graph.initializer[-1]

    def write(self) -> None:
        for name, value in self.values.items():
            self.stored[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))


def _runs(batches: Iterable[Mapping[str, np.ndarray]], index: Graph, tensors: Sequence[str] | None,
          run_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    """The samples of `batches` in runs whose exposed `tensors` (None: all) fit `run_bytes`
    (one sample at least).

    A model with a fixed batch size runs its batches whole.
    """
    axes = sample_axes(index.inputs)
    fixed = graph.fixed_batch_size(index.model)
    run_size = None
    count = 0
    for batch in batches:
        count += 1
        if fixed:
            yield dict(batch)
            continue
        size = batch_length(batch, axes)
        if run_size is None:
            one = slice_batch(batch, axes, 0, 1)
            run_size = index.samples_within({name: np.shape(value) for name, value in one.items()},
                                            run_bytes, tensors)
        for start in range(0, size, run_size):
            yield slice_batch(batch, axes, start, min(size, start + run_size))
    if not count:
        raise DataError("the calibration data holds no batches; a repair that measures needs "
                        "at least one sample.")


def _channel_reduce(value: np.ndarray, axis: int, name: str, how: str) -> np.ndarray:
    """Per-channel float64 sum (how="sum") or max |x| (how="amax") of `value` along `axis`."""
    value = np.asarray(value)
    moved = np.moveaxis(value, axis, -1).reshape(-1, value.shape[axis])
    if how == "sum":
        result = moved.sum(axis=0, dtype=np.float64)
    else:
        result = np.abs(moved).max(axis=0, initial=0.0).astype(np.float64)
    if not np.isfinite(result).all():
        raise DataError(f"tensor '{name}' holds NaN or Inf on the calibration data; fix the "
                        "data or the layer producing it before repairing the model.")
    return result
