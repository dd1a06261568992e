"""Does the local error rank units by their effect on the output? Spearman rank correlation.

For a model and its calibration data (the calibration folder of `quantlab calibrate`:
its model.onnx, BatchNorm folded and depthwise inputs equalized as calibrate did, and its
scales), every unit's local INT8 SQNR (the planner's prior and `validate --mode local`:
the unit alone on FP32 inputs, measured at the output of the fused layer TensorRT runs:
folded BatchNorm, bias and fused activation) is compared with its single-unit output
impact: that unit alone in INT8, every other unit in FP32, output SQNR on the same
samples (one pass of that plan's Q/DQ model per unit). Prints the Spearman correlation of
both rankings, also for the local error taken at the linear op's own output (before the
fused activation) and for the planner's prior since round 3 (each unit's output SQNR
alone on the first ``--alone-samples`` samples only: `quantlab plan`'s single-unit step),
and the units the local error ranks worst and the output ranks worst; ``--out FILE``
writes every unit's figures.

    python -m benchmarks.local_rank reports/layout --samples 16

The layout-int8 study measured 0.12 with the error taken before the BatchNorm the Paddle
export keeps (quantlab before the fold) and 0.60 after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr


def main(argv: list[str] | None = None) -> int:
    from quantlab import graph, plan
    from quantlab.calibration import qdq
    from quantlab.calibration.calibrate import Scales
    from quantlab.data import Preprocess, open_data
    from quantlab.engine.backends.onnxruntime import OnnxRuntimeBackend
    from quantlab.experiments.experiment import read_json
    from quantlab.planner.measure import in_runs, output_sample_axes
    from quantlab.planner.trials import single_unit_samples

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a calibration folder (quantlab calibrate --out)")
    parser.add_argument("--samples", type=int, default=4, help="calibration samples used")
    parser.add_argument("--alone-samples", type=int,
                        help="samples of the single-unit prior, the first of --samples "
                             "(default: as many as `quantlab plan` takes of that many)")
    parser.add_argument("--top", type=int, default=5, help="worst units listed")
    parser.add_argument("--out", help="write every unit's figures (JSON) here")
    args = parser.parse_args(argv)

    folder = Path(args.folder)
    recorded = read_json(folder / "calibration.json")
    model = graph.load_model(folder / "model.onnx")
    g = graph.Graph(model)
    amax = plan.share_scales(g, Scales.load(folder / "scales.json").amax)
    preprocess = Preprocess.from_dict(recorded["preprocess"]) if recorded.get("preprocess") \
        else None
    source = open_data(recorded["data"], g.inputs, 1, args.samples, preprocess)
    batches = list(source)
    fp32 = OnnxRuntimeBackend(model, name="fp32")
    units = plan.find_units(g, {k: np.shape(v) for k, v in batches[0].items()},
                            lambda names: {n: a.shape for n, a in
                                           fp32.run(batches[0], names).items()})
    local = plan.local_sqnr(g, amax, units, batches, precisions=("int8",))
    unfused = plan.local_sqnr(g, amax, units, batches, precisions=("int8",),
                              fuse_activations=False)
    probe = open_data(recorded["data"], g.inputs, 2, 2, preprocess)
    # Outputs samples first, as the planner reads them (silero-vad's state [2, N, 128]).
    axes = output_sample_axes(model, fp32.run, next(iter(probe)), probe)
    references = [in_runs(fp32.run, source, 1, axes)(b) for b in batches]
    few = min(args.alone_samples or single_unit_samples(len(batches), len(local)),
              len(batches))
    impact, prior = {}, {}
    for unit in units:
        if unit.name not in local:
            continue
        alone = qdq.quantize_model(model, amax, {n: "int8" if u is unit else "fp32"
                                                 for u in units for n in u.nodes})
        backend = OnnxRuntimeBackend(alone, name=f"{unit.name} in INT8")
        run = in_runs(backend.run, source, 1, axes)
        outputs = [run(b) for b in batches]
        impact[unit.name] = plan.output_sqnr(outputs, references)
        prior[unit.name] = {"int8": plan.output_sqnr(outputs[:few], references[:few])}
    names = sorted(impact)

    def rho(figures) -> float:
        return round(float(spearmanr([figures[n]["int8"] for n in names],
                                     [impact[n] for n in names]).statistic), 3)

    by_local = sorted(names, key=lambda n: local[n]["int8"])[:args.top]
    by_output = sorted(names, key=lambda n: impact[n])[:args.top]
    if args.out:
        Path(args.out).write_text(json.dumps(
            {n: {"local_fused_db": local[n]["int8"], "local_op_output_db": unfused[n]["int8"],
                 "alone_few_db": prior[n]["int8"], "output_db": impact[n]} for n in names},
            indent=1))
    print(json.dumps({
        "model": recorded.get("data"), "units": len(names), "samples": len(batches),
        "spearman_local_vs_output": rho(local),
        "spearman_local_at_op_output_vs_output": rho(unfused),
        f"spearman_alone_on_{few}_vs_output": rho(prior),
        "worst_by_local": [(n, round(local[n]["int8"], 1), round(impact[n], 1))
                           for n in by_local],
        "worst_by_output": [(n, round(local[n]["int8"], 1), round(impact[n], 1))
                            for n in by_output],
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
