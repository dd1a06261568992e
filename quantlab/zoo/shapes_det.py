"""shapes-det: a MobileNet-style anchor-free detector (TTFNet/CenterNet family) and its decoding.

The module maps a normalized image to two dense maps at stride 4:

* ``scores`` (N, C, H/4, W/4): per-class centre heatmap after a sigmoid;
* ``boxes`` (N, 4, H/4, W/4): distances in pixels from each cell centre to the
  left, top, right and bottom box edges.

Decoding (3x3 max-pool peak picking, top-k, class-wise NMS) lives in
:func:`decode`, outside the module, so the exported graph holds only the network.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import nn
from torch.nn import functional as F

from quantlab.zoo import shapes

STRIDE = 4
INPUT_SHAPE = (3, shapes.IMAGE_SIZE, shapes.IMAGE_SIZE)
OUTPUT_NAMES = ("scores", "boxes")
MEAN, STD = 0.5, 0.25
# Box distances are predicted in units of this many pixels (TTFNet uses 16).
BOX_SCALE = 16.0


def preprocess(images: np.ndarray) -> np.ndarray:
    """N x H x W x 3 uint8 RGB -> N x 3 x H x W float32: /255, then (x - 0.5) / 0.25."""
    x = images.astype(np.float32) / 255.0
    return np.ascontiguousarray(((x - MEAN) / STD).transpose(0, 3, 1, 2))


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

    def __init__(self, width: int = 64, num_classes: int = len(shapes.CATEGORIES)) -> None:
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


def cell_centers(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates (x, y) of the centres of the stride-4 output cells."""
    return (np.arange(width, dtype=np.float32) + 0.5) * STRIDE, (
        np.arange(height, dtype=np.float32) + 0.5) * STRIDE


def decode(scores: np.ndarray, boxes: np.ndarray, image_ids: list[int], top_k: int = 100,
           score_threshold: float = 0.01, iou_threshold: float = 0.6) -> list[dict]:
    """Raw ``scores``/``boxes`` arrays -> COCO detections ``{image_id, category_id, bbox, score}``.

    Peaks are cells equal to the max of their 3x3 neighbourhood (CenterNet); the
    ``top_k`` best per image are kept and class-wise NMS removes duplicates.
    """
    n, num_classes, h, w = scores.shape
    padded = np.pad(scores, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-1.0)
    pooled = sliding_window_view(padded, (3, 3), axis=(2, 3)).max(axis=(-2, -1))
    peaks = np.where(scores == pooled, scores, 0.0).reshape(n, -1)
    k = min(top_k, peaks.shape[1])
    order = np.argsort(-peaks, axis=1, kind="stable")[:, :k]
    top_scores = np.take_along_axis(peaks, order, axis=1)
    classes, cells = np.divmod(order, h * w)
    rows, cols = np.divmod(cells, w)
    xs, ys = cell_centers(h, w)
    dist = boxes[np.arange(n)[:, None], :, rows, cols]  # (n, k, 4): l, t, r, b
    cx, cy = xs[cols], ys[rows]
    left, top, right, bottom = np.moveaxis(dist, -1, 0)
    xyxy = np.stack([cx - left, cy - top, cx + right, cy + bottom], -1)
    xyxy = np.clip(xyxy, 0.0, float(max(h, w) * STRIDE))
    import torchvision  # here: importing it costs 2 s every zoo command would pay

    detections = []
    for i, image_id in enumerate(image_ids):
        keep = top_scores[i] >= score_threshold
        b, s, c = (torch.from_numpy(a[i][keep]) for a in (xyxy, top_scores, classes))
        kept = torchvision.ops.batched_nms(b.float(), s.float(), c, iou_threshold).numpy()
        for j in kept:
            x0, y0, x1, y1 = (float(v) for v in b[j])
            detections.append({"image_id": int(image_id), "category_id": int(c[j]) + 1,
                               "bbox": [x0, y0, x1 - x0, y1 - y0], "score": float(s[j])})
    return detections


def targets(objects_per_image: list[list[dict]], height: int, width: int,
            num_classes: int = len(shapes.CATEGORIES), alpha: float = 0.54
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training targets (TTFNet): Gaussian heatmaps, box targets and box-loss weights.

    Each object spreads an elliptical Gaussian (sigma = alpha * size / 6, TTFNet's
    alpha = 0.54) over the stride-4 grid; every cell inside it regresses the
    object's box, weighted by the Gaussian and by log(area) so large boxes do not
    dominate. Where objects overlap, the smaller one owns the cell.
    """
    n = len(objects_per_image)
    heat = np.zeros((n, num_classes, height, width), np.float32)
    box_target = np.zeros((n, 4, height, width), np.float32)
    box_weight = np.zeros((n, height, width), np.float32)
    xs, ys = cell_centers(height, width)
    for i, objects in enumerate(objects_per_image):
        for obj in sorted(objects, key=lambda o: -o["bbox"][2] * o["bbox"][3]):
            x, y, bw, bh = obj["bbox"]
            cx, cy = x + bw / 2, y + bh / 2
            # Peak on the cell containing the centre: the heatmap maximum must sit on a cell.
            px = (np.floor(cx / STRIDE) + 0.5) * STRIDE
            py = (np.floor(cy / STRIDE) + 0.5) * STRIDE
            sx, sy = max(alpha * bw / 6, 0.8), max(alpha * bh / 6, 0.8)
            g = np.exp(-((xs[None] - px) ** 2) / (2 * sx**2)
                       - ((ys[:, None] - py) ** 2) / (2 * sy**2))
            c = obj["category_id"] - 1
            heat[i, c] = np.maximum(heat[i, c], g)
            region = g > 0.05
            region[int(py // STRIDE), int(px // STRIDE)] = True
            weight = g * np.log(max(bw * bh, 2.0)) / g[region].sum()
            box_weight[i][region] = weight[region]
            box_target[i, :, region] = [x, y, x + bw, y + bh]
    return heat, box_target, box_weight


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
