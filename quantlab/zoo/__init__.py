"""Reference model zoo: small trained models with their weights shipped in the repo.

``get(name)`` returns a :class:`ZooModel` that builds the trained module, loads its
calibration split from ``calibration_data/`` and its held-out evaluation split, and
turns raw outputs into task results. Weights are never downloaded; retrain with
``python -m quantlab.zoo.train``. Only building a module imports torch: a command whose
export is cached reads the zoo's data and labels without it (importing torch takes 4 s).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import quantlab
from quantlab.errors import ConfigError, DataError, ModelError
from quantlab.zoo import digits, shapes, shapes_det
from quantlab.zoo_names import ZOO_NAMES

if TYPE_CHECKING:
    import torch

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
CALIBRATION_ENV = "QUANTLAB_CALIBRATION_DATA"


@dataclass(frozen=True)
class EvalSet:
    """A held-out evaluation split: preprocessed inputs and the ground truth to score them."""

    inputs: np.ndarray
    labels: np.ndarray | None
    coco: dict | None
    image_ids: list[int]


def calibration_root(must_exist: bool = True) -> Path:
    """The ``calibration_data/`` folder; ``$QUANTLAB_CALIBRATION_DATA`` overrides the repo's."""
    override = os.environ.get(CALIBRATION_ENV)
    root = Path(override) if override else (
        Path(quantlab.__file__).resolve().parents[1] / "calibration_data")
    if must_exist and not root.is_dir():
        raise DataError(
            f"calibration data folder not found: {root}. Set {CALIBRATION_ENV} to the folder "
            "holding shapes-det/ and digits/, or regenerate it with "
            "`python -m quantlab.zoo.train all`."
        )
    return root


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build it, where its data lives and how to read its outputs."""

    name: str
    task: str  # "classification" | "detection"
    description: str
    input_shape: tuple[int, ...]
    output_names: tuple[str, ...]
    _make_module: Callable[[], torch.nn.Module]
    _load_calibration: Callable[[Path], np.ndarray]
    _make_eval_set: Callable[[int | None], EvalSet]
    _postprocess: Callable[[dict[str, np.ndarray], list[int]], list[dict] | np.ndarray]
    input_name: str = "input"

    @property
    def weights_path(self) -> Path:
        """The shipped ``state_dict`` file."""
        return WEIGHTS_DIR / f"{self.name}.pt"

    def build(self) -> torch.nn.Module:
        """The module with its trained weights loaded, in eval mode."""
        if not self.weights_path.is_file():
            raise ModelError(
                f"weights of zoo model '{self.name}' not found at {self.weights_path}; "
                f"retrain with `python -m quantlab.zoo.train {self.name}`."
            )
        import torch

        module = self._make_module()
        module.load_state_dict(torch.load(self.weights_path, map_location="cpu", weights_only=True))
        return module.eval()

    def calibration_set(self) -> np.ndarray:
        """The calibration split, preprocessed: (N, *input_shape) float32."""
        return self._load_calibration(calibration_root())

    def eval_set(self, limit: int | None = None) -> EvalSet:
        """The held-out evaluation split (its first ``limit`` samples if given)."""
        if limit is not None and limit < 1:  # a negative slice would drop the last samples
            raise ConfigError(f"the evaluation limit must be at least 1 sample, got {limit}.")
        return self._make_eval_set(limit)

    def postprocess(self, outputs: dict[str, np.ndarray], image_ids: list[int]
                    ) -> list[dict] | np.ndarray:
        """Raw outputs by name -> COCO detections (detection) or logits (N, classes)."""
        return self._postprocess(outputs, image_ids)


SHAPES_EVAL_SIZE = 500


def _shapes_calibration(root: Path) -> np.ndarray:
    folder = root / "shapes-det"
    if not (folder / "annotations.json").is_file():
        raise DataError(f"{folder / 'annotations.json'} is missing; regenerate it with "
                        "`python -m quantlab.zoo.train shapes-det`.")
    images, _ = shapes.read_coco_folder(folder)
    return shapes_det.preprocess(images)


def _shapes_eval(limit: int | None) -> EvalSet:
    count = SHAPES_EVAL_SIZE if limit is None else min(limit, SHAPES_EVAL_SIZE)
    images, coco = shapes.make_split(shapes.EVAL_SEED, count)
    return EvalSet(shapes_det.preprocess(images), None, coco, [e["id"] for e in coco["images"]])


def _shapes_postprocess(outputs: dict[str, np.ndarray], image_ids: list[int]) -> list[dict]:
    return shapes_det.decode(outputs["scores"], outputs["boxes"], image_ids)


def _digits_calibration(root: Path) -> np.ndarray:
    path = root / "digits" / "calibration.npy"
    if not path.is_file():
        raise DataError(f"{path} is missing; regenerate it with "
                        "`python -m quantlab.zoo.train digits-cnn`.")
    return np.load(path).astype(np.float32)


def _digits_eval(limit: int | None) -> EvalSet:
    x, y = digits.split("eval")
    x, y = x[:limit], y[:limit]
    return EvalSet(x, y, None, list(range(len(x))))


def _logits(outputs: dict[str, np.ndarray], image_ids: list[int]) -> np.ndarray:
    return outputs["logits"]


def _shapes_det_module() -> torch.nn.Module:
    from quantlab.zoo import shapes_det_net

    return shapes_det_net.ShapesDetector()


def _digits_entry(name: str, description: str) -> ZooModel:
    def module() -> torch.nn.Module:
        from quantlab.zoo import digits_nets

        return digits_nets.MODELS[name]()

    return ZooModel(name, "classification", description, digits.INPUT_SHAPE, digits.OUTPUT_NAMES,
                    module, _digits_calibration, _digits_eval, _logits)


_REGISTRY: dict[str, ZooModel] = {
    "shapes-det": ZooModel(
        "shapes-det", "detection",
        "MobileNet-style depthwise-separable detector (anchor-free, TTFNet-style heatmap + "
        "box distances at stride 4) for 5 classes of procedurally generated shapes, 3x128x128.",
        shapes_det.INPUT_SHAPE, shapes_det.OUTPUT_NAMES, _shapes_det_module,
        _shapes_calibration, _shapes_eval, _shapes_postprocess,
    ),
    "digits-cnn": _digits_entry(
        "digits-cnn",
        "Small CNN (Conv+BN+ReLU, residual Add, max-pool, Linear) on scikit-learn 8x8 digits."),
    "digits-vit": _digits_entry(
        "digits-vit",
        "Small vision transformer (2x2 patches, class token, 3 MatMul/Softmax attention layers) "
        "on scikit-learn 8x8 digits."),
}

if tuple(_REGISTRY) != ZOO_NAMES:  # the command line lists ZOO_NAMES without importing torch
    raise ImportError(f"quantlab.zoo_names.ZOO_NAMES {ZOO_NAMES} does not list the zoo's models "
                      f"{tuple(_REGISTRY)}; update it.")


def names() -> list[str]:
    """Names of the zoo models."""
    return list(_REGISTRY)


def get(name: str) -> ZooModel:
    """The zoo entry called ``name``; unknown names raise :class:`ConfigError`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown zoo model '{name}'; valid names: {', '.join(names())}") from None
