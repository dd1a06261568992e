"""Procedural shapes detection dataset with exact COCO ground truth.

Every image is a pure function of ``(split_seed, index)``: its NumPy Generator is
seeded with that pair, so splits with different seeds never share a stream and
any image can be regenerated alone. Shapes are rasterized without anti-aliasing
(a pixel belongs to a shape iff its centre does), so each ground-truth box is the
exact bounding box of the shape's pixels, even where a later shape occludes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SIZE = 128
CATEGORIES = ("circle", "square", "triangle", "ring", "cross")
MIN_SIZE, MAX_SIZE = 8.0, 64.0
MAX_OBJECTS = 6

# Split seeds: the train stream is infinite; calibration and evaluation are finite.
TRAIN_SEED, CALIBRATION_SEED, EVAL_SEED = 1000, 2000, 3000

# A shape may hide at most this fraction of an earlier shape's pixels.
MAX_OCCLUDED_FRACTION = 0.5
# Minimum RGB distance (in [0, 1] units) between a shape's colour and the background under it.
MIN_CONTRAST = 0.35
# Per-image standard deviation range of the Gaussian pixel noise added last.
NOISE_STD_RANGE = (0.005, 0.03)


def _shape_mask(rng: np.random.Generator, category: int, size: float, xs: np.ndarray,
                ys: np.ndarray) -> np.ndarray:
    """Boolean mask of one shape centred at (0, 0) sampled at pixel-centre offsets (xs, ys)."""
    angle = rng.uniform(0.0, np.pi / 2)
    cos, sin = np.cos(angle), np.sin(angle)
    u, v = cos * xs + sin * ys, -sin * xs + cos * ys  # shape-frame coordinates
    half = size / 2
    name = CATEGORIES[category]
    if name == "circle":
        return xs**2 + ys**2 <= half**2
    if name == "ring":
        thickness = max(2.0, size * rng.uniform(0.15, 0.25))
        r2 = xs**2 + ys**2
        return (r2 <= half**2) & (r2 >= (half - thickness) ** 2)
    if name == "square":
        side = half / np.sqrt(2) * rng.uniform(1.15, 1.4)
        return (np.abs(u) <= side) & (np.abs(v) <= side)
    if name == "cross":
        arm = max(1.5, half * rng.uniform(0.28, 0.4))
        horizontal = (np.abs(u) <= half) & (np.abs(v) <= arm)
        return horizontal | ((np.abs(v) <= half) & (np.abs(u) <= arm))
    # triangle: equilateral-ish, vertices on the circle of radius `half`, jittered
    theta = angle * 4 + np.array([0.0, 2 * np.pi / 3, 4 * np.pi / 3]) + rng.uniform(-0.25, 0.25, 3)
    px, py = half * np.cos(theta), half * np.sin(theta)
    inside = np.ones(xs.shape, dtype=bool)
    for k in range(3):
        ax, ay, bx, by = px[k], py[k], px[(k + 1) % 3], py[(k + 1) % 3]
        inside &= (bx - ax) * (ys - ay) - (by - ay) * (xs - ax) >= 0
    return inside


def _background(rng: np.random.Generator) -> np.ndarray:
    """Cluttered float background in [0, 1]: gradient, stripes, soft blobs and thin lines."""
    n = IMAGE_SIZE
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) / n
    base = rng.uniform(0.2, 0.8, 3).astype(np.float32)
    slope = rng.uniform(-0.35, 0.35, (2, 3)).astype(np.float32)
    img = base + xx[..., None] * slope[0] + yy[..., None] * slope[1] - slope.sum(0) / 2
    if rng.random() < 0.5:  # stripes at a random angle and period
        angle, period = rng.uniform(0, np.pi), rng.uniform(6, 24)
        phase = (np.cos(angle) * xx + np.sin(angle) * yy) * n * 2 * np.pi / period
        img += np.sin(phase)[..., None] * rng.uniform(0.03, 0.12, 3).astype(np.float32)
    for _ in range(rng.integers(0, 5)):  # soft Gaussian blobs: not objects
        cx, cy = rng.uniform(0, 1, 2)
        sigma = rng.uniform(0.03, 0.15)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * sigma**2))
        img += blob[..., None] * rng.uniform(-0.35, 0.35, 3).astype(np.float32)
    for _ in range(rng.integers(0, 4)):  # thin straight lines: not objects
        x0, y0, x1, y1 = rng.uniform(0, n, 4)
        t = np.linspace(0, 1, 2 * n)
        cols = np.clip((x0 + t * (x1 - x0)).astype(int), 0, n - 1)
        rows = np.clip((y0 + t * (y1 - y0)).astype(int), 0, n - 1)
        img[rows, cols] = rng.uniform(0, 1, 3)
    return img


def generate(split_seed: int, index: int) -> tuple[np.ndarray, list[dict]]:
    """Image ``index`` of a split: (HxWx3 uint8 RGB, objects with ``category_id`` and ``bbox``).

    ``bbox`` is COCO ``[x, y, w, h]`` in pixels with pixel edges at integer coordinates;
    ``category_id`` is 1-based into :data:`CATEGORIES`.
    """
    rng = np.random.default_rng([split_seed, index])
    n = IMAGE_SIZE
    img = _background(rng)
    owner = np.full((n, n), -1, dtype=np.int32)  # which object each pixel shows
    pixel_counts: list[int] = []
    objects: list[dict] = []
    target = int(rng.integers(1, MAX_OBJECTS + 1))
    for _ in range(4 * target):  # placement attempts; a rejected one is not retried
        if len(objects) == target:
            break
        category = int(rng.integers(len(CATEGORIES)))
        size = float(np.exp(rng.uniform(np.log(MIN_SIZE), np.log(MAX_SIZE))))
        r = size / 2 + 1
        cx, cy = rng.uniform(r, n - r, 2)
        x0, y0 = int(np.floor(cx - r)), int(np.floor(cy - r))
        x1, y1 = int(np.ceil(cx + r)), int(np.ceil(cy + r))
        ys, xs = np.mgrid[y0:y1, x0:x1].astype(np.float32) + 0.5
        local = _shape_mask(rng, category, size, xs - cx, ys - cy)
        rows, cols = np.nonzero(local)
        if rows.size == 0:
            continue
        window = owner[y0:y1, x0:x1]
        hidden = np.bincount(window[local][window[local] >= 0], minlength=len(objects))
        visible = np.bincount(owner[owner >= 0], minlength=len(objects))
        if len(objects) and np.any(
            visible - hidden < (1 - MAX_OCCLUDED_FRACTION) * np.asarray(pixel_counts)
        ):
            continue
        under = img[y0:y1, x0:x1][local].mean(0)
        color = rng.uniform(0, 1, 3)
        for _ in range(10):
            if np.linalg.norm(color - under) >= MIN_CONTRAST:
                break
            color = rng.uniform(0, 1, 3)
        else:
            color = np.where(under > 0.5, 0.0, 1.0)
        img[y0:y1, x0:x1][local] = color
        window[local] = len(objects)
        pixel_counts.append(int(rows.size))
        bx, by = x0 + cols.min(), y0 + rows.min()
        objects.append({
            "category_id": category + 1,
            "bbox": [float(bx), float(by), float(x0 + cols.max() + 1 - bx),
                     float(y0 + rows.max() + 1 - by)],
        })
    img += rng.normal(0, rng.uniform(*NOISE_STD_RANGE), img.shape).astype(np.float32)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8), objects


def coco_categories() -> list[dict]:
    """COCO ``categories`` entries of the dataset."""
    return [{"id": i + 1, "name": name, "supercategory": "shape"}
            for i, name in enumerate(CATEGORIES)]


def make_split(split_seed: int, count: int, start: int = 0) -> tuple[np.ndarray, dict]:
    """Images ``start .. start+count-1`` of a split as (N x H x W x 3 uint8, COCO GT dict).

    Image ids are ``index + 1`` and file names ``{index:05d}.png``.
    """
    images, coco_images, annotations = [], [], []
    for index in range(start, start + count):
        image, objects = generate(split_seed, index)
        images.append(image)
        coco_images.append({"id": index + 1, "file_name": f"{index:05d}.png",
                            "width": IMAGE_SIZE, "height": IMAGE_SIZE})
        for obj in objects:
            w, h = obj["bbox"][2:]
            annotations.append({"id": len(annotations) + 1, "image_id": index + 1,
                                "category_id": obj["category_id"], "bbox": obj["bbox"],
                                "area": w * h, "iscrowd": 0})
    coco = {"images": coco_images, "annotations": annotations, "categories": coco_categories()}
    return np.stack(images), coco


def write_coco_folder(folder: Path, images: np.ndarray, coco: dict) -> None:
    """Write ``images/<file_name>`` PNGs and ``annotations.json`` into ``folder``."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for image, entry in zip(images, coco["images"], strict=True):
        Image.fromarray(image).save(folder / "images" / entry["file_name"], optimize=True)
    (folder / "annotations.json").write_text(json.dumps(coco))


def read_coco_folder(folder: Path) -> tuple[np.ndarray, dict]:
    """Inverse of :func:`write_coco_folder`: images in ``coco['images']`` order and the GT."""
    coco = json.loads((folder / "annotations.json").read_text())
    images = [np.asarray(Image.open(folder / "images" / e["file_name"]).convert("RGB"))
              for e in coco["images"]]
    return np.stack(images), coco
