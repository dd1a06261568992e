"""Tests of quantlab.zoo: dataset generator, splits, registry and the shipped models' accuracy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantlab import zoo
from quantlab.errors import ConfigError, DataError
from quantlab.evaluation import tasks
from quantlab.zoo import digits, shapes, shapes_det


def run(model: torch.nn.Module, inputs: np.ndarray) -> tuple[np.ndarray, ...]:
    with torch.no_grad():
        out = model(torch.from_numpy(inputs))
    return tuple(o.numpy() for o in (out if isinstance(out, tuple) else (out,)))


def test_generator_is_deterministic_and_seed_dependent():
    image_a, objects_a = shapes.generate(shapes.EVAL_SEED, 7)
    image_b, objects_b = shapes.generate(shapes.EVAL_SEED, 7)
    assert np.array_equal(image_a, image_b) and objects_a == objects_b
    image_c, _ = shapes.generate(shapes.CALIBRATION_SEED, 7)
    assert not np.array_equal(image_a, image_c)


def test_ground_truth_boxes_are_tight(monkeypatch):
    # On a blank background without noise, every drawn pixel is inside some GT box, and in
    # single-object images the box is exactly the extent of the nonzero pixels.
    monkeypatch.setattr(shapes, "_background", lambda rng: np.zeros((128, 128, 3), np.float32))
    monkeypatch.setattr(shapes, "NOISE_STD_RANGE", (0.0, 0.0))
    single = 0
    for index in range(150):
        image, objects = shapes.generate(shapes.TRAIN_SEED, index)
        drawn = image.max(-1) > 0
        covered = np.zeros_like(drawn)
        for obj in objects:
            x, y, w, h = (int(v) for v in obj["bbox"])
            covered[y:y + h, x:x + w] = True
        assert not np.any(drawn & ~covered)
        if len(objects) == 1:
            rows, cols = np.nonzero(drawn)
            x, y, w, h = objects[0]["bbox"]
            assert (cols.min(), rows.min(), cols.max() + 1, rows.max() + 1) == (x, y, x + w, y + h)
            single += 1
    assert single >= 10


def test_coco_ground_truth_is_well_formed():
    _, coco = shapes.make_split(shapes.EVAL_SEED, 20)
    assert [c["name"] for c in coco["categories"]] == list(shapes.CATEGORIES)
    ids = {image["id"] for image in coco["images"]}
    for ann in coco["annotations"]:
        x, y, w, h = ann["bbox"]
        assert ann["image_id"] in ids and ann["iscrowd"] == 0 and ann["area"] == w * h
        assert 0 <= x and 0 <= y and x + w <= 128 and y + h <= 128 and min(w, h) >= 3


def test_calibration_and_eval_splits_are_disjoint():
    calibration = zoo.get("shapes-det").calibration_set()
    evaluation = zoo.get("shapes-det").eval_set().inputs
    assert calibration.shape == (512, 3, 128, 128) and evaluation.shape == (500, 3, 128, 128)
    assert not {a.tobytes() for a in calibration} & {a.tobytes() for a in evaluation}

    x_cal = zoo.get("digits-cnn").calibration_set()
    x_train, _ = digits.split("train")
    x_eval = zoo.get("digits-vit").eval_set().inputs
    assert x_cal.shape == (200, 1, 8, 8) and x_cal.dtype == np.float32
    assert len(x_train) + len(x_cal) + len(x_eval) == 1797
    # load_digits has a few exact duplicates, so compare sample indices, not pixels.
    from sklearn.datasets import load_digits

    order = np.random.default_rng(digits.SPLIT_SEED).permutation(1797)
    assert len(set(order[:1097]) | set(order[1097:1297]) | set(order[1297:])) == 1797
    assert np.array_equal(x_cal, (load_digits().images[order[1097:1297]] / 16.0)[:, None])


def test_calibration_files_match_the_generator():
    images, coco = shapes.read_coco_folder(zoo.calibration_root() / "shapes-det")
    expected_images, expected_coco = shapes.make_split(shapes.CALIBRATION_SEED, 3)
    assert np.array_equal(images[:3], expected_images)
    assert coco["annotations"][:5] == expected_coco["annotations"][:5]


def test_missing_calibration_folder_raises_data_error(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTLAB_CALIBRATION_DATA", str(tmp_path / "absent"))
    with pytest.raises(DataError, match="absent"):
        zoo.get("digits-cnn").calibration_set()


def test_unknown_model_raises_config_error_naming_valid_names():
    with pytest.raises(ConfigError, match="shapes-det"):
        zoo.get("nope")


def test_decode_recovers_a_planted_box():
    scores = np.zeros((1, len(shapes.CATEGORIES), 32, 32), np.float32)
    boxes = np.zeros((1, 4, 32, 32), np.float32)
    scores[0, 2, 10, 5] = 0.9  # cell centre (22, 42)
    boxes[0, :, 10, 5] = [12.0, 2.0, 8.0, 10.0]
    detections = shapes_det.decode(scores, boxes, [17])
    assert detections == [{"image_id": 17, "category_id": 3, "bbox": [10.0, 40.0, 20.0, 12.0],
                           "score": pytest.approx(0.9)}]


def test_classwise_nms_equals_torchvision_batched_nms():
    """The numpy NMS of decode keeps what torchvision.ops.batched_nms keeps, in its order:
    random boxes in clusters (many overlaps near the threshold), 3 classes, duplicates,
    boxes inside others and empty boxes; distinct scores (tied ones may be ordered either
    way by torch's sort)."""
    import torchvision

    rng = np.random.default_rng(11)
    for trial in range(200):
        count = int(rng.integers(0, 60))
        centres = rng.uniform(0, 128, (count, 2)) if trial % 2 else \
            rng.uniform(40, 60, (count, 2))  # crowded: most pairs overlap
        sizes = rng.uniform(0, 30, (count, 2)) * (rng.random((count, 1)) > 0.05)
        xyxy = np.concatenate([centres - sizes / 2, centres + sizes / 2], 1).astype(np.float32)
        if count > 3:
            xyxy[1] = xyxy[0]  # a duplicate
        classes = rng.integers(0, 3, count)
        scores = np.sort(rng.permutation(count * 7)[:count].astype(np.float32))[::-1] / (count * 7)
        threshold = float(rng.choice([0.3, 0.5, 0.6]))
        expected = torchvision.ops.batched_nms(torch.from_numpy(xyxy), torch.from_numpy(
            scores.copy()), torch.from_numpy(classes), threshold).numpy()
        assert shapes_det.classwise_nms(xyxy, classes, threshold).tolist() == expected.tolist()


@pytest.mark.parametrize(("name", "threshold"), [("digits-cnn", 0.97), ("digits-vit", 0.93)])
def test_digits_models_meet_their_accuracy(name, threshold):
    entry = zoo.get(name)
    data = entry.eval_set()
    (logits,) = run(entry.build(), data.inputs)
    logits = entry.postprocess({"logits": logits}, data.image_ids)
    assert len(data.labels) == 500
    assert (logits.argmax(1) == data.labels).mean() >= threshold


def test_shapes_det_meets_its_map_on_the_held_out_split():
    entry = zoo.get("shapes-det")
    data = entry.eval_set()
    assert len(data.inputs) >= 500
    scores, boxes = run(entry.build(), data.inputs)
    detections = entry.postprocess({"scores": scores, "boxes": boxes}, data.image_ids)
    metrics = tasks.coco_map(data.coco, detections)
    # The zoo's stated bar: COCO mAP@[.5:.95] >= 0.50 and mAP@.5 >= 0.85, pycocotools as referee.
    assert metrics["map"] >= 0.50 and metrics["map50"] >= 0.85


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_onnx_export_matches_torch(tmp_path, name):
    onnxruntime = pytest.importorskip("onnxruntime")
    entry = zoo.get(name)
    model = entry.build()
    x = entry.calibration_set()[:3]
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (torch.from_numpy(x[:1]),), path, dynamo=True, opset_version=18,
                      input_names=[entry.input_name], output_names=list(entry.output_names),
                      dynamic_shapes=({0: "batch"},))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    actual_outputs = session.run(list(entry.output_names), {entry.input_name: x})
    for expected, actual in zip(run(model, x), actual_outputs, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)
