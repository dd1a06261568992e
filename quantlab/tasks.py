"""End-to-end task metrics: top-k accuracy for classification, COCO mAP for detection.

COCO mAP is computed by pycocotools (the reference implementation); this
module only adapts predictions to it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from quantlab.errors import DataError

# The figure each task is judged by in summaries and reports.
PRIMARY_METRIC = {"classification": "top1", "detection": "map"}
METRIC_LABELS = {
    "top1": "top-1",
    "top5": "top-5",
    "map": "mAP@[.5:.95]",
    "map50": "mAP@.5",
    "map75": "mAP@.75",
}


def topk_accuracy(
    logits: np.ndarray, labels: np.ndarray, ks: Sequence[int] = (1, 5)
) -> dict[str, float]:
    """Fraction of samples whose label is among the k highest logits, for each k."""
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.ndim != 2 or len(logits) != len(labels):
        raise DataError(
            f"top-k accuracy needs logits of shape (N, classes) and N labels; got logits "
            f"{logits.shape} and labels {labels.shape}."
        )
    # Rank of the true class = number of classes with a strictly higher logit.
    true_logit = np.take_along_axis(logits, labels[:, None], axis=1)
    rank = (logits > true_logit).sum(axis=1)
    return {f"top{k}": float((rank < k).mean()) for k in ks if k <= logits.shape[1]}


def coco_map(coco_gt: Mapping, detections: Sequence[Mapping]) -> dict:
    """COCO box mAP of `detections` against ground truth `coco_gt` (both COCO-format).

    Returns ``map`` (mAP@[.5:.95]), ``map50``, ``map75``, ``map_small/medium/large``
    and ``per_class`` (category name -> AP@[.5:.95]). No detections scores 0.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth = COCO()
        ground_truth.dataset = {
            "images": list(coco_gt["images"]),
            "annotations": list(coco_gt["annotations"]),
            "categories": list(coco_gt["categories"]),
        }
        ground_truth.createIndex()
        names = {c["id"]: c["name"] for c in coco_gt["categories"]}
        if not detections:
            return {
                "map": 0.0,
                "map50": 0.0,
                "map75": 0.0,
                "map_small": 0.0,
                "map_medium": 0.0,
                "map_large": 0.0,
                "per_class": dict.fromkeys(names.values(), 0.0),
            }
        predictions = ground_truth.loadRes([dict(d) for d in detections])
        evaluator = COCOeval(ground_truth, predictions, iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = evaluator.stats
    # precision[T, R, K, A, M]: IoU thresholds, recall points, classes, area ranges, max dets;
    # area "all" (0) and 100 detections (last) are what the headline mAP uses.
    precision = evaluator.eval["precision"][:, :, :, 0, -1]
    per_class = {}
    for k, cat_id in enumerate(evaluator.params.catIds):
        values = precision[:, :, k]
        values = values[values > -1]
        per_class[names[cat_id]] = float(values.mean()) if values.size else float("nan")
    return {
        "map": float(stats[0]),
        "map50": float(stats[1]),
        "map75": float(stats[2]),
        "map_small": float(stats[3]),
        "map_medium": float(stats[4]),
        "map_large": float(stats[5]),
        "per_class": per_class,
    }


def evaluate(
    zoo_model,
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    eval_set,
    batch_size: int = 32,
    progress: Callable | None = None,
) -> dict:
    """Run `run` over `eval_set` batch by batch and score it with the zoo model's task metric.

    Post-processing runs per batch, so only predictions (not raw outputs) are kept.
    """
    predictions: list = []
    starts = range(0, len(eval_set.inputs), batch_size)
    for start in progress(starts) if progress else starts:
        stop = start + batch_size
        outputs = run({zoo_model.input_name: eval_set.inputs[start:stop]})
        predicted = zoo_model.postprocess(outputs, list(eval_set.image_ids[start:stop]))
        if zoo_model.task == "classification":
            predictions.append(predicted)
        else:
            predictions.extend(predicted)
    if zoo_model.task == "classification":
        return topk_accuracy(np.concatenate(predictions), eval_set.labels)
    return coco_map(eval_set.coco, predictions)
