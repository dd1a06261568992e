"""Which tensors a TensorRT <= 10 implicit-INT8 build needs a dynamic range for.

The rule (docs/tensorrt.md, "Calibration cache TensorRT can use whole"): in
implicit quantization TensorRT needs a dynamic range for every network tensor
that is not Int32 or Bool -- the network inputs and the output of every layer,
network outputs included (TensorRT's sampleINT8API README; TensorRT's build log
"Calibrator is not being used. Users must provide dynamic range for all tensors
that are not Int32 or Bool"). A tensor without one makes every layer consuming
or producing it fall back to a non-INT8 implementation ("Missing scale and
zero-point for tensor ..., expect fall back to non-int8 implementation"), and
caches TensorRT writes itself hold one line per such tensor, layer outputs
included. ONNX's parser names a layer's output after the ONNX tensor, so in
ONNX terms these are the float graph inputs and float node outputs; tensors the
parser creates itself (``(Unnamed Layer* N) [Constant]_output``, reshaped
biases) have no ONNX name and stay out of quantlab's cache.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from quantlab import graph
from quantlab.calibration import qdq


def tensors_needing_ranges(model: onnx.ModelProto | graph.Graph) -> list[str]:
    """Float graph inputs and float node outputs of `model`, in topological order."""
    index = graph.Graph.of(model)
    return [name for name in index.order if name in index.floats]


def tensors_to_calibrate(model: onnx.ModelProto | graph.Graph) -> list[str]:
    """Tensors to collect statistics for: the Q/DQ model's activation inputs and every tensor
    :func:`tensors_needing_ranges` lists, once each, in topological order."""
    index = qdq.indexed(model)
    wanted = set(qdq.activation_tensors_to_calibrate(index))
    wanted.update(tensors_needing_ranges(index))
    return [name for name in index.order if name in wanted]


def missing_ranges(model: onnx.ModelProto, scales: Mapping[str, float]) -> list[str]:
    """Tensors an implicit-INT8 build of `model` needs that `scales` (a cache) has no range
    for: each makes TensorRT run the layers around it outside INT8. A zero range is a range
    (TensorRT writes 0 for all-zero tensors itself)."""
    return [name for name in tensors_needing_ranges(model) if name not in scales]
