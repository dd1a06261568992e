"""End-to-end task scoring: top-k accuracy for classification, COCO mAP for detection.

A :class:`Task` says how a stage is scored (post-processing and ground truth);
a :class:`TaskScore` folds one batch of raw outputs after another into hit
counts or detections, so raw outputs never accumulate; :func:`evaluate` runs
any backend's ``run`` over batches and scores it. COCO mAP is computed by
pycocotools (the reference implementation) in :func:`coco_map`, the one place
quantlab calls it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from quantlab.errors import ConfigError, DataError

# The figure each task is judged by in summaries and reports.
PRIMARY_METRIC = {"classification": "top1", "detection": "map"}
METRIC_LABELS = {
    "top1": "top-1",
    "top5": "top-5",
    "map": "mAP@[.5:.95]",
    "map50": "mAP@.5",
    "map75": "mAP@.75",
}
# The IoU threshold of each single-threshold COCO figure (:func:`coco_map_resampler`).
COCO_IOU = {"map50": 0.5, "map75": 0.75}


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


TASK_KINDS = ("classification", "detection")


@dataclass
class Task:
    """How to score a stage end to end: classification (labels) or detection (COCO GT).

    `postprocess(outputs, image_ids)` turns one batch of raw outputs (by ONNX output
    name) into logits (N, classes) or a list of COCO detection dicts. Sample i of
    the data is ``labels[i]`` or the image ``image_ids[i]`` (default: the order of
    ``coco["images"]``).
    """

    kind: str
    postprocess: Callable[[dict[str, np.ndarray], list[int]], object]
    labels: np.ndarray | None = None
    coco: dict | None = None
    image_ids: Sequence[int] | None = None

    def __post_init__(self):
        if self.kind not in TASK_KINDS:
            raise ConfigError(
                f"task kind '{self.kind}' is not one of {', '.join(TASK_KINDS)}.")
        if self.kind == "classification" and self.labels is None:
            raise ConfigError("a classification task needs `labels` (one per sample).")
        if self.kind == "detection" and self.coco is None:
            raise ConfigError("a detection task needs `coco` ground truth (a COCO dict).")

    @classmethod
    def from_zoo(cls, zoo_model, eval_set) -> Task:
        """The task of a zoo model scored on one of its evaluation sets."""
        return cls(zoo_model.task, zoo_model.postprocess, eval_set.labels, eval_set.coco,
                   list(eval_set.image_ids))

    @property
    def primary_metric(self) -> str:
        """The metric the task is judged by (``top1`` or ``map``)."""
        return PRIMARY_METRIC[self.kind]

    def ids(self) -> list[int]:
        """Image id of every sample, in data order (0..N-1 for classification)."""
        if self.image_ids is not None:
            return list(self.image_ids)
        if self.coco is not None:
            return [image["id"] for image in self.coco["images"]]
        return list(range(len(self.labels)))

    def check_samples(self, num_samples: int) -> None:
        """Raise DataError unless the ground truth covers `num_samples` samples."""
        have = len(self.labels) if self.kind == "classification" else len(self.ids())
        if have < num_samples:
            raise DataError(
                f"the data has {num_samples} samples but the {self.kind} ground truth covers "
                f"only {have}; pass as many labels/images as samples (or --max-samples {have})."
            )

    def score(self) -> TaskScore:
        """A fresh streaming score of this task."""
        return TaskScore(self)


class TaskScore:
    """Streaming task score of one stage: top-k hit counts, or the detections so far.

    ``update(outputs, start, stop)`` folds the raw outputs of samples
    ``start:stop``; ``result()`` scores the samples seen so far.
    """

    def __init__(self, task: Task):
        self.task = task
        self.hits: dict[str, float] = {}
        self.count = 0
        self.detections: list = []
        self.seen_ids: list[int] = []

    def update(self, outputs: Mapping[str, np.ndarray], start: int, stop: int) -> None:
        """Fold the raw outputs (by output name) of samples `start:stop`."""
        ids = self.task.ids()[start:stop]
        predicted = self.task.postprocess(dict(outputs), ids)
        if self.task.kind == "classification":
            batch = topk_accuracy(predicted, np.asarray(self.task.labels)[start:stop])
            for key, value in batch.items():
                self.hits[key] = self.hits.get(key, 0.0) + value * (stop - start)
        else:
            self.detections.extend(predicted)
        self.seen_ids.extend(ids)
        self.count += stop - start

    def result(self) -> dict:
        """The metrics of the samples seen (classification: top-k; detection: COCO mAP)."""
        if self.task.kind == "classification":
            return {key: value / self.count for key, value in self.hits.items()}
        ids = set(self.seen_ids)
        coco = self.task.coco
        # Scored against the images actually evaluated (--max-samples may cut the set).
        ground_truth = {
            "images": [i for i in coco["images"] if i["id"] in ids],
            "annotations": [a for a in coco["annotations"] if a["image_id"] in ids],
            "categories": coco["categories"],
        }
        return coco_map(ground_truth, self.detections)


def coco_map_resampler(coco_gt: Mapping, detections: Sequence[Mapping],
                       image_ids: Sequence[int], key: str = "map",
                       ) -> Callable[[np.ndarray], float]:
    """``score(positions) -> mAP`` of the images ``image_ids[positions]`` (repeats count
    again): COCOeval's per-image matching runs once, only the accumulation per call.

    Matching is per image and category, so a bootstrap resample of images is an
    accumulation over their stored per-image results; ``score(arange(N))`` equals
    :func:`coco_map`'s `key` ("map": @[.5:.95], "map50": @.5) of all images, -1 where
    no image picked has ground truth (COCOeval's "absent").
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth = COCO()
        ground_truth.dataset = {key: list(coco_gt[key])
                                for key in ("images", "annotations", "categories")}
        ground_truth.createIndex()
        if not detections:
            return lambda positions: 0.0
        evaluator = COCOeval(ground_truth, ground_truth.loadRes([dict(d) for d in detections]),
                             iouType="bbox")
        evaluator.evaluate()
    stored, params = evaluator.evalImgs, evaluator._paramsEval
    sorted_ids = list(params.imgIds)
    position = {image: i for i, image in enumerate(sorted_ids)}
    columns = np.array([position[image] for image in image_ids])
    # evalImgs is laid out category, area range, image; stats[0] of COCOeval.summarize reads
    # area "all" (index 0) at the most detections (the last limit) only.
    stride = len(params.areaRng) * len(sorted_ids)
    recalls, most = np.asarray(params.recThrs), params.maxDets[-1]
    thresholds = (slice(None) if key == "map" else
                  np.flatnonzero(np.isclose(params.iouThrs, COCO_IOU[key])))

    per_category = [_CategoryMatches([stored[k * stride + i] for i in range(len(sorted_ids))],
                                     most) for k in range(len(params.catIds))]

    def score(positions: np.ndarray) -> float:
        picked = columns[np.asarray(positions)]
        found = [p[thresholds] for p in (c.precision(picked, recalls) for c in per_category)
                 if p is not None]
        return float(np.mean(found)) if found else -1.0

    return score


class _CategoryMatches:
    """COCOeval's per-image results of one category (``entries[i]``: image i's, None where it
    has neither ground truth nor detections), their first `most` detections flattened once so
    that a resample of images is an index, not a concatenation of a dict per image."""

    def __init__(self, entries: Sequence[Mapping | None], most: int):
        self.present = np.array([e is not None for e in entries])
        kept = [e for e in entries if e is not None]
        self.ground_truth = np.zeros(len(entries), np.int64)
        self.length = np.zeros(len(entries), np.int64)
        self.ground_truth[self.present] = [np.count_nonzero(np.asarray(e["gtIgnore"]) == 0)
                                           for e in kept]
        self.length[self.present] = [len(e["dtScores"][:most]) for e in kept]
        self.start = np.cumsum(self.length) - self.length
        thresholds = len(kept[0]["dtMatches"]) if kept else 0
        self.scores = np.concatenate([np.asarray(e["dtScores"][:most], np.float64)
                                      for e in kept] or [np.zeros(0)])
        self.matched, self.ignored = (np.concatenate(
            [np.asarray(e[key])[:, :most].astype(bool) for e in kept] or
            [np.zeros((thresholds, 0), bool)], axis=1) for key in ("dtMatches", "dtIgnore"))

    def precision(self, picked: np.ndarray, recalls: np.ndarray) -> np.ndarray | None:
        """Interpolated precision (IoU thresholds x `recalls`) over the images `picked`
        (repeats count again): COCOeval.accumulate's arithmetic, vectorized over detections
        (it loops over them in Python). None where COCOeval leaves the category out (no
        image, no ground truth that is not ignored)."""
        ground_truth = int(self.ground_truth[picked].sum())
        if not self.present[picked].any() or ground_truth == 0:
            return None
        lengths = self.length[picked]
        index = (np.arange(lengths.sum()) + np.repeat(self.start[picked] - np.cumsum(lengths)
                                                      + lengths, lengths))
        # COCOeval's (Matlab's) stable order: tied scores keep the images' order.
        index = index[np.argsort(-self.scores[index], kind="mergesort")]
        matched, counted = self.matched[:, index], ~self.ignored[:, index]
        true = np.cumsum(matched & counted, axis=1, dtype=float)
        false = np.cumsum(~matched & counted, axis=1, dtype=float)
        recall = true / ground_truth
        precision = true / (false + true + np.spacing(1))
        # The precision envelope: the best precision at this recall or beyond.
        precision = np.maximum.accumulate(precision[:, ::-1], axis=1)[:, ::-1]
        result = np.zeros((len(recall), len(recalls)))
        for t in range(len(recall)):
            at = np.searchsorted(recall[t], recalls, side="left")
            inside = at < recall.shape[1]
            result[t, inside] = precision[t, at[inside]]
        return result


def batch_length(batch: Mapping[str, np.ndarray], batches=None) -> int:
    """Samples in `batch`: by the source's sample axes when it knows them, else axis 0."""
    if hasattr(batches, "length"):
        return batches.length(batch)
    return len(next(iter(batch.values())))


def evaluate(
    task: Task,
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
    batches: Iterable[Mapping[str, np.ndarray]],
    progress: Callable | None = None,
) -> dict:
    """Run `run` (a backend's ``run``) over `batches` and score `task` on its outputs.

    `batches` is a :class:`quantlab.data.BatchSource` or any iterable of batch
    dicts, in data order. Post-processing runs per batch, so only predictions
    (not raw outputs) are kept.
    """
    score = task.score()
    start = 0
    for batch in progress(batches) if progress else batches:
        stop = start + batch_length(batch, batches)
        score.update(run(dict(batch)), start, stop)
        start = stop
    return score.result()


def zoo_batches(zoo_model, eval_set, batch_size: int = 32):
    """The batches of a zoo evaluation set, ``{input name: samples}``, in order."""
    for start in range(0, len(eval_set.inputs), batch_size):
        yield {zoo_model.input_name: eval_set.inputs[start:start + batch_size]}
