"""Empirical bias correction (DFQ section 4.2; AIMET's empirical variant) of a Q/DQ model:
each INT8 linear op's mean output error per channel subtracted from its bias. Not in the
registry: it shifts the INT8 ops of a plan, and calibrate and plan each run it themselves."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from quantlab import graph
from quantlab.calibration.collect import RUN_BYTES
from quantlab.calibration.repairs.base import (
    _ONNX_DOMAINS,
    RepairReport,
    _channel_reduce,
    _copy,
    _runs,
    _Weights,
)
from quantlab.calibration.repairs.scaling import (
    _output_channels,
)
from quantlab.data import batch_length, sample_axes
from quantlab.errors import ConfigError
from quantlab.graph import Graph
from quantlab.metadata import attribute


@dataclass
class _Target:
    node: str
    output: str
    axis: int  # channel axis of the output
    channels: int
    bias: str  # float initializer holding the bias (made when the op had none)
    gain: float  # Gemm's beta: the bias enters the output as gain * C
    added: bool
    measured: str  # the op's own output in the Q/DQ model given (what "local" compares)


def _correction_targets(result: onnx.ModelProto, weights: _Weights, reference: Graph,
                        only: Iterable[str] | None = None) -> tuple[list[_Target], list[dict]]:
    """INT8 linear ops of a Q/DQ model whose bias can take a correction (biases made if absent).

    With `only`, the ops of those names alone.
    """
    only = None if only is None else set(only)
    producers = graph.producers(result)
    consumers = graph.consumers(result)
    known = set(reference.order) | set(reference.outputs)
    targets, skipped = [], []
    inserted: dict[str, onnx.NodeProto] = {}
    for node in result.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or \
                node.domain not in _ONNX_DOMAINS or len(node.input) < 2 or \
                (only is not None and node.name not in only):
            continue
        dequantize = producers.get(node.input[1])
        if dequantize is None or dequantize.op_type != "DequantizeLinear" or \
                dequantize.input[0] not in weights.stored:
            continue  # not INT8 in this model: no quantization error of its own
        measured = node.output[0]
        found = _output_channels(node, list(weights.stored[dequantize.input[0]].dims))
        channels, axis = found if found is not None else (0, 0)
        bias_add = _bias_add(node, consumers, weights, channels) if found else None
        output = bias_add[0].output[0] if bias_add else node.output[0]
        if found is None or output not in known or reference.dtype(output) != np.float32:
            skipped.append({"node": node.name, "reason": f"output '{output}' is not a float32 "
                            "tensor of the FP32 model with a known channel axis"})
            continue
        gain = float(attribute(node, "beta", 1.0)) if node.op_type == "Gemm" else 1.0
        if gain == 0.0:
            skipped.append({"node": node.name, "reason": "Gemm with beta = 0 ignores its bias"})
            continue
        has_bias = bias_add is not None or (
            node.op_type != "MatMul" and len(node.input) > 2 and bool(node.input[2]))
        if bias_add is not None:
            bias = weights.own(*bias_add)
        elif has_bias:
            if not weights.float_initializer(node.input[2]) or \
                    weights.get(node.input[2]).size not in (1, channels) or \
                    (node.op_type != "Gemm" and weights.get(node.input[2]).size != channels):
                skipped.append({"node": node.name, "reason": f"bias '{node.input[2]}' is not a "
                                f"float32 constant of {channels} channels"})
                continue
            bias = weights.own(node, 2)
            # Gemm's C may be a scalar or [1, N]: spelled out per channel, it broadcasts the same.
            weights.values[bias] = np.broadcast_to(weights.get(bias).reshape(-1),
                                                   (channels,)).copy()
        else:
            bias = weights.add(f"{node.name}_bias", np.zeros(channels))
            if node.op_type == "MatMul":
                # y = MatMul(x, W) + b, the Add writing the MatMul's old output name.
                plain = weights.fresh(f"{output}_without_bias")
                node.output[0] = plain
                inserted[node.name] = helper.make_node(
                    "Add", [plain, bias], [output], name=weights.fresh(f"{node.name}_bias_add"))
            elif len(node.input) > 2:
                node.input[2] = bias
            else:
                node.input.append(bias)
        targets.append(_Target(node.name, output, axis, channels, bias, gain, not has_bias,
                               measured))
    if inserted:
        nodes = []
        for node in result.graph.node:
            nodes.append(node)
            if node.name in inserted:
                nodes.append(inserted[node.name])
        del result.graph.node[:]
        result.graph.node.extend(nodes)
    return targets, skipped


def _bias_add(node: onnx.NodeProto, consumers: Mapping[str, list[onnx.NodeProto]],
              weights: _Weights, channels: int) -> tuple[onnx.NodeProto, int] | None:
    """(Add, input index) of the bias a MatMul's only reader adds ([channels] constant), or None.

    torch exports a Linear on 3-D inputs as MatMul followed by such an Add.
    """
    readers = consumers.get(node.output[0], [])
    if node.op_type != "MatMul" or len(readers) != 1 or readers[0].op_type != "Add" or \
            len(readers[0].input) != 2:
        return None
    add = readers[0]
    for index, name in enumerate(add.input):
        if add.input[1 - index] == node.output[0] and weights.float_initializer(name) and \
                weights.get(name).shape == (channels,):
            return add, index
    return None


def _reiterable(batches: Iterable, uses: int) -> None:
    if uses > 1 and iter(batches) is batches:
        raise ConfigError("the calibration batches are a one-shot iterator, but this repair "
                          f"reads them {uses} times; pass a BatchSource (quantlab.data.open_data) "
                          "or a list of batches.")


BIAS_CORRECTION_MODES = ("local", "global")


def bias_correction(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                    batches: Iterable[Mapping[str, np.ndarray]], mode: str = "local",
                    rounds: int = 2, run_bytes: int = RUN_BYTES,
                    ) -> tuple[onnx.ModelProto, RepairReport]:
    """Empirical bias correction (DFQ section 4.2; AIMET's empirical variant) of a Q/DQ model.

    For every INT8 linear op of `qdq_model` (weight read through DequantizeLinear)
    the mean over `batches` of (quantized output - FP32 output) per output
    channel is subtracted from its bias; a Conv/Gemm without bias gets one, a
    MatMul an Add after it (the output keeps its name), a MatMul already followed
    by a bias Add has that Add's constant corrected.

    ``mode="local"`` (default, one pass): each op runs quantized on the FP32
    inputs (:func:`quantlab.evaluation.sensitivity.local_error_model`), so its error is its
    own and all ops are corrected at once without counting an upstream error
    twice (NNCF's FastBiasCorrection measures the same way). Cost per sample:
    one FP32 pass and one pass of the local graph (each INT8 op once).

    ``mode="global"``: errors are measured on the whole Q/DQ model, as AIMET
    does, so what reaches an op from quantized upstream layers (Relu
    rectification included) is corrected too. AIMET corrects layer after layer
    (one pass per layer); here all ops are corrected together in `rounds`
    rounds, each re-measuring the corrected model (Jacobi iteration towards the
    sequential solution; exact after as many rounds as the longest chain of
    ops, and it can overshoot before: measured on the zoo in docs/repairs.md).
    Cost per sample: one FP32 pass and `rounds` Q/DQ passes.

    Memory: runs sized to `run_bytes`, folded into per-channel sums. `batches` is
    read once ("local") or `rounds` times (a BatchSource or a list). Returns the
    corrected copy and the report (per op: max |mean error| per round, largest
    correction).
    """
    corrected, report, _, _ = _bias_correction(fp32_model, qdq_model, batches, mode, rounds,
                                               run_bytes)
    return corrected, report


def bias_shifts(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                batches: Iterable[Mapping[str, np.ndarray]], run_bytes: int = RUN_BYTES,
                ) -> tuple[dict[str, np.ndarray], RepairReport]:
    """Local bias correction's output shift per channel of every INT8 linear op of `qdq_model`.

    Measured as :func:`bias_correction` ``mode="local"`` measures (each op quantized
    on FP32 inputs), so an op's shift is its own error's and holds whatever
    precision the other ops run in: the planner measures it once on the all-INT8
    model and applies it to the INT8 ops of any plan (:func:`shift_biases`).
    Returns node -> shift (added to the op's output, -mean error) and the report.
    """
    _, report, shifts, _ = _bias_correction(fp32_model, qdq_model, batches, "local", 1,
                                            run_bytes)
    return shifts, report


def bias_shift_folds(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                     parts: Sequence[Iterable[Mapping[str, np.ndarray]]],
                     run_bytes: int = RUN_BYTES, settle: Settle | None = None,
                     model_outputs: int = 0,
                     ) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], RepairReport,
                                list[list[dict[str, np.ndarray]]]]:
    """:func:`bias_shifts` measured on each of `parts` (disjoint shares of the data), the
    shifts of all of them together with its report, as :func:`bias_correction` gives them,
    and per part the FP32 model's outputs of its first `model_outputs` runs (name -> value;
    fewer where they would hold more than RUN_BYTES: :class:`FirstOutputs`), which the pass
    computes anyway: a caller scoring those samples against FP32 reads them here instead of
    running the model again.

    Local bias correction's shift is a per-channel mean, so the shifts of the whole data
    are the parts' means weighted by the elements each counted: one local pass over the
    data in all, where measuring the parts and then the whole took two. With `settle`, each
    part is read until its shifts are settled (:class:`Settle`), not to its end; the report's
    ``samples_read`` gives the samples each part read.
    """
    kept = [FirstOutputs(model_outputs) for _ in parts]
    measured = [_bias_correction(fp32_model, qdq_model, part, "local", 1, run_bytes, settle,
                                 outputs) for part, outputs in zip(parts, kept, strict=True)]
    counts = [m[3] for m in measured]
    pooled = {node: sum(m[2][node] * c[node] for m, c in zip(measured, counts, strict=True))
                    / max(sum(c[node] for c in counts), 1.0) for node in measured[0][2]}
    report = measured[0][1]
    report.summary["samples_read"] = [m[1].summary.get("samples_read", 0) for m in measured]
    for entry in report.applied:
        largest = float(np.abs(pooled[entry["node"]]).max())
        entry.update({"mean_error_max_per_round": [largest], "correction_max": largest})
    return [m[2] for m in measured], pooled, report, [outputs.runs for outputs in kept]


def shift_biases(fp32_model: onnx.ModelProto | Graph, qdq_model: onnx.ModelProto,
                 shifts: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `qdq_model` whose INT8 linear ops in `shifts` have their output shifted by it.

    The shift (node -> per output channel, :func:`bias_shifts`) goes into the op's
    bias (made when absent; a Gemm's divided by its beta). Ops that are not INT8 in
    `qdq_model` keep their bias: the shift corrects INT8's error only.
    """
    result = _copy(qdq_model)
    weights = _Weights(result)
    targets, _ = _correction_targets(result, weights, Graph.of(fp32_model), only=shifts)
    for t in targets:
        weights.values[t.bias] = weights.get(t.bias) + shifts[t.node] / t.gain
    weights.write()
    return result


def _bias_correction(fp32_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                     batches: Iterable[Mapping[str, np.ndarray]], mode: str, rounds: int,
                     run_bytes: int, settle: Settle | None = None,
                     outputs: FirstOutputs | None = None,
                     ) -> tuple[onnx.ModelProto, RepairReport, dict[str, np.ndarray],
                                dict[str, float]]:
    """bias_correction, also returning each op's total output shift (node -> per channel)
    and, local mode, the elements per channel its mean error was taken over (read until
    settled with `settle`; the report's ``samples_read`` says how far), keeping the FP32
    model's outputs of the first runs in `outputs`."""
    if mode not in BIAS_CORRECTION_MODES:
        raise ConfigError(f"mode '{mode}' is not one of {', '.join(BIAS_CORRECTION_MODES)}.")
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be a whole number >= 1, got {rounds!r}.")
    rounds = rounds if mode == "global" else 1
    _reiterable(batches, rounds)
    result = _copy(qdq_model)
    weights = _Weights(result)
    reference = Graph(fp32_model)
    targets, skipped = _correction_targets(result, weights, reference)
    report = RepairReport("bias_correction", skipped=skipped)
    local = None
    if mode == "local" and targets:
        from quantlab.evaluation.sensitivity import local_error_model

        # The bias enters before the activation: compare at the op's own output.
        local = local_error_model(Graph(qdq_model), reference, fuse_activations=False)
        cut = {tensor: name for name, tensor in local.outputs.items()
               if local.precisions.get(name) == "int8"}
        for t in [t for t in targets if t.measured not in cut]:
            report.skipped.append({"node": t.node, "reason": "its INT8 inputs could not be cut "
                                   "out for a local measurement"})
        targets = [t for t in targets if t.measured in cut]
    if not targets:
        return _copy(qdq_model), report, {}, {}
    weights.write()
    errors: dict[str, list[float]] = {t.node: [] for t in targets}
    corrections = {t.node: np.zeros(t.channels) for t in targets}

    def apply(mean_errors: Mapping[str, np.ndarray]) -> None:
        for t in targets:
            error = mean_errors[t.node]
            errors[t.node].append(float(np.abs(error).max()))
            corrections[t.node] -= error
            weights.values[t.bias] = weights.get(t.bias) - error / t.gain
        weights.write()

    counts: dict[str, float] = {}
    if local is not None:
        mean_errors, counts, report.summary["samples_read"] = _local_mean_errors(
            reference, local, cut, targets, batches, run_bytes, settle, outputs)
        apply(mean_errors)
    else:
        counts = _global_rounds(fp32_model, result, reference, targets, batches, rounds,
                                run_bytes, apply)
    for t in targets:
        report.applied.append({
            "node": t.node, "tensor": t.output, "channels": t.channels, "bias_added": t.added,
            "mean_error_max_per_round": errors[t.node],
            "correction_max": float(np.abs(corrections[t.node]).max()),
        })
    report.passes = 2 if local is not None else 1 + rounds
    report.summary.update({"mode": mode, "rounds": rounds})
    return result, report, corrections, counts


def _global_rounds(fp32_model: onnx.ModelProto, result: onnx.ModelProto, reference: Graph,
                   targets: Sequence[_Target], batches: Iterable[Mapping[str, np.ndarray]],
                   rounds: int, run_bytes: int,
                   apply: Callable[[Mapping[str, np.ndarray]], None]) -> dict[str, float]:
    """Global mode: `rounds` Q/DQ passes of `result` (corrected in place by `apply` after
    each) against one FP32 pass; the elements per channel of each op's mean error."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend

    fp32 = OnnxRuntimeBackend(fp32_model, name="fp32")
    names = [t.output for t in targets]
    fp32_sums = {t.node: np.zeros(t.channels) for t in targets}
    counts = dict.fromkeys(fp32_sums, 0)
    for round_index in range(rounds):
        quantized = OnnxRuntimeBackend(result, name="int8")
        sums = {t.node: np.zeros(t.channels) for t in targets}
        for run in _runs(batches, reference, names, run_bytes):
            if round_index == 0:
                reference_values = fp32.run(run, names)
                for t in targets:
                    fp32_sums[t.node] += _channel_reduce(reference_values[t.output], t.axis,
                                                         t.output, "sum")
                    counts[t.node] += reference_values[t.output].size // t.channels
                reference_values = None
            values = quantized.run(run, names)
            for t in targets:
                sums[t.node] += _channel_reduce(values[t.output], t.axis, t.output, "sum")
            del values
        apply({t.node: (sums[t.node] - fp32_sums[t.node]) / max(counts[t.node], 1)
               for t in targets})
    return counts


def _local_mean_errors(reference: Graph, local, cut: Mapping[str, str],
                       targets: Sequence[_Target], batches: Iterable[Mapping[str, np.ndarray]],
                       run_bytes: int, settle: Settle | None = None,
                       outputs: FirstOutputs | None = None,
                       ) -> tuple[dict[str, np.ndarray], dict[str, float], int]:
    """Each target's mean error per output channel, its op quantized on FP32 inputs, the
    elements per channel the mean is over, and the samples read: one
    pass of the FP32 model with the local copies attached and the errors summed in it
    (:func:`quantlab.evaluation.sensitivity.error_channel_sums`), so only per-channel sums leave
    ONNX Runtime (returning every op's FP32 inputs and local outputs of one 640 px sample held
    about 1.9 GB more); runs of as many samples as all their tensors fit `run_bytes`, until
    the means are settled with `settle`; the FP32 model's outputs of the first runs go into
    `outputs`."""
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.evaluation.sensitivity import error_channel_sums

    kept = reference.outputs if outputs is not None and outputs.limit else []
    model, sums = error_channel_sums(reference, local.model,
                                     {cut[t.measured]: (t.measured, t.axis) for t in targets},
                                     kept)
    names = {t.node: sums[cut[t.measured]] for t in targets}
    channels = {t.node: t.channels for t in targets}
    backend = OnnxRuntimeBackend(model, name="bias shifts", memory_pattern=False)
    totals = {name: 0.0 for pair in sums.values() for name in pair}
    spread = _RunSpread()
    axes = sample_axes(reference.inputs)
    read = 0
    for run in _runs(batches, reference, None, run_bytes):
        values = backend.run(run)
        if kept and len(outputs.runs) < outputs.limit:
            # Copies: a view would hold its ONNX Runtime buffer, and the arena, unable to reuse
            # the blocks under it, grew by 430 MB on the layout detector keeping 16 of them.
            outputs.offer({name: np.array(values[name]) for name in kept})
        values = {name: np.asarray(values[name], np.float64) for name in totals}
        for name, value in values.items():
            totals[name] = totals[name] + value
        read += batch_length(run, axes)
        if settle is not None:
            spread.add({node: values[total] * channels[node] / max(float(values[count]), 1.0)
                        for node, (total, count) in names.items()})
            if read >= settle.minimum and spread.noise_ratio() <= settle.tolerance:
                # Told now that no more is read: a progress bar over the samples says so
                # here, not when the caller lets go of it (after the other half had run).
                getattr(batches, "close", lambda: None)()
                break
    counts = {node: float(totals[count]) / channels[node] for node, (_, count) in names.items()}
    return {node: totals[total] / max(counts[node], 1.0)
            for node, (total, _) in names.items()}, counts, read


@dataclass
class FirstOutputs:
    """The FP32 model's outputs of the first `limit` runs of a measuring pass (name ->
    value, one dict per run), as the pass computes them, as long as they fit `max_bytes`
    together (the runs after the first that does not fit are not kept either: a reader
    takes them as the outputs of the first runs, in order)."""

    limit: int
    max_bytes: int = RUN_BYTES
    runs: list[dict[str, np.ndarray]] = field(default_factory=list)

    def offer(self, outputs: dict[str, np.ndarray]) -> None:
        """Keep a run's `outputs` if the runs before it were all kept and they fit."""
        held = sum(value.nbytes for run in self.runs for value in run.values())
        if len(self.runs) < self.limit and \
                held + sum(value.nbytes for value in outputs.values()) <= self.max_bytes:
            self.runs.append(outputs)
        else:
            self.limit = len(self.runs)


@dataclass(frozen=True)
class Settle:
    """When local bias correction's shifts are measured enough (:func:`bias_shift_folds`):
    after `minimum` samples, once the shifts' sampling noise is under `tolerance` of what
    they remove (:meth:`_RunSpread.noise_ratio`)."""

    tolerance: float
    minimum: int


class _RunSpread:
    """Each run's mean error per channel of every op, summed, for the shifts' sampling noise."""

    def __init__(self) -> None:
        self.runs = 0
        self.sums: dict[str, np.ndarray] = {}
        self.squares: dict[str, np.ndarray] = {}

    def add(self, means: Mapping[str, np.ndarray]) -> None:
        self.runs += 1
        for node, mean in means.items():
            self.sums[node] = self.sums.get(node, 0.0) + mean
            self.squares[node] = self.squares.get(node, 0.0) + mean * mean

    def noise_ratio(self) -> float:
        """The shifts' squared standard errors summed over every op's channels, over their
        squares summed: correcting by a mean of these runs leaves that share of the bias
        energy the exact means would remove (inf before two runs)."""
        if self.runs < 2:
            return float("inf")
        count = self.runs
        noise = signal = 0.0
        for node, total in self.sums.items():
            mean = total / count
            spread = np.maximum(self.squares[node] - count * mean * mean, 0.0) / (count - 1)
            noise += float(np.sum(spread)) / count  # squared standard errors of the means
            signal += float(np.sum(mean * mean))
        return noise / signal if signal > 0 else float("inf")
