"""Experiment folders: a run is written all or nothing, locked, with the user's umask."""

import errno
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from quantlab.errors import ConfigError, OutputExistsError
from quantlab.experiments import experiment
from quantlab.experiments.experiment import (
    atomic_write,
    check_output,
    lock_path,
    output_folder,
    prepare_output,
    read_json,
    write_json,
    write_text,
)

PRODUCES = ("a.txt", "b.txt", "c.txt")


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (hidden ones too) -> its bytes (None for folders)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def _write_all(folder: Path, tag: str) -> None:
    for name in PRODUCES:
        write_text(folder / name, f"{tag} {name}\n")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_new_folder_appears_complete_with_umask_modes_and_nothing_else(tmp_path, umask_022):
    out = tmp_path / "runs" / "r1"
    with output_folder(out, produces=PRODUCES) as staging:
        assert staging.parent == out.parent and staging.name.startswith(".r1.quantlab-tmp-")
        assert lock_path(out).exists()
        assert not out.exists()  # nothing under the final name until the run is complete
        _write_all(staging, "new")
    assert sorted(os.listdir(out)) == list(PRODUCES)
    assert os.listdir(out.parent) == ["r1"]  # no staging folder, no lock left
    assert (out / "a.txt").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    assert out.stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0700


def test_files_follow_a_stricter_umask(tmp_path):
    old = os.umask(0o077)
    try:
        path = write_text(tmp_path / "x.txt", "x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failed_or_interrupted_run_leaves_nothing(tmp_path, failure):
    out = tmp_path / "new" / "deeper" / "run"
    with pytest.raises(type(failure)), output_folder(out, produces=PRODUCES) as staging:
        write_text(staging / "a.txt", "half")
        raise failure
    # Not even the parents it created, nor a lock or a temp file.
    assert _tree(tmp_path) == {}


def test_force_keeps_old_results_until_new_ones_are_complete(tmp_path):
    out = tmp_path / "run"
    with output_folder(out, produces=PRODUCES) as staging:
        _write_all(staging, "old")
    (out / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    # --force, then a failure (a tensor name the cache refuses, disk full, Ctrl-C) while
    # writing: the old results are all there, unchanged (reliability report, case 3.5b).
    for failure in (ValueError("bad name"), OSError(errno.ENOSPC, "No space left on device"),
                    KeyboardInterrupt()):
        with pytest.raises(type(failure)), output_folder(out, True, PRODUCES) as staging:
            write_text(staging / "a.txt", "new a")
            assert (out / "a.txt").read_text() == "old a.txt\n"
            raise failure
        assert _tree(tmp_path) == before
    with output_folder(out, True, PRODUCES) as staging:
        write_text(staging / "a.txt", "new a")
        write_text(staging / "b.txt", "new b")
    # The results are the new run's only (old c.txt gone); files that are not results stay.
    assert _tree(tmp_path) == {"run": None, "run/a.txt": b"new a", "run/b.txt": b"new b",
                               "run/notes.txt": b"mine"}


def test_occupied_folder_is_refused_without_force_and_untouched(tmp_path):
    out = tmp_path / "run"
    with output_folder(out, produces=PRODUCES) as staging:
        _write_all(staging, "old")
    before = _tree(tmp_path)
    with pytest.raises(OutputExistsError, match=r"already holds results \(a.txt.*--force"):
        with output_folder(out, produces=PRODUCES):
            pytest.fail("the body must not run")
    assert _tree(tmp_path) == before


def test_empty_produces_means_everything_in_the_folder(tmp_path):
    out = tmp_path / "demo"
    (out / "old-model").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    with pytest.raises(OutputExistsError, match="old-model|summary.json"):
        check_output(out)
    with output_folder(out, force=True) as staging:
        write_text(staging / "summary.json", "new")
    assert _tree(tmp_path) == {"demo": None, "demo/summary.json": b"new"}


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftovers_of_killed_runs_are_not_results_and_are_removed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # What SIGKILL leaves: an atomic_write temp file, a staging folder, a set-aside folder
    # and a lock whose process is gone (reliability report, cases 4.4 and 4.4rf).
    (out / ".stats.npz.m9k3p7hb.tmp").write_bytes(b"x" * 100)
    (tmp_path / ".run.quantlab-tmp-abcd1234").mkdir()
    (tmp_path / ".run.quantlab-tmp-abcd1234" / "model.onnx").write_bytes(b"partial")
    (tmp_path / ".run.quantlab-old-abcd1234").mkdir()
    lock_path(out).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(),
                                          "started": "then"}))
    (tmp_path / "other").mkdir()  # a sibling that is not ours stays
    check_output(out, produces=PRODUCES)  # not refused: nothing in it is a result
    with output_folder(out, produces=PRODUCES) as staging:
        _write_all(staging, "new")
    assert sorted(os.listdir(tmp_path)) == ["other", "run"]
    assert sorted(os.listdir(out)) == list(PRODUCES)


def test_prepare_output_removes_leftovers_and_does_not_count_them(tmp_path):
    out = tmp_path / "v"
    out.mkdir()
    (out / ".summary.json.abcdefgh.tmp").write_text("x")
    (out / ".vimrc.tmp").write_text("not quantlab's")  # not a mkstemp name: kept
    assert prepare_output(out, produces=["summary.json"]) == out
    assert sorted(os.listdir(out)) == [".vimrc.tmp"]
    assert not lock_path(out).exists()


def test_second_writer_is_refused_at_once_while_the_first_holds_the_lock(tmp_path):
    out = tmp_path / "run"
    with output_folder(out, True, PRODUCES) as staging:
        write_text(staging / "a.txt", "first")
        for attempt in (lambda: check_output(out, True, PRODUCES),
                        lambda: output_folder(out, True, PRODUCES).__enter__(),
                        lambda: prepare_output(out, True, PRODUCES)):
            with pytest.raises(OutputExistsError,
                               match=rf"being written by another quantlab run \(pid {os.getpid()}"):
                attempt()
    assert _tree(tmp_path) == {"run": None, "run/a.txt": b"first"}


def test_lock_of_another_host_is_respected_and_a_garbled_old_one_taken_over(tmp_path):
    out = tmp_path / "run"
    lock_path(out).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "now"}))
    with pytest.raises(OutputExistsError, match=r"on elsewhere.*delete .*\.run\.quantlab-lock"):
        check_output(out)
    lock_path(out).write_text("")  # its writer died between creating and filling it
    with pytest.raises(OutputExistsError):  # too recent to tell
        check_output(out)
    old = experiment.UNREADABLE_LOCK_AGE_S + 5
    os.utime(lock_path(out), (os.path.getmtime(lock_path(out)) - old,) * 2)
    with output_folder(out) as staging:
        write_text(staging / "a.txt", "x")
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_unwritable_out_is_a_one_line_config_error_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write .*afile/sub: .*afile is a file"):
        check_output(tmp_path / "afile" / "sub")
    # We run as root, which chmod 0o555 does not stop: sysfs refuses new files to anyone.
    with pytest.raises(ConfigError, match=r"cannot write /sys/quantlab-out: creating a file"):
        check_output("/sys/quantlab-out")

    # A read-only mount, simulated: creating any file fails with EROFS.
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(experiment.tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigError, match=r"run: creating a file in .* \(Read-only file system\)"):
        with output_folder(tmp_path / "run"):
            pytest.fail("the body must not run")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_disk_full_names_the_file_under_out_not_the_temp_names(tmp_path):
    out = tmp_path / "run"

    def disk_full(tmp):
        Path(tmp).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")  # write(2) names no file

    with pytest.raises(OSError) as info, output_folder(out, produces=PRODUCES) as staging:
        write_text(staging / "a.txt", "a")
        atomic_write(staging / "b.txt", disk_full)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(out / "b.txt")
    assert _tree(tmp_path) == {}


def test_write_json_writes_standard_json_and_read_json_restores_non_finite(tmp_path):
    import numpy as np

    data = {"sqnr_db": math.inf, "low": -math.inf, "nan": float("nan"),
            "array": np.array([1.0, np.inf]), "np": np.float32(np.inf), "name": "relu"}
    path = write_json(tmp_path / "s.json", data)

    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    raw = json.loads(path.read_text(), parse_constant=refuse)  # strict JSON (jq, JS, pandas)
    assert raw["sqnr_db"] == "Infinity" and raw["nan"] == "NaN" and raw["low"] == "-Infinity"
    back = read_json(path)
    assert back["sqnr_db"] == math.inf and back["low"] == -math.inf and math.isnan(back["nan"])
    assert back["array"] == [1.0, math.inf] and back["np"] == math.inf
    assert back["name"] == "relu"


def test_existing_out_in_a_read_only_parent_stages_and_locks_inside_it(tmp_path, monkeypatch):
    # `--out /out` where /out is a writable volume mounted into a read-only tree (or on
    # another file system than its parent: renames must stay inside it). Simulated, as root
    # ignores modes: the parent refuses new entries.
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    real_mkdtemp, real_open = experiment.tempfile.mkdtemp, os.open

    def refuse_parent(path):
        if Path(path).parent == tmp_path and Path(path) != out:
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(experiment.os, "access", lambda path, mode: Path(path) != tmp_path)
    monkeypatch.setattr(experiment.tempfile, "mkdtemp",
                        lambda dir, prefix: refuse_parent(Path(dir) / prefix)
                        or real_mkdtemp(dir=dir, prefix=prefix))
    monkeypatch.setattr(experiment.os, "open",
                        lambda path, *a, **k: refuse_parent(path) or real_open(path, *a, **k))
    assert lock_path(out) == out / ".quantlab-lock"
    with output_folder(out, True, PRODUCES) as staging:
        assert staging.parent == out
        write_text(staging / "a.txt", "new")
    assert _tree(tmp_path) == {"out": None, "out/a.txt": b"new"}
