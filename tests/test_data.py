"""Batch sources: every supported format, preprocessing, and the errors for bad data."""

import json

import numpy as np
import pytest
from PIL import Image

from quantlab.backends.onnxruntime import OnnxRuntimeBackend
from quantlab.data import Preprocess, check_batch, open_data, scalar_arrays
from quantlab.errors import ConfigError, DataError
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


def _rgb_image(path, height, width, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels


def test_letterbox_keeps_the_aspect_ratio_and_pads_centred(tmp_path):
    # 20 x 40 image into 16 x 16: scaled to 8 x 16, 4 rows of padding above and below.
    pixels = _rgb_image(tmp_path / "imgs" / "a.png", 20, 40)
    pre = Preprocess(size=(16, 16), resize_mode="letterbox", pad_value=114, scale=1.0)
    spec = [TensorSpec("input", (None, 3, 16, 16), np.dtype(np.float32))]
    (batch,) = list(open_data(tmp_path / "imgs", spec, preprocess=pre))
    image = batch["input"][0]
    assert (image[:, :4] == 114).all() and (image[:, 12:] == 114).all()
    inner = np.asarray(Image.fromarray(pixels).resize((16, 8), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(image[:, 4:12].transpose(1, 2, 0), inner.astype(np.float32))


def test_center_crop_scales_the_short_side_then_crops(tmp_path):
    # ImageNet style: short side to 10, centre 8 x 8 crop of a 20 x 30 image (10 x 15 after).
    pixels = _rgb_image(tmp_path / "imgs" / "a.png", 20, 30)
    pre = Preprocess(size=(8, 8), resize_mode="center-crop", resize_short=10, scale=1.0,
                     interpolation="bicubic")
    (batch,) = list(open_data(tmp_path / "imgs", SPEC, preprocess=pre))
    scaled = np.asarray(Image.fromarray(pixels).resize((15, 10), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(batch["input"][0].transpose(1, 2, 0),
                                  scaled[1:9, 3:11].astype(np.float32))


@pytest.mark.parametrize("kwargs, message", [
    ({"mean": (0.5, 0.4)}, r"--mean has 2 value\(s\).*RGB has 3 channel"),
    ({"std": (0.2, 0.2, 0.2), "channel_order": "L"}, r"--std has 3 value\(s\).*L has 1 channel"),
    ({"size": (0, 0)}, "at least 1 pixel"),
    ({"resize_mode": "pad"}, "resize mode 'pad'"),
    ({"scale": float("nan")}, "finite"),
    ({"mean": (0.0, float("inf"), 0.0)}, "finite"),
])
def test_preprocessing_options_are_checked_when_given(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Preprocess(**kwargs)


def test_preprocess_round_trips_through_its_record():
    pre = Preprocess(size=(224, 224), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                     channel_order="BGR", resize_mode="center-crop", resize_short=256)
    assert Preprocess.from_dict(json.loads(json.dumps(pre.to_dict()))) == pre


@pytest.mark.parametrize("content, message", [
    (b"just some text\n", "not a NumPy array file of numbers"),
    (None, "holds Python objects"),
])
def test_npy_that_is_text_or_objects_is_refused_without_unpickling(tmp_path, content, message):
    path = tmp_path / "x.npy"
    if content is None:
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        open_data(path, SPEC)
    assert "allow_pickle" not in str(info.value)


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.complex64])
def test_non_float_npy_for_a_float_input_is_refused(tmp_path, dtype):
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 8, 8), dtype))
    with pytest.raises(DataError, match=f"'input' is float32 but the data is {np.dtype(dtype)}"):
        open_data(tmp_path / "x.npy", SPEC)


def test_iterable_of_torch_tensors_and_batches_of_different_shapes():
    import torch

    batches = [torch.zeros(2, 3, 8, 8), torch.ones(1, 3, 8, 8)]
    source = open_data(iter(batches), SPEC, batch_size=8)
    assert source.num_samples == 3
    with pytest.raises(DataError, match=r"batch 1 gives input 'input' shape \(1, 3, 8, 9\)"):
        open_data(iter([np.zeros((2, 3, 8, 8), np.float32), np.zeros((1, 3, 8, 9), np.float32)]),
                  SPEC)


@pytest.mark.parametrize("batch_size", [2.5, True, "4"])
def test_batch_size_must_be_a_whole_number(tmp_path, batch_size):
    with pytest.raises(ConfigError, match="whole number"):
        open_data(np.zeros((2, 3, 8, 8), np.float32), SPEC, batch_size=batch_size)


def test_scalar_arrays_of_an_npz_read_headers_and_match_loading_every_member(tmp_path):
    # The 0-d members are found from each member's header; what np.load gives for them, for
    # every header version (3.0 has no public reader, so that member is loaded instead).
    import zipfile

    path = tmp_path / "d.npz"
    np.savez(path, x=np.ones((4, 3), np.float32), sr=np.int64(16000), gain=np.float32(0.5))
    with zipfile.ZipFile(path, "a") as archive:
        for name, value, version in (("v2", np.int32(7), (2, 0)), ("v3", np.int8(3), (3, 0)),
                                     ("rows", np.arange(5), (3, 0))):
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, np.asarray(value), version=version)
    with np.load(path) as archive:
        expected = {k: archive[k] for k in archive.files if archive[k].ndim == 0}
    found = scalar_arrays(path)
    assert sorted(found) == sorted(expected) == ["gain", "sr", "v2", "v3"]
    assert all(found[k] == expected[k] and found[k].dtype == expected[k].dtype for k in found)
