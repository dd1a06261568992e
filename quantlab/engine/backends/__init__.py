"""Backends run a model on a batch and return tensors keyed by ONNX name.

Every backend implements one method, ``run(batch, tensors=None)``: ``batch``
maps graph-input names to arrays; ``tensors`` lists ONNX tensor names to
return (``None`` returns the graph outputs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np


class Backend(Protocol):
    """What every backend offers: a name for reports and ``run``."""

    name: str

    def run(
        self, batch: Mapping[str, np.ndarray], tensors: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run one batch; return the requested tensors (default: graph outputs)."""
        ...
