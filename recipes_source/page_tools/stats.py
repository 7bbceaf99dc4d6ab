"""Medians, spreads, and whether a difference between two measurements is more than noise.

Every timing on these pages is repeated; a page shows the median with the spread
(highest minus lowest), and a difference between two medians that is smaller than the
larger of their two spreads is *within noise*: the page then says so, and draws no
conclusion from it. ``verdict`` renders that sentence from the numbers, so that no page
states a speed or memory claim in fixed prose.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def summary(values: Sequence[float]) -> dict:
    """Median, lowest, highest and spread of repeated measurements."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no measurements")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "spread": max(values) - min(values),
        "n": len(values),
        "values": values,
    }


def difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """``b``'s median minus ``a``'s, the noise it must beat, and whether it does."""
    first, second = summary(a), summary(b)
    effect = second["median"] - first["median"]
    noise = max(first["spread"], second["spread"])
    return {
        "a": first,
        "b": second,
        "effect": effect,
        "noise": noise,
        "within_noise": abs(effect) <= noise,
        "ratio": first["median"] / second["median"] if second["median"] else float("inf"),
    }


def verdict(
    a_name: str, a: Sequence[float], b_name: str, b: Sequence[float], unit: str, scale: float = 1.0
) -> tuple[str, dict]:
    """A sentence comparing two measured quantities (``scale`` converts to ``unit``), and the
    numbers it rests on: "a: 1.4 ms less than b (...)", or "... within noise ..."."""
    diff = difference(a, b)
    ma, mb = diff["a"]["median"] * scale, diff["b"]["median"] * scale
    numbers = (
        f"medians {ma:.3g} and {mb:.3g} {unit}, spreads {diff['a']['spread'] * scale:.2g} "
        f"and {diff['b']['spread'] * scale:.2g} {unit}"
    )
    if diff["within_noise"]:
        return f"{a_name} and {b_name} are within noise of each other ({numbers})", diff
    word = "less" if ma < mb else "more"
    return f"{a_name}: {abs(ma - mb):.3g} {unit} {word} than {b_name} ({numbers})", diff


def effect(values: Sequence[float], neutral: float = 0.0) -> dict:
    """Repeated measurements of an effect that cannot be negative (a stall, extra memory, a
    slow-down above ``neutral``): their ``summary``, the ``effect`` (median minus ``neutral``)
    and whether it is ``within_noise``: smaller than the spread, or below ``neutral`` (a
    checkpoint does not make training faster: a negative median measures noise)."""
    entry = summary(values)
    entry["effect"] = entry["median"] - neutral
    entry["within_noise"] = entry["effect"] < entry["spread"]
    return entry


def shown(entry: dict | None, spec: str, unit: str) -> str:
    """``median unit [lowest .. highest]``, marked "within noise" where the entry says so."""
    if not entry:
        return "-"
    low, high = format(entry["min"], spec), format(entry["max"], spec)
    text = f"{format(entry['median'], spec)}{unit} [{low} .. {high}]"
    return text + (" within noise" if entry.get("within_noise") else "")


def below_goal(values: Sequence[float], limits: Sequence[float]) -> dict:
    """Whether measurements meet a goal "at most ``limits``" (one limit, or one per round):
    ``met`` is True where the median is below the limit's median by more than the noise,
    False where it is above by more, None where the difference is within noise."""
    diff = difference(values, limits)
    met = None if diff["within_noise"] else diff["a"]["median"] < diff["b"]["median"]
    return {**diff, "met": met}
