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


def loss_curves(
    curves: dict[str, dict[int, float]],
    marks: dict[int, str] | None = None,
    ylabel: str = "loss (mean over ranks)",
):
    """A plot of named curves (step -> loss): the first wide and pale under the others, each
    of the others over the ones after it; a dashed vertical line and its label at each step
    of ``marks``. Returns the figure (Sphinx-Gallery shows the figures a cell leaves open)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 3.8))
    styles = [
        {"color": "tab:gray", "lw": 5, "alpha": 0.4},
        {"color": "tab:red", "marker": "o", "ms": 2, "lw": 1},
        {"color": "tab:blue", "marker": "s", "ms": 4, "lw": 1},
        {"color": "tab:green", "marker": "^", "ms": 4, "lw": 1},
    ]
    for index, ((label, curve), style) in enumerate(zip(curves.items(), styles, strict=False)):
        steps = sorted(curve)  # an earlier curve lies over a later one where both have points
        axis.plot(
            steps,
            [curve[s] for s in steps],
            label=label,
            zorder=10 - index if index else 1,
            **style,
        )
    for position, (step, label) in enumerate(sorted((marks or {}).items())):
        axis.axvline(step, color="tab:red" if position == len(marks) - 1 else "tab:blue", ls="--")
        axis.annotate(
            label,
            (step, 0.95 - 0.25 * position),
            xycoords=("data", "axes fraction"),
            ha="right",
            va="top",
            fontsize=8,
            xytext=(-4, 0),
            textcoords="offset points",
        )
    axis.set_xlabel("step")
    axis.set_ylabel(ylabel)
    axis.set_yscale("log")
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure
