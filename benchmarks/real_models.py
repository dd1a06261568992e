"""The README flow on the real-model suite, as a user runs it: wall time, peak RSS, output SQNR.

For every model of tests/realmodels.py (the test setup fetches them; this script generates
their seeded data with each package's preprocessing), runs in a child process under
``/usr/bin/time``:

- ``quantlab calibrate MODEL --data CALIB --out DIR`` with the default method and with
  ``--method entropy`` (TensorRT's EntropyCalibration2), and
- ``quantlab validate --from DIR --data VAL --out V`` in ``--mode global`` and ``--mode local``
  (ONet: also ``--torch tests.realmodels:onet`` on its TorchScript and dynamo exports),

and reads each validation's ``summary.json``: the worst output SQNR of the INT8 model vs
FP32 (end to end, ONNX Runtime integer kernels) and the worst local layer. The comparison
with ONNX Runtime's ``quantize_static`` MinMax on the same data is
``benchmarks/default_method.py``.

    python benchmarks/real_models.py                 # all models
    python benchmarks/real_models.py --models vad onet --workdir /tmp/rm-bench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import realmodels  # noqa: E402

IMAGENET = ["--mean", "0.485", "0.456", "0.406", "--std", "0.229", "0.224", "0.225"]
# (model file key, calibration data key, validation data key, options), per case.
CASES = {
    "layout": ("layout", "calib", "val", ["--channel-order", "BGR", *IMAGENET]),
    "orientation": ("orientation", "calib", "val",
                    ["--channel-order", "BGR", "--resize-mode", "center-crop",
                     "--resize-short", "256", "--interpolation", "lanczos", *IMAGENET]),
    "vad": ("vad", "calib_npz", "val_npz", []),
    "onet-torchscript-b1": ("onet:legacy_static", "calib_npy", "val_npy", []),
    "onet-dynamo": ("onet:quantlab", "calib_npy", "val_npy", []),
    "yolo": ("yolo", "calib_npy", "val_npy", []),
    # The 640x640 PNG pages as RGB with ImageNet mean/std (the resize is the identity; the
    # model's H and W are dynamic): the package's preprocessing bit for bit.
    "ppocr_det": ("ppocr_det", "calib", "val", ["--resize", "640", "640", *IMAGENET]),
}
# ppocr_det: 128 pages, the calibration issue 41 times against ORT MinMax.
SIZES = {"layout": (16, 8), "orientation": (64, 32), "vad": (64, 32), "onet": (64, 32),
         "yolo": (64, 32), "ppocr_det": (128, 32)}


def timed(args: list[str]) -> tuple[float, float, int, str]:
    """Run ``quantlab ARGS`` under /usr/bin/time: (seconds, peak RSS in MB, exit code, stderr)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as record:
        proc = subprocess.run(["/usr/bin/time", "-o", record.name, "-f", "%e %M", "quantlab",
                               *args, "--no-progress"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
        seconds, kb = record.read().split()[-2:]
    return float(seconds), int(kb) / 1024, proc.returncode, proc.stderr


def worst_output_db(summary: dict) -> float:
    """The lowest end-to-end output SQNR of the FP32-vs-INT8 pair in a validation summary."""
    pair = next(p for p in summary["pairs"] if p["test"] != "onnx_fp32")
    values = [o["sqnr_db"] for o in pair["outputs"].values()]
    return min(math.inf if v is None else float(v) for v in values)


def _cell(row: dict, prefix: str) -> str:
    if f"{prefix}_error" in row:
        return "FAILED: " + re.sub(r"\s+", " ", row[f"{prefix}_error"])[:80]
    if f"{prefix}_s" not in row:
        return "-"
    return f"{row[f'{prefix}_s']:.1f} / {row[f'{prefix}_mb']:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="quantlab-real-"))
    models = realmodels.fetch()
    onet_files = None
    rows = []
    for case in args.models:
        key, calib_key, val_key, options = CASES[case]
        family = key.split(":")[0]
        data = realmodels.GENERATORS[family](work / "data" / family,
                                             n_calib=SIZES[family][0], n_val=SIZES[family][1])
        if family == "onet":
            onet_files = onet_files or realmodels.export_onet(work / "onet")
            model = onet_files[key.split(":")[1]]
        else:
            model = models[family]
        for method in ("default", "entropy"):
            out = work / "runs" / case / method
            calib = [str(model), "--data", str(data[calib_key]), "--out", str(out), "--force",
                     *options, *([] if method == "default" else ["--method", method])]
            seconds, mb, code, err = timed(["calibrate", *calib])
            row = {"case": case, "method": method, "calibrate_s": seconds, "calibrate_mb": mb}
            if code:
                row["calibrate_error"] = err.strip().splitlines()[-1]
                rows.append(row)
                continue
            for mode in ("global", "local"):
                target = out / f"validate-{mode}"
                extra = ["--torch", "tests.realmodels:onet"] if family == "onet" else []
                seconds, mb, code, err = timed(
                    ["validate", "--from", str(out), "--data", str(data[val_key]), "--out",
                     str(target), "--mode", mode, "--force", *options, *extra])
                row[f"{mode}_s"], row[f"{mode}_mb"] = seconds, mb
                if code:
                    row[f"{mode}_error"] = err.strip().splitlines()[-1]
                    continue
                summary = json.loads((target / "summary.json").read_text())
                if mode == "global":
                    row["output_sqnr_db"] = worst_output_db(summary)
                    torch_pair = [p for p in summary["pairs"] if p["reference"] == "torch"]
                    if torch_pair:
                        row["torch_tensors"] = (f"{torch_pair[0]['tensors_compared']} mapped, "
                                                f"{len(torch_pair[0]['tensors_not_compared'])} not")
                else:
                    divergence = summary["pairs"][-1]["first_divergence"]
                    row["local_first"] = (f"{divergence['tensor']} {divergence['sqnr_db']:.1f} dB"
                                          if divergence else "none")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| model | method | calibrate s / MB | validate global s / MB | validate local s / MB "
          "| worst output SQNR dB | local first divergence | torch stage |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['method']} | {_cell(r, 'calibrate')} | {_cell(r, 'global')} | "
              f"{_cell(r, 'local')} | {r.get('output_sqnr_db', float('nan')):.1f} | "
              f"{r.get('local_first', '-')} | {r.get('torch_tensors', '-')} |")
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "real_models.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
