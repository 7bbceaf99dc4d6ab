"""Tables rendered as HTML on the page, and as aligned text everywhere else.

A cell that ends with a ``Table`` shows it as an HTML table (Sphinx-Gallery captures an
object's ``_repr_html_``), so that a page's numbers fit its column instead of running
off the side of a text block. ``str(table)`` is the same table as aligned text, for
logs and for ``make gpu-check``.
"""

from __future__ import annotations

import dataclasses
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
    title: str = "",
):
    """One horizontal timeline per panel, stacked, sharing their time axis.

    Each panel is ``(title, bars, marks)``: a bar ``(row, what, start, end)`` is drawn on
    the row of that name, in the colour of ``what``; a mark ``(x, label)`` is written
    above the first row. Time starts at 0; the legend names every colour; ``title`` (the
    machine, ``machine.title()``) goes above the panels. Returns the matplotlib figure (a
    page cell that makes it shows it).
    """
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=figsize, sharex=True, squeeze=False)
    where = {row: i for i, row in enumerate(rows)}
    latest = 0.0
    for axis, (panel_title, bars, marks) in zip(axes[:, 0], panels, strict=True):
        for row, what, start, end in bars:
            axis.broken_barh([(start, end - start)], (where[row] - 0.4, 0.8), color=colors[what])
            latest = max(latest, end)
        for x, label in marks:
            axis.annotate(label, (x, -0.45), ha="center", va="bottom", fontsize=8)
        axis.set_yticks(range(len(rows)), [row.replace(" ", "\n", 1) for row in rows])
        axis.set_ylim(len(rows) - 0.4, -1.1)  # the first row on top
        axis.set_title(panel_title, loc="left", fontsize=10)
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
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    return figure


def lines(
    series: dict[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    level: float | None = None,
    level_label: str = "",
):
    """A plot of one line per series, against 1, 2, 3, ... (saves, steps), with an optional
    dotted level (one copy of a rank's share, say). Returns the matplotlib figure; on a
    page, Sphinx-Gallery shows it under the cell."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.6))
    for label, values in series.items():
        axis.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label)
    if level is not None:
        axis.axhline(level, color="gray", linestyle=":", label=level_label)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    longest = max((len(values) for values in series.values()), default=0)
    axis.set_xticks(range(1, longest + 1, 2 if longest > 10 else 1))
    axis.set_title(title, fontsize="medium")
    axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def save_with_results(figure, recipe: str | None = None):
    """Write ``figure`` as a PNG beside the page's results file (``<recipe>.png``), where
    there is one (the build's, ``make bench``'s); returns its path, or None."""
    import os

    from page_tools import results

    path = results.results_path(recipe)
    if path is None or os.environ.get("RANK", "0") != "0":
        return None
    png = path.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=120)
    return png


@dataclasses.dataclass
class Column:
    """A column of a ``measured`` table: ``key``'s repeated values as "median (lowest-highest)"
    (times ``scale``), or, with ``of``, their median as a fraction of ``of``."""

    title: str
    key: str
    spec: str = ".2f"
    scale: float = 1.0
    of: float | None = None


def measured(
    heading: str, groups: dict[str, dict[str, list]], columns: Sequence[Column], caption: str = ""
) -> Table:
    """One row per group of repeated measurements (``stats.group``), one cell per column."""
    from page_tools import stats

    def cell(group: dict[str, list], column: Column) -> Any:
        values = group[column.key]
        if any(value is None for value in values):  # not measured for this group
            return "-"
        if column.of is not None:
            return round(stats.median(values) / column.of, 2)
        return stats.median_range(values, column.spec, column.scale)

    return Table(
        [heading, *(column.title for column in columns)],
        [[name, *(cell(group, column) for column in columns)] for name, group in groups.items()],
        caption,
    )


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


def save_beside(figure: Any, results_file: Any, name: str = "") -> Any:
    """Save ``figure`` as a PNG beside a page's results file (same name, or with ``-name``
    added), where there is one (``results.results_path()``); returns the path, or None."""
    import os
    from pathlib import Path

    if results_file is None or os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 writes
        return None

    path = Path(results_file).with_suffix(".png")
    if name:
        path = path.with_name(f"{path.stem}-{name}.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


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
