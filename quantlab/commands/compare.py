"""Put two experiment folders side by side.

A and B are --out folders of calibrate, sweep, plan, validate or demo. Shows every
setting that differs (every field the folders' records hold: calibration.json,
summary.json), the INT8 model's accuracy against FP32 (output SQNR, the --metric
result) where the folder or a validate run of it holds it (inside the folder, or
beside it run with --from it; else the command that measures it), the key figures
(metrics with their intervals), every tensor's amax ratio B / A where both have
scales (largest change first), and the per-layer FP32-vs-INT8 SQNR difference
where both were validated. Prints the largest differences and writes a
self-contained page.

examples:
  quantlab compare runs/monday runs/tuesday --out runs/monday-vs-tuesday.html
"""

from __future__ import annotations

import argparse

HELP = "two experiment folders side by side: settings, scales, per-layer SQNR, metrics"
# Rows printed per table on the console.
PRINTED = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab compare`."""
    parser.add_argument("a", metavar="A", help="an experiment folder")
    parser.add_argument("b", metavar="B", help="another experiment folder")
    parser.add_argument("--out", default="compare.html", metavar="FILE",
                        help="the page to write (default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="replace --out even when it is a file quantlab did not write (a "
                             "page quantlab wrote is replaced without it; a page inside an "
                             "experiment folder is refused either way)")


def run(args: argparse.Namespace) -> int:
    """Compare the two runs, print the largest differences and write the page."""
    from quantlab.experiments.experiment import check_page
    from quantlab.experiments.report import write_report
    from quantlab.experiments.report.runs import comparison_sections
    from quantlab.experiments.runs import compare_runs, load_run

    check_page(args.out, args.force)
    comparison = compare_runs(load_run(args.a), load_run(args.b))
    print(f"compare: A {args.a} ({comparison.a.kind}) vs B {args.b} ({comparison.b.kind})")
    for row in comparison.settings.itertuples(index=False):
        print(f"  setting {row.setting}: {row.a or '-'} -> {row.b or '-'}")
    for row in comparison.accuracy.itertuples(index=False):
        print(f"  accuracy {row.figure}: {row.a or '-'} -> {row.b or '-'}")
    for row in comparison.figures.itertuples(index=False):
        if row.a != row.b:
            print(f"  {row.figure}: {row.a or '-'} -> {row.b or '-'}")
    if comparison.scales is not None:
        for row in comparison.scales.head(PRINTED).itertuples(index=False):
            print(f"  amax {row.tensor}: {row.amax_a:.4g} -> {row.amax_b:.4g} (x{row.ratio:.3g})")
    if comparison.layers is not None:
        for row in comparison.layers.head(PRINTED).itertuples(index=False):
            print(f"  SQNR {row.tensor}: {row.sqnr_db_a:.1f} -> {row.sqnr_db_b:.1f} dB")
    write_report(args.out, f"quantlab compare: {args.a} vs {args.b}",
                 comparison_sections(comparison))
    print(f"compare: wrote {args.out}")
    return 0
