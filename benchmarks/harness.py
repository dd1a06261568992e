"""Child-process measurement shared by the benchmarks: one configuration per child process.

A child runs under an address-space limit and reports its own peak RSS (VmHWM);
the parent watches it and stops it past an RSS limit, a time limit, or when the
machine runs low on memory, so a tool that needs too much is reported instead of
taking the machine down. Used by every benchmark script here.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from unittest import mock

import psutil

GIB = 1 << 30
MIB = 1 << 20
# A child is stopped when the machine has less than this available (the other
# processes on it keep working).
MACHINE_RESERVE = int(1.5 * GIB)
POLL_SECONDS = 0.1


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM).

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries that over fork and exec,
    so a child would report its parent's peak whenever the parent was larger.
    """
    status = Path("/proc/self/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(kib) * 1024


@contextlib.contextmanager
def timed(module: ModuleType, name: str, seconds: dict[str, float]) -> Iterator[None]:
    """Add the time spent in ``module.name`` to ``seconds[name]`` while the block runs."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    with mock.patch.object(module, name, wrapper):
        yield


def limit_address_space(limit: int) -> None:
    """Cap this (child) process's address space at `limit` bytes (allocations fail past it)."""
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def watch(process: subprocess.Popen, memory_limit: int,
          time_limit: float) -> tuple[str | None, int]:
    """Wait for `process`; kill it past the RSS or time limit or when the machine runs low.

    Returns why it was stopped (None if it ended by itself) and its sampled peak RSS.
    """
    watched = psutil.Process(process.pid)
    start = time.monotonic()
    peak = 0
    while process.poll() is None:
        try:
            rss = watched.memory_info().rss
        except psutil.NoSuchProcess:
            break
        peak = max(peak, rss)
        reason = None
        if rss > memory_limit:
            reason = f"stopped: RSS above {memory_limit / GIB:.0f} GiB"
        elif psutil.virtual_memory().available < MACHINE_RESERVE:
            reason = "stopped: machine low on memory"
        elif time.monotonic() - start > time_limit:
            reason = f"stopped: over {time_limit:.0f} s"
        if reason:
            process.kill()
            process.wait()
            return reason, peak
        time.sleep(POLL_SECONDS)
    return None, peak


def run_child(script: str | Path, spec: Mapping, log: Path, memory_limit: int,
              time_limit: float, python: str = sys.executable) -> tuple[str | None, int, int]:
    """Run ``python script --child <spec as JSON>`` under the watchdog, output into `log`.

    `python` is the interpreter (another virtual environment's, for a peer whose pinned
    dependencies would replace this environment's). Returns why it was stopped (None if it
    ended by itself), its sampled peak RSS and its exit code.
    """
    with open(log, "w") as handle:
        process = subprocess.Popen([python, str(script), "--child", json.dumps(spec)],
                                   stdout=handle, stderr=subprocess.STDOUT)
        stopped, sampled_peak = watch(process, memory_limit, time_limit)
    return stopped, sampled_peak, process.returncode


def format_table(rows: Sequence[Mapping[str, object]]) -> str:
    """Rows of equal keys as a left-aligned plain-text table."""
    header = list(rows[0])
    cells = [header] + [[str(row[key]) for key in header] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in cells)
