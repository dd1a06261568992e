"""ONNX Runtime backend: runs FP32 and Q/DQ INT8 graphs and exposes intermediate tensors."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from quantlab import graph
from quantlab.data import check_batch
from quantlab.engine import fp16
from quantlab.errors import DataError, InternalRunError, ModelError

_DEFAULT_SESSIONS_CACHED = 4
# Session config every quantlab session sets. Without it, ONNX Runtime on x86 rewrites
# int8 Q/DQ to u8s8 kernels, which saturate on AVX2 CPUs without VNNI (silero-vad: 4.3 dB
# instead of 10.0 dB) and cannot fuse a Q feeding several consumers into QLinearConv.
# It keeps int8 as TensorRT runs it; run model.int8.onnx with it to reproduce quantlab.
SESSION_CONFIG = {"session.qdqisint8allowed": "1"}


_SHARED_ARENA: list[ort.OrtMemoryInfo] = []


def _register_shared_arena() -> None:
    """Register ONNX Runtime's process-wide CPU arena (once; it lives as long as the process)."""
    if not _SHARED_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                 ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _SHARED_ARENA.append(info)


class OnnxRuntimeBackend:
    """Run an ONNX model in ONNX Runtime; any tensor of the graph can be requested.

    Intermediate tensors are exposed by adding them as graph outputs; one session
    is kept per requested tensor set (a small LRU), so repeated runs are cheap.
    """

    def __init__(
        self,
        model: onnx.ModelProto | str | os.PathLike,
        name: str = "onnxruntime",
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        check_inputs: bool = True,
        shared_arena: bool = False,
        spinning: bool = True,
        memory_pattern: bool = True,
        release_arena: bool = False,
    ):
        self.model = model if isinstance(model, onnx.ModelProto) else graph.load_model(model)
        # What ONNX Runtime runs: float16 nodes (a plan's FP16 units) compute in float32
        # between explicit roundings, as TensorRT's FP16 kernels do; ORT's own handling
        # runs them in float32 without rounding anything (quantlab.engine.fp16).
        self.runnable = fp16.emulated(self.model)
        self.name = name
        self.providers = list(providers or ["CPUExecutionProvider"])
        self.threads = threads
        self.optimization = optimization
        # A segment of a graph reads intermediate tensors, which have no sample axis to check.
        self.check_inputs = check_inputs
        # Sessions run one after another (graph segments) share one process-wide memory
        # arena, so memory peaks at the largest segment's, not at the sum of all of them.
        self.shared_arena = shared_arena
        # ONNX Runtime's pool threads spin-wait after a run for the next one. A flow that
        # computes between runs on the same cores (statistics collection) turns that off:
        # the spinning threads would take the cores its own threads need.
        self.spinning = spinning
        # ONNX Runtime's memory pattern (one planned block per input shape, reused run
        # after run) costs memory where a run frees most of what it makes: the planner's
        # local-error model of a 640 px detector peaked 0.36 GB higher with it, at the
        # same speed.
        self.memory_pattern = memory_pattern
        # A session kept for a whole flow (the planner's FP32 model) otherwise holds its
        # arena's high-water mark between runs: 0.5 GB after runs of a 640 px detector, under
        # every later step's peak. Released after each run, at some cost in speed.
        self.run_options = ort.RunOptions()
        if release_arena:
            self.run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage",
                                                  "cpu:0")
        self.inputs = graph.input_specs(self.model)
        self.outputs = [spec.name for spec in graph.output_specs(self.model)]
        self._known = set(graph.topological_tensors(self.model)) | set(self.outputs)
        self._sessions: dict[tuple[str, ...], ort.InferenceSession] = {}

    def session_options(self, optimized_model_path: str | None = None) -> ort.SessionOptions:
        """Session options used for every session of this backend."""
        options = ort.SessionOptions()
        options.graph_optimization_level = self.optimization
        options.log_severity_level = 3
        for key, value in SESSION_CONFIG.items():
            options.add_session_config_entry(key, value)
        if self.threads:
            options.intra_op_num_threads = self.threads
        if not self.spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_mem_pattern = self.memory_pattern
        if self.shared_arena:
            _register_shared_arena()
            options.add_session_config_entry("session.use_env_allocators", "1")
        if optimized_model_path:
            options.optimized_model_filepath = optimized_model_path
        return options

    def _session(self, tensors: tuple[str, ...]) -> ort.InferenceSession:
        if tensors in self._sessions:
            return self._sessions[tensors]
        model = (with_outputs(self.runnable, tensors) if tensors != tuple(self.outputs)
                 else self.runnable)
        try:
            session = _create_session(model, self.session_options(), self.providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NotImplemented types
            raise ModelError(load_error_message(model, exc)) from None
        if len(self._sessions) >= _DEFAULT_SESSIONS_CACHED:
            self._sessions.pop(next(iter(self._sessions)))
        self._sessions[tensors] = session
        return session

    def run(
        self, batch: Mapping[str, np.ndarray], tensors: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run one batch; return the requested tensors (default: graph outputs)."""
        if self.check_inputs:
            check_batch(batch, self.inputs)
        wanted = tuple(tensors) if tensors is not None else tuple(self.outputs)
        unknown = [t for t in wanted if t not in self._known]
        if unknown:
            raise ModelError(
                f"tensor(s) {unknown[:5]} are not in the model; list the model's tensors with "
                "quantlab.graph.topological_tensors(model)."
            )
        session = self._session(wanted)
        # np.require, not np.ascontiguousarray: that one turns a 0-d value (a shape scalar a
        # segment reads) into shape (1,).
        arrays = {spec.name: np.require(batch[spec.name], dtype=spec.dtype, requirements="C")
                  for spec in self.inputs}
        feeds = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
        # OrtValues, not session.run: their .numpy() views ONNX Runtime's own buffers
        # (kept alive by the array) instead of copying every exposed activation.
        try:
            values = session.run_with_ort_values(list(wanted), feeds, self.run_options)
        except Exception as exc:  # ORT raises InvalidArgument/Fail/RuntimeException at run time
            shapes = {name: tuple(np.shape(batch[name])) for name in feeds}
            if not self.check_inputs:  # fed tensors quantlab computed, not the user's data
                raise InternalRunError(
                    f"ONNX Runtime failed to run '{self.name}' fed tensors of shapes {shapes}: "
                    f"{_first_line(exc)}") from None
            raise DataError(
                f"ONNX Runtime failed to run '{self.name}' on inputs of shapes {shapes}: "
                f"{_first_line(exc)}. Check that the data matches the model's inputs "
                f"{[(s.name, s.shape) for s in self.inputs]} (sample axis, fixed batch size, "
                "dtype) and that the model runs on such inputs in plain ONNX Runtime."
            ) from None
        return {name: _owned(value.numpy(), arrays.values())
                for name, value in zip(wanted, values, strict=True)}


def _owned(array: np.ndarray, feeds) -> np.ndarray:
    """`array`, copied if it lies in a feed's buffer.

    ONNX Runtime hands back an input exposed as an output, or an Identity/Reshape of
    one, as a view of the feed's memory; the feed may be a temporary contiguous copy
    (a state sliced on axis 1) that is freed when the run returns.
    """
    start = array.__array_interface__["data"][0]
    for feed in feeds:
        base = feed.__array_interface__["data"][0]
        if base <= start < base + max(feed.nbytes, 1):
            return array.copy()
    return array


# ONNX Runtime reads models of 2 GB or more (protobuf's limit) only from a file with
# external data; smaller ones are handed over in memory.
_IN_MEMORY_LIMIT = 2**31 - (64 << 20)


def _create_session(model: onnx.ModelProto, options: ort.SessionOptions,
                    providers: Sequence[str]) -> ort.InferenceSession:
    disabled = _output_dropping_optimizers(model)
    if model.ByteSize() < _IN_MEMORY_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers,
                                    disabled_optimizers=disabled)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.onnx"
        onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")
        return ort.InferenceSession(str(path), options, providers=providers,
                                    disabled_optimizers=disabled)


# ONNX Runtime's ConvAddActivationFusion (CPU, ORT_ENABLE_ALL) is triggered by one Conv whose
# only reader is an Add, then fuses the Add into the first Conv among the Add's inputs that has
# a bias and one reader: with two such Convs, that may be the other one, whose output it never
# checks for being a graph output. That output then has no producer and the session does not
# load ("Failed to find node output or a constant initializer producing output: da", ORT 1.32;
# reliability case G08). quantlab exposes exactly such an output: the residual input of an Add
# of two Convs carries the Add's Q/DQ pair, so collection asks for it. It happens where ORT knows
# every shape (inferred at import) and its NCHWc rewrite, which runs first and fuses correctly,
# leaves the Convs alone: depthwise convs of 2, 3, 5, 6, 7, 9... channels (every count from 2 to
# 33 that is not a multiple of 4 failed), or weights that are graph inputs as well.
_OUTPUT_DROPPING_FUSION = "ConvAddActivationFusion"


def _output_dropping_optimizers(model: onnx.ModelProto) -> list[str]:
    """The ONNX Runtime optimizers to turn off for `model`: ConvAddActivationFusion where a
    graph output is a Conv's output that an Add also reads (it could lose that output)."""
    outputs = {value.name for value in model.graph.output}
    exposed = {node.output[0] for node in model.graph.node
               if node.op_type == "Conv" and node.domain in ("", "ai.onnx")
               and node.output[0] in outputs}
    if any(node.op_type == "Add" and exposed.intersection(node.input)
           for node in model.graph.node):
        return [_OUTPUT_DROPPING_FUSION]
    return []


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_error_message(model: onnx.ModelProto, exc: Exception) -> str:
    """A one-paragraph explanation of why ONNX Runtime cannot load `model`."""
    unknown = [node for node in model.graph.node
               if node.domain not in ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")]
    if unknown:
        ops = sorted({f"{n.domain}:{n.op_type}" for n in unknown})
        return (
            f"ONNX Runtime cannot load the model: it has {len(unknown)} node(s) of op(s) "
            f"{', '.join(ops)} from a custom domain (first: node '{unknown[0].name}'), which "
            "ONNX Runtime does not implement. Replace them with standard ONNX ops in the "
            "export, or run with the custom-op library registered. "
            f"({_first_line(exc)})"
        )
    return f"ONNX Runtime cannot load the model: {_first_line(exc)}"


def with_outputs(model: onnx.ModelProto, tensors: Sequence[str]) -> onnx.ModelProto:
    """A copy of `model` whose graph outputs are exactly `tensors` (types left to ORT)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    known = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output)}
    known.update({v.name: v for v in model.graph.input})
    del copy.graph.output[:]
    for name in tensors:
        if name in known:
            copy.graph.output.append(known[name])
        else:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def optimized_op_types(model: onnx.ModelProto) -> Counter:
    """Op types of the graph ONNX Runtime actually executes on CPU after its optimizations.

    This is how to show that a Q/DQ model runs integer kernels: the fused graph
    holds QLinearConv / QLinearMatMul / MatMulInteger instead of float ops.
    """
    backend = OnnxRuntimeBackend(model)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "optimized.onnx")
        _create_session(backend.runnable, backend.session_options(optimized_model_path=path),
                        ["CPUExecutionProvider"])
        optimized = onnx.load(path)
    return Counter(node.op_type for node in optimized.graph.node)


def check_finite(values: Mapping[str, np.ndarray], order: Sequence[str], where: str) -> None:
    """Raise DataError naming the first tensor (in `order`) that holds NaN or Inf."""
    for name in order:
        if name in values and not np.isfinite(values[name]).all():
            raise DataError(
                f"{where}: tensor '{name}' contains NaN or Inf. It is the first such tensor in "
                "topological order; check the input data and the layer that produces it."
            )
