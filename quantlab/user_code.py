"""The user's Python named on the command line (``--metric module:function``,
``--torch module:factory``): imported from PYTHONPATH or the current directory."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import ModuleType


def import_module(name: str) -> ModuleType:
    """Import `name` as ``python -c`` would from the current directory: the `quantlab` console
    script's sys.path starts at its own bin folder, so a module beside the user (``metrics.py``
    in the folder they run from) is found only with the directory put first for the import."""
    with _cwd_first():
        return importlib.import_module(name)


@contextlib.contextmanager
def _cwd_first():
    """sys.path with the current directory first, as it was again afterwards."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path[:] = saved
