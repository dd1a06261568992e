"""The demo's first screen: the story in numbers from its records, names escaped, codes explained.

The demo itself runs for minutes (`quantlab demo`); these tests render its report parts from
records of the shape it writes into summary.json.
"""

from helpers import assert_every_column_explained

from quantlab import demo
from quantlab.experiments.report import render_report
from quantlab.experiments.report.demo import story_section
from quantlab.plan import Plan, Reason, UnitDecision


def _record(certified: bool = True) -> dict:
    layer = {"tensor": "dw_out", "node": "dw<1>", "op_type": "Conv", "sqnr_db": 0.9,
             "depthwise": True}
    return {
        "name": "shapes-det", "description": "a detector.", "metric": "map", "eval_samples": 500,
        "fp32": 0.6657, "int8": 0.5497, "method": "percentile",
        "methods": {"max": {"map": 0.2402}, "percentile": {"map": 0.5497}},
        "validation": {"samples": 64, "folder": "shapes-det/validate",
                       "divergence": {**layer, "tensor": "relu", "node": "stem",
                                      "op_type": "Relu", "sqnr_db": 27.1, "depthwise": False},
                       "worst": [layer]},
        "plan": {"command": "quantlab plan shapes-det --out shapes-det/plan",
                 "folder": "shapes-det/plan", "max_drop": 0.01, "int8_mac_share": 0.981,
                 "model_runs": 4, "repairs": ["dw-equalize"],
                 "certificate": {"value": 0.6615, "reference": 0.6657, "confidence": 0.95,
                                 "interval": [0.0021, 0.0110], "certified": certified,
                                 "samples": 500}},
    }


def _plan() -> Plan:
    spread = Reason("R-DW", False, ("int8", "fp16", "fp32"), "weight ranges spread <40x>",
                    "Nagel et al. 2019")
    return Plan({
        "stem": UnitDecision("int8", ["stem"], 981, [], {"local_sqnr_int8_db": 40.0}),
        "dw<1>": UnitDecision("fp16", ["dw<1>"], 19, [spread],
                              {"local_sqnr_int8_db": 0.9, "local_sqnr_fp16_db": 70.0,
                               "output_rank": 1}),
    })


def test_story_tells_fp32_all_int8_and_the_plan_with_pins_explained(tmp_path):
    (tmp_path / "trtexec.txt").write_text("# TensorRT 8.6 - 10.x\ntrtexec --onnx=model.int8.onnx "
                                          "--int8\n# TensorRT 10.x\ntrtexec --onnx=model.int8"
                                          ".onnx --stronglyTyped\n")
    section = story_section(_record(), _plan(), tmp_path)
    page = render_report("demo", [section])
    # The three rows of the first screen, in numbers.
    for text in ("0.6657", "0.5497", "0.6615", "98.1%", "-11.60", "-0.42",
                 "certified: 95% bound of the margin +0.21 points", "planned INT8 (dw-equalize)"):
        assert text in page, text
    # The validator's layers, the plan's own measure of them, the command that builds it.
    assert "dw_out (depthwise Conv dw&lt;1&gt;, 0.9 dB)" in page
    assert "<code>dw&lt;1&gt;</code> FP16 at 70.0 dB" in page
    assert "trtexec --onnx=model.int8.onnx --stronglyTyped" in page  # the TensorRT 10 line
    assert "--int8" not in page
    # The pinned unit's reason: a short code, its evidence on hover (escaped), the legend.
    assert ('<abbr class="soft" title="R-DW (soft): weight ranges spread &lt;40x&gt;">R-DW'
            '</abbr>') in page
    assert "<dt>R-DW</dt><dd>Depthwise convs whose per-channel weight ranges spread" in page
    assert "&lt;40x&gt;" in page and "<40x>" not in page
    assert "1 of the 2 units leave INT8, 1.9% of the MACs" in page
    assert assert_every_column_explained(page) == 2  # the three rows, the pinned units


def test_story_says_when_the_plan_is_not_certified_and_nothing_is_pinned(tmp_path):
    (tmp_path / "trtexec.txt").write_text("trtexec --onnx=model.int8.onnx\n")
    plan = _plan()
    plan.units["dw<1>"].precision = "int8"
    page = render_report("demo", [story_section(_record(certified=False), plan, tmp_path)])
    assert "NOT certified" in page and "every one of the 2 units stays in INT8" in page


def test_the_plan_command_of_the_demo_names_calibrators_only_when_some_are_left_out():
    argv = demo.plan_argv("shapes-det", "out", ["entropy", "max", "percentile", "mse"], None)
    assert argv == ["shapes-det", "--data", "zoo", "--eval", "zoo", "--metric", "map",
                    "--max-drop", "0.01", "--out", "out"]
    argv = demo.plan_argv("digits-cnn", "out", ["max"], 64)
    assert argv[argv.index("--metric") + 1] == "top1"
    assert argv[argv.index("--calibrators"):argv.index("--out")] == [
        "--calibrators", "max", "--max-samples", "64"]


def test_the_demo_plans_as_the_command_line_it_shows():
    import argparse

    from quantlab.commands import plan as command
    from quantlab.commands.options import data_options

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    for methods, limit in ((["mse", "entropy", "max", "percentile"], None), (["max"], 64)):
        args = parser.parse_args(demo.plan_argv("digits-cnn", "out", methods, limit))
        assert (command.plan_options(args), data_options(args)) == demo.plan_settings(
            "digits-cnn", methods, limit)


def test_the_demo_plan_names_the_folder_it_ends_up_in_not_the_staging_one(tmp_path):
    """The demo plans into its staging folder; the plan's next steps (summary.json, its
    report) name the folder the user finds afterwards (they named the staging folder, gone
    once the demo finished)."""
    from quantlab.experiments.experiment import read_json

    staging, final = tmp_path / ".demo.quantlab-tmp-x" / "plan", tmp_path / "demo" / "plan"
    demo._plan("digits-cnn", staging, ["max"], 64, False, final)
    steps = read_json(staging / "summary.json")["next_steps"]
    assert any(f"quantlab build {final}`" in step for step in steps), steps
    for name in ("summary.json", "report.html"):
        assert ".quantlab-tmp" not in (staging / name).read_text()
