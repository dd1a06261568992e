"""Write one HTML index of every experiment folder under the given folders.

Lists the runs of calibrate, sweep, plan, validate and demo found in or under each
DIR, newest first, with each run's key figures (method and samples, best
configuration and sufficiency verdicts, INT8 share and certificate, task
metrics) and a link to its own report.html. The page is self-contained.

examples:
  quantlab report reports/ runs/ --out reports/index.html
"""

from __future__ import annotations

import argparse

HELP = "an HTML index of every experiment folder under some folders, newest first"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quantlab report`."""
    parser.add_argument("roots", nargs="+", metavar="DIR", help="folders holding experiment "
                        "folders (searched recursively)")
    parser.add_argument("--out", metavar="FILE",
                        help="the index page to write (default: DIR/index.html of the first DIR)")
    parser.add_argument("--force", action="store_true",
                        help="replace --out even when it is a file quantlab did not write (a "
                             "page quantlab wrote is replaced without it; a page inside an "
                             "experiment folder is refused either way)")


def run(args: argparse.Namespace) -> int:
    """Find the runs and write the index."""
    from pathlib import Path

    from quantlab.experiments.experiment import check_page
    from quantlab.experiments.report import write_report
    from quantlab.experiments.report.runs import index_section
    from quantlab.experiments.runs import find_runs

    runs = find_runs(args.roots)
    out = Path(args.out) if args.out else Path(args.roots[0]) / "index.html"
    check_page(out, args.force)
    write_report(out, "quantlab runs", [index_section(runs, out)],
                 subtitle=", ".join(str(root) for root in args.roots))
    kinds = ", ".join(f"{sum(r.kind == k for r in runs)} {k}"
                      for k in dict.fromkeys(r.kind for r in runs))
    print(f"report: {len(runs)} runs ({kinds or 'none'}); wrote {out}")
    return 0
