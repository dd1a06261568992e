"""Shared fixtures: tiny real models exported through quantlab's own export path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# Real models from PyPI wheels and their generated data (tests/test_realmodels.py).
from conftest_realmodels import onet_exports, real_data, real_models  # noqa: F401

from quantlab import graph


class TinyConvNet(torch.nn.Module):
    """Conv-BN-ReLU, a residual Add, global pooling and a Gemm: the ops most models have."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(y.mean((2, 3)))


@pytest.fixture(scope="session", autouse=True)
def quantlab_cache(tmp_path_factory):
    """quantlab's cache (zoo exports) in a folder of the test session, for every test and
    every command a test runs in a child process: never the user's own."""
    import os

    from quantlab.calibration import pipeline

    folder = tmp_path_factory.mktemp("quantlab-cache")
    saved = os.environ.get(pipeline.CACHE_ENV)
    os.environ[pipeline.CACHE_ENV] = str(folder)
    yield folder
    if saved is None:
        del os.environ[pipeline.CACHE_ENV]
    else:
        os.environ[pipeline.CACHE_ENV] = saved


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(ONNX model, path, torch module) of TinyConvNet with 3x16x16 inputs."""
    torch.manual_seed(0)
    module = TinyConvNet().eval()
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    sample = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    model = graph.export_torch(module, sample, path, output_names=["logits"])
    return model, path, module
