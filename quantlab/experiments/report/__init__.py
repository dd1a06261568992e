"""Self-contained HTML reports: one page, inline CSS, figures embedded as PNG data URIs.

A report is a list of :class:`Section` objects, each an HTML fragment that a
step of the flow renders from its own results; this module only assembles them.
"""

from __future__ import annotations

import base64
import datetime as _dt
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
import matplotlib
import pandas as pd
from markupsafe import Markup, escape

from quantlab import __version__
from quantlab.experiments.experiment import write_text

# Reports are rendered off-screen (CI, servers, notebooks alike).
matplotlib.use("Agg")

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("quantlab.experiments.report", "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(frozen=True)
class Section:
    """One titled part of a report; `html` is a trusted fragment built by this module."""

    title: str
    html: str
    anchor: str = ""


def figure_to_data_uri(figure) -> str:
    """Encode a matplotlib figure as a PNG data URI and close it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def plot_text(name: str) -> str:
    """`name` (a tensor, node or unit name from the model) as matplotlib draws it literally:
    ``$`` escaped, since ``$...$`` is mathtext (a name like ``a$b$c`` is parsed, and a lone
    ``$^`` fails to parse); what HTML escaping is for names in the report's tables."""
    return name.replace("$", r"\$")


def figure_html(figure, caption: str) -> str:
    """An embedded figure with a caption, as an HTML fragment."""
    return _ENV.get_template("figure.html").render(src=figure_to_data_uri(figure), caption=caption)


# Columns several reports show: name -> (unit, what it is), for the legend under a table.
COLUMNS = {
    "tensor": ("name", "ONNX tensor of the FP32 graph (the identity every table is keyed by)"),
    "node": ("name", "ONNX node producing the tensor"),
    "op_type": ("ONNX op", "operator type of that node"),
    "torch_module": ("module path", "torch module the node was exported from, if recorded"),
    "output": ("name", "graph output of the model"),
    "pair": ("stages", "reference stage vs test stage"),
    "stage": ("stage", "where the model ran (torch, ONNX Runtime FP32, the INT8 engine)"),
    "sqnr_db": ("dB", "10 log10(sum ref^2 / sum (test - ref)^2) pooled over every element of "
                      "every sample; higher is better, inf when identical"),
    "cosine": ("1", "cosine similarity of test and reference over all elements; 1 is identical"),
    "rel_l2": ("1", "||test - ref|| / ||ref|| over all elements; 0 is identical"),
    "max_abs": ("tensor units", "largest |test - ref| of any element"),
    "frac_outside": ("share 0-1", "share of elements with |test - ref| > atol + rtol |ref| "
                                  "(numpy.isclose)"),
}


def table_html(frame: pd.DataFrame, float_format: str = "{:.4g}", caption: str = "",
               columns: Mapping[str, tuple[str, str]] | None = None) -> str:
    """A DataFrame as an HTML table in a box that scrolls when it is wider or taller than the
    page (values escaped except Markup fragments, numbers right-aligned). With `columns`
    (name -> (unit, explanation); :data:`COLUMNS` and the section's own), every header shows
    its unit and a legend under the table explains each column in one line."""
    rows = [
        [v if isinstance(v, Markup) else float_format.format(v) if isinstance(v, float)
         else str(v) for v in row]
        for row in frame.itertuples(index=False)
    ]
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) for c in frame.columns]
    described = {**COLUMNS, **(columns or {})} if columns is not None else {}
    legend = [(str(c), *described[str(c)]) for c in frame.columns if str(c) in described]
    return _ENV.get_template("table.html").render(
        columns=[(str(c), described.get(str(c), ("", ""))[0]) for c in frame.columns],
        rows=rows, numeric=numeric, caption=caption, legend=legend,
    )


def prose_html(text: str) -> Markup:
    """`text` escaped, with its `backquoted` commands set as code."""
    parts = str(escape(text)).split("`")
    return Markup("".join(f"<code>{part}</code>" if i % 2 else part
                          for i, part in enumerate(parts)))


def render_report(title: str, sections: Sequence[Section], subtitle: str = "") -> str:
    """The whole self-contained page as a string."""
    return _ENV.get_template("report.html").render(
        title=title,
        subtitle=subtitle,
        sections=[(s.title, s.anchor or f"s{i}", Markup(s.html)) for i, s in enumerate(sections)],
        generated=_dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        version=__version__,
    )


def write_report(
    path: str | os.PathLike, title: str, sections: Sequence[Section], subtitle: str = ""
) -> Path:
    """Render and atomically write the report to `path`."""
    return write_text(path, render_report(title, sections, subtitle))
