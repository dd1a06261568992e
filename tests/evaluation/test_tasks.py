"""Task metrics against hand-computed values and a brute-force top-k."""

import numpy as np
import pytest

from quantlab.errors import DataError
from quantlab.evaluation.tasks import coco_map, coco_map_resampler, topk_accuracy


def _coco(boxes_per_image):
    images, annotations = [], []
    for image_id, boxes in enumerate(boxes_per_image, start=1):
        images.append({"id": image_id, "width": 100, "height": 100, "file_name": f"{image_id}.png"})
        for box in boxes:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": 1,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    return {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": 1, "name": "square"}],
    }


def _det(image_id, box, score):
    return {"image_id": image_id, "category_id": 1, "bbox": box, "score": score}


def test_perfect_detections_score_one():
    gt = _coco([[[10, 10, 30, 30]], [[50, 40, 20, 25]]])
    result = coco_map(gt, [_det(1, [10, 10, 30, 30], 0.9), _det(2, [50, 40, 20, 25], 0.8)])
    assert result["map"] == pytest.approx(1.0)
    assert result["per_class"]["square"] == pytest.approx(1.0)


def test_iou_062_counts_at_three_of_ten_thresholds():
    # GT 20x20; detection 20x12.4 inside it: IoU = 248/400 = 0.62, so it matches at
    # IoU thresholds .50, .55, .60 and misses at .65 ... .95: mAP@[.5:.95] = 3/10.
    gt = _coco([[[10, 10, 20, 20]]])
    result = coco_map(gt, [_det(1, [10, 10, 20, 12.4], 0.9)])
    assert result["map50"] == pytest.approx(1.0)
    assert result["map75"] == pytest.approx(0.0)
    assert result["map"] == pytest.approx(0.3)


def test_false_positive_between_true_positives():
    # Ranked: TP, FP, TP over two GT boxes. Precision 1 up to recall .5, then 2/3 up to
    # recall 1; COCO's 101-point interpolation: (51 * 1 + 50 * 2/3) / 101.
    gt = _coco([[[10, 10, 20, 20], [60, 60, 20, 20]]])
    dets = [
        _det(1, [10, 10, 20, 20], 0.9),
        _det(1, [35, 80, 10, 10], 0.8),
        _det(1, [60, 60, 20, 20], 0.7),
    ]
    assert coco_map(gt, dets)["map"] == pytest.approx((51 + 50 * 2 / 3) / 101)


def test_no_detections_score_zero():
    assert coco_map(_coco([[[10, 10, 20, 20]]]), [])["map"] == 0.0


def test_topk_matches_brute_force():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((300, 10))
    labels = rng.integers(0, 10, 300)
    result = topk_accuracy(logits, labels, ks=(1, 3, 5))
    for k in (1, 3, 5):
        expected = np.mean([labels[i] in np.argsort(-logits[i])[:k] for i in range(300)])
        assert result[f"top{k}"] == pytest.approx(expected)


def test_topk_rejects_mismatched_labels():
    with pytest.raises(DataError, match="labels"):
        topk_accuracy(np.zeros((4, 10)), np.zeros(5, dtype=int))


def test_coco_map_resampler_equals_coco_map_with_repeated_images():
    boxes = [[[10, 10, 20, 20]], [[50, 40, 20, 25], [5, 5, 10, 10]], [[30, 30, 40, 40]]]
    dets = [_det(1, [10, 10, 20, 12.4], 0.9), _det(2, [50, 40, 20, 25], 0.8),
            _det(2, [70, 70, 10, 10], 0.85), _det(3, [30, 30, 40, 40], 0.6)]
    score = coco_map_resampler(_coco(boxes), dets, [3, 1, 2])  # data order differs from ids
    assert score(np.arange(3)) == pytest.approx(coco_map(_coco(boxes), dets)["map"])
    # Positions [1, 1, 2] = images 1, 1, 2: coco_map of that set with the repeat renumbered.
    repeated = [boxes[0], boxes[0], boxes[1]]
    moved = {1: [1, 2], 2: [3]}
    dets_repeated = [{**d, "image_id": new} for d in dets if d["image_id"] in moved
                     for new in moved[d["image_id"]]]
    assert score(np.array([1, 1, 2])) == pytest.approx(
        coco_map(_coco(repeated), dets_repeated)["map"])
    assert coco_map_resampler(_coco(boxes), [], [1, 2, 3])(np.arange(3)) == 0.0


def test_coco_map_resampler_matches_cocoeval_on_many_detections_and_categories():
    # The resampler accumulates COCOeval's per-image matches itself (vectorized over
    # detections); pycocotools' own evaluation of the resampled set, renumbered, is the
    # reference: three categories (one without ground truth), crowd boxes, misses, ties.
    rng = np.random.default_rng(3)
    images, annotations, dets = [], [], []
    for image_id in range(1, 41):
        images.append({"id": image_id, "width": 200, "height": 200, "file_name": f"{image_id}"})
        for _ in range(rng.integers(0, 4)):
            box = [float(v) for v in rng.uniform(0, 120, 2)] + \
                  [float(v) for v in rng.uniform(8, 80, 2)]
            category = int(rng.integers(1, 3))
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": category, "bbox": box,
                                "area": box[2] * box[3], "iscrowd": int(rng.random() < 0.05)})
            if rng.random() < 0.8:  # found, off by a few pixels, with a rounded (tied) score
                moved = [box[0] + rng.normal(0, 4), box[1] + rng.normal(0, 4), box[2], box[3]]
                dets.append({"image_id": image_id, "category_id": category, "bbox": moved,
                             "score": round(float(rng.random()), 1)})
        for _ in range(rng.integers(0, 3)):  # false positives, some of the empty category
            dets.append({"image_id": image_id, "category_id": int(rng.integers(1, 4)),
                         "bbox": [float(v) for v in rng.uniform(0, 150, 4)],
                         "score": float(rng.random())})
    coco = {"images": images, "annotations": annotations,
            "categories": [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)]}
    order = [image["id"] for image in images]  # tied scores keep COCOeval's image order
    scores = {key: coco_map_resampler(coco, dets, order, key)
              for key in ("map", "map50", "map75")}
    whole = coco_map(coco, dets)
    for key, score in scores.items():
        assert score(np.arange(40)) == pytest.approx(whole[key], abs=1e-12)
    positions = rng.integers(0, 40, 40)
    renumbered = {"images": [], "annotations": [], "categories": coco["categories"]}
    resampled = []
    for new_id, position in enumerate(positions, start=1):
        old_id = order[position]
        renumbered["images"].append({**images[old_id - 1], "id": new_id})
        renumbered["annotations"] += [{**a, "id": len(renumbered["annotations"]) + i + 1,
                                       "image_id": new_id}
                                      for i, a in enumerate(a for a in annotations
                                                            if a["image_id"] == old_id)]
        resampled += [{**d, "image_id": new_id} for d in dets if d["image_id"] == old_id]
    expected = coco_map(renumbered, resampled)
    for key, score in scores.items():
        assert score(positions) == pytest.approx(expected[key], abs=1e-12)


def test_benchmark_agreement_resampler_equals_agreement_map_of_the_resample():
    """benchmarks.planner_metrics' resampler (the layout metric's bootstrap) against its
    agreement_map of the resampled images listed out, repeats included, at both IoU keys;
    images without reference boxes score 100 when nothing is found there, else 0."""
    from benchmarks.planner_metrics import agreement_map, agreement_resampler

    rng = np.random.default_rng(5)
    reference, candidate = [], []
    for _ in range(12):
        corners = rng.uniform(0, 300, (int(rng.integers(0, 5)), 2))
        boxes = np.concatenate([corners, corners + rng.uniform(10, 90, corners.shape)], axis=1)
        labels = list(rng.integers(0, 4, len(boxes)))
        reference.append((boxes.tolist(), [1.0] * len(boxes), labels))
        moved = boxes + rng.normal(0, 3, boxes.shape)
        keep = rng.random(len(boxes)) < 0.85
        candidate.append((moved[keep].tolist(), list(rng.random(keep.sum())),
                          [label for label, k in zip(labels, keep, strict=True) if k]))
    reference[3] = candidate[3] = ([], [], [])  # a page without boxes
    for key in ("map", "map50"):
        score = agreement_resampler(candidate, reference, key)
        for positions in (np.arange(12), rng.integers(0, 12, 12), rng.integers(0, 12, 12)):
            expected = agreement_map([candidate[i] for i in positions],
                                     [reference[i] for i in positions], key)
            assert score(positions) == pytest.approx(expected, abs=1e-9)
    found = [([[1, 1, 9, 9]], [0.9], [0])] * 12
    assert agreement_resampler(found, reference)(np.array([3, 3])) == 0.0
    assert agreement_resampler(reference, reference)(np.array([3, 3])) == 100.0
