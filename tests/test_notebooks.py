"""The notebooks run top to bottom under a real Jupyter kernel (nbclient), against the current
API, and are saved with their outputs."""

import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# A saved notebook, outputs and figures included, stays readable in a repository viewer.
MAX_SAVED_BYTES = 1_000_000
# What the last, added cell reports of the quickstart's results (the test's own probe).
PROBE = """\
import json
_table = checked.tables[("onnx_fp32", "engine_int8")]
_worst = _table.sort_values("sqnr_db").iloc[0]
_node = next(n for n in result.model.graph.node if n.name == _worst["node"])
print(json.dumps({"fp32": fp32_map, "int8": max(int8_map.values()), "op": _node.op_type,
                  "sqnr": float(_worst["sqnr_db"]),
                  "group": next(a.i for a in _node.attribute if a.name == "group"),
                  "certified": bool(planned.certificate.certified),
                  "share": planned.plan.int8_mac_share()}))
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_saved_with_its_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    assert all(c["outputs"] for c in cells if c["cell_type"] == "code"), \
        "run the notebook and save it with its outputs"
    assert path.stat().st_size < MAX_SAVED_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_under_a_jupyter_kernel(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbclient and ipykernel are dev extras")
    nbclient = pytest.importorskip("nbclient", reason="nbclient and ipykernel are dev extras")
    pytest.importorskip("ipykernel", reason="nbclient and ipykernel are dev extras")
    notebook = nbformat.read(path, as_version=4)
    if path.name == "quickstart.ipynb":
        notebook.cells.append(nbformat.v4.new_code_cell(PROBE))
    workdir = tmp_path / "notebooks"  # notebooks write to ../reports, here inside tmp_path
    workdir.mkdir()
    # The kernel imports this checkout's quantlab, as the test does.
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])))
    nbclient.NotebookClient(notebook, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}}).execute()
    if path.name == "quickstart.ipynb":
        # The demo's story through the API: every calibrator alone loses points of mAP, the
        # validator's largest local error is a depthwise conv, the plan recovers the budget
        # with most MACs in INT8, certified.
        found = json.loads(notebook.cells[-1].outputs[0]["text"])
        assert found["fp32"] > 0.6 and found["int8"] < found["fp32"] - 0.05
        assert found["op"] == "Conv" and found["sqnr"] < 15 and found["group"] > 1
        assert found["certified"] and found["share"] > 0.9
