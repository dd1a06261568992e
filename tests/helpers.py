"""Models shared by several test files: the zoo modules under test, SSDlite's raw outputs, and
small ONNX graphs built from nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torchvision
from onnx import TensorProto, helper, numpy_helper

from quantlab import zoo


class SSDLiteRaw(torch.nn.Module):
    """SSDlite320 backbone + head raw outputs (box regression, class logits), no NMS/decoding."""

    def __init__(self):
        super().__init__()
        ssd = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
            weights=None, weights_backbone=None)
        self.backbone, self.head = ssd.backbone, ssd.head

    def forward(self, x):
        out = self.head(list(self.backbone(x).values()))
        return out["bbox_regression"], out["cls_logits"]


def zoo_params() -> list:
    """``zoo.names()`` for parametrize; shapes-det (3x128x128, 41 convs) is marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name == "shapes-det" else name
            for name in zoo.names()]


def onnx_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    """An opset-17 model (not normalized) from nodes, (name, shape) float inputs, output names
    (shapes left to inference) and numpy initializers stored as float32."""
    g = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in initializers.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
