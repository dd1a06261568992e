"""An experiment is a folder of plain, re-loadable files; writes are atomic.

Nothing that exists is overwritten unless the user asks (``force``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from quantlab.errors import OutputExistsError


def existing_results(
    folder: str | os.PathLike, force: bool = False, produces: Iterable[str] = ()
) -> list[Path]:
    """The files of `produces` already in `folder` (everything in it when `produces` is empty).

    Raises OutputExistsError if there are any and `force` is false. Nothing is
    changed on disk, so a command can check before it starts its long work.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputExistsError(f"output path {folder} exists and is not a folder.")
    names = list(produces)
    if names:
        existing = [folder / n for n in names if (folder / n).exists()]
    else:
        existing = list(folder.iterdir()) if folder.exists() else []
    if existing and not force:
        shown = ", ".join(p.name for p in existing[:5])
        raise OutputExistsError(
            f"output folder {folder} already holds results ({shown}). Choose another --out "
            "folder, or pass --force to replace them."
        )
    return existing


def prepare_output(
    folder: str | os.PathLike, force: bool = False, produces: Iterable[str] = ()
) -> Path:
    """Create `folder` for new results: refuse if it holds any of `produces` (or anything, when
    `produces` is empty) unless `force`, in which case those are removed first."""
    for path in existing_results(folder, force, produces):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then move the temporary file onto `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write a text file."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Atomically write `data` as indented JSON (NumPy scalars and arrays allowed).

    Non-finite floats (an SQNR of identical tensors is +inf) are kept as the
    tokens ``Infinity``/``NaN``, which Python's json and pandas read back.
    """
    return write_text(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file written by :func:`write_json`."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
