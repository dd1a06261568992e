"""benchmarks.planner_metrics' yolo F1 (the real-model suite's decode-and-match metric):
its decoding against hand-placed boxes and a loop-by-loop NMS, its counts on a case with
known TP/FP/FN, and its two forms against each other; the same for the text detector's
binarized-map F1."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.planner_metrics import (
    TextMapF1,
    YoloF1,
    text_map_counts,
    text_map_f1,
    yolo_detections,
    yolo_f1,
    yolo_matches,
    yolo_records,
)

CLASSES = 18
ANCHORS = 2100


def output(boxes: list[tuple[float, float, float, float, int, float]]) -> np.ndarray:
    """``output0`` [1, 22, 2100] holding `boxes` (centre x, centre y, w, h, class, score) on
    their own anchors and near-zero probabilities elsewhere."""
    rows = np.zeros((ANCHORS, 4 + CLASSES), np.float32)
    rows[:, :4] = (160, 160, 10, 10)
    rows[:, 4:] = 0.01
    for anchor, (cx, cy, w, h, label, score) in enumerate(boxes):
        rows[anchor, :4] = (cx, cy, w, h)
        rows[anchor, 4 + label] = score
    return rows.T[None]


def corners(cx, cy, w, h):
    """x1 y1 x2 y2 as nudenet's _postprocess makes them on a 320x320 image, one by one."""
    x, y = max(0, min(cx - w / 2, 320)), max(0, min(cy - h / 2, 320))
    w, h = min(w, 320 - x), min(h, 320 - y)
    return [x, y, x + w, y + h]


# FP32 (reference): A and C are class 1 (FACE_FEMALE), B class 12 (FACE_MALE).
REFERENCE = [(70, 70, 40, 40, 1, 0.9), (230, 230, 60, 60, 12, 0.8), (265, 75, 30, 30, 1, 0.7)]
CANDIDATE = [
    (72, 71, 40, 40, 1, 0.85),   # A moved 2 px: IoU 0.90, same class -> TP
    (70, 72, 40, 40, 7, 0.6),    # A's duplicate, another class: IoU 0.90 > 0.45, NMS drops it
    (230, 230, 60, 60, 1, 0.8),  # B's place, wrong class -> FP (and B is missed: FN)
    (285, 95, 30, 30, 1, 0.7),   # C moved 20 px each way: IoU 0.05 -> FP (C: FN)
    (100, 260, 50, 40, 9, 0.5),  # nothing there in FP32 -> FP
    (160, 40, 30, 30, 1, 0.22),  # >= nudenet's 0.2 pre-filter, < NMS's 0.25: dropped
]


def test_decoding_keeps_the_boxes_nudenet_keeps():
    boxes, scores, classes = yolo_detections(output(CANDIDATE))
    expected = [CANDIDATE[i] for i in (0, 2, 3, 4)]  # by score, stable on the tie
    np.testing.assert_allclose(boxes, [corners(*b[:4]) for b in expected], atol=1e-4)
    np.testing.assert_allclose(scores, [b[5] for b in expected], atol=1e-6)
    assert classes.tolist() == [b[4] for b in expected]
    # nudenet clips the top-left corner into the image and then the width and height to
    # what is left of it: a box hanging off the left keeps its width.
    boxes, _, _ = yolo_detections(output([(10, 310, 40, 40, 1, 0.9)]))
    np.testing.assert_allclose(boxes, [[0, 290, 40, 320]], atol=1e-4)


def test_known_true_false_positives_and_misses():
    candidate, reference = yolo_detections(output(CANDIDATE)), yolo_detections(output(REFERENCE))
    assert yolo_matches(candidate, reference) == (1, 3, 2)
    outputs, references = [{"output0": output(CANDIDATE)}], [{"output0": output(REFERENCE)}]
    assert yolo_f1(outputs, references) == pytest.approx(2 / 7, abs=1e-15)
    assert YoloF1().record(outputs[0], references[0]) == (1, 3, 2)
    # Against itself: every box a true positive, F1 1.0; nothing on both sides is agreement.
    assert yolo_f1(references, references) == 1.0
    empty = [{"output0": output([])}]
    assert yolo_records(empty, empty) == [(0, 0, 0)] and yolo_f1(empty, empty) == 1.0
    assert yolo_f1(empty, references) == 0.0


def slow_nms(boxes: np.ndarray, scores: np.ndarray) -> list[int]:
    """OpenCV's NMSBoxes written out box by box: scores >= 0.25 sorted stably (descending),
    a box kept unless its IoU with a kept one exceeds 0.45."""
    order = sorted((i for i in range(len(scores)) if scores[i] >= 0.25), key=lambda i: -scores[i])
    kept: list[int] = []
    for i in order:
        x1, y1, x2, y2 = boxes[i]
        ok = True
        for j in kept:
            a1, b1, a2, b2 = boxes[j]
            inter = max(0.0, min(x2, a2) - max(x1, a1)) * max(0.0, min(y2, b2) - max(y1, b1))
            union = (x2 - x1) * (y2 - y1) + (a2 - a1) * (b2 - b1) - inter
            ok = ok and inter / union <= 0.45
        if ok:
            kept.append(i)
    return kept


def test_vectorized_nms_equals_a_box_by_box_one():
    rng = np.random.default_rng(7)
    for _ in range(5):
        count = 300
        centres = rng.uniform(20, 300, (count, 2))
        sizes = rng.uniform(8, 80, (count, 2))
        labels = rng.integers(0, CLASSES, count)
        scores = np.round(rng.uniform(0.1, 0.95, count), 2)  # ties on purpose
        rows = [(*c, *s, int(k), float(p)) for c, s, k, p in
                zip(centres, sizes, labels, scores, strict=True)]
        boxes, got, classes = yolo_detections(output(rows))
        clipped = np.array([corners(*np.float32(r[:4]).tolist()) for r in rows])
        kept = slow_nms(clipped, np.float32(scores).astype(np.float64))
        np.testing.assert_allclose(boxes, clipped[kept], atol=1e-4)
        assert classes.tolist() == labels[kept].tolist()


def test_two_part_score_of_records_equals_the_function_bit_for_bit():
    """Batches of several samples, split into records, pooled in any order: the same F1."""
    rng = np.random.default_rng(11)

    def jittered(rows, spread):
        return [(cx + rng.normal(0, spread), cy + rng.normal(0, spread), w, h,
                 label if rng.random() > 0.1 else int(rng.integers(CLASSES)),
                 min(0.99, score + rng.normal(0, 0.1))) for cx, cy, w, h, label, score in rows]

    scenes = [[(*rng.uniform(30, 290, 2), *rng.uniform(20, 90, 2), int(rng.integers(3)),
                float(rng.uniform(0.3, 0.95))) for _ in range(int(rng.integers(0, 6)))]
              for _ in range(12)]
    references = [{"output0": np.concatenate([output(s) for s in scenes[i:i + 4]])}
                  for i in range(0, 12, 4)]
    outputs = [{"output0": np.concatenate([output(jittered(s, 6)) for s in scenes[i:i + 4]])}
               for i in range(0, 12, 4)]
    metric = YoloF1()
    records = [metric.record({"output0": o["output0"][k:k + 1]},
                             {"output0": r["output0"][k:k + 1]})
               for o, r in zip(outputs, references, strict=True) for k in range(4)]
    whole = yolo_f1(outputs, references)
    assert 0 < whole < 1
    assert metric.score(records) == whole
    assert metric.score(records[::-1]) == whole
    pick = rng.integers(0, 12, 12)  # a bootstrap resample: repeats count again
    per_sample = [{"output0": o["output0"][k:k + 1]} for o in outputs for k in range(4)]
    per_truth = [{"output0": r["output0"][k:k + 1]} for r in references for k in range(4)]
    assert metric.score([records[i] for i in pick]) == yolo_f1(
        [per_sample[i] for i in pick], [per_truth[i] for i in pick])


# ------------------------------------------------------------ the text detector's map F1


def test_map_counts_on_a_hand_made_map():
    """FP32 text on rows 0-1 (8 pixels), the candidate's on rows 1-2: row 1 is TP (4), row 2
    FP (4), row 0 FN (4); a pixel at exactly 0.3 is not text (DB keeps > 0.3)."""
    reference = np.zeros((1, 1, 4, 4), np.float32)
    reference[..., :2, :] = 0.9
    candidate = np.zeros_like(reference)
    candidate[..., 1:3, :] = 0.6
    candidate[..., 3, 0] = 0.3
    reference[..., 3, 1] = np.float32(0.3)
    assert text_map_counts(candidate, reference) == (4, 4, 4)
    candidate[..., 3, 0] = np.nextafter(np.float32(0.3), np.float32(1))
    assert text_map_counts(candidate, reference) == (4, 5, 4)
    outputs, references = [{"map": candidate}], [{"map": reference}]
    assert TextMapF1().record(outputs[0], references[0]) == (4, 5, 4)
    assert text_map_f1(outputs, references) == pytest.approx(8 / 17, abs=1e-15)


def slow_counts(output: np.ndarray, reference: np.ndarray) -> tuple[int, int, int]:
    """TP, FP, FN pixel by pixel, in Python floats."""
    tp = fp = fn = 0
    for got, want in zip(output.ravel().tolist(), reference.ravel().tolist(), strict=True):
        tp += got > 0.3 and want > 0.3
        fp += got > 0.3 and not want > 0.3
        fn += want > 0.3 and not got > 0.3
    return tp, fp, fn


def text_maps(rng: np.random.Generator, count: int) -> np.ndarray:
    """DB-like maps [count, 1, 24, 32]: near 0 off the text, near 1 on a few text lines."""
    maps = rng.uniform(0, 0.05, (count, 1, 24, 32))
    for sample in maps:
        for _ in range(int(rng.integers(0, 4))):
            row, col = int(rng.integers(0, 22)), int(rng.integers(0, 20))
            sample[0, row:row + 3, col:col + int(rng.integers(4, 13))] = rng.uniform(0.7, 1)
    return maps.astype(np.float32)


def test_map_f1_two_parts_equal_the_function_and_a_pixel_by_pixel_count():
    """Batches of 4 maps, the candidate's noisy near the threshold: every record equals the
    slow count, the pooled records score the function's F1 bit for bit (in any order and on
    a bootstrap resample), and FP32 against itself scores 1.0."""
    rng = np.random.default_rng(12)
    fp32 = text_maps(rng, 12)
    int8 = np.clip(fp32 + rng.normal(0, 0.2, fp32.shape), 0, 1).astype(np.float32)
    references = [{"sigmoid_0.tmp_0": fp32[i:i + 4]} for i in range(0, 12, 4)]
    outputs = [{"sigmoid_0.tmp_0": int8[i:i + 4]} for i in range(0, 12, 4)]
    metric = TextMapF1()
    records = [metric.record({"sigmoid_0.tmp_0": int8[k:k + 1]},
                             {"sigmoid_0.tmp_0": fp32[k:k + 1]}) for k in range(12)]
    assert records == [slow_counts(int8[k], fp32[k]) for k in range(12)]
    whole = text_map_f1(outputs, references)
    assert 0 < whole < 1
    assert metric.score(records) == whole
    assert metric.score(records[::-1]) == whole
    pick = rng.integers(0, 12, 12)
    assert metric.score([records[i] for i in pick]) == text_map_f1(
        [{"sigmoid_0.tmp_0": int8[i:i + 1]} for i in pick],
        [{"sigmoid_0.tmp_0": fp32[i:i + 1]} for i in pick])
    assert text_map_f1(references, references) == 1.0
    blank = [{"sigmoid_0.tmp_0": np.zeros_like(fp32[:4])}]
    assert text_map_f1(blank, blank) == 1.0 and text_map_f1(blank, references[:1]) == 0.0
