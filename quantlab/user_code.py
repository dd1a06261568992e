"""The user's Python named on the command line (``--metric module:function``,
``--torch module:factory``): imported from PYTHONPATH or the current directory."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_module(name: str) -> ModuleType:
    """Import `name` as ``python -c`` would from the current directory: the `quantlab` console
    script's sys.path starts at its own bin folder, so a module beside the user (``metrics.py``
    in the folder they run from) is found only with the directory put first. It stays first,
    as under ``python -c``: the module's own later imports (a sibling module imported inside
    the metric function) must find the same folder."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)
