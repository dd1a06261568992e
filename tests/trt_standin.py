"""A stand-in for a TensorRT engine: NOT TensorRT, and it builds nothing.

:class:`StandInTensorRT` has :class:`quantlab.engine.backends.tensorrt.TensorRTBackend`'s interface,
and its ``run``, ``available`` and ``not_exposed`` are TensorRTBackend's own code. Only the
runner underneath is a stand-in: ONNX Runtime runs the Q/DQ model and hands back what a real
engine's Polygraphy runner would, and nothing more: the graph outputs and the intermediate
tensors the stand-in is told the engine exposes, every one of them on every run (TensorRT's
debug listener copies all debug tensors), under the name TensorRT reports each one by. Like
Polygraphy's ``set_input_shape``, it refuses a batch larger than the profile's maximum.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from polygraphy.exception import PolygraphyException

from quantlab import graph
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.engine.backends.tensorrt import (
    LAYERS,
    ExposedTensors,
    TensorRTBackend,
    sample_axes,
)


class StandInRunner:
    """What ``TrtRunner.infer`` returns, computed by ONNX Runtime on the Q/DQ model."""

    def __init__(self, model, engine_names: Mapping[str, str], axes: Mapping[str, int],
                 max_batch: int | None):
        self.session = OnnxRuntimeBackend(model, name="stand-in")
        self.engine_names = dict(engine_names)
        self.axes, self.max_batch = dict(axes), max_batch
        self.batches: list[int] = []  # samples per run, in order
        self.is_active = True

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        size = max(np.shape(feed[name])[axis] for name, axis in self.axes.items())
        if self.max_batch is not None and size > self.max_batch:
            raise PolygraphyException(f"input shape outside the profile (batch {size})")
        self.batches.append(int(size))
        values = self.session.run(feed, list(self.engine_names))
        return {self.engine_names[name]: value for name, value in values.items()}

    def deactivate(self) -> None:
        self.is_active = False


class StandInTensorRT(TensorRTBackend):
    """TensorRTBackend over a :class:`StandInRunner` (see the module docstring).

    `exposed` maps each intermediate ONNX tensor the engine exposes to how it was obtained
    (a key of ``SOURCES``) and, optionally, `engine_names` to the name TensorRT reports it by;
    `max_batch` is the profile's maximum batch (None: the model's shapes decide).
    """

    def __init__(self, model, exposed: Mapping[str, str], engine_names: Mapping[str, str] = (),
                 max_batch: int | None = None, name: str = "tensorrt",
                 version: tuple[int, int, int] = (10, 12, 0)):
        self.name, self.version = name, version
        self.model = graph.load_model(model) if not hasattr(model, "graph") else model
        self.engine_bytes, self.debug_tensors = b"", LAYERS
        self.inputs = {spec.name: np.dtype(np.float32) for spec in graph.input_specs(self.model)}
        self.outputs = [o.name for o in self.model.graph.output]
        self.exposed = ExposedTensors(notes=["stand-in engine (ONNX Runtime), not TensorRT"])
        for output in self.outputs:
            self.exposed.add(output, "graph_output")
        for tensor, source in exposed.items():
            self.exposed.add(tensor, source, dict(engine_names).get(tensor))
        self.sample_axes = sample_axes(self.model, list(self.inputs))
        self.max_batch = max_batch
        self._runner = StandInRunner(self.model, self.exposed.engine_names, self.sample_axes,
                                     self.max_batch)
