"""user_code.py: the user's module:function is found in the current directory, as the
`quantlab` console script (whose sys.path starts at its bin folder) runs."""

from __future__ import annotations

import sys

import pytest

from quantlab import plan, user_code
from quantlab.commands.options import check_metric
from quantlab.errors import ConfigError


@pytest.fixture
def beside_the_user(tmp_path, monkeypatch):
    """The current directory holds here_metric.py; sys.path has neither it nor ''."""
    (tmp_path / "here_metric.py").write_text(
        "def closeness(outputs, references):\n    return 0.25\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "here_metric", raising=False)
    yield tmp_path
    sys.modules.pop("here_metric", None)


def test_a_module_in_the_current_directory_is_imported_and_its_later_imports_found(
        beside_the_user):
    # The metric imports a sibling module only when called, long after the import returned
    # (benchmarks.planner_metrics does: `from tests import realmodels` inside a function).
    (beside_the_user / "here_sibling.py").write_text("VALUE = 0.5\n")
    (beside_the_user / "here_lazy.py").write_text(
        "def closeness(outputs, references):\n    from here_sibling import VALUE\n"
        "    return VALUE\n")
    module = user_code.import_module("here_metric")
    assert module.__file__ == str(beside_the_user / "here_metric.py")
    assert sys.path[0] == str(beside_the_user)  # as under `python -c`, and only once
    user_code.import_module("here_metric")
    assert sys.path.count(str(beside_the_user)) == 1
    try:
        assert user_code.import_module("here_lazy").closeness([], []) == 0.5
    finally:
        for name in ("here_lazy", "here_sibling"):
            sys.modules.pop(name, None)
    with pytest.raises(ModuleNotFoundError):
        user_code.import_module("no_such_module_here")


def test_plan_and_validate_metrics_load_from_the_current_directory(beside_the_user):
    """plan and validate check --metric with options.check_metric, and the planner resolves it
    with plan.resolve_metric: both find here_metric.py."""
    check_metric("here_metric:closeness", False, "")
    assert plan.resolve_metric("here_metric:closeness")([{}], [{}]) == 0.25
    with pytest.raises(ConfigError, match="in the current directory or on PYTHONPATH"):
        plan.resolve_metric("elsewhere_metric:closeness")
