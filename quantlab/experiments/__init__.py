"""Experiments: what a run writes and reads back (docs/internals.md).

Owns ``experiment`` (experiment folders on disk: all-or-nothing output folders, JSON records
read with their fields checked), ``records`` (each kind of folder as a typed, versioned
record), ``runs`` (folders indexed as runs and compared),
``sweep`` and ``sweep_folder`` (calibration sweeps and their folder) and ``report/`` (the HTML
reports; it renders results handed in and runs nothing).

``experiment`` imports only ``errors`` at its head: every step writes through it. Must not
import ``commands/``, ``cli`` or ``api``.
"""
