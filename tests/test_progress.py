"""Progress: a live bar on a terminal, a few plain lines in a log, nothing with --no-progress."""

import io
import sys

import pytest

from quantlab import progress
from quantlab.progress import LogLines, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_live_bar_and_a_log_a_line_per_tenth(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    list(progress_bar(range(50), desc="collect", unit="sample"))
    assert "\r" in sys.stderr.getvalue() and "collect" in sys.stderr.getvalue()

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    assert list(progress_bar(range(50), desc="collect", unit="sample")) == list(range(50))
    lines = sys.stderr.getvalue().splitlines()
    assert "\r" not in sys.stderr.getvalue()
    assert lines[0] == "collect: started, 50 sample"
    assert lines[1].startswith("collect: 5/50 sample (10%")
    assert lines[-2].startswith("collect: 45/50 sample (90%")
    assert lines[-1].startswith("collect: done, 50 sample in ")
    assert len(lines) == 11


def test_log_lines_are_rate_limited_and_silent_when_disabled(monkeypatch, capsys):
    with progress_bar(total=1000, desc="validate", unit="sample") as bar:
        bar.set_postfix_str("batch 3/4")
        for _ in range(1000):
            bar.update(1)
    # Under LINE_SECONDS from start to end: the start and end lines only.
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("validate: done, 1000 sample in ")
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    with progress_bar(total=4, desc="validate", unit="sample") as bar:
        bar.set_postfix_str("batch 3/4")
        bar.update(3)
    assert capsys.readouterr().err.splitlines()[1].endswith(" s left), batch 3/4")
    with progress_bar(total=10, desc="quiet", enabled=False) as bar:
        bar.update(10)
    list(progress_bar(range(3), desc="quiet", enabled=False))
    assert capsys.readouterr().err == ""


def test_log_lines_say_the_time_left_at_the_rate_so_far(monkeypatch, capsys):
    clock = iter([100.0, 112.0])  # start; 3 of 4 done 12 s later: 4 s per item, 1 left
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress_bar(total=4, desc="calibrate: bias shifts", unit="sample") as bar:
        bar.update(3)
        line = capsys.readouterr().err.splitlines()[1]
        assert line == "calibrate: bias shifts: 3/4 sample (75%, 12 s, about 4 s left)"
        monkeypatch.setattr(progress.time, "monotonic", lambda: 113.0)


def test_an_interrupted_phase_writes_no_done_line(capsys):
    with pytest.raises(KeyboardInterrupt), LogLines(desc="plan", total=4) as bar:
        bar.update(1)
        raise KeyboardInterrupt
    assert capsys.readouterr().err.splitlines() == ["plan: started, 4 it"]


@pytest.mark.slow
def test_a_zoo_plan_logged_to_a_file_is_a_few_dozen_plain_lines(tmp_path, capsys, monkeypatch):
    from quantlab.cli import main

    # Every phase may write its tenths (as a slow machine would) and still stays short.
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    # A floor all-INT8 misses (about 38 dB), so that the trials run after it.
    argv = ["plan", "digits-cnn", "--data", "zoo", "--eval", "zoo", "--min-sqnr", "45",
            "--max-samples", "64", "--trials", "4", "--hard-samples", "8",
            "--resamples", "20", "--calibrators", "max", "--repairs"]
    assert main([*argv, "--out", str(tmp_path / "logged")]) == 0
    logged = capsys.readouterr()
    lines = (logged.out + logged.err).splitlines()
    assert "\r" not in logged.out + logged.err
    assert any(line.startswith("trials: started") for line in lines)
    assert any(line.startswith("INT8 evaluation: done") for line in lines)
    assert len(lines) <= 40, "\n".join(lines)
    assert main([*argv, "--no-progress", "--out", str(tmp_path / "quiet")]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and len(quiet.out.splitlines()) <= 3, quiet.out
