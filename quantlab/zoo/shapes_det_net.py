"""shapes-det's torch module and training losses (:mod:`quantlab.zoo.shapes_det` holds its
preprocessing, decoding and training targets, which read without torch)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from quantlab.zoo.shapes import CATEGORIES
from quantlab.zoo.shapes_det import BOX_SCALE, cell_centers


def conv_bn_relu(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1,
                 relu6: bool = False) -> nn.Sequential:
    """Conv (no bias) + BatchNorm + ReLU/ReLU6: the unit TensorRT fuses into one INT8 kernel."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True) if relu6 else nn.ReLU(inplace=True),
    )


class DepthwiseSeparable(nn.Sequential):
    """MobileNet v1 block: 3x3 depthwise (groups=C) + BN + ReLU6, then 1x1 pointwise + BN + ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__(
            conv_bn_relu(cin, cin, 3, stride, groups=cin, relu6=True),
            conv_bn_relu(cin, cout, 1),
        )


class Backbone(nn.Module):
    """Depthwise-separable backbone returning features at strides 4, 8, 16 and 32."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_bn_relu(3, 16, 3, 2), DepthwiseSeparable(16, 24))
        self.stage4 = nn.Sequential(DepthwiseSeparable(24, 32, 2), DepthwiseSeparable(32, 32))
        self.stage8 = nn.Sequential(DepthwiseSeparable(32, 64, 2), DepthwiseSeparable(64, 64))
        self.stage16 = nn.Sequential(
            DepthwiseSeparable(64, 128, 2), DepthwiseSeparable(128, 128),
            DepthwiseSeparable(128, 128),
        )
        self.stage32 = nn.Sequential(DepthwiseSeparable(128, 256, 2), DepthwiseSeparable(256, 256))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c4 = self.stage4(self.stem(x))
        c8 = self.stage8(c4)
        c16 = self.stage16(c8)
        return [c4, c8, c16, self.stage32(c16)]


class Neck(nn.Module):
    """Top-down feature pyramid merging every level into one stride-4 map."""

    def __init__(self, in_channels: tuple[int, ...] = (32, 64, 128, 256), width: int = 64) -> None:
        super().__init__()
        self.lateral = nn.ModuleList(conv_bn_relu(c, width) for c in in_channels)
        self.smooth = nn.ModuleList(DepthwiseSeparable(width, width) for _ in in_channels[:-1])

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.lateral[-1](features[-1])
        for i in range(len(features) - 2, -1, -1):
            x = F.interpolate(x, scale_factor=2.0, mode="nearest") + self.lateral[i](features[i])
            x = self.smooth[i](x)
        return x


class Head(nn.Module):
    """Detection head: a class-heatmap branch and a box-distance branch."""

    def __init__(self, width: int = 64, num_classes: int = len(CATEGORIES)) -> None:
        super().__init__()
        self.cls_tower = nn.Sequential(DepthwiseSeparable(width, width),
                                       DepthwiseSeparable(width, width))
        self.box_tower = nn.Sequential(DepthwiseSeparable(width, width),
                                       DepthwiseSeparable(width, width))
        self.cls = nn.Conv2d(width, num_classes, 1)
        self.box = nn.Conv2d(width, 4, 1)
        # Focal-loss prior (RetinaNet): start every class at probability 0.01.
        nn.init.constant_(self.cls.bias, -float(np.log(99.0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.cls(self.cls_tower(x)))
        boxes = F.relu(self.box(self.box_tower(x))) * BOX_SCALE
        return scores, boxes


class ShapesDetector(nn.Module):
    """Backbone + neck + head; forward returns ``(scores, boxes)`` at stride 4."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.neck = Neck()
        self.head = Head()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.neck(self.backbone(x)))


def focal_loss(scores: torch.Tensor, heat: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss (alpha=2, beta=4), normalized by object count."""
    p = scores.clamp(1e-4, 1 - 1e-4)
    positive = heat.eq(1.0).float()
    pos = -torch.log(p) * (1 - p) ** 2 * positive
    neg = -torch.log(1 - p) * p**2 * (1 - heat) ** 4 * (1 - positive)
    return (pos.sum() + neg.sum()) / positive.sum().clamp(min=1.0)


def giou_loss(boxes: torch.Tensor, box_target: torch.Tensor, box_weight: torch.Tensor
              ) -> torch.Tensor:
    """TTFNet's weighted GIoU loss, plus L1 on the box edges (in units of 16 px) for tightness."""
    import torchvision

    n, _, h, w = boxes.shape
    mask = box_weight > 0
    xs, ys = (torch.from_numpy(a) for a in cell_centers(h, w))
    cx, cy = xs.expand(n, h, w)[mask], ys[:, None].expand(n, h, w)[mask]
    d = boxes.permute(0, 2, 3, 1)[mask]
    pred = torch.stack([cx - d[:, 0], cy - d[:, 1], cx + d[:, 2], cy + d[:, 3]], 1)
    tgt = box_target.permute(0, 2, 3, 1)[mask]
    weight = box_weight[mask]
    giou = torchvision.ops.generalized_box_iou_loss(pred, tgt, reduction="none")
    l1 = (pred - tgt).abs().sum(1) / BOX_SCALE
    return ((giou + 0.2 * l1) * weight).sum() / weight.sum().clamp(min=1e-4)
