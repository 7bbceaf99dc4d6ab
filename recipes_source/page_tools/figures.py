"""Tables rendered as HTML on the page, and as aligned text everywhere else.

A cell that ends with a ``Table`` shows it as an HTML table (Sphinx-Gallery captures an
object's ``_repr_html_``), so that a page's numbers fit its column instead of running
off the side of a text block. ``str(table)`` is the same table as aligned text, for
logs and for ``make gpu-check``.
"""

from __future__ import annotations

import html
import textwrap
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


OUTPUT_WIDTH = 88  # a page's output block shows about 90 characters without scrolling
WIDTH = OUTPUT_WIDTH


def wrap(text: str, width: int = OUTPUT_WIDTH) -> str:
    """A sentence (a claim's, a verdict's) broken into lines that fit the page's output
    blocks; lines after the first are indented."""
    return "\n".join(
        textwrap.fill(paragraph, width, subsequent_indent="  ", break_on_hyphens=False)
        for paragraph in text.splitlines()
    )


def say(*lines: str, width: int = OUTPUT_WIDTH) -> None:
    """Print each line, wrapped to the page's column (continuations indented)."""
    for line in lines:
        print(wrap(line, width))


# --------------------------------------------------------------------------
# Timelines
# --------------------------------------------------------------------------


def timelines(
    panels: Sequence[tuple[str, Sequence[tuple[str, str, float, float]], Sequence[tuple]]],
    rows: Sequence[str],
    colors: dict[str, str],
    xlabel: str,
    figsize: tuple[float, float] = (10, 5),
):
    """One horizontal timeline per panel, stacked, sharing their time axis.

    Each panel is ``(title, bars, marks)``: a bar ``(row, what, start, end)`` is drawn on
    the row of that name, in the colour of ``what``; a mark ``(x, label)`` is written
    above the first row. Time starts at 0; the legend names every colour. Returns the
    matplotlib figure (a page cell that makes it shows it).
    """
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=figsize, sharex=True, squeeze=False)
    where = {row: i for i, row in enumerate(rows)}
    latest = 0.0
    for axis, (title, bars, marks) in zip(axes[:, 0], panels, strict=True):
        for row, what, start, end in bars:
            axis.broken_barh([(start, end - start)], (where[row] - 0.4, 0.8), color=colors[what])
            latest = max(latest, end)
        for x, label in marks:
            axis.annotate(label, (x, -0.45), ha="center", va="bottom", fontsize=8)
        axis.set_yticks(range(len(rows)), [row.replace(" ", "\n", 1) for row in rows])
        axis.set_ylim(len(rows) - 0.4, -1.1)  # the first row on top
        axis.set_title(title, loc="left", fontsize=10)
    axes[-1, 0].set_xlim(0, 1.02 * latest or 1)
    axes[-1, 0].set_xlabel(xlabel)
    figure.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=color) for color in colors.values()],
        labels=list(colors),
        loc="lower center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    return figure
