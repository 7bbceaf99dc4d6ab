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


def wrapped(text: str, width: int = 88) -> str:
    """A sentence the page prints, in lines that fit a page's output block (90 columns, with
    room for a ``[rankN]`` label where a rank prints it)."""
    import textwrap

    return "\n".join(
        textwrap.fill(line, width, subsequent_indent="  ") for line in text.split("\n")
    )


def medians(
    columns: Sequence[str],
    rows: dict[str, Sequence[float]],
    scale: float = 1.0,
    caption: str = "",
    digits: int = 1,
) -> Table:
    """A table of the median of each row's measurements, times ``scale`` (to ms, MB)."""
    import statistics

    return Table(
        columns,
        [[name, round(statistics.median(values) * scale, digits)] for name, values in rows.items()],
        caption,
    )
