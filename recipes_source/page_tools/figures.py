"""Tables rendered as HTML on the page, and as aligned text everywhere else.

A cell that ends with a ``Table`` shows it as an HTML table (Sphinx-Gallery captures an
object's ``_repr_html_``), so that a page's numbers fit its column instead of running
off the side of a text block. ``str(table)`` is the same table as aligned text, for
logs and for ``make gpu-check``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any


class Table:
    """Rows of values under column headings; numbers align right."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = ""):
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]
        self.caption = caption
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"a row of {len(row)} cells under {len(self.columns)} columns")

    @staticmethod
    def _numeric(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    def _html_cell(self, tag: str, value: Any) -> str:
        style = ' class="dcp-num"' if self._numeric(value) else ""
        return f"<{tag}{style}>{html.escape(str(value))}</{tag}>"

    def _repr_html_(self) -> str:
        head = "".join(self._html_cell("th", column) for column in self.columns)
        body = "".join(
            "<tr>" + "".join(self._html_cell("td", value) for value in row) + "</tr>"
            for row in self.rows
        )
        caption = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return (
            f'<table class="dcp-results">{caption}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )

    def __str__(self) -> str:
        rows = [self.columns, *self.rows]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(self.columns))]
        lines = [self.caption] if self.caption else []
        for row in rows:
            cells = [
                str(v).rjust(w) if self._numeric(v) else str(v).ljust(w)
                for v, w in zip(row, widths, strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    __repr__ = __str__


def medians_with_whiskers(names: Sequence[str], panels: Sequence[dict], title: str = ""):
    """Horizontal bars side by side, one panel per measured quantity: each bar a median, its
    whisker the lowest and highest measurement (``stats.summary`` entries).

    A panel is a dict: ``entries`` (one per name), ``xlabel``, ``labels`` (the text beside
    each bar), and optionally ``log`` (a log scale), ``reference`` (``(value, label)``: a
    dashed line) and ``color``. Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), sharey=True)
    for axis, panel in zip([axes] if len(panels) == 1 else axes, panels, strict=True):
        entries = panel["entries"]
        medians = [e["median"] for e in entries]
        whiskers = [
            [e["median"] - e["min"] for e in entries],
            [e["max"] - e["median"] for e in entries],
        ]
        bars = axis.barh(names, medians, xerr=whiskers, color=panel.get("color"), capsize=3)
        axis.bar_label(bars, panel["labels"], padding=8, fontsize="small")
        if panel.get("reference"):
            value, text = panel["reference"]
            axis.axvline(value, color="black", linestyle="--", label=text)
            axis.legend(loc="lower right", fontsize="small")
        if panel.get("log"):
            axis.set_xscale("log")
            axis.set_xlim(right=max(e["max"] for e in entries) * 8)  # room for the labels
        else:
            axis.margins(x=0.35)
            axis.axvline(0, color="black", linewidth=0.8)
        axis.set_xlabel(panel["xlabel"])
    (axes if len(panels) == 1 else axes[0]).invert_yaxis()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def save_beside(figure: Any, results_file: Any) -> Any:
    """Save ``figure`` as a PNG beside a page's results file (same name), where there is one
    (``results.results_path()``); returns the path, or None."""
    import os
    from pathlib import Path

    if results_file is None or os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 writes
        return None

    path = Path(results_file).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
