"""TensorRT backend: builds and runs engines where the `tensorrt` package is installed.

Only the availability check exists for now; building and running engines is a
later issue (see docs/tensorrt.md). It is never faked: without TensorRT the
constructor raises :class:`BackendUnavailableError`.
"""

from __future__ import annotations

import os

import onnx

from quantlab.errors import BackendUnavailableError


class TensorRTBackend:
    """Run an ONNX model as a TensorRT engine (needs `tensorrt` and an NVIDIA GPU)."""

    def __init__(self, model: onnx.ModelProto | str | os.PathLike, name: str = "tensorrt"):
        try:
            import tensorrt
        except ImportError:
            raise BackendUnavailableError(
                "the TensorRT backend needs the `tensorrt` Python package, which is not "
                "installed; install quantlab[tensorrt] on a machine with an NVIDIA GPU, or "
                "validate the Q/DQ model with ONNX Runtime (the default engine stage)."
            ) from None
        self.trt = tensorrt
        self.model = model
        self.name = name
