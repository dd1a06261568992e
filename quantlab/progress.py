"""Progress of the long loops: a live bar on a terminal, a few plain lines in a log.

tqdm redraws its bar with carriage returns; written into a file or a CI log that
is one line of tens of kB. When standard error is not a terminal, a phase writes
a line when it starts, at most one per tenth of its total (and no more often than
every LINE_SECONDS) and one when it ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

# Least time between two in-progress lines of one phase: a phase of a few seconds
# writes its start and end only.
LINE_SECONDS = 5.0


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None,
                 unit: str = "it", enabled: bool = True, leave: bool = True):
    """A tqdm bar on a terminal, :class:`LogLines` elsewhere, a silent tqdm when not `enabled`.

    Used like tqdm: wrap an iterable, or ``with progress_bar(total=N, desc=...) as bar:
    bar.update(n)``.
    """
    from tqdm import tqdm

    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr)
    return LogLines(iterable, desc=desc, total=total, unit=unit)


class LogLines:
    """Progress as plain lines on standard error, for logs: start, each tenth, end."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str,
                 total: int | None = None, unit: str = "it"):
        self.iterable = iterable
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.desc, self.total, self.unit = desc, total, unit
        self.count, self.postfix, self.closed = 0, "", False
        self.tenth = 0  # tenths of the total already reported
        self.started = self.last = time.monotonic()
        self._write(f"{desc}: started" + (f", {total} {unit}" if total else ""))

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:  # an error or an interrupt is reported by whoever handles it
            self.close()

    def update(self, n: int = 1) -> None:
        """Count `n` more; write a line when a new tenth of the total is reached, unless the
        last line is less than LINE_SECONDS old."""
        self.count += n
        if not self.total:
            return
        tenth = min(10 * self.count // self.total, 9)
        now = time.monotonic()
        if tenth > self.tenth and now - self.last >= LINE_SECONDS:
            self.tenth, self.last = tenth, now
            elapsed = now - self.started
            left = elapsed * max(self.total - self.count, 0) / self.count
            self._write(f"{self.desc}: {self.count}/{self.total} {self.unit} "
                        f"({self.count / self.total:.0%}, {elapsed:.0f} s, about {left:.0f} s "
                        "left)"
                        + (f", {self.postfix}" if self.postfix else ""))

    def set_postfix_str(self, text: str) -> None:
        """Shown at the end of the next line, as tqdm shows it after the bar."""
        self.postfix = text

    def close(self) -> None:
        """Write the end line (once)."""
        if self.closed:
            return
        self.closed = True
        self._write(f"{self.desc}: done, {self.count} {self.unit} in "
                    f"{time.monotonic() - self.started:.1f} s")

    @staticmethod
    def _write(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
