"""Models shared by several test files: the zoo modules under test and SSDlite's raw outputs."""

from __future__ import annotations

import pytest
import torch
import torchvision

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
