"""shapes-det: a MobileNet-style anchor-free detector (TTFNet/CenterNet family) and its decoding.

The torch module itself is in :mod:`quantlab.zoo.shapes_det_net`; this module (decoding
included) imports no torch.

The module maps a normalized image to two dense maps at stride 4:

* ``scores`` (N, C, H/4, W/4): per-class centre heatmap after a sigmoid;
* ``boxes`` (N, 4, H/4, W/4): distances in pixels from each cell centre to the
  left, top, right and bottom box edges.

Decoding (3x3 max-pool peak picking, top-k, class-wise NMS) lives in
:func:`decode`, outside the module, so the exported graph holds only the network.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from quantlab.zoo.shapes import CATEGORIES, IMAGE_SIZE

STRIDE = 4
INPUT_SHAPE = (3, IMAGE_SIZE, IMAGE_SIZE)
OUTPUT_NAMES = ("scores", "boxes")
MEAN, STD = 0.5, 0.25
# Box distances are predicted in units of this many pixels (TTFNet uses 16).
BOX_SCALE = 16.0


def preprocess(images: np.ndarray) -> np.ndarray:
    """N x H x W x 3 uint8 RGB -> N x 3 x H x W float32: /255, then (x - 0.5) / 0.25."""
    x = images.astype(np.float32) / 255.0
    return np.ascontiguousarray(((x - MEAN) / STD).transpose(0, 3, 1, 2))


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
    detections = []
    for i, image_id in enumerate(image_ids):
        keep = top_scores[i] >= score_threshold
        b, s, c = (a[i][keep] for a in (xyxy, top_scores, classes))
        for j in classwise_nms(b, c, iou_threshold):
            x0, y0, x1, y1 = (float(v) for v in b[j])
            detections.append({"image_id": int(image_id), "category_id": int(c[j]) + 1,
                               "bbox": [x0, y0, x1 - x0, y1 - y0], "score": float(s[j])})
    return detections


def classwise_nms(xyxy: np.ndarray, classes: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy NMS within each class of boxes (x0, y0, x1, y1) already sorted by descending
    score: the positions kept, in that order (``torchvision.ops.batched_nms``'s result, which
    the tests compare it with; here in numpy, so that decoding imports no torch)."""
    x0, y0, x1, y1 = np.asarray(xyxy, np.float32).T
    area = (x1 - x0) * (y1 - y0)
    width = np.clip(np.minimum(x1[:, None], x1) - np.maximum(x0[:, None], x0), 0, None)
    height = np.clip(np.minimum(y1[:, None], y1) - np.maximum(y0[:, None], y0), 0, None)
    inter = width * height
    with np.errstate(invalid="ignore", divide="ignore"):  # two empty boxes: 0/0, no overlap
        overlaps = inter / (area[:, None] + area - inter) > iou_threshold
    overlaps &= classes[:, None] == classes
    suppressed = np.zeros(len(area), bool)
    kept = []
    for i in range(len(area)):
        if not suppressed[i]:
            kept.append(i)
            suppressed |= overlaps[i]
    return np.array(kept, np.int64)


def targets(objects_per_image: list[list[dict]], height: int, width: int,
            num_classes: int = len(CATEGORIES), alpha: float = 0.54
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
