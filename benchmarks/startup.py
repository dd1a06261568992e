"""Startup of the command line: `quantlab --help` and `quantlab COMMAND --help`.

Each invocation runs in a fresh child interpreter, as a user's shell starts it,
`--runs` times: wall time from spawn to exit (interpreter start included) and the
child's own peak RSS (VmHWM, read at exit). Medians are printed with the slowest
run, then the imports `quantlab --help` pays most for (``python -X importtime``,
top-level modules by cumulative time) and which heavy packages it loaded. Target
(issue 24): under 0.5 s and 100 MB each.

    python benchmarks/startup.py            # 5 runs of each
    python benchmarks/startup.py --runs 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = ("demo", "calibrate", "validate", "zoo", "plan", "build")
HEAVY = ("numpy", "pandas", "onnx", "onnxruntime", "torch", "matplotlib", "scipy", "numba",
         "jinja2", "tqdm", "PIL")
# Runs `quantlab ARGS` as the console script does and reports VmHWM and heavy modules at exit.
CHILD = """\
import atexit, sys
def report():
    status = open("/proc/self/status").read().splitlines()
    kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    heavy = [m for m in {heavy!r} if m in sys.modules]
    print("STARTUP", kib, ",".join(heavy), file=sys.stderr)
atexit.register(report)
sys.argv = ["quantlab", *{args!r}]
from quantlab.cli import main
sys.exit(main())
"""


def run_once(args: list[str]) -> tuple[float, float, list[str]]:
    """(wall seconds, peak RSS MiB, heavy modules loaded) of one `quantlab ARGS`."""
    code = CHILD.format(args=args, heavy=HEAVY)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - start
    line = next(row for row in done.stderr.splitlines() if row.startswith("STARTUP"))
    _, kib, heavy = (line.split(" ") + [""])[:3]
    return wall, int(kib) / 1024, [m for m in heavy.split(",") if m]


def top_imports(args: list[str], count: int) -> list[tuple[float, str]]:
    """The `count` top-level imports of `quantlab ARGS` with the most cumulative time (ms)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           f"import sys; sys.argv = ['quantlab', *{args!r}]\n"
                           "from quantlab.cli import main\nmain()"],
                          capture_output=True, text=True)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        if not name[1:].startswith(" "):  # top level: no indentation
            rows.append((int(cumulative) / 1000, name.strip()))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="imports listed (default: 8)")
    options = parser.parse_args()
    print(f"{'invocation':<28} {'median s':>9} {'max s':>7} {'median MiB':>11} heavy modules")
    for args in (["--help"], *([c, "--help"] for c in COMMANDS)):
        runs = [run_once(args) for _ in range(options.runs)]
        walls, peaks = [r[0] for r in runs], [r[1] for r in runs]
        heavy = sorted({m for r in runs for m in r[2]})
        print(f"{'quantlab ' + ' '.join(args):<28} {statistics.median(walls):9.3f} "
              f"{max(walls):7.3f} {statistics.median(peaks):11.1f} {', '.join(heavy) or '-'}")
    print("\nslowest top-level imports of `quantlab --help` (python -X importtime):")
    for ms, name in top_imports(["--help"], options.top):
        print(f"  {ms:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
