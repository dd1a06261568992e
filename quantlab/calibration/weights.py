"""Per-channel weight amax chosen by the error of the layer TensorRT runs, on calibration data.

:func:`quantlab.calibration.qdq.weight_amax` offers one criterion for every weight: max |w|, or the
amax with the least int8 error of the weights themselves (MSE). Neither is right
everywhere: the MSE amax clips a channel's largest weights, and whether that costs more
than the finer step gains depends on what the layer reads (benchmarks/README.md: MSE
weights lost 0.3-1.3 dB of output SQNR on 8 of 28 model/calibrator pairs and gained on 3).
So each output channel takes the candidate whose layer output is closest to FP32 where
TensorRT computes it: the linear op with the candidate's INT8 weights on the FP32 input,
with the folded BatchNorm, the bias and the fused activation
(:func:`quantlab.evaluation.sensitivity.local_error_model`). An output channel's error depends on
that channel's weights alone (the activation acts on each element), so the per-channel choice
minimizes the layer's error over every mix of the candidates, in one pass over the data.

The input is FP32, not INT8: the weights' error is then measured alone. With the INT8
input the layer's error is mostly the input's rounding, the same for every candidate, and
its products with the weight error (zero on average) decide the choice by sampling noise:
on a constructed conv (tests/calibration/test_weights.py) the INT8-input criterion picked the MSE
amax for a channel whose clipped weights read the loudest input channel, where FP32 inputs
measure 2x the error of max |w|.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from quantlab import graph
from quantlab.calibration import qdq
from quantlab.errors import DataError
from quantlab.graph import Graph

# The amax candidates of every weight channel, the first one kept on a tie.
CANDIDATES = ("max", "mse")
# The choice is measured until settled (_settled): at least SETTLE_MIN_SAMPLES samples, then
# until the channels' expected loss from choosing on these samples is under SETTLE_TOLERANCE
# of the layer's noise (1 %: 0.04 dB of local SQNR), or the samples given run out
# (pipeline.CHOICE_SAMPLES). On the PP-OCRv3 detector (7,290 channels, 32 pages) the choice
# on the first 8 pages loses 0.03 % of the local noise against the choice on all 32 (17
# channels differ), and the rule would stop there. Held out, the choice moves the zoo's
# output SQNR by a few tenths of a dB either way whatever the count (digits-cnn 35.1 dB on
# 8-16 samples, 34.6 on 24-32; digits-vit 30.75 on 8, 30.97 on 16, 31.10 on 32): 16 keeps
# digits-vit, whose 8x8 inputs give few values per sample, within 0.15 dB of all 32.
SETTLE_MIN_SAMPLES = 16
SETTLE_TOLERANCE = 0.01
# Output-channel axis of a linear op's output (the weight's per-channel axis maps onto it).
_OUTPUT_AXIS = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1, "MatMul": -1}


@dataclass
class WeightChoice:
    """Chosen weight amax (weight initializer -> per-channel amax) and, per weight tensor,
    what was chosen and the local SQNR each candidate and the choice give."""

    amax: dict[str, np.ndarray] = field(default_factory=dict)
    tensors: dict[str, dict] = field(default_factory=dict)
    samples: int = 0  # measured on (the choice stops once settled: _settled)
    alike: int = 0  # weights whose candidates agree on every channel: nothing to measure

    def summary(self) -> dict:
        """Counts for ``calibration.json``: channels taking each candidate, tensors improved."""
        channels = {c: sum(t["channels_by_candidate"].get(c, 0) for t in self.tensors.values())
                    for c in CANDIDATES}
        return {"tensors": len(self.tensors), "channels_by_candidate": channels,
                "samples": self.samples, "tensors_alike": self.alike}


def choose_weight_amax(model: onnx.ModelProto | Graph,
                       batches: Iterable[Mapping[str, np.ndarray]],
                       candidates: Sequence[str] = CANDIDATES) -> WeightChoice:
    """Per output channel of every INT8 weight, the candidate amax with the least local error.

    `model` is the normalized FP32 model and `batches` the calibration data: one pass of
    the FP32 model with, beside it, every linear op once per candidate on its FP32 input,
    reduced to per-channel squared errors in the graph
    (:func:`quantlab.evaluation.sensitivity.error_sums`). Weights that cannot be cut out for a
    local measurement are left out (quantized by the first candidate), and so are those
    whose candidates agree on every channel (counted in ``alike``): the first candidate is
    what their measurement would choose, a tie.
    """
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.evaluation.sensitivity import error_sums, local_error_model

    index = qdq.indexed(model)
    placement = qdq.place(index)
    nodes = {node.name: node for node in index.model.graph.node}
    readers: dict[str, list[tuple[str, int | None]]] = {}
    for (node, _), (weight, axis) in placement.weights.items():
        if qdq.LINEAR_OPS.get(nodes[node].op_type) == 1 and nodes[node].input[1] == weight:
            readers.setdefault(weight, []).append((node, axis))
    values = graph.initializers(index.model)
    options = {w: {c: qdq.weight_amax(values[w], r[0][1], c) for c in candidates}
               for w, r in readers.items()}
    # On the PP-OCRv3 detector the MSE amax clips no weight of 42 of its 74 weight tensors
    # (6,965 of 7,290 channels): their layers' copies would double the pass for nothing.
    alike = {w for w, amax in options.items()
             if all(np.array_equal(amax[candidates[0]], amax[c]) for c in candidates[1:])}
    readers = {w: reads for w, reads in readers.items() if w not in alike}
    unused = dict.fromkeys(qdq.activation_tensors_to_calibrate(index), 1.0)  # pairs left out
    local = local_error_model(  # the amax of `options`, not worked out again
        [Graph(qdq.quantize_model(index, unused, weight_criterion=c, weight_amax={
            w: amax[c] for w, amax in options.items()})) for c in candidates],
        index, labels=list(candidates), weights_only=True)
    axes = {node: axis for reads in readers.values() for node, axis in reads}
    by_node = {(local.nodes[name], local.labels[name]): name for name in local.outputs}
    wanted = [name for name in local.outputs if local.nodes[name] in axes]
    if not wanted:
        return WeightChoice(alike=len(alike))
    # Per-channel weights: the noise per output channel; per-tensor weights: one sum.
    summed, sums = error_sums(index, local.model, {n: local.outputs[n] for n in wanted},
                              {n: _OUTPUT_AXIS[nodes[local.nodes[n]].op_type] for n in wanted
                               if axes[local.nodes[n]] is not None})
    compared = {weight: [[by_node.get((node, c)) for c in candidates] for node, _ in reads]
                for weight, reads in readers.items()}
    compared = {weight: rows for weight, rows in compared.items()
                if all(name is not None and name in wanted for row in rows for name in row)}
    if not compared:
        return WeightChoice(alike=len(alike))
    backend = OnnxRuntimeBackend(summed, name="weight errors", memory_pattern=False)
    noise, power = _measured(backend, batches, compared, sums, len(candidates))
    count = len(next(iter(noise.values())))
    if not count:
        raise DataError("the calibration data holds no batches; choosing weight amax by the "
                        "layer error needs at least one sample.")
    result = WeightChoice(samples=count, alike=len(alike))
    for weight, reads in readers.items():
        if weight not in compared:
            continue
        summed_noise = np.sum(noise[weight], axis=0)  # candidate x channel
        if not np.isfinite(summed_noise).all():
            continue
        best = np.argmin(summed_noise, axis=0)  # the first candidate on a tie
        chosen = np.choose(best, [options[weight][c] * np.ones(summed_noise.shape[1])
                                  for c in candidates]).astype(np.float32)
        axis = reads[0][1]
        result.amax[weight] = chosen if axis is not None else chosen.reshape(())
        picked = summed_noise[best, np.arange(summed_noise.shape[1])].sum()
        result.tensors[weight] = {
            "nodes": [node for node, _ in reads],
            "channels": int(summed_noise.shape[1]),
            "channels_by_candidate": {c: int((best == k).sum())
                                      for k, c in enumerate(candidates)},
            "local_sqnr_db": {**{c: _db(power[weight], summed_noise[k].sum())
                                 for k, c in enumerate(candidates)},
                              "chosen": _db(power[weight], picked)},
        }
    return result


def _measured(backend, batches: Iterable[Mapping[str, np.ndarray]],
              compared: Mapping[str, list[list[str]]], sums: Mapping[str, tuple[str, str]],
              candidates: int) -> tuple[dict[str, list[np.ndarray]], dict[str, float]]:
    """Per weight tensor, each sample's candidate x channel squared errors and the reference
    power over the samples read, reading `batches` until the choice is :func:`_settled`."""
    noise: dict[str, list[np.ndarray]] = {weight: [] for weight in compared}
    power = dict.fromkeys(compared, 0.0)
    for batch in batches:
        values = backend.run(batch)
        for weight, rows in compared.items():
            noise[weight].append(np.array([
                sum(np.atleast_1d(np.asarray(values[sums[row[k]][0]], np.float64))
                    for row in rows) for k in range(candidates)]))
            power[weight] += sum(float(values[sums[row[0]][1]]) for row in rows)
        if _settled(noise.values()):
            break
    return noise, power


def _settled(noise: Iterable[list[np.ndarray]]) -> bool:
    """Whether more samples could no longer change the choice by more than a hair.

    `noise` holds, per weight tensor, each sample's candidate x channel squared errors. Per
    channel, the per-sample difference between the runner-up and the best candidate (by the
    mean) estimates how much the best one saves; were the truth the other way, choosing by
    the mean would lose what the difference falls below zero: in expectation (a normal
    mean) ``se * pdf(m / se) - m * cdf(-m / se)``. Settled when, in every tensor, that
    expected loss summed over its channels is under SETTLE_TOLERANCE of the chosen noise,
    after SETTLE_MIN_SAMPLES.
    """
    for per_sample in noise:
        count = len(per_sample)
        if count < SETTLE_MIN_SAMPLES:
            return False
        stacked = np.stack(per_sample)  # sample x candidate x channel
        order = np.argsort(stacked.mean(axis=0), axis=0)[None, :2]  # best, runner-up
        best, second = np.moveaxis(np.take_along_axis(stacked, order, axis=1), 1, 0)
        difference = (second - best).mean(axis=0)
        error = (second - best).std(axis=0, ddof=1) / np.sqrt(count)
        z = difference / np.where(error > 0, error, 1.0)
        loss = np.where(error > 0, error * np.exp(-z * z / 2) / np.sqrt(2 * np.pi) -
                        difference * _upper_tail(z), 0.0).sum()
        if loss > SETTLE_TOLERANCE * best.mean(axis=0).sum():
            return False
    return True


# The standard normal's upper tail, 1 - cdf(z), per element (scipy.special would add 0.4 s of
# imports to a calibration that takes 3 s on the zoo).
_upper_tail = np.vectorize(lambda z: 0.5 * math.erfc(z / math.sqrt(2)), otypes=[np.float64])


def _db(power: float, noise: float) -> float:
    return float(10 * np.log10(power / noise)) if noise > 0 else float("inf")
