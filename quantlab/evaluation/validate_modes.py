"""The test side of validate's FP32-vs-engine pair, one class per ``--mode``.

A test stage says which FP32 tensors the engine is compared on, what it is fed from the
FP32 run, how its tensors map onto FP32's, and runs one segment of a slice at a time;
:func:`quantlab.evaluation.validate.run_stages` streams any of them the same way (as Polygraphy's
comparator takes any runner a loader built). A new mode is a class here and one line in
:data:`TEST_STAGES` (and its name in choices.MODES, which tests/evaluation/test_validate.py checks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from quantlab import graph
from quantlab.engine.backends import Backend
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.engine.fusion import fused_activation
from quantlab.errors import ConfigError, InternalRunError
from quantlab.evaluation import segments
from quantlab.evaluation.sensitivity import local_error_model


class SegmentedRun:
    """A stage run segment by segment: one backend per segment of its graph.

    `uncut` says whether `stage` runs on the slice's graph inputs (then a failed segment
    is told from failing data by running it whole) and `hint` how to cut less.
    """

    def __init__(self, stage: Backend, plan: list[segments.Segment], uncut: bool = True,
                 hint: str = ""):
        self.stage = stage
        self.plan = plan
        self.uncut, self.hint = uncut, hint
        if isinstance(stage, OnnxRuntimeBackend):
            # Segment sessions run one after another and share ONNX Runtime's process-wide
            # arena: memory peaks at the largest segment's, not at the sum over segments.
            # Comparisons run between the runs: ORT's threads must not spin-wait on the cores.
            self.backends = [
                OnnxRuntimeBackend(s.model, name=stage.name, providers=stage.providers,
                                   threads=stage.threads, optimization=stage.optimization,
                                   check_inputs=False, shared_arena=True, spinning=False)
                if s.outputs else None for s in plan]
        else:
            self.backends = None  # any other backend runs whole, exposing what is asked

    def run(self, number: int, live: Mapping[str, np.ndarray],
            batch: Mapping[str, np.ndarray], samples: str) -> dict[str, np.ndarray]:
        """Outputs of segment `number`, its inputs read from `live` (graph inputs from `batch`);
        `samples` names the slice in an error."""
        segment = self.plan[number]
        if not segment.outputs:
            return {}
        if self.backends is None:
            return self.stage.run(batch, segment.outputs)
        try:
            return self.backends[number].run({name: live[name] for name in segment.inputs})
        except InternalRunError as error:
            whole = (lambda: self.stage.run(batch)) if self.uncut else None
            raise segments.run_failure(error, whole, f"'{self.stage.name}'", number, len(self.plan),
                                       samples, self.hint) from None


def last_use(*plans: Sequence[segments.Segment]) -> dict[str, int]:
    """For each tensor the segments of `plans` expose or read, the last step that reads it."""
    last: dict[str, int] = {}
    for plan in plans:
        for segment in plan:
            for name, step in segment.last_use.items():
                last[name] = max(last.get(name, step), step)
            for name in segment.inputs:
                last[name] = max(last.get(name, segment.index), segment.index)
    return last


def drop(live: dict[str, np.ndarray], last: Mapping[str, int], step: int,
         keep: set[str]) -> None:
    """Forget the tensors no step after `step` reads, except `keep` (the slice's inputs)."""
    for name in [n for n in live if n not in keep and last.get(n, step + 1) <= step]:
        del live[name]


class TestStage:
    """The engine's side of the pair in `mode`: its compared FP32 `tensors`, the FP32
    tensors it is `feeds` beyond them, the report's `extra` columns, `layers` (compared
    tensor -> the tensor whose node its row names) and `whole` (tensors one engine run
    holds whatever is asked: their bytes come off the memory budget first)."""

    mode: ClassVar[str]
    note: ClassVar[str]

    def __init__(self, engine: Backend, index: graph.Graph, engine_index: graph.Graph,
                 tensors: list[str]):
        self.engine, self.index, self.engine_index = engine, index, engine_index
        self.tensors = tensors
        self.feeds: list[str] = []
        self.whole: list[str] = []
        self.extra: dict[str, dict[str, list[str]]] = {}
        self.layers: dict[str, str] = {}

    def upstream(self) -> dict[str, list[str]]:
        """Compared tensor -> the compared tensors upstream of it (compare.first_divergence)."""
        return self.index.upstream(self.tensors)

    def start(self, groups: list[list[str]], hint: str) -> list[segments.Segment]:
        """Prepare to run by the FP32 run's `groups` of tensors; the segments that read the FP32
        run's tensors (kept alive until then)."""
        return []

    def begin(self, part: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Start slice `part`: the engine's end-to-end outputs, from its own unexposed run
        (integer kernels)."""
        return self.engine.run(part)

    def values(self, number: int, group: Sequence[str], fp32_live: Mapping[str, np.ndarray],
               part: Mapping[str, np.ndarray], samples: str) -> dict[str, np.ndarray]:
        """The engine's values of the compared tensors of `group` (segment `number`), keyed by
        their FP32 names; `samples` names the slice in an error."""
        raise NotImplementedError

    def done(self, number: int) -> None:
        """Forget what no step after `number` reads."""


class GlobalStage(TestStage):
    """The engine runs end to end, segment by segment on its own tensors."""

    mode = "global"
    note = (
        "Global mode runs the INT8 model twice per sample: once with every compared tensor "
        "exposed as a graph output — ONNX Runtime then keeps the Q/DQ graph in float, so the "
        "layer rows measure fake quantization — and once unexposed, with its integer kernels, "
        "for the end-to-end outputs and the task metrics.")

    @classmethod
    def build(cls, engine: Backend, index: graph.Graph, engine_index: graph.Graph
              ) -> TestStage:
        """The stage of `engine`: an engine that exposes only some tensors runs whole."""
        shared = index.common_tensors(engine_index)
        if hasattr(engine, "available"):  # TensorRT returns only its outputs and debug tensors
            return ExposingStage(engine, index, engine_index, engine.available(shared))
        return cls(engine, index, engine_index, shared)

    def start(self, groups: list[list[str]], hint: str) -> list[segments.Segment]:
        self.run = SegmentedRun(self.engine, segments.plan_segments(self.engine_index, groups),
                                hint=hint)
        self.last = last_use(self.run.plan)
        self.inputs = set(self.index.input_names)
        return []

    def begin(self, part: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.live = {name: part[name] for name in self.index.input_names}
        return super().begin(part)

    def values(self, number: int, group: Sequence[str], fp32_live: Mapping[str, np.ndarray],
               part: Mapping[str, np.ndarray], samples: str) -> dict[str, np.ndarray]:
        self.live.update(self.run.run(number, self.live, part, samples))
        return self.live

    def done(self, number: int) -> None:
        drop(self.live, self.last, number, self.inputs)


class ExposingStage(TestStage):
    """An engine that exposes only some tensors (TensorRT) runs whole, once per slice, asked
    only for what it exposes (trt-review-r2 N1, N9); its end-to-end outputs come from that
    run."""

    mode = "global"
    # N19 of trt-review-r2.
    note = (
        "The engine stage runs once per slice and returns its outputs and the intermediate "
        "tensors it exposes (column obtained); the tensors it does not expose are listed as not "
        "compared. The slice is at most the engine's profile batch, and every tensor the engine "
        "exposes counts against the memory budget: TensorRT's debug listener copies all of them "
        "on every run, whichever are asked for.")

    def __init__(self, engine: Backend, index: graph.Graph, engine_index: graph.Graph,
                 tensors: list[str]):
        super().__init__(engine, index, engine_index, tensors)
        self.whole = list(engine.tensor_sources)
        sources = engine.tensor_sources  # how each tensor was obtained
        if sources:
            self.extra["obtained"] = {t: [sources[t]] for t in tensors if t in sources}

    def begin(self, part: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.index.outputs
        self.exposed = self.engine.run(part, list(dict.fromkeys([*self.tensors, *outputs])))
        return {o: self.exposed[o] for o in outputs}

    def values(self, number: int, group: Sequence[str], fp32_live: Mapping[str, np.ndarray],
               part: Mapping[str, np.ndarray], samples: str) -> dict[str, np.ndarray]:
        values = {t: self.exposed[t] for t in group if t in self.exposed}
        for name in [t for t in values if t not in self.index.outputs]:
            del self.exposed[name]  # held by `values` until the caller has folded them
        return values


class LocalStage(TestStage):
    """Every quantized node of the engine's Q/DQ graph runs alone, cut out by
    :func:`quantlab.evaluation.sensitivity.local_error_model` and fed the FP32 run's tensors, so a
    row is the error its own quantization adds; a linear op is compared where TensorRT's fused
    layer ends, after the activation fused into it."""

    mode = "local"
    note = (
        "Local mode feeds each quantized node of the INT8 model the FP32 run's inputs, so a "
        "layer row is the error that node's own quantization adds, taken where TensorRT's "
        "fused layer ends: after the folded BatchNorm, the bias and the activation TensorRT "
        "fuses into a Conv/Gemm/MatMul (column fused_activation); the end-to-end outputs and "
        "the task metrics come from an unexposed run of the INT8 model (integer kernels).")

    @classmethod
    def build(cls, engine: Backend, index: graph.Graph, engine_index: graph.Graph
              ) -> TestStage:
        """The cut-out model of `engine`'s Q/DQ graph; ConfigError for an engine that is not
        an ONNX graph run in ONNX Runtime (TensorRT)."""
        if hasattr(engine, "available"):
            raise ConfigError(
                f"--mode local measures each node on cut-outs of the Q/DQ model run in ONNX "
                f"Runtime, so its layer rows would not come from the engine '{engine.name}' "
                "(trt-review-r2 N5); validate a TensorRT engine with --mode global, or the Q/DQ "
                "model with --engine-backend onnxruntime for local rows.")
        return cls(engine, index, engine_index)

    def __init__(self, engine: Backend, index: graph.Graph, engine_index: graph.Graph):
        self.local = local_error_model(engine_index, index)
        compared = set(self.local.outputs.values())
        super().__init__(engine, index, engine_index, [t for t in index.order if t in compared])
        self.feeds = self.local.feeds
        self.extra["quantized_inputs"] = self.local.quantized_inputs
        # A linear op is compared at the end of the activation fused into its layer: its row
        # names the op, and the activation nodes measured with it.
        nodes = {node.name: node for node in index.model.graph.node}
        for name, tensor in self.local.outputs.items():
            node = nodes[self.local.nodes[name]]
            if tensor not in node.output:
                self.layers[tensor] = node.output[0]
                self.extra.setdefault("fused_activation", {})[tensor] = [
                    n.name for n in fused_activation(index, node)]

    def upstream(self) -> dict[str, list[str]]:
        return {}  # fed the FP32 inputs, a node's only error is its own: judged against +inf

    def start(self, groups: list[list[str]], hint: str) -> list[segments.Segment]:
        # The cut-outs are defined on the Q/DQ ONNX graph and run in ONNX Runtime, fed the FP32
        # run's tensors (so they cannot be run uncut on the slice's inputs).
        by_tensor = {tensor: name for name, tensor in self.local.outputs.items()}
        local_groups = [[by_tensor[t] for t in group if t in by_tensor] for group in groups]
        self.run = SegmentedRun(
            OnnxRuntimeBackend(self.local.model, name=self.engine.name),
            segments.plan_segments(graph.Graph(self.local.model), local_groups),
            uncut=False, hint=hint)
        return self.run.plan

    def values(self, number: int, group: Sequence[str], fp32_live: Mapping[str, np.ndarray],
               part: Mapping[str, np.ndarray], samples: str) -> dict[str, np.ndarray]:
        return {self.local.outputs[k]: v
                for k, v in self.run.run(number, fp32_live, part, samples).items()}


# The test stage of each --mode (choices.MODES): how its class is built for an engine.
TEST_STAGES = {
    "global": GlobalStage.build,
    "local": LocalStage.build,
}
