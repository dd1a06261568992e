"""Batch sources: image folders, COCO annotation files, .npy/.npz arrays, Python iterables.

A batch is ``dict[input_name, array]`` in the model's own layout and dtype: the
samples sit on each input's sample axis (``TensorSpec.batch_axis``, axis 0 for
most inputs, 1 for recurrent state ``[layers, N, hidden]``), and integer or
boolean inputs (token ids, masks) keep their type. Every source validates what it
reads against the model's inputs where the data enters, so a mistake is
reported with the file name and the fix.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from quantlab.choices import INTERPOLATIONS
from quantlab.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
# An image folder whose preprocessed samples fit in this many bytes keeps them after the
# first pass: the planner reads its data a dozen times, and decoding and resizing an
# 800x608 page costs about as much as the model's forward pass on it. Larger folders
# are decoded on every pass (memory stays bounded by a batch).
IMAGE_CACHE_BYTES = 256 * 2**20

RESIZE_MODES = ("squash", "letterbox", "pad", "height-pad", "center-crop")


@dataclass(frozen=True)
class Preprocess:
    """How images become input tensors: resize, scale, mean/std, channel order, layout.

    ``x = (pixels * scale - mean) / std`` per channel, after resizing to ``size``
    (H, W); ``size=None`` takes the model input's static H and W. Resize modes:
    ``squash`` stretches to H x W; ``letterbox`` scales to fit inside H x W keeping
    the aspect ratio and pads, centred, with `pad_value` (in pixel units, YOLO's
    114 by default); ``pad`` is ``letterbox`` anchored at the top-left corner (the
    padding all at the bottom and right, as Ultralytics' ``LetterBox(center=False)``;
    the YOLOv8 ONNX examples that paste the image into a square before resizing give the
    same image but for the blending of its last row and column with the padding);
    ``height-pad`` scales to height H keeping the aspect ratio (width
    ``ceil(H * w / h)``, at most W, squashed to W beyond) and pads on the right to W
    (text recognizers: PaddleOCR's ``resize_norm_img``); ``center-crop`` scales the
    short side to `resize_short` (default max(H, W)) and crops the centre H x W.
    Padding is written after resampling, in float, so a pad value such as 127.5 is
    exact. Interpolation ``area`` averages the source pixels each output pixel
    covers (OpenCV's ``INTER_AREA``, :func:`area_resize`); the others are Pillow's
    filters. `mean`/`std` default to 0 and 1 for every channel.
    """

    size: tuple[int, int] | None = None
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    channel_order: str = "RGB"
    layout: str = "NCHW"
    resize_mode: str = "squash"
    resize_short: int | None = None
    pad_value: float = 114.0
    interpolation: str = "bilinear"

    def __post_init__(self):
        if self.channel_order not in ("RGB", "BGR", "L"):
            raise ConfigError(
                f"channel order '{self.channel_order}' is not one of RGB, BGR, L (grayscale)."
            )
        if self.layout not in ("NCHW", "NHWC"):
            raise ConfigError(f"layout '{self.layout}' is not one of NCHW, NHWC.")
        if self.resize_mode not in RESIZE_MODES:
            raise ConfigError(
                f"resize mode '{self.resize_mode}' is not one of {', '.join(RESIZE_MODES)}.")
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(
                f"interpolation '{self.interpolation}' is not one of {', '.join(INTERPOLATIONS)}.")
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise ConfigError(f"--resize needs two sizes H W of at least 1 pixel, got {self.size}.")
        if self.resize_short is not None and self.resize_short < 1:
            raise ConfigError(f"--resize-short must be at least 1 pixel, got {self.resize_short}.")
        if self.resize_short is not None and self.resize_mode != "center-crop":
            warnings.warn(f"--resize-short {self.resize_short} has no effect with --resize-mode "
                          f"{self.resize_mode}; it sets the short side of center-crop.",
                          stacklevel=2)
        if not np.isfinite(self.scale):
            raise ConfigError(f"--scale must be a finite number, got {self.scale}.")
        if not np.isfinite(self.pad_value):
            raise ConfigError(f"--pad-value must be a finite number, got {self.pad_value}.")
        channels = self.channels
        for label, values in (("mean", self.mean), ("std", self.std)):
            if values is None:
                continue
            if len(values) != channels:
                raise ConfigError(
                    f"--{label} has {len(values)} value(s) {tuple(values)} but channel order "
                    f"{self.channel_order} has {channels} channel(s); give one value per channel."
                )
            if not np.isfinite(values).all():
                raise ConfigError(f"--{label} {tuple(values)} must be finite numbers.")
        if self.std is not None and any(s == 0 for s in self.std):
            raise ConfigError(f"std {self.std} contains a zero; every std must be non-zero.")

    @property
    def channels(self) -> int:
        """Channels of the preprocessed image: 1 for L, else 3."""
        return 1 if self.channel_order == "L" else 3

    def to_dict(self) -> dict:
        """Plain values for JSON (recorded in the experiment folder)."""
        return {field: getattr(self, field) for field in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: Mapping) -> Preprocess:
        """The inverse of :meth:`to_dict`."""
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        for key in ("size", "mean", "std"):
            if known.get(key) is not None:
                known[key] = tuple(known[key])
        return cls(**known)

    def apply(self, path: Path, size: tuple[int, int]) -> np.ndarray:
        """Decode one image file into a float32 CHW or HWC array of height/width `size`."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                image = image.convert("L" if self.channel_order == "L" else "RGB")
                pixels = self._resize(image, size)
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise DataError(
                f"image {path} cannot be decoded ({exc}). Remove or replace the file; "
                f"supported formats: {', '.join(IMAGE_SUFFIXES)}."
            ) from None
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.channel_order == "BGR":
            pixels = pixels[:, :, ::-1]
        channels = pixels.shape[2]
        mean = np.asarray(self.mean if self.mean is not None else [0.0] * channels, np.float32)
        std = np.asarray(self.std if self.std is not None else [1.0] * channels, np.float32)
        pixels = (pixels * np.float32(self.scale) - mean) / std
        return np.ascontiguousarray(pixels.transpose(2, 0, 1) if self.layout == "NCHW" else pixels)

    def _resize(self, image, size: tuple[int, int]) -> np.ndarray:
        """The image as float32 pixels of height/width `size`, by `resize_mode`."""
        height, width = size
        if self.resize_mode == "squash":
            return self._scaled(image, width, height)
        if self.resize_mode in ("letterbox", "pad"):
            ratio = min(height / image.height, width / image.width)
            inner = (max(1, round(image.width * ratio)), max(1, round(image.height * ratio)))
            corner = ((0, 0) if self.resize_mode == "pad" else
                      ((height - inner[1]) // 2, (width - inner[0]) // 2))
            return self._padded(self._scaled(image, *inner), size, corner)
        if self.resize_mode == "height-pad":
            # PaddleOCR's expression, float rounding included: ceil(H * (w / h)), at most W.
            inner_width = min(width, max(1, math.ceil(height * (image.width / image.height))))
            return self._padded(self._scaled(image, inner_width, height), size, (0, 0))
        short = self.resize_short or max(height, width)
        if short < min(height, width):
            raise ConfigError(f"--resize-short {short} is below the {height}x{width} crop: the "
                              "short side is scaled to it before the centre is cropped. Give "
                              f"--resize-short of at least {max(height, width)}.")
        ratio = short / min(image.width, image.height)
        scaled = (max(width, round(image.width * ratio)), max(height, round(image.height * ratio)))
        top, left = (scaled[1] - height) // 2, (scaled[0] - width) // 2
        return self._scaled(image, *scaled)[top:top + height, left:left + width]

    def _scaled(self, image, width: int, height: int) -> np.ndarray:
        """The image resampled to `width` x `height` by `interpolation`, as float32 pixels
        (8-bit values: Pillow's filters and :func:`area_resize` both round)."""
        if image.size == (width, height):
            return np.asarray(image, dtype=np.float32)
        if self.interpolation == "area":
            averaged = area_resize(np.asarray(image), height, width)
            return np.floor(averaged + 0.5).astype(np.float32)  # halves up, as OpenCV's 8-bit
        if self.interpolation == "opencv-linear":
            return opencv_linear_resize(np.asarray(image), height, width).astype(np.float32)
        from PIL import Image

        method = getattr(Image.Resampling, self.interpolation.upper())
        return np.asarray(image.resize((width, height), method), dtype=np.float32)

    def _padded(self, pixels: np.ndarray, size: tuple[int, int],
                corner: tuple[int, int]) -> np.ndarray:
        """`pixels` placed with their top-left at `corner` (row, column) in an H x W canvas of
        `pad_value`."""
        canvas = np.full(tuple(size) + pixels.shape[2:], self.pad_value, np.float32)
        top, left = corner
        canvas[top:top + pixels.shape[0], left:left + pixels.shape[1]] = pixels
        return canvas


def preprocessing(given: Mapping[str, object], recorded: Preprocess | None = None) -> Preprocess:
    """The Preprocess of the fields `given` explicitly, the others taken from `recorded` (a
    calibration folder's ``calibration.json``, so images are read as calibration read them)
    or Preprocess's defaults; a field given always wins, even when it equals the default."""
    return replace(recorded or Preprocess(), **given)


@dataclass(frozen=True)
class DataOptions:
    """How a command reads its data (the --data options): samples per batch, the first
    `max_samples`, the image `preprocess` fields given (:func:`preprocessing`), inputs
    frozen to `constants` and the sample axes `batch_axes` of
    :func:`quantlab.calibration.pipeline.prepare_model`."""

    batch_size: int = 32
    max_samples: int | None = None
    preprocess: Mapping[str, object] = field(default_factory=dict)
    constants: Mapping[str, object] = field(default_factory=dict)
    batch_axes: Mapping[str, int | None] = field(default_factory=dict)


def opencv_linear_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)`` of a uint8
    H x W or H x W x C image, in numpy: no antialiasing when shrinking.

    Half-pixel centres, edge clamping, 11-bit fixed-point weights and the rounding of
    OpenCV's 8-bit SIMD path (``VResizeLinearVec_32s8u``), written from OpenCV's resize.cpp
    (OpenCV is not a dependency; tests/test_data.py checks it against OpenCV itself).
    """
    in_h, in_w = image.shape[:2]

    def taps(out_n: int, in_n: int):
        scale = in_n / out_n
        f = ((np.arange(out_n) + 0.5) * scale - 0.5).astype(np.float32)
        s = np.floor(f).astype(np.int64)
        f = f - s
        f[s < 0], s[s < 0] = 0, 0
        over = s >= in_n - 1
        f[over], s[over] = 0, in_n - 1
        w0 = np.rint((1.0 - f) * 2048).astype(np.int64)
        return s, np.minimum(s + 1, in_n - 1), w0, 2048 - w0

    x0, x1, a0, a1 = taps(width, in_w)
    y0, y1, b0, b1 = taps(height, in_h)
    src = np.asarray(image).astype(np.int64).reshape(in_h, in_w, -1)
    rows = src[:, x0] * a0[None, :, None] + src[:, x1] * a1[None, :, None]  # in_h x W x C
    r0, r1 = rows[y0] >> 4, rows[y1] >> 4
    out = (((b0[:, None, None] * r0) >> 16) + ((b1[:, None, None] * r1) >> 16) + 2) >> 2
    return np.clip(out, 0, 255).astype(np.uint8).reshape((height, width) + image.shape[2:])


def area_resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """`pixels` (H x W or H x W x C) resampled by area averaging, in float64.

    Every output pixel is the mean of the source over the rectangle it covers, source
    pixels cut at its edges weighted by the part inside (OpenCV's ``INTER_AREA`` when
    shrinking; OpenCV switches to a bilinear variant when enlarging, this stays the
    area mean there too). Separable: each axis integrates the piecewise-constant source
    between the output pixel edges (block sums for a whole factor, exact for 8-bit
    pixels), and the result is divided once by the rectangle's area.
    """
    pixels = np.asarray(pixels)
    summed = _area_sums(_area_sums(pixels, height, 0), width, 1)
    return summed * (height * width) / (pixels.shape[0] * pixels.shape[1])


def _area_sums(values: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Integrals of `values` along `axis` over `size` equal intervals of its length."""
    count = values.shape[axis]
    exact = np.int64 if values.dtype.kind in "biu" else np.float64  # 8-bit pixels sum exactly
    if count % size == 0:  # whole blocks of count // size pixels
        blocks = values.shape[:axis] + (size, count // size) + values.shape[axis + 1:]
        return values.reshape(blocks).sum(axis=axis + 1, dtype=exact).astype(np.float64)
    # Edge e sits at e * count / size source pixels: whole pixels, and the fraction of the
    # next. An interval holds the whole pixels from its first edge's to its last edge's,
    # less the fraction of the first before its edge, plus the fraction of the last.
    whole, part = np.divmod(np.arange(size + 1) * count, size)
    along = [1] * values.ndim
    along[axis] = size
    pixels = np.add.reduceat(values, whole[:-1], axis=axis, dtype=exact).astype(np.float64)
    pixels *= (whole[1:] > whole[:-1]).reshape(along)  # reduceat gives one pixel for none
    first = np.take(values, np.minimum(whole[:-1], count - 1), axis=axis)
    last = np.take(values, np.minimum(whole[1:], count - 1), axis=axis)
    return (pixels - (part[:-1] / size).reshape(along) * first
            + (part[1:] / size).reshape(along) * last)


class BatchSource:
    """An iterable of batches with a known number of samples; iterate it as often as needed.

    `axes` maps input name -> sample axis for inputs whose samples are not on axis 0.
    `preprocess` is the image preprocessing the source applies (None: it applies none, as
    for arrays), which a calibration folder records. `offset`: where its samples start in
    the data it was cut from (:meth:`subset`), so that a message names the data's samples.
    """

    def __init__(
        self,
        description: str,
        num_samples: int,
        batch_size: int,
        load: Callable[[int, int], dict[str, np.ndarray]],
        axes: Mapping[str, int] | None = None,
        preprocess: Preprocess | None = None,
        offset: int = 0,
    ):
        if num_samples == 0:
            raise DataError(f"{description} holds no samples; point --data at a non-empty source.")
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool):
            raise ConfigError(f"batch size must be a whole number, got {batch_size!r}.")
        if batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {batch_size}.")
        self.description = description
        self.num_samples = num_samples
        self.batch_size = int(batch_size)
        self.axes = dict(axes or {})
        self.preprocess = preprocess
        self._load = load
        self.offset = offset

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The batches, each checked for NaN/Inf here, where every command reads its data: a
        DataError names the data, the samples and the tensor."""
        from quantlab.evaluation.compare import first_nonfinite

        for start in range(0, self.num_samples, self.batch_size):
            stop = min(start + self.batch_size, self.num_samples)
            batch = self._load(start, stop)
            bad = first_nonfinite(batch, sorted(batch))
            if bad is not None:
                first, last = self.offset + start, self.offset + stop - 1
                raise DataError(
                    f"{self.description}: input batch of samples {first}..{last}: tensor "
                    f"'{bad}' contains NaN or Inf (batch {first // self.batch_size}, counted "
                    "from 0). Fix or remove these samples in the data.")
            yield batch

    def length(self, batch: Mapping[str, np.ndarray]) -> int:
        """Number of samples in `batch`."""
        return batch_length(batch, self.axes)

    def slice(self, batch: Mapping[str, np.ndarray], start: int, stop: int) -> dict:
        """Samples `start:stop` of `batch` (views, no copy)."""
        return slice_batch(batch, self.axes, start, stop)

    def subset(self, start: int, stop: int) -> BatchSource:
        """Samples `start:stop` of this source as a source of their own (same batch size and
        description and preprocessing: a calibration folder records the data it came from)."""
        return BatchSource(self.description, stop - start, self.batch_size,
                           lambda a, b: self._load(start + a, start + b), self.axes,
                           self.preprocess, self.offset + start)

    def __repr__(self) -> str:
        return (
            f"BatchSource({self.description}, {self.num_samples} samples, batch {self.batch_size})"
        )


def batch_length(batch: Mapping[str, np.ndarray], axes: Mapping[str, int]) -> int:
    """Number of samples in `batch`, read on the first input that has a sample axis."""
    name, array = next((n, a) for n, a in batch.items() if axes.get(n, 0) is not None)
    return np.shape(array)[axes.get(name, 0)]


def slice_batch(batch: Mapping[str, np.ndarray], axes: Mapping[str, int], start: int,
                stop: int) -> dict[str, np.ndarray]:
    """Samples `start:stop` of every input of `batch`, each on its own sample axis.

    An input without a sample axis (axis None) is shared by every sample and kept whole.
    """
    result = {}
    for name, array in batch.items():
        if name in axes and axes[name] is None:
            result[name] = array
            continue
        index = [slice(None)] * np.ndim(array)
        index[axes.get(name, 0)] = slice(start, stop)
        result[name] = array[tuple(index)]
    return result


def sample_axes(inputs: Sequence) -> dict[str, int]:
    """{input name: sample axis} for the inputs whose samples are not on axis 0 (None: none)."""
    return {spec.name: spec.batch_axis for spec in inputs if spec.batch_axis != 0}


def open_data(
    source: str | os.PathLike | np.ndarray | Mapping[str, np.ndarray] | Iterable,
    inputs: Sequence,
    batch_size: int = 32,
    max_samples: int | None = None,
    preprocess: Preprocess | None = None,
) -> BatchSource:
    """Open a data source for a model whose graph inputs are `inputs` (``graph.TensorSpec``).

    `source` is a folder of images, a COCO annotation ``.json`` (images next to it
    or in ``images/``), a ``.npy`` of preprocessed samples (single-input model),
    an ``.npz`` keyed by input name, an in-memory array or dict of arrays, or an
    iterable of batches. Arrays hold the samples on each input's sample axis.
    A model that fixes the number of samples per run (``[1, 3, H, W]``) gets
    batches of exactly that size.
    """
    fixed = {spec.batch_size for spec in inputs if spec.batch_axis is not None} - {None}
    if fixed:
        batch_size = min(fixed)
    source = _tensor_as_array(source)
    if isinstance(source, Mapping):
        source = {name: _tensor_as_array(value) for name, value in source.items()}
    if isinstance(source, np.ndarray):
        return _array_source(
            {_single_input(inputs, "array").name: source}, "array", inputs, batch_size, max_samples
        )
    if isinstance(source, Mapping):
        return _array_source(dict(source), "arrays", inputs, batch_size, max_samples)
    if not isinstance(source, (str, os.PathLike)):
        return _iterable_source(source, inputs, batch_size, max_samples)
    path = Path(source)
    if not path.exists():
        raise DataError(f"data path {path} does not exist.")
    if path.is_dir():
        files = _folder_images(path)
        if not files:
            raise DataError(
                f"data folder {path} contains no images ({', '.join(IMAGE_SUFFIXES)}). "
                "Point --data at a folder of images, a .npy/.npz file or a COCO .json."
            )
        return _image_source(files, str(path), inputs, batch_size, max_samples, preprocess)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        array = _load_numpy(path, mmap_mode="r")
        return _array_source(
            {_single_input(inputs, str(path)).name: array},
            str(path),
            inputs,
            batch_size,
            max_samples,
        )
    if suffix == ".npz":
        with _load_numpy(path) as archive:
            arrays = {key: archive[key] for key in archive.files}
        return _array_source(arrays, str(path), inputs, batch_size, max_samples)
    if suffix == ".json":
        files = coco_image_files(path)
        return _image_source(files, str(path), inputs, batch_size, max_samples, preprocess)
    raise DataError(
        f"data file {path} has an unsupported type '{suffix}'. Use a folder of images, a .npy, "
        "a .npz keyed by input name, or a COCO annotation .json."
    )


def scalar_arrays(source: object) -> dict[str, np.ndarray]:
    """The 0-d arrays of an ``.npz`` file or a dict (``sr``): values shared by every sample."""
    if isinstance(source, Mapping):
        return {k: np.asarray(v) for k, v in source.items() if np.ndim(v) == 0}
    if isinstance(source, (str, os.PathLike)) and Path(source).suffix.lower() == ".npz" \
            and Path(source).is_file():
        with _load_numpy(Path(source)) as archive:
            return {k: archive[k] for k in archive.files if _member_ndim(archive, k) == 0}
    return {}


def _member_ndim(archive, key: str) -> int:
    """The rank of an ``.npz`` member from its header, without reading its data (a
    640 px evaluation set would be read whole just to learn it is not a scalar)."""
    member = f"{key}.npy" if f"{key}.npy" in archive.zip.namelist() else key
    with archive.zip.open(member) as stream:
        reader = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}.get(
            np.lib.format.read_magic(stream))
        if reader is not None:
            return len(reader(stream)[0])
    return archive[key].ndim  # a header version without a public reader: load it


def _load_numpy(path: Path, **kwargs):
    try:
        loaded = np.load(path, allow_pickle=False, **kwargs)
    except (ValueError, OSError) as exc:
        if "pickle" in str(exc) or "Python objects" in str(exc):
            # NumPy's advice here is to load with allow_pickle; quantlab never unpickles data.
            raise DataError(
                f"{path} is not a NumPy array file of numbers: it is another kind of file, or "
                "it holds Python objects, which quantlab does not load (unpickling runs code). "
                "Save plain numeric arrays with numpy.save / numpy.savez."
            ) from None
        raise DataError(f"{path} is not a readable NumPy file ({exc}).") from None
    if isinstance(loaded, np.ndarray) and loaded.dtype.hasobject:
        raise DataError(
            f"{path} holds Python objects, which quantlab does not load; save numeric arrays."
        )
    return loaded


def _folder_images(path: Path) -> list[Path]:
    """The image files of a data folder, its subfolders included, in path order."""
    return sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def data_files(source: object) -> list[Path]:
    """The files :func:`open_data` reads for `source`: the .npy/.npz file, a folder's images,
    a COCO file and the images it lists; none for in-memory data or a missing path."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).exists():
        return []
    path = Path(source)
    if path.is_dir():
        return _folder_images(path)
    return [path, *coco_image_files(path)] if path.suffix.lower() == ".json" else [path]


def files_stamp(files: Sequence[Path]) -> str | None:
    """sha256 of every file's path, size and modification time (None for no files): it
    changes when a file is edited, replaced, added or removed, without reading the data."""
    if not files:
        return None
    import hashlib

    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def coco_image_files(path: Path) -> list[Path]:
    """Image files listed by a COCO annotation file, in its `images` order."""
    try:
        coco = json.loads(path.read_text())
        entries = coco["images"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(
            f"{path} is not a COCO annotation file (needs an 'images' list): {exc}"
        ) from None
    if not entries:
        raise DataError(f"COCO file {path} lists no images.")
    files = []
    for entry in entries:
        name = entry.get("file_name", "")
        candidates = [path.parent / name, path.parent / "images" / name]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise DataError(
                f"COCO file {path} lists image '{name}', which is neither next to it nor in "
                f"{path.parent / 'images'}."
            )
        files.append(found)
    return files


def _single_input(inputs: Sequence, where: str):
    if len(inputs) != 1:
        names = [spec.name for spec in inputs]
        raise DataError(
            f"{where} gives one input but the model has {len(inputs)} inputs {names}; "
            "use an .npz keyed by input name (give a value shared by every sample as a 0-d "
            "array in the .npz, or as --input NAME=VALUE)."
        )
    return inputs[0]


def _limit(count: int, max_samples: int | None) -> int:
    if max_samples is not None and (not isinstance(max_samples, (int, np.integer))
                                    or isinstance(max_samples, bool)):
        raise ConfigError(f"max samples must be a whole number, got {max_samples!r}.")
    if max_samples is not None and max_samples < 1:
        raise ConfigError(f"max samples must be at least 1, got {max_samples}.")
    return count if max_samples is None else min(count, max_samples)


def check_dtype(dtype: np.dtype, spec, where: str) -> None:
    """Raise DataError unless data of `dtype` can feed input `spec` without changing values.

    Float data feeds float inputs (any precision); integer and boolean data feed
    integer/boolean inputs unchanged. Integer data for a float input is refused:
    raw pixels or counts almost always mean the normalization was forgotten.
    """
    dtype = np.dtype(dtype)
    wanted = np.dtype(spec.dtype)
    if wanted.kind == "f" and dtype.kind == "f":
        return
    if wanted.kind in "iub" and dtype.kind in "iub":
        return
    if wanted.kind == "f" and dtype.kind in "iub":
        advice = ("normalize it as the model expects and save it as float32 "
                  "(raw pixels or counts usually mean the preprocessing is missing)")
    else:
        advice = f"save it as {wanted}"
    raise DataError(
        f"{where}: input '{spec.name}' is {wanted} but the data is {dtype}; {advice}."
    )


def _array_source(arrays, description, inputs, batch_size, max_samples) -> BatchSource:
    missing = [spec.name for spec in inputs if spec.name not in arrays]
    if missing:
        raise DataError(
            f"{description} has no array for model input(s) {missing}; it has {sorted(arrays)}."
        )
    axes = sample_axes(inputs)
    counts = {}
    for spec in inputs:
        array = arrays[spec.name]
        check_dtype(array.dtype, spec, description)
        if spec.batch_axis is None:
            check_sample_shape(np.shape(array), spec, description)
            continue
        axis = spec.batch_axis
        if np.ndim(array) <= axis:
            check_sample_shape(np.shape(array), spec, description)
        counts[spec.name] = np.shape(array)[axis]
        check_sample_shape(np.delete(np.shape(array), axis), spec, description)
    if len(set(counts.values())) > 1:
        raise DataError(
            f"{description}: inputs have different sample counts {counts} (each counted on "
            f"its sample axis {({s.name: s.batch_axis for s in inputs})}). Give every input "
            "the same samples, or set an input's sample axis with --batch-axis NAME=AXIS."
        )
    if not counts:
        raise DataError(
            f"{description}: no model input has a sample axis {[s.name for s in inputs]}; "
            "there is nothing to iterate over. Set one with --batch-axis NAME=AXIS.")
    num = _limit(next(iter(counts.values())), max_samples)
    fixed = {spec.batch_size for spec in inputs if spec.batch_axis is not None} - {None}
    if fixed and num % min(fixed):
        raise DataError(
            f"{description}: the model takes exactly {min(fixed)} samples per run and {num} "
            f"is not a multiple of it; pass --max-samples {num - num % min(fixed)}."
        )

    def load(start: int, stop: int) -> dict[str, np.ndarray]:
        part = slice_batch({s.name: arrays[s.name] for s in inputs}, axes, start, stop)
        return {s.name: _batch_array(part[s.name], s.dtype) for s in inputs}

    return BatchSource(description, num, batch_size, load, axes)


def _batch_array(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A batch's array as `dtype`: a view of an array in memory; for a memory-mapped .npy, a
    copy, and the file's pages let go of. Pages of a mapping read once stay in the process
    (they count in its RSS) until it unmaps: every pass over a 128-image 640 px .npy would
    hold its 630 MB; the copy is freed with the batch, the page cache keeps the file."""
    if not isinstance(array, np.memmap):
        return np.asarray(array, dtype=dtype)
    copy = np.array(array, dtype=dtype)
    mapping = getattr(array, "_mmap", None)
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)
    return copy


def _image_source(files, description, inputs, batch_size, max_samples, preprocess) -> BatchSource:
    spec = _single_input(inputs, description)
    preprocess = preprocess or Preprocess()
    if len(spec.shape) != 4:
        raise DataError(
            f"images from {description} make 4-D batches, but model input '{spec.name}' has "
            f"shape {spec.shape}; use a .npy/.npz of preprocessed samples instead."
        )
    check_dtype(np.float32, spec, description)
    height_axis = 2 if preprocess.layout == "NCHW" else 1
    size = preprocess.size or tuple(spec.shape[height_axis : height_axis + 2])
    if None in size:
        raise ConfigError(
            f"model input '{spec.name}' has dynamic height/width {spec.shape}; pass --resize H W."
        )
    files = files[: _limit(len(files), max_samples)]
    first = preprocess.apply(files[0], size)
    check_sample_shape(first.shape, spec, f"{description} (after preprocessing)")

    cache: dict[int, np.ndarray] | None = \
        {0: first} if first.nbytes * len(files) <= IMAGE_CACHE_BYTES else None

    def sample(index: int) -> np.ndarray:
        if cache is None:
            return preprocess.apply(files[index], size)
        if index not in cache:
            cache[index] = preprocess.apply(files[index], size)
        return cache[index]

    def load(start: int, stop: int) -> dict[str, np.ndarray]:  # stacked: a copy of its own
        images = np.stack([sample(i) for i in range(start, stop)])
        return {spec.name: images.astype(spec.dtype, copy=False)}

    return BatchSource(description, len(files), batch_size, load, preprocess=preprocess)


def _tensor_as_array(value: object) -> object:
    """A torch tensor (anything with ``detach().cpu().numpy()``) as a NumPy array; any other
    value unchanged. Without this a tensor is iterated as a sequence of batches, one
    sample each, and refused as samples of the wrong shape."""
    if isinstance(value, np.ndarray) or not all(
            hasattr(value, name) for name in ("detach", "cpu", "numpy", "shape")):
        return value
    return value.detach().cpu().numpy()


def checked_digest(source: BatchSource, option: str) -> str:
    """sha256 of every batch `source` yields (its content after preprocessing); the source
    refuses NaN/Inf (:meth:`BatchSource.__iter__`), here with the `option` (``--eval``) that
    named the data before its message. One pass over the data, before any long work."""
    import hashlib

    digest = hashlib.sha256()
    try:
        for batch in source:
            for name in sorted(batch):
                array = np.ascontiguousarray(batch[name])
                digest.update(f"{name}{array.dtype}{array.shape}".encode())
                digest.update(array.tobytes())
    except DataError as exc:
        raise DataError(f"{option} {exc}") from None
    return digest.hexdigest()


def _iterable_source(batches: Iterable, inputs, batch_size, max_samples) -> BatchSource:
    """Materialize a Python iterable of batches (arrays or dicts) into an array source."""
    if not isinstance(batches, Iterable):
        raise DataError(
            f"data of type {type(batches).__name__} is not a path, an array, a dict of arrays "
            "or an iterable of batches."
        )
    axes = sample_axes(inputs)
    collected: dict[str, list[np.ndarray]] = {}
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            batch = {_single_input(inputs, "the batch iterable").name: batch}
        for name, value in batch.items():
            array = np.asarray(value)  # also takes torch CPU tensors
            parts = collected.setdefault(name, [])
            axis = axes.get(name, 0)
            if parts and np.delete(parts[0].shape, axis).tolist() != np.delete(
                    array.shape, axis).tolist():
                raise DataError(
                    f"batch iterable: batch {index} gives input '{name}' shape {array.shape} but "
                    f"batch 0 gave {parts[0].shape}; every batch must have the same sample shape."
                )
            parts.append(array)
    if not collected:
        raise DataError("the batch iterable yielded no batches.")
    arrays = {name: np.concatenate(parts, axis=axes.get(name, 0))
              for name, parts in collected.items()}
    return _array_source(arrays, "batch iterable", inputs, batch_size, max_samples)


def check_sample_shape(shape: Sequence[int], spec, where: str) -> None:
    """Raise DataError unless a per-sample `shape` fits model input `spec` (sample axis dropped)."""
    expected = spec.sample_shape
    shape = tuple(int(d) for d in shape)
    fits = len(shape) == len(expected) and all(
        e is None or e == s for e, s in zip(expected, shape, strict=True)
    )
    if not fits:
        dims = ["?" if e is None else str(e) for e in expected]
        if spec.batch_axis is not None:
            dims.insert(spec.batch_axis, "N")
        axis = spec.batch_axis if spec.batch_axis is not None else "none"
        raise DataError(
            f"{where}: samples have shape {shape} but model input '{spec.name}' expects "
            f"({', '.join(dims)}), N = samples on axis {axis}. Check the preprocessing (resize, "
            "layout, channels) or the array's axes (set an input's sample axis with "
            "--batch-axis NAME=AXIS)."
        )


def check_batch(batch: Mapping[str, np.ndarray], inputs: Sequence) -> None:
    """Raise DataError unless `batch` has an array of fitting shape and type for every input."""
    for spec in inputs:
        if spec.name not in batch:
            raise DataError(
                f"batch has no array for model input '{spec.name}'; it has {sorted(batch)}."
            )
        shape = np.shape(batch[spec.name])
        check_dtype(np.asarray(batch[spec.name]).dtype, spec, "batch")
        if spec.batch_axis is None:
            check_sample_shape(shape, spec, "batch")
            continue
        if len(shape) <= spec.batch_axis:
            check_sample_shape(shape, spec, "batch")
        check_sample_shape(np.delete(shape, spec.batch_axis), spec, "batch")
        if spec.batch_size is not None and shape[spec.batch_axis] != spec.batch_size:
            raise DataError(
                f"batch has {shape[spec.batch_axis]} samples for input '{spec.name}', but the "
                f"model takes exactly {spec.batch_size} per run (its batch dimension is fixed)."
            )
