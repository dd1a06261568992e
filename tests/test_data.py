"""Batch sources: every supported format, preprocessing, and the errors for bad data."""

import json

import numpy as np
import pytest
from PIL import Image

from quantlab.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.data import Preprocess, check_batch, open_data
from quantlab.errors import DataError
from quantlab.graph import TensorSpec

SPEC = [TensorSpec("input", (None, 3, 8, 8), np.dtype(np.float32))]


def _write_images(folder, count, size=(8, 8)):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (count, size[0], size[1], 3), dtype=np.uint8)
    for i, image in enumerate(pixels):
        Image.fromarray(image).save(folder / f"img{i:03d}.png")
    return pixels


def test_npy_batches_cover_every_sample_once(tmp_path):
    data = np.random.default_rng(1).standard_normal((10, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", data)
    source = open_data(tmp_path / "x.npy", SPEC, batch_size=4)
    batches = [b["input"] for b in source]
    assert len(source) == 3 and [len(b) for b in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(batches), data)
    assert open_data(tmp_path / "x.npy", SPEC, batch_size=4, max_samples=5).num_samples == 5


def test_npy_with_wrong_shape_names_file_and_expected_shape(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((4, 8, 8, 3), np.float32))  # NHWC for an NCHW model
    with pytest.raises(DataError, match=r"bad\.npy.*\(4, 8, 8, 3\)|bad\.npy.*\(8, 8, 3\)"):
        open_data(tmp_path / "bad.npy", SPEC)


def test_npz_missing_input_is_named(tmp_path):
    np.savez(tmp_path / "d.npz", images=np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(DataError, match="'input'|input"):
        open_data(tmp_path / "d.npz", SPEC)


def test_image_folder_preprocessing_matches_manual(tmp_path):
    pixels = _write_images(tmp_path / "imgs", 3)
    pre = Preprocess(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    (batch,) = list(open_data(tmp_path / "imgs", SPEC, batch_size=8, preprocess=pre))
    manual = (pixels / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.2, 0.25, 0.3])
    # float32 arithmetic on values of magnitude <= 5: a few ulps.
    np.testing.assert_allclose(batch["input"], manual.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-5)
    bgr = next(iter(open_data(tmp_path / "imgs", SPEC, preprocess=Preprocess(channel_order="BGR"))))
    np.testing.assert_allclose(bgr["input"][:, 0], pixels[..., 2] / 255.0, atol=1e-6)


def test_image_folder_resizes_to_model_input(tmp_path):
    _write_images(tmp_path / "big", 2, size=(20, 30))
    batch = next(iter(open_data(tmp_path / "big", SPEC)))
    assert batch["input"].shape == (2, 3, 8, 8)


def test_empty_folder_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="contains no images"):
        open_data(tmp_path / "empty", SPEC)


def test_undecodable_image_is_named(tmp_path):
    _write_images(tmp_path / "imgs", 2)
    (tmp_path / "imgs" / "img001.png").write_bytes(b"not a png at all")
    source = open_data(tmp_path / "imgs", SPEC, batch_size=1)
    with pytest.raises(DataError, match="img001.png cannot be decoded"):
        list(source)


def test_coco_file_lists_its_images(tmp_path):
    _write_images(tmp_path / "images", 3)
    coco = {
        "images": [{"id": i, "file_name": f"img{i:03d}.png"} for i in (2, 0)],
        "annotations": [],
        "categories": [],
    }
    (tmp_path / "ann.json").write_text(json.dumps(coco))
    assert open_data(tmp_path / "ann.json", SPEC).num_samples == 2
    coco["images"].append({"id": 9, "file_name": "missing.png"})
    (tmp_path / "ann.json").write_text(json.dumps(coco))
    with pytest.raises(DataError, match="missing.png"):
        open_data(tmp_path / "ann.json", SPEC)


def test_unsupported_file_type(tmp_path):
    (tmp_path / "data.csv").write_text("1,2,3\n")
    with pytest.raises(DataError, match="unsupported type '.csv'"):
        open_data(tmp_path / "data.csv", SPEC)


def test_backend_rejects_batch_that_does_not_fit(tiny_model):
    model, _, _ = tiny_model
    backend = OnnxRuntimeBackend(model)
    with pytest.raises(DataError, match="expects"):
        backend.run({"input": np.zeros((2, 3, 32, 32), np.float32)})
    with pytest.raises(DataError, match="no array for model input 'input'"):
        check_batch({"x": np.zeros((1, 3, 16, 16))}, backend.inputs)
