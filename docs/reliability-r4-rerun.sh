#!/bin/bash
# Re-runs the bad cases of reliability-r4.md, in a scratch folder laid out as the report's
# (docs/reliability-r4-rerun.md); prints its markdown table.
export PYTHONPATH=${QUANTLAB:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}  # the checkout under test
Q="python -m quantlab.cli"
rm -rf o && mkdir o
row() {  # id, shown command, then the command to run
  local id="$1" shown="$2"; shift 2
  local out rc
  out=$("$@" 2>&1); rc=$?
  local last=$(printf '%s\n' "$out" | grep -v '^\s*$' | tail -1 | sed 's/|/\\|/g' | cut -c1-330)
  printf '| %s | `%s` | %s | %s |\n' "$id" "$shown" "$rc" "$last"
}
echo '| case | command | rc | last line of output (new message or behaviour) |'
echo '|---|---|---|---|'
row S09 "sweep base/model.onnx --data digits.npy --eval eval64.npy --resamples 0 --out o/S09" bash -c "$Q sweep base/model.onnx --data digits.npy --eval eval64.npy --resamples 0 --out o/S09 2>&1 | tail -1 | tr '\n' ' '; test -e o/S09 && echo 'o/S09 exists' || echo '(o/S09 absent)'"
cp -r base o/S16
row S16 "sweep base/model.onnx --data digits.npy --eval eval64.npy --methods max --out o/S16 (a calibration copy)" $Q sweep base/model.onnx --data digits.npy --eval eval64.npy --methods max --out o/S16 --no-progress
row S18 "sweep base/model.onnx --data vbase --eval eval64.npy --out o/S18" $Q sweep base/model.onnx --data vbase --eval eval64.npy --out o/S18 --no-progress
$Q calibrate base/model.onnx --data outlier1e6.npy --method max --weight-amax max --no-bias-correction --out o/reg --no-progress >/dev/null 2>&1
row K05 "check o/reg --baseline base --eval eval64.npy --max-drop nan" $Q check o/reg --baseline base --eval eval64.npy --max-drop nan
row K05b "check o/reg --baseline base --eval eval64.npy --max-drop inf" $Q check o/reg --baseline base --eval eval64.npy --max-drop inf
row K05+ "check o/reg --baseline base --eval eval64.npy (the regression itself)" $Q check o/reg --baseline base --eval eval64.npy --no-progress
row K06 "check base --baseline base --eval eval64.npy --min-sqnr nan" $Q check base --baseline base --eval eval64.npy --min-sqnr nan
row K10 "check base --baseline vbase --eval eval64.npy" $Q check base --baseline vbase --eval eval64.npy --no-progress
python - <<'PY'
import shutil, onnx, numpy as np
from onnx import numpy_helper
for name in ("o/K11b", "o/K12c"):
    shutil.copytree("base", name)
    m = onnx.load(f"{name}/model.int8.onnx")
    scales = {n.input[1] for n in m.graph.node if n.op_type == "QuantizeLinear"}
    for i in m.graph.initializer:
        if i.name in scales:
            a = numpy_helper.to_array(i).copy(); a[...] = np.nan
            i.CopyFrom(numpy_helper.from_array(a, i.name))
    onnx.save(m, f"{name}/model.int8.onnx")
PY
row K11 "check o/reg --baseline o/K11b --eval eval64.npy (baseline INT8 outputs NaN)" $Q check o/reg --baseline o/K11b --eval eval64.npy --no-progress
row K12 "check o/K12c --baseline base --eval eval64.npy (candidate INT8 outputs NaN)" $Q check o/K12c --baseline base --eval eval64.npy --no-progress
row K15 "check base --baseline base --eval eval_nan.npy" $Q check base --baseline base --eval eval_nan.npy --no-progress
row K19 "check base --baseline base --eval eval64.npy --resamples 0" $Q check base --baseline base --eval eval64.npy --resamples 0
mkdir -p o/H_runs && cp -r V0 'o/H_runs/javascript:alert(7)' && cp -r V0 'o/H_runs/<img src=x onerror=alert(1)>'
row H01 "report o/H_runs (folders 'javascript:alert(7)', '<img src=x onerror=...>'); grep href" bash -c "$Q report o/H_runs >/dev/null && grep -o 'href=\"[^\"#][^\"]*' o/H_runs/index.html | tr '\n' ' '; grep -c '<img src=x' o/H_runs/index.html"
mkdir -p o/H02 && cp -r base o/H02/cal && echo mine > o/H02/index.html
row H02 "report o/H02 (holding the user's index.html); cat o/H02/index.html" bash -c "$Q report o/H02 2>&1 | tr '\n' ' '; echo -n 'index.html now: '; cat o/H02/index.html"
echo notes > o/H09_notes.txt
row H09 "compare base o/reg --out o/H09_notes.txt; cat it" bash -c "$Q compare base o/reg --out o/H09_notes.txt 2>&1 | tail -1 | tr '\n' ' '; echo -n 'file now: '; cat o/H09_notes.txt"
cp -r base o/H10a
row H10 "compare o/H10a o/reg --out o/H10a/scales.json" $Q compare o/H10a o/reg --out o/H10a/scales.json
row DR3 "doctor --zoo ../../escape" $Q doctor --zoo ../../escape
row MT08 "validate ... --metric r4metrics:sysexit --out o/MT08" $Q validate --onnx base/model.onnx --engine base/model.int8.onnx --data digits.npy --metric r4metrics:sysexit --out o/MT08 --no-progress
row MT15 "plan base/model.onnx --data digits.npy --eval eval64.npy --metric r4metrics:boolean --max-drop 0 --out o/MT15" $Q plan base/model.onnx --data digits.npy --eval eval64.npy --metric r4metrics:boolean --max-drop 0 --out o/MT15 --no-progress
row PP12 "calibrate img8.onnx --data img --resize-mode center-crop --resize-short 4 --out o/PP12" $Q calibrate img8.onnx --data img --resize-mode center-crop --resize-short 4 --out o/PP12 --no-progress
row PP13 "calibrate img8.onnx --data img --resize-short 20 --out o/PP13" bash -c "$Q calibrate img8.onnx --data img --resize-short 20 --out o/PP13 --no-progress 2>&1 | grep -m1 resize-short"
row PP15 "calibrate img8.onnx --data img --resize-mode letterbox --pad-value 300 --out o/PP15" $Q calibrate img8.onnx --data img --resize-mode letterbox --pad-value 300 --out o/PP15
row PP17b "calibrate base/model.onnx --data digits.npy --input gain=NaN --out o/PP17b" $Q calibrate base/model.onnx --data digits.npy --input gain=NaN --out o/PP17b
row PP18b "calibrate base/model.onnx --data digits.npy --input gain=1e999 --out o/PP18b" $Q calibrate base/model.onnx --data digits.npy --input gain=1e999 --out o/PP18b
row PP20 "calibrate base/model.onnx --data digits.npy --input 'b=[[1,2],[3]]' --out o/PP20" $Q calibrate base/model.onnx --data digits.npy --input 'b=[[1,2],[3]]' --out o/PP20
row PP20b "calibrate base/model.onnx --data digits.npy --input 'gain=[[1,2],[3]]' --out o/PP20b" $Q calibrate base/model.onnx --data digits.npy --input 'gain=[[1,2],[3]]' --out o/PP20b
row PP22b "calibrate base/model.onnx --data digits.npy --input gain=2 --input gain=3 --out o/PP22b" $Q calibrate base/model.onnx --data digits.npy --input gain=2 --input gain=3 --out o/PP22b --no-progress
row G05 "calibrate bn0.onnx --data bn0.npy --out o/G05 (BatchNorm var 0, eps 0)" $Q calibrate bn0.onnx --data bn0.npy --out o/G05 --no-progress
SW="sweep base/model.onnx --data digits.npy --eval eval64.npy --methods max entropy --calib-sizes 64 200 --resamples 50 --metric r4versioned:score"
R4_STOP=150 $Q $SW --out o/I06 --no-progress >/dev/null 2>&1
sed -i 's/return 1.0  # version 1/return 2.0  # version 2/' r4versioned.py; rm -rf __pycache__
row I06 "$SW --out o/I06: interrupted, score() edited, rerun" bash -c "$Q $SW --out o/I06 --no-progress > o/I06.log 2>&1; echo rc \$?; grep 'resuming\|starting over' o/I06.log"
sed -i 's/return 2.0  # version 2/return 1.0  # version 1/' r4versioned.py; rm -rf __pycache__
PL="plan base/model.onnx --data digits.npy --eval eval64.npy --max-drop 0 --resamples 50 --metric r4versioned:score"
R4_STOP=150 $Q $PL --out o/I07 --no-progress >/dev/null 2>&1
sed -i 's/return 1.0  # version 1/return 2.0  # version 2/' r4versioned.py; rm -rf __pycache__
row I07 "$PL --out o/I07: interrupted, score() edited, rerun" bash -c "ls -a o/I07 | tr '\n' ' '; $Q $PL --out o/I07 --no-progress > o/I07.log 2>&1; echo rc \$?; grep -c 'resuming' o/I07.log; echo 'resume lines (0: started over)'"
sed -i 's/return 2.0  # version 2/return 1.0  # version 1/' r4versioned.py; rm -rf __pycache__
R4_STOP=150 $Q $SW --out o/I08 --no-progress >/dev/null 2>&1
for f in o/I08/.sweep-progress/block-*.npz; do head -c 100 "$f" > "$f.t" && mv "$f.t" "$f"; done
row I08 "$SW --out o/I08: interrupted, its blocks truncated, rerun" bash -c "$Q $SW --out o/I08 --no-progress > o/I08.log 2>&1; echo rc \$?; grep 'starting over' o/I08.log; ls -a o/I08 | tr '\n' ' '"
row I09 "sweep ... --out on a full disk" echo "not re-run (needs a tmpfs mount; tests/test_reliability_r4.py::test_i09 plays it: the failed sweep removes .sweep-progress)"
( $Q calibrate base/model.onnx --data digits.npy --out o/I12 --no-progress > o/I12.cal.log 2>&1; echo "calibrate rc $?" >> o/I12.cal.log ) &
$Q sweep base/model.onnx --data digits.npy --eval eval64.npy --methods max --out o/I12 --no-progress > o/I12.sw.log 2>&1; echo "sweep rc $?" >> o/I12.sw.log
wait
row I12 "calibrate and sweep into o/I12 at once" bash -c "tail -1 o/I12.cal.log; tail -2 o/I12.sw.log | tr '\n' ' '"
row R5 "calibrate() on stats.npz whose max is NaN" python -c "import numpy as np;from quantlab.calibration.collect import Statistics;from quantlab.calibration.calibrate import calibrate;z=dict(np.load('base/stats.npz'));z['max'][:]=np.nan;np.savez('o/nan.npz',**z);print(calibrate(Statistics.load('o/nan.npz'),'entropy').amax)"
row P44 "plan base/model.onnx --data vbase --eval eval64.npy --min-sqnr 30 --out o/P44" $Q plan base/model.onnx --data vbase --eval eval64.npy --min-sqnr 30 --out o/P44 --no-progress
row B01 "plan base/model.onnx --data digits.npy --eval eval64.npy --min-sqnr 45 --trt-version 8.6.1 --out o/B01 && build o/B01" bash -c "$Q plan base/model.onnx --data digits.npy --eval eval64.npy --min-sqnr 45 --trt-version 8.6.1 --out o/B01 --no-progress >/dev/null 2>&1 && $Q build o/B01 2>&1 | head -1"
row MT09 "validate ... --metric r4metrics:slow (bootstrap progress)" echo "tests/evaluation/test_validate.py::test_a_metric_bootstrap_shows_progress"
# G08: two depthwise convs sharing one weight and bias, on relu(x) and -0.1 * relu(x), summed
# (tests/helpers.py); 3 channels, with the initializers also listed as graph inputs for G08b.
python - <<PY
import sys
import numpy as np, onnx
sys.path.insert(0, "$PYTHONPATH/tests")
from helpers import shared_weight_convs
for name, channels, listed in (("g08", 3, False), ("g08b", 8, True)):
    onnx.save(shared_weight_convs(channels, listed)[0], f"{name}.onnx")
    spread = np.geomspace(0.1, 10, channels, dtype=np.float32)[None, :, None, None]
    x = np.random.default_rng(2).standard_normal((64, channels, 8, 8), np.float32) * spread
    np.save(f"{name}.npy", x)
PY
row G08 "calibrate g08.onnx --data g08.npy --out o/G08 (two depthwise convs sharing one weight into one Add)" $Q calibrate g08.onnx --data g08.npy --out o/G08 --no-progress
row G08+ "calibrate g08.onnx --data g08.npy --no-equalize --no-bias-correction --weight-amax max --method percentile --out o/G08+" $Q calibrate g08.onnx --data g08.npy --no-equalize --no-bias-correction --weight-amax max --method percentile --out o/G08+ --no-progress
row G08b "calibrate g08b.onnx --data g08b.npy --out o/G08b (8 channels, initializers also graph inputs)" $Q calibrate g08b.onnx --data g08b.npy --out o/G08b --no-progress
