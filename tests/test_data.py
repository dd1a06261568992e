"""Batch sources: every supported format, preprocessing, and the errors for bad data."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quantlab.data import (
    Preprocess,
    area_resize,
    check_batch,
    open_data,
    opencv_linear_resize,
    scalar_arrays,
)
from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
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


def _rss_file_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_a_pass_over_a_large_npy_does_not_keep_its_pages(tmp_path):
    """A .npy is memory-mapped; every batch is a copy and the file's pages are let go of,
    so a pass does not leave the whole file resident in the process (it counted in peak
    RSS: 630 MB for 128 images of 640 px). The batches still equal the file's samples."""
    rows = np.arange(48 * 3 * 256 * 256, dtype=np.float32).reshape(48, 3, 256, 256)  # 36 MiB
    np.save(tmp_path / "big.npy", rows)
    spec = [TensorSpec("input", (None, 3, 256, 256), np.dtype(np.float32))]
    before = _rss_file_kb()
    for i, batch in enumerate(open_data(tmp_path / "big.npy", spec, batch_size=8)):
        np.testing.assert_array_equal(batch["input"], rows[8 * i:8 * i + 8])
        assert batch["input"].flags.owndata
    # The file's 36 MiB would be resident after a pass over a plain mapping; allow 1/4 of it
    # (the last batch's pages are let go of too; the rest is whatever else the test maps).
    assert _rss_file_kb() - before < rows.nbytes / 1024 / 4


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


def test_image_folder_decodes_once_when_it_fits_and_on_every_pass_when_not(tmp_path,
                                                                          monkeypatch):
    """A folder whose preprocessed samples fit in IMAGE_CACHE_BYTES is decoded on the
    first pass only (the planner reads its data a dozen times); a larger one on every
    pass. Every pass yields the same batches, copies that the caller may change."""
    from quantlab import data

    _write_images(tmp_path / "imgs", 5)
    decoded = []
    apply = Preprocess.apply
    monkeypatch.setattr(Preprocess, "apply",
                        lambda self, path, size: decoded.append(path) or apply(self, path, size))
    # Opening the folder decodes its first image (its shape is checked).
    for limit, decodes in ((data.IMAGE_CACHE_BYTES, 5), (4 * 3 * 8 * 8 * 4, 1 + 5 * 3)):
        monkeypatch.setattr(data, "IMAGE_CACHE_BYTES", limit)
        decoded.clear()
        source = open_data(tmp_path / "imgs", SPEC, batch_size=2)
        passes = []
        for _ in range(3):
            passes.append(np.concatenate([b["input"] for b in source]))
            passes[-1] += 1.0  # the caller's own copy
        assert len(decoded) == decodes
        np.testing.assert_array_equal(passes[0], passes[2])


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


def _preprocessed(folder, pre, height, width, channels=3):
    spec = [TensorSpec("input", (None, channels, height, width), np.dtype(np.float32))]
    (batch,) = list(open_data(folder, spec, preprocess=pre))
    return batch["input"][0].transpose(1, 2, 0)


def test_pad_anchors_the_image_top_left_and_pads_bottom_and_right(tmp_path):
    # 4 x 8 into 8 x 8: already fits (scale 1), rows 4..7 are padding; 8 x 4 into 8 x 8:
    # columns 4..7. No resampling, so every pixel is known.
    wide = _rgb_image(tmp_path / "wide" / "a.png", 4, 8)
    tall = _rgb_image(tmp_path / "tall" / "a.png", 8, 4, seed=1)
    pre = Preprocess(size=(8, 8), resize_mode="pad", pad_value=7, scale=1.0)
    expected = np.full((8, 8, 3), 7.0, np.float32)
    expected[:4] = wide
    np.testing.assert_array_equal(_preprocessed(tmp_path / "wide", pre, 8, 8), expected)
    expected = np.full((8, 8, 3), 7.0, np.float32)
    expected[:, :4] = tall
    np.testing.assert_array_equal(_preprocessed(tmp_path / "tall", pre, 8, 8), expected)


def test_pad_scales_to_fit_as_letterbox_does_without_centring(tmp_path):
    # 20 x 40 into 16 x 24: scale 0.6 (width bound), 12 x 24 at the top, rows 12..15 padding.
    pixels = _rgb_image(tmp_path / "imgs" / "a.png", 20, 40)
    pre = Preprocess(size=(16, 24), resize_mode="pad", pad_value=0, scale=1.0)
    image = _preprocessed(tmp_path / "imgs", pre, 16, 24)
    inner = np.asarray(Image.fromarray(pixels).resize((24, 12), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(image[:12], inner.astype(np.float32))
    assert (image[12:] == 0).all()
    centred = _preprocessed(tmp_path / "imgs", Preprocess(
        size=(16, 24), resize_mode="letterbox", pad_value=0, scale=1.0), 16, 24)
    np.testing.assert_array_equal(centred[2:14], image[:12])


def paddle_resize_norm_img(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """PaddleOCR's recognizer preprocessing (ppocr/data/imaug/rec_img_aug.py
    resize_norm_img), with Pillow's bilinear filter for cv2.resize: HWC uint8 in, CHW out."""
    h, w = pixels.shape[:2]
    ratio = w / float(h)
    resized_w = width if np.ceil(height * ratio) > width else int(np.ceil(height * ratio))
    resized = np.asarray(Image.fromarray(pixels).resize((resized_w, height),
                                                         Image.Resampling.BILINEAR))
    resized = (resized.astype("float32").transpose((2, 0, 1)) / 255 - 0.5) / 0.5
    padded = np.zeros((3, height, width), dtype=np.float32)
    padded[:, :, :resized_w] = resized
    return padded


@pytest.mark.parametrize("size", [(10, 25), (10, 100), (48, 100), (30, 12)])
def test_height_pad_is_paddleocrs_recognizer_preprocessing(tmp_path, size):
    # (10, 25) -> width 50 of 64; (10, 100) -> wider than 64: squashed to 64; (48, 100):
    # 20 * (100 / 48) is 41.67, ceil 42; (30, 12) -> width 8.
    pixels = _rgb_image(tmp_path / "imgs" / "a.png", *size)
    pre = Preprocess(size=(20, 64), resize_mode="height-pad", pad_value=127.5,
                     mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    got = _preprocessed(tmp_path / "imgs", pre, 20, 64).transpose(2, 0, 1)
    want = paddle_resize_norm_img(pixels, 20, 64)
    np.testing.assert_allclose(got, want, atol=1e-6)
    columns = int(min(64, np.ceil(20 * size[1] / size[0])))
    assert np.abs(got[:, :, columns:]).max(initial=0.0) < 1e-6  # 127.5 is normalized 0
    assert np.abs(got[:, :, :columns]).max() > 0.1


def area_reference(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Area averaging written out: each output pixel's rectangle, each source pixel weighted by
    the area of its overlap with it (float64, one pixel at a time)."""
    in_h, in_w = pixels.shape[:2]
    out = np.zeros((height, width) + pixels.shape[2:])
    step_y, step_x = in_h / height, in_w / width
    for oy in range(height):
        for ox in range(width):
            y0, y1, x0, x1 = oy * step_y, (oy + 1) * step_y, ox * step_x, (ox + 1) * step_x
            total, weight = 0.0, 0.0
            for iy in range(int(np.floor(y0)), min(in_h, int(np.ceil(y1)))):
                for ix in range(int(np.floor(x0)), min(in_w, int(np.ceil(x1)))):
                    area = (min(y1, iy + 1) - max(y0, iy)) * (min(x1, ix + 1) - max(x0, ix))
                    total = total + area * pixels[iy, ix].astype(np.float64)
                    weight += area
            out[oy, ox] = total / weight
    return out


@pytest.mark.parametrize("shape, size", [
    ((12, 18, 3), (6, 9)),     # 2 x 2 blocks
    ((12, 18, 3), (4, 3)),     # 3 x 6 blocks
    ((12, 18), (3, 18)),       # 4 x 1, grayscale
    ((13, 17, 3), (5, 7)),     # fractional coverage
    ((7, 5, 3), (11, 8)),      # enlarging: still the mean of the area covered
])
def test_area_resize_equals_area_averaging_written_out(shape, size):
    pixels = np.random.default_rng(3).integers(0, 256, shape).astype(np.uint8)
    np.testing.assert_allclose(area_resize(pixels, *size), area_reference(pixels, *size),
                               rtol=0, atol=1e-9)


def test_area_interpolation_averages_whole_blocks_and_rounds_halves_up(tmp_path):
    # 4 x 4 -> 2 x 2: each output pixel is the mean of a 2 x 2 block (OpenCV INTER_AREA),
    # rounded to whole pixel values with halves up, as OpenCV's 8-bit 2x path does.
    blocks = np.array([[0, 1, 10, 10],
                       [0, 1, 10, 11],
                       [200, 200, 3, 4],
                       [201, 202, 5, 5]], np.uint8)
    (tmp_path / "imgs").mkdir()
    Image.fromarray(blocks).save(tmp_path / "imgs" / "a.png")
    pre = Preprocess(size=(2, 2), interpolation="area", channel_order="L", scale=1.0)
    image = _preprocessed(tmp_path / "imgs", pre, 2, 2, channels=1)[:, :, 0]
    # Means 0.5, 10.25, 200.75, 4.25.
    np.testing.assert_array_equal(image, [[1, 10], [201, 4]])


@pytest.mark.parametrize("kwargs, message", [
    ({"mean": (0.5, 0.4)}, r"--mean has 2 value\(s\).*RGB has 3 channel"),
    ({"std": (0.2, 0.2, 0.2), "channel_order": "L"}, r"--std has 3 value\(s\).*L has 1 channel"),
    ({"size": (0, 0)}, "at least 1 pixel"),
    ({"resize_mode": "pad-centre"}, "resize mode 'pad-centre'"),
    ({"interpolation": "cubic"}, "interpolation 'cubic'"),
    ({"pad_value": float("nan")}, "--pad-value must be a finite number"),
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
    for mode in ("pad", "height-pad"):
        pre = Preprocess(size=(48, 320), resize_mode=mode, pad_value=127.5,
                         interpolation="area")
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


@pytest.mark.parametrize(("shape", "size"), [
    ((97, 61, 3), (40, 23)),    # shrinking by non-integer factors: no antialiasing
    ((64, 48, 3), (32, 24)),    # by two exactly
    ((13, 17), (50, 31)),       # enlarging, grayscale
    ((600, 900, 3), (800, 608)),  # a page to the layout detector's input
])
def test_opencv_linear_resize_matches_opencv(shape, size):
    cv2 = pytest.importorskip("cv2", reason="opencv-python-headless is a dev dependency")
    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    got = opencv_linear_resize(pixels, *size)
    want = cv2.resize(pixels, size[::-1], interpolation=cv2.INTER_LINEAR)
    assert got.shape == want.shape and got.dtype == np.uint8
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_opencv_linear_interpolation_preprocesses_as_opencv_does(tmp_path):
    """--resize-mode pad with opencv-linear: the image as cv2.resize draws it, padded; Pillow's
    bilinear filter averages over the shrunk footprint and is off by many grey levels."""
    cv2 = pytest.importorskip("cv2", reason="opencv-python-headless is a dev dependency")
    rgb = _rgb_image(tmp_path / "imgs" / "a.png", 90, 60)
    pre = Preprocess(size=(40, 40), resize_mode="pad", pad_value=0, scale=1.0,
                     interpolation="opencv-linear")
    got = _preprocessed(tmp_path / "imgs", pre, 40, 40)
    want = np.zeros((40, 40, 3), np.float32)
    want[:, :27] = cv2.resize(rgb.astype(np.uint8), (27, 40), interpolation=cv2.INTER_LINEAR)
    assert np.abs(got - want).max() <= 1
    pillow = _preprocessed(tmp_path / "imgs", Preprocess(
        size=(40, 40), resize_mode="pad", pad_value=0, scale=1.0), 40, 40)
    assert np.abs(pillow - want).max() > 10


def test_a_subset_names_the_samples_of_the_data_it_was_cut_from():
    """calibrate reads its statistics in two shares (the equalization's first samples, then
    the rest): NaN in sample 70 is named as sample 70's batch, not as the share's."""
    arrays = np.ones((96, 2), np.float32)
    arrays[70, 1] = np.inf
    source = open_data(arrays, [TensorSpec("x", (None, 2), np.dtype(np.float32))], 32)
    with pytest.raises(DataError, match=r"samples 64\.\.95: tensor 'x' contains NaN or Inf "
                                        r"\(batch 2, counted from 0\)"):
        list(source.subset(64, 96))
    with pytest.raises(DataError, match=r"samples 64\.\.95"):
        list(source.subset(32, 96).subset(32, 64))
