"""Batch sources: image folders, COCO annotation files, .npy/.npz arrays, Python iterables.

A batch is ``dict[input_name, float32 array]`` with the samples on axis 0. Every
source validates what it reads against the model's inputs where the data
enters, so a mistake is reported with the file name and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantlab.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class Preprocess:
    """How images become input tensors: resize, scale, mean/std, channel order, layout.

    ``x = (pixels * scale - mean) / std`` per channel, after resizing to
    ``size`` (H, W). ``size=None`` takes the model input's static H and W.
    """

    size: tuple[int, int] | None = None
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    channel_order: str = "RGB"
    layout: str = "NCHW"

    def __post_init__(self):
        if self.channel_order not in ("RGB", "BGR", "L"):
            raise ConfigError(
                f"channel order '{self.channel_order}' is not one of RGB, BGR, L (grayscale)."
            )
        if self.layout not in ("NCHW", "NHWC"):
            raise ConfigError(f"layout '{self.layout}' is not one of NCHW, NHWC.")
        if any(s == 0 for s in self.std):
            raise ConfigError(f"std {self.std} contains a zero; every std must be non-zero.")

    def apply(self, path: Path, size: tuple[int, int]) -> np.ndarray:
        """Decode one image file into a float32 CHW or HWC array."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                image = image.convert("L" if self.channel_order == "L" else "RGB")
                if image.size != (size[1], size[0]):
                    image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
                pixels = np.asarray(image, dtype=np.float32)
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
        mean = np.resize(np.asarray(self.mean, np.float32), channels)
        std = np.resize(np.asarray(self.std, np.float32), channels)
        pixels = (pixels * self.scale - mean) / std
        return np.ascontiguousarray(pixels.transpose(2, 0, 1) if self.layout == "NCHW" else pixels)


class BatchSource:
    """An iterable of batches with a known number of samples; iterate it as often as needed."""

    def __init__(
        self,
        description: str,
        num_samples: int,
        batch_size: int,
        load: Callable[[int, int], dict[str, np.ndarray]],
    ):
        if num_samples == 0:
            raise DataError(f"{description} holds no samples; point --data at a non-empty source.")
        if batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {batch_size}.")
        self.description = description
        self.num_samples = num_samples
        self.batch_size = batch_size
        self._load = load

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, self.num_samples, self.batch_size):
            yield self._load(start, min(start + self.batch_size, self.num_samples))

    def __repr__(self) -> str:
        return (
            f"BatchSource({self.description}, {self.num_samples} samples, batch {self.batch_size})"
        )


def open_data(
    source: str | os.PathLike | np.ndarray | Mapping[str, np.ndarray] | Iterable,
    inputs: Sequence,
    batch_size: int = 32,
    max_samples: int | None = None,
    preprocess: Preprocess | None = None,
) -> BatchSource:
    """Open a data source for a model whose graph inputs are `inputs` (``graph.TensorSpec``).

    `source` is a folder of images, a COCO annotation ``.json`` (images next to it
    or in ``images/``), a ``.npy`` of preprocessed samples (single-input model,
    axis 0 = samples), an ``.npz`` keyed by input name, an in-memory array or
    dict of arrays, or an iterable of batches.
    """
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
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
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


def _load_numpy(path: Path, **kwargs):
    try:
        return np.load(path, allow_pickle=False, **kwargs)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path} is not a readable NumPy file ({exc}).") from None


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
            f"{where} holds one array but the model has {len(inputs)} inputs {names}; "
            "use an .npz keyed by input name."
        )
    return inputs[0]


def _limit(count: int, max_samples: int | None) -> int:
    if max_samples is not None and max_samples < 1:
        raise ConfigError(f"max samples must be at least 1, got {max_samples}.")
    return count if max_samples is None else min(count, max_samples)


def _array_source(arrays, description, inputs, batch_size, max_samples) -> BatchSource:
    missing = [spec.name for spec in inputs if spec.name not in arrays]
    if missing:
        raise DataError(
            f"{description} has no array for model input(s) {missing}; it has {sorted(arrays)}."
        )
    counts = {
        spec.name: len(arrays[spec.name]) if np.ndim(arrays[spec.name]) else 0 for spec in inputs
    }
    if len(set(counts.values())) > 1:
        raise DataError(f"{description}: inputs have different sample counts {counts}.")
    for spec in inputs:
        check_sample_shape(arrays[spec.name].shape[1:], spec, description)
    num = _limit(next(iter(counts.values())), max_samples)

    def load(start: int, stop: int) -> dict[str, np.ndarray]:
        return {s.name: np.asarray(arrays[s.name][start:stop], dtype=np.float32) for s in inputs}

    return BatchSource(description, num, batch_size, load)


def _image_source(files, description, inputs, batch_size, max_samples, preprocess) -> BatchSource:
    spec = _single_input(inputs, description)
    preprocess = preprocess or Preprocess()
    if len(spec.shape) != 4:
        raise DataError(
            f"images from {description} make 4-D batches, but model input '{spec.name}' has "
            f"shape {spec.shape}; use a .npy/.npz of preprocessed samples instead."
        )
    height_axis = 2 if preprocess.layout == "NCHW" else 1
    size = preprocess.size or tuple(spec.shape[height_axis : height_axis + 2])
    if None in size:
        raise ConfigError(
            f"model input '{spec.name}' has dynamic height/width {spec.shape}; pass --resize H W."
        )
    files = files[: _limit(len(files), max_samples)]
    first = preprocess.apply(files[0], size)
    check_sample_shape(first.shape, spec, f"{description} (after preprocessing)")

    def load(start: int, stop: int) -> dict[str, np.ndarray]:
        return {spec.name: np.stack([preprocess.apply(f, size) for f in files[start:stop]])}

    return BatchSource(description, len(files), batch_size, load)


def _iterable_source(batches: Iterable, inputs, batch_size, max_samples) -> BatchSource:
    """Materialize a Python iterable of batches (arrays or dicts) into an array source."""
    collected: dict[str, list[np.ndarray]] = {}
    for batch in batches:
        if isinstance(batch, np.ndarray):
            batch = {_single_input(inputs, "the batch iterable").name: batch}
        for name, value in batch.items():
            collected.setdefault(name, []).append(np.asarray(value, dtype=np.float32))
    if not collected:
        raise DataError("the batch iterable yielded no batches.")
    arrays = {name: np.concatenate(parts) for name, parts in collected.items()}
    return _array_source(arrays, "batch iterable", inputs, batch_size, max_samples)


def check_sample_shape(shape: Sequence[int], spec, where: str) -> None:
    """Raise DataError unless a per-sample `shape` fits model input `spec` (batch axis dropped)."""
    expected = spec.shape[1:]
    fits = len(shape) == len(expected) and all(
        e is None or e == s for e, s in zip(expected, shape, strict=True)
    )
    if not fits:
        wanted = "x".join("?" if e is None else str(e) for e in expected)
        raise DataError(
            f"{where}: samples have shape {tuple(shape)} but model input '{spec.name}' expects "
            f"(N, {wanted.replace('x', ', ')}). Check the preprocessing (resize, layout, "
            "channels) or the array's axes; axis 0 must be the sample axis."
        )


def check_batch(batch: Mapping[str, np.ndarray], inputs: Sequence) -> None:
    """Raise DataError unless `batch` has an array of fitting shape for every model input."""
    for spec in inputs:
        if spec.name not in batch:
            raise DataError(
                f"batch has no array for model input '{spec.name}'; it has {sorted(batch)}."
            )
        check_sample_shape(np.shape(batch[spec.name])[1:], spec, "batch")
