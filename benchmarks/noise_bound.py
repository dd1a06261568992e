"""Where an all-INT8 model's output noise comes from: its weights, its activations, and what
an offset before the activations' symmetric grid would give (issue 41's bound).

    python benchmarks/noise_bound.py FOLDER CALIB.npy VAL.npy [--metric module:function]

FOLDER is a ``quantlab calibrate`` output: ``model.onnx`` (the FP32 model as quantlab
prepared it: BatchNorm folded, equalized) and ``model.int8.onnx``. Each variant is scored
held out on VAL against ``model.onnx`` (output SQNR, float64, pooled over the samples, the
worst output; with ``--metric`` its score too), one sample at a time, all in ONNX Runtime's
float Q/DQ arithmetic (graph optimizations off, so no int8 kernels and their rounding ties):
the variants differ only in what is quantized.

- ``as calibrated``: model.int8.onnx.
- ``weights only``: the activations' Q/DQ pairs removed (weights and constants quantized,
  bias correction kept).
- ``activations only``: every layer's weights and biases from model.onnx (no weight
  rounding, no bias correction): the activations' share. Bias correction can go above it
  (it also corrects the activations' mean error); weight rounding alone cannot.
- ``activations only, offsets (unpadded readers)``: one-sided activations (minimum on the
  first CALIB samples at most half the amax below zero) quantized as ``c + s' q`` with
  ``c`` the middle of [minimum, amax] and ``s'`` half the step: the grid an asymmetric
  zero point would give. Only where every reader is a Conv without padding, where the
  offset folds exactly into the reader's bias, so the engine keeps TensorRT's symmetric
  int8 (zero point 0).
- ``activations only, offsets (every one-sided tensor)``: the same on every one-sided
  tensor, padded readers included (a depthwise conv's zero padding would become ``-c``:
  not a symmetric int8 conv any more).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, run or imported
from calibrate_phases import ROOT, output_scores  # noqa: E402

sys.path.insert(0, str(ROOT))  # quantlab, and --metric benchmarks.planner_metrics:...
from quantlab import graph  # noqa: E402
from quantlab.metadata import attribute  # noqa: E402

OFFSET_SAMPLES = 4  # calibration samples whose FP32 minima decide which tensors are one-sided
ONE_SIDED = 0.5  # a tensor is one-sided when its minimum is above -ONE_SIDED * amax


ort.set_default_logger_severity(3)  # the variants leave initializers unused, on purpose


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _copied(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _constant(tensor: str, producers: dict, constants: set) -> bool:
    """True when `tensor` is computed from initializers and Constant nodes alone."""
    if tensor in constants:
        return True
    node = producers.get(tensor)
    return node is not None and all(_constant(name, producers, constants)
                                    for name in node.input if name)


def _activation_quantizers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The QuantizeLinear nodes of tensors that depend on the model's input."""
    producers, constants = graph.producers(model), graph.constant_tensors(model)
    return [node for node in model.graph.node if node.op_type == "QuantizeLinear"
            and not _constant(node.input[0], producers, constants)]


def weights_only(int8: onnx.ModelProto) -> onnx.ModelProto:
    """`int8` with its activations' Q/DQ pairs removed."""
    model = _copied(int8)
    readers = graph.consumers(model)
    bypass, dropped = {}, set()
    for quantize in _activation_quantizers(model):
        dropped.add(id(quantize))
        for dequantize in readers.get(quantize.output[0], []):
            bypass[dequantize.output[0]] = quantize.input[0]
            dropped.add(id(dequantize))
    nodes = [node for node in model.graph.node if id(node) not in dropped]
    for node in nodes:
        node.input[:] = [bypass.get(name, name) for name in node.input]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def activations_only(int8: onnx.ModelProto, fp32: onnx.ModelProto) -> onnx.ModelProto:
    """`int8` with every node's initializer inputs as in `fp32` (the same node names): FP32
    weights and biases, the biases bias correction added dropped."""
    model = _copied(int8)
    fp32_nodes = {node.name: node for node in fp32.graph.node if node.name}
    fp32_initializers = {i.name: i for i in fp32.graph.initializer}
    used = set()
    for node in model.graph.node:
        original = fp32_nodes.get(node.name)
        if original is None or original.op_type != node.op_type:
            continue
        inputs = list(node.input[:len(original.input)])
        for index, name in enumerate(original.input):
            if name in fp32_initializers:
                inputs[index] = "fp32/" + name
                used.add(name)
        node.input[:] = inputs
    model.graph.initializer.extend(
        numpy_helper.from_array(numpy_helper.to_array(fp32_initializers[name]), "fp32/" + name)
        for name in sorted(used))
    return model


def minima(model: onnx.ModelProto, tensors: list[str], samples: np.ndarray) -> dict[str, float]:
    """Each tensor's minimum over `samples` (one at a time) in `model`."""
    exposed = _copied(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                                for name in tensors)
    session = _session(exposed)
    feed = session.get_inputs()[0].name
    low = dict.fromkeys(tensors, np.inf)
    for sample in samples:
        for name, value in zip(tensors, session.run(None, {feed: sample[None]}), strict=True):
            low[name] = min(low[name], float(value.min()))
    return low


def _unpadded_convs(readers: list[onnx.NodeProto]) -> bool:
    return all(node.op_type == "Conv" and not any(attribute(node, "pads", []))
               for node in readers)


def with_offsets(model: onnx.ModelProto, low: dict[str, float], unpadded_only: bool
                 ) -> tuple[onnx.ModelProto, int]:
    """`model` with each one-sided activation `x` quantized as ``DQ(Q(x - c, s'), s') + c``;
    and how many tensors."""
    model = _copied(model)
    scales = {i.name: float(numpy_helper.to_array(i)) for i in model.graph.initializer
              if not i.dims}
    readers = graph.consumers(model)
    before, after, added = {}, {}, []
    for quantize in _activation_quantizers(model):
        tensor, amax = quantize.input[0], 127 * scales[quantize.input[1]]
        dequantizers = readers[quantize.output[0]]
        floor = max(low[tensor], -amax)
        if floor < -ONE_SIDED * amax or (unpadded_only and not all(
                _unpadded_convs(readers.get(dq.output[0], [])) for dq in dequantizers)):
            continue
        tag = f"offset/{quantize.name}"
        added += [numpy_helper.from_array(np.float32((amax + floor) / 2), tag + "/c"),
                  numpy_helper.from_array(np.float32((amax - floor) / 254), tag + "/s")]
        before[id(quantize)] = helper.make_node("Sub", [tensor, tag + "/c"], [tag + "/x"])
        quantize.input[0], quantize.input[1] = tag + "/x", tag + "/s"
        for dequantize in dequantizers:
            output = dequantize.output[0]
            dequantize.input[1], dequantize.output[0] = tag + "/s", output + "/shifted"
            after[id(dequantize)] = helper.make_node("Add", [output + "/shifted", tag + "/c"],
                                                     [output])
    nodes = []
    for node in model.graph.node:
        nodes += [n for n in (before.get(id(node)), node, after.get(id(node))) if n is not None]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(added)
    return model, len(before)


def score(model: onnx.ModelProto, references: list[list[np.ndarray]], names: list[str],
          val: np.ndarray, metric: str | None) -> dict:
    """Held-out SQNR of `model` (the worst output) against `references`, and `metric`'s
    score (``module:function``)."""
    session = _session(model)
    feed = session.get_inputs()[0].name
    outputs = [session.run(names, {feed: sample[None]}) for sample in val]
    worst, found = output_scores(references, outputs, names, metric)
    result = {"sqnr_db": round(worst, 2)}
    if metric:
        result["metric"] = round(found, 4)
    return result


def folder_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a script that reads a calibration folder: FOLDER CALIB VAL [--metric]."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the --out folder of a `quantlab calibrate`")
    parser.add_argument("calib", help="calibration samples (.npy, leading sample axis)")
    parser.add_argument("val", help="held-out samples (.npy, leading sample axis)")
    parser.add_argument("--metric", help="module:function, lists of candidate and FP32 batches")
    return parser


def folder_models(parser: argparse.ArgumentParser, folder: Path) -> tuple[Path, Path]:
    """FOLDER's model.onnx and model.int8.onnx; a folder without them is refused by name."""
    models = folder / "model.onnx", folder / "model.int8.onnx"
    missing = [path.name for path in models if not path.is_file()]
    if missing:
        parser.error(f"{folder} has no {' or '.join(missing)}: give the --out folder of a "
                     "`quantlab calibrate` run")
    return models


def main() -> None:
    parser = folder_parser(__doc__)
    args = parser.parse_args()
    fp32_path, int8_path = folder_models(parser, args.folder)
    fp32, int8 = onnx.load(fp32_path), onnx.load(int8_path)
    val = np.load(args.val, mmap_mode="r")
    calib = np.load(args.calib, mmap_mode="r")[:OFFSET_SAMPLES]
    reference = _session(fp32)
    names = [output.name for output in reference.get_outputs()]
    feed = reference.get_inputs()[0].name
    references = [reference.run(names, {feed: sample[None]}) for sample in val]
    activations = activations_only(int8, fp32)
    low = minima(activations, sorted({q.input[0] for q in _activation_quantizers(int8)}),
                 calib)
    variants = {"as calibrated": (int8, None), "weights only": (weights_only(int8), None),
                "activations only": (activations, None)}
    for label, unpadded in (("unpadded readers", True), ("every one-sided tensor", False)):
        model, count = with_offsets(activations, low, unpadded)
        variants[f"activations only, offsets ({label})"] = (model, count)
    for label, (model, count) in variants.items():
        result = score(model, references, names, val, args.metric)
        if count is not None:
            result["offset_tensors"] = count
        print(json.dumps({"variant": label, **result}), flush=True)


if __name__ == "__main__":
    main()
