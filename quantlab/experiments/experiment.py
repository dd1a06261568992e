"""An experiment is a folder of plain, re-loadable files, written all or nothing.

A run writes into a staging folder (next to its output folder, or inside it when
it exists) and moves its files into place only once all of them are complete
(:func:`output_folder`); a lock file next to the output folder keeps two runs
from writing into it at once. Nothing that exists is overwritten unless the
user asks (``force``), and then only after the new results are complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from quantlab.errors import ConfigError, DataError, OutputExistsError, QuantlabError

# Names of the staging folder, of the old results set aside during a swap and of the
# lock, all next to the output folder OUT: ".OUT.quantlab-tmp-XXXX", ".OUT.quantlab-old-XXXX",
# ".OUT.quantlab-lock". Temporary files of atomic_write are ".NAME.XXXX.tmp".
STAGING_TAG = ".quantlab-tmp-"
RETIRED_TAG = ".quantlab-old-"
LOCK_SUFFIX = ".quantlab-lock"
LOCK_NAME = LOCK_SUFFIX  # the lock inside the folder, when it cannot be next to it
# A lock file that cannot be parsed (its writer died between creating and filling it)
# is stale once it is this old; a parsable one is stale when its process is gone.
UNREADABLE_LOCK_AGE_S = 30.0
# JSON has no Infinity/NaN; write_json stores non-finite floats as these strings
# (the spelling of JavaScript and of Python's json module) and read_json maps them back.
# atomic_write's temporary files: mkstemp's ".NAME." + 8 random characters + ".tmp".
_TEMP_FILE = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
NON_FINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (thread-safe)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_leftover(name: str) -> bool:
    """Whether `name` is a temporary file or folder a killed quantlab run left behind."""
    return bool(_TEMP_FILE.fullmatch(name)) or (
        name.startswith(".") and (STAGING_TAG in name or RETIRED_TAG in name)
    )


def existing_results(
    folder: str | os.PathLike, force: bool = False, produces: Iterable[str] = ()
) -> list[Path]:
    """The files of `produces` already in `folder` (everything in it when `produces` is empty).

    Raises OutputExistsError if there are any and `force` is false. Leftovers of
    killed runs (see :func:`is_leftover`) are not results. Nothing is changed on
    disk, so a command can check before it starts its long work.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputExistsError(f"output path {folder} exists and is not a folder.")
    names = list(produces)
    if names:
        existing = [folder / n for n in names if (folder / n).exists()]
    else:
        existing = (
            [p for p in folder.iterdir() if not (is_leftover(p.name) or p.name == LOCK_NAME)]
            if folder.exists() else []
        )
    if existing and not force:
        shown = ", ".join(p.name for p in existing[:5])
        raise OutputExistsError(
            f"output folder {folder} already holds results ({shown}). Choose another --out "
            "folder, or pass --force to replace them."
        )
    others = [name for name in RUN_RECORDS if name not in names and (folder / name).is_file()]
    if names and others and not force:
        raise OutputExistsError(
            f"output folder {folder} holds the results of another command ({others[0]}); one "
            "folder holds one run. Choose another --out folder, or pass --force to write "
            "this run beside them.")
    return existing


# The record each command writes into its --out folder (runs.MARKERS): a folder holding one
# that the writing command does not produce holds another command's run.
RUN_RECORDS = ("calibration.json", "plan.json", "sweep.json", "summary.json")
# The mark in the head of every page quantlab writes (report/templates/report.html): a page
# holding it may be replaced; any other file is the user's.
PAGE_MARK = '<meta name="generator" content="quantlab">'


def check_page(path: str | os.PathLike, force: bool = False) -> None:
    """The one decision whether a single page (report's index, compare's page) may be written
    at `path`: never inside an experiment folder (its files are the run's), and over an
    existing file only when quantlab wrote it (it holds PAGE_MARK) or `force`.
    OutputExistsError otherwise, saying why."""
    path = Path(path)
    parent = path.resolve().parent
    if any((parent / name).is_file() for name in RUN_RECORDS):
        raise OutputExistsError(
            f"{path} is inside the experiment folder {parent}, whose files belong to its run; "
            "write the page elsewhere with --out.")
    if path.is_dir():
        raise OutputExistsError(f"{path} is a folder; pass the page's file name with --out.")
    if path.exists() and not force:
        with open(path, "rb") as stream:
            head = stream.read(4096)
        if PAGE_MARK.encode() not in head:
            raise OutputExistsError(
                f"{path} exists and was not written by quantlab; choose another --out, or "
                "pass --force to replace it.")


def check_writable(folder: str | os.PathLike) -> None:
    """ConfigError unless `folder` exists as a writable folder or can be created as one.

    Cheap and leaves nothing behind, so a command can check before its long work
    (missing parents are not created: the nearest existing one is tried instead).
    """
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"cannot write {folder}: {probe} is a file, not a folder. Choose another --out folder."
        )
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".quantlab-probe-", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(
            f"cannot write {folder}: creating a file in {probe} fails ({exc.strerror}). "
            "Choose another --out folder."
        ) from None
    os.close(fd)
    os.unlink(tmp)


def check_output(
    folder: str | os.PathLike, force: bool = False, produces: Iterable[str] = ()
) -> None:
    """Every check :func:`output_folder` makes, without changing anything on disk.

    For a command to run before its long work: OutputExistsError if `folder`
    holds results (see :func:`existing_results`) or another live run is writing
    it, ConfigError if it cannot be created or written.
    """
    existing_results(folder, force, produces)
    check_writable(folder)
    owner = _lock_owner(lock_path(folder))
    if owner is not None:
        raise _locked_error(folder, owner)


def _locked_error(folder: str | os.PathLike, owner: dict) -> OutputExistsError:
    return OutputExistsError(
        f"output folder {folder} is being written by another quantlab run (pid "
        f"{owner.get('pid')} on {owner.get('host')}, since {owner.get('started')}). Wait for "
        f"it to finish or choose another --out folder; if no such run is alive, delete "
        f"{lock_path(folder)}."
    )


def lock_path(folder: str | os.PathLike) -> Path:
    """The lock file of output folder `folder`: ``.NAME.quantlab-lock`` next to it, or
    ``.quantlab-lock`` inside it when it exists in a folder nobody can write (a volume
    mounted into a read-only tree; then nobody can create it either, so the place is
    the same for every run)."""
    folder = Path(folder)
    if folder.is_dir() and not os.access(folder.parent, os.W_OK):
        return folder / LOCK_NAME
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


def _lock_owner(path: Path) -> dict | None:
    """The live run holding lock file `path`, or None when the lock is stale or gone."""
    try:
        text = path.read_text(encoding="utf-8")
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(text)
        pid, host = int(owner["pid"]), str(owner["host"])
    except (ValueError, KeyError, TypeError):
        return None if age > UNREADABLE_LOCK_AGE_S else {"pid": "?", "host": "?"}
    if host != socket.gethostname():
        return owner  # another machine's process cannot be checked: assume it runs
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it exists, under another user
    return owner


def _break_stale_lock(path: Path) -> None:
    """Remove a stale lock; a lock that another run re-took meanwhile is put back."""
    aside = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _lock_owner(aside) is None:
        aside.unlink()
    else:  # it was fresh: restore it unless yet another run took the name
        with contextlib.suppress(OSError):
            os.link(aside, path)
        aside.unlink()


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold the advisory lock of output folder `folder` (OutputExistsError if a live run has it).

    The lock is a file created with O_CREAT|O_EXCL next to the folder, holding the
    owner's pid and host; a lock whose process is gone is stale and taken over.
    """
    path = lock_path(folder)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            break
        except FileExistsError:
            owner = _lock_owner(path)
            if owner is not None:
                raise _locked_error(folder, owner) from None
            _break_stale_lock(path)
    else:
        raise OutputExistsError(
            f"output folder {folder} is being locked by other quantlab runs right now; "
            "choose another --out folder or try again."
        )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(record)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Delete what killed runs left in and next to output folder `folder`; return it.

    Temporary files (``.*.tmp``) inside it, and staging or set-aside folders of it
    next to it. Call only while holding the folder's lock (:func:`output_lock`).
    """
    folder = Path(folder)
    found = [p for p in folder.iterdir() if is_leftover(p.name)] if folder.is_dir() else []
    if folder.parent.is_dir():
        found += [p for p in folder.parent.glob(f".{glob_escape(folder.name)}.quantlab-*-*")
                  if is_leftover(p.name)]
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return found


def glob_escape(name: str) -> str:
    """`name` with glob's special characters escaped."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _make_folder(folder: Path) -> list[Path]:
    """mkdir -p `folder`; the folders it created, outermost first."""
    created = []
    for path in reversed([folder, *folder.parents]):
        if not path.exists():
            path.mkdir()
            created.append(path)
    return created


def _with_user_path(exc: OSError, staging: Path, out: Path) -> OSError:
    """A copy of `exc` naming the path under `out` that the staging path it names stands for."""
    name = str(exc.filename) if exc.filename is not None else str(out)
    if name.startswith(str(staging)):
        name = str(out) + name[len(str(staging)):]
    return OSError(exc.errno, exc.strerror, name)


def _move_in(staging: Path, out: Path, retire: list[Path]) -> None:
    """Replace `retire` (entries of `out`) and put every entry of `staging` into `out`.

    Old entries are renamed aside first, then the new ones renamed in, then the
    old ones deleted; a failure puts the old entries back.
    """
    if staging.parent != out:
        os.rename(staging, out)
        return
    new = sorted(staging.iterdir())
    retire = list(dict.fromkeys([*retire, *(out / p.name for p in new if (out / p.name).exists())]))
    aside = Path(tempfile.mkdtemp(dir=out, prefix=RETIRED_TAG))
    moved_aside: list[Path] = []
    moved_in: list[Path] = []
    try:
        for path in retire:
            os.rename(path, aside / path.name)
            moved_aside.append(path)
        for path in new:
            os.rename(path, out / path.name)
            moved_in.append(out / path.name)
    except BaseException:
        for path in moved_in:
            with contextlib.suppress(OSError):
                os.rename(path, staging / path.name)
        for path in moved_aside:
            with contextlib.suppress(OSError):
                os.rename(aside / path.name, path)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def output_folder(
    out: str | os.PathLike, force: bool = False, produces: Iterable[str] = ()
) -> Iterator[Path]:
    """Write a run's results all or nothing: ``with output_folder(out) as staging: ...``.

    Refuses (OutputExistsError) when `out` holds any of `produces` (anything, when
    `produces` is empty) unless `force`, or when another run holds its lock.
    The body writes its files into `staging`, an empty folder next to `out` (inside
    it, hidden, when `out` exists: renames then stay on its file system); when
    the body completes, they replace the old results in `out` (all of `produces`
    that exist, or everything when `produces` is empty; other files are kept), and
    `out` is created if needed. When the body raises (or is interrupted), nothing
    in `out` changes and nothing is left behind: no staging folder, no new `out`
    or parent folders, no lock. Leftovers of killed runs are removed first.
    Files and folders get the user's umask. OSError names the path under `out`.
    """
    out = Path(out)
    existing_results(out, force, produces)
    check_writable(out)
    created = _make_folder(out.parent)
    try:
        with output_lock(out):
            remove_leftovers(out)
            retire = existing_results(out, force, produces)  # again, under the lock
            # Inside an existing `out`, so every rename stays on its file system (it may be
            # a mount point or a symlink); next to a new one, which appears in one rename.
            staging = Path(tempfile.mkdtemp(dir=out, prefix=STAGING_TAG) if out.is_dir() else
                           tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}{STAGING_TAG}"))
            try:
                os.chmod(staging, 0o777 & ~_umask())
                yield staging
                _move_in(staging, out, retire)
            except OSError as exc:
                if exc.errno is None:
                    raise
                raise _with_user_path(exc, staging, out) from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def prepare_output(
    folder: str | os.PathLike, force: bool = False, produces: Iterable[str] = ()
) -> Path:
    """Create `folder` for new results written file by file: refuse if it holds any of
    `produces` (or anything, when `produces` is empty) unless `force`, in which case
    those are removed first.

    Prefer :func:`output_folder`, which keeps the old results until the new ones are
    complete and leaves nothing behind on failure. This removes leftovers of killed
    runs and does not count them as results.
    """
    folder = Path(folder)
    existing = existing_results(folder, force, produces)
    check_writable(folder)
    with output_lock(folder):
        remove_leftovers(folder)
        for path in existing:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        _make_folder(folder)
    return folder


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then move the temporary file onto `path` in one rename.

    The file gets the mode the user's umask gives new files (mkstemp's is 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno is not None and exc.filename in (None, tmp):  # name the file, not its temp
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write a text file."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def recorded_path(description: str) -> str:
    """A data description as an experiment folder records it: a path made absolute (the
    folder is read from other working directories), anything else ("arrays") unchanged."""
    path = Path(description)
    return str(path.resolve()) if path.exists() else description


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by its NON_FINITE string."""
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    if isinstance(value, np.ndarray):
        return _finite_json(value.tolist())
    return value


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Atomically write `data` as indented, standard JSON (NumPy scalars and arrays allowed).

    JSON has no Infinity or NaN (an SQNR of identical tensors is +inf): non-finite
    floats are written as the strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"``,
    which :func:`read_json` turns back into floats.
    """
    text = json.dumps(_finite_json(data), indent=2, default=_jsonable, allow_nan=False)
    return write_text(path, text + "\n")


def _from_json(value: Any) -> Any:
    if isinstance(value, str):
        return NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {key: _from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file written by :func:`write_json` (``"Infinity"``/``"NaN"`` -> floats)."""
    return _from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def read_record(path: str | os.PathLike, what: str,
                fields: Mapping[str, Callable[[Any], Any]] | None = None,
                file_format: str | None = None, made_by: str = "") -> dict:
    """A JSON object a command reads back, each of `fields` converted and checked.

    The one reader of quantlab's JSON files (calibration.json, scales.json, plan.json,
    summary.json, checkpoints): a DataError names `path` when it cannot be read, is
    not a JSON object or (with `file_format`) lacks ``"format": file_format``, and
    names `path` and the field when ``fields[name](value)`` raises (a missing field
    is passed as None). `what` ("calibration record") and `made_by` ("the
    calibration.json written by `quantlab calibrate`") word the messages.
    """
    path = Path(path)
    fix = f" Pass {made_by}, or write it again." if made_by else " Write it again."
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable {what} file ({exc}).{fix}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} holds a JSON {type(data).__name__}, not the object of a "
                        f"{what} file.{fix}")
    if file_format is not None and data.get("format") != file_format:
        raise DataError(f"{path} is not a quantlab {what} file (no \"format\": "
                        f"\"{file_format}\"); pass {made_by or 'another file'}.")
    check_fields(path, data, fields or {}, fix)
    return data


def check_fields(path: Path, data: dict, fields: Mapping[str, Callable[[Any], Any]],
                 fix: str) -> None:
    """Replace each of `fields` in `data` (read from `path`) by ``fields[name](value)``; a
    DataError names `path`, the field and `fix` when that raises (a missing field is None)."""
    for name, convert in fields.items():
        value = data.get(name)
        try:
            data[name] = convert(value)
        except (TypeError, ValueError, KeyError, AttributeError, QuantlabError) as exc:
            shown = repr(value)
            holds = f" ({shown})" if len(shown) <= 60 else ""
            raise DataError(f"{path}: field '{name}'{holds} cannot be used: "
                            f"{str(exc).rstrip('.')}.{fix}") from None


def read_artifact(path: str | os.PathLike, file_format: str, what: str, made_by: str) -> dict:
    """A JSON artifact's content, checked to be a dict marked ``"format": file_format``
    (see :func:`read_record`)."""
    return read_record(path, what, file_format=file_format, made_by=made_by)


class Checkpoint:
    """The finished work of an interrupted run, in one JSON file, so that a re-run resumes.

    The file holds ``format``, the run's `fingerprint` (a hash of the model, the data's
    content and every setting) and one JSON object per section of finished work (a plan's
    trials and evaluations, a sweep's configurations). `sections` maps each section's
    name to the function that turns its JSON object back into entries. A file of
    another run, or one that cannot be read, is ignored (``ignored``) and replaced; every
    update is written atomically. A kind of checkpoint is a subclass naming its sections.
    """

    def __init__(self, path: str | os.PathLike, file_format: str, fingerprint: str,
                 sections: Mapping[str, Callable[[dict], dict]]):
        self.path = Path(path)
        self.file_format, self.fingerprint = file_format, fingerprint
        self.sections: dict[str, dict] = {name: {} for name in sections}
        # A file was there but of another run (or unreadable): it is replaced.
        self.ignored = False
        if not self.path.is_file():
            return
        try:
            data = read_record(self.path, "checkpoint", file_format=file_format)
            if data.get("fingerprint") != fingerprint:
                self.ignored = True
                return
            self.sections = {name: dict(load(data[name])) for name, load in sections.items()}
        except (DataError, ValueError, KeyError, TypeError, AttributeError):
            self.sections = {name: {} for name in sections}  # unreadable: start over
            self.ignored = True

    def add(self, section: str, key: object, entry: object) -> None:
        """Record one finished `entry` of `section` and save the file."""
        self.sections[section][key] = entry
        self.save()

    def save(self) -> None:
        """Write the file (a dataclass entry as its fields)."""
        write_json(self.path, {"format": self.file_format, "fingerprint": self.fingerprint,
                               **{name: {key: _entry_json(entry) for key, entry in entries.items()}
                                  for name, entries in self.sections.items()}})

    def discard(self) -> None:
        """Forget every entry and delete the file (a finished run, or unusable work)."""
        self.sections = {name: {} for name in self.sections}
        self.path.unlink(missing_ok=True)


def _entry_json(entry: object) -> object:
    return dataclasses.asdict(entry) if dataclasses.is_dataclass(entry) else entry
