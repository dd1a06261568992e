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


def metric_code(metric: str) -> str:
    """sha256 of the code behind --metric: the source file of a ``module:function`` metric's
    module (its helpers included), the name alone for a built-in one. A resumed run reuses
    scores only while this is unchanged."""
    import hashlib

    digest = hashlib.sha256(metric.encode())
    if ":" in metric:
        module = import_module(metric.partition(":")[0])
        source = getattr(module, "__file__", None)
        if source:
            with open(source, "rb") as stream:
                digest.update(stream.read())
    return digest.hexdigest()


class UserExit(Exception):
    """The user's function called sys.exit(): caught with its other exceptions, so a metric
    that exits fails the command instead of ending it with the status it chose."""


def call(function, *args):
    """``function(*args)`` for the user's code: a SystemExit it raises comes out as UserExit
    (an Exception), so the caller's ``except Exception`` reports it as the function failing."""
    try:
        return function(*args)
    except SystemExit as exc:
        raise UserExit(f"it called sys.exit({exc.code!r})") from None


def as_number(value) -> float:
    """`value` as a float; TypeError for a bool (True is not a score of 1.0) or a non-number."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)) or (isinstance(value, np.ndarray)
                                               and value.dtype == bool):
        raise TypeError("a bool is not a number")
    return float(value)
