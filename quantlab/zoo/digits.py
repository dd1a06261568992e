"""digits-cnn and digits-vit: two classifiers of scikit-learn's bundled 8x8 handwritten digits.

Both share one deterministic split of the 1797 samples (a permutation seeded with
:data:`SPLIT_SEED`): train 1097, calibration 200, eval 500, pairwise disjoint.
Preprocessing is ``pixel / 16.0`` as float32, shape (N, 1, 8, 8).
"""

from __future__ import annotations

import numpy as np

INPUT_SHAPE = (1, 8, 8)
OUTPUT_NAMES = ("logits",)
NUM_CLASSES = 10
SPLIT_SEED = 20240
SPLIT_SIZES = {"train": 1097, "calibration": 200, "eval": 500}


def split(name: str) -> tuple[np.ndarray, np.ndarray]:
    """One split as (N x 1 x 8 x 8 float32 pixel/16, N int64 labels)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(data.target))
    bounds = np.cumsum([0, *SPLIT_SIZES.values()])
    start = bounds[list(SPLIT_SIZES).index(name)]
    index = order[start:start + SPLIT_SIZES[name]]
    x = (data.images[index] / 16.0).astype(np.float32)[:, None]
    return x, data.target[index].astype(np.int64)


def random_shift(x: np.ndarray, rng: np.random.Generator, max_shift: int = 1) -> np.ndarray:
    """Translate each sample by an independent random offset in [-max_shift, max_shift] pixels."""
    n, _, h, w = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    dy, dx = rng.integers(0, 2 * max_shift + 1, (2, n))
    rows = dy[:, None] + np.arange(h)[None]
    cols = dx[:, None] + np.arange(w)[None]
    return padded[np.arange(n)[:, None, None], 0, rows[:, :, None], cols[:, None, :]][:, None]
