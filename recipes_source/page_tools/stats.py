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


def claim_less(
    claim: str,
    a_name: str,
    a: Sequence[float],
    b_name: str,
    b: Sequence[float],
    unit: str,
    scale: float = 1.0,
) -> dict:
    """Decide the claim that ``a`` is less than ``b`` by more than noise, and say it in the
    words of ``verdict`` (a claim that fails shows the numbers it rests on)."""
    from page_tools import figures, results

    said, diff = verdict(a_name, a, b_name, b, unit, scale)
    results.claim(
        claim, not diff["within_noise"] and diff["effect"] > 0, figures.wrapped(said), **diff
    )
    return diff


def added(*series: Sequence[float]) -> list[float]:
    """Element-wise sums of equally long series (two phases of each attempt)."""
    return [sum(values) for values in zip(*series, strict=True)]


def say(
    a_name: str, a: Sequence[float], b_name: str, b: Sequence[float], unit: str, scale: float = 1.0
) -> dict:
    """Print ``verdict``'s sentence, in lines that fit the page, and return its numbers."""
    from page_tools import figures

    said, diff = verdict(a_name, a, b_name, b, unit, scale)
    print(figures.wrapped(said))
    return {"said": said, **diff}


def claim_less_paired(
    claim: str, series: dict[str, Sequence[float]], a: str, b: str, unit: str, scale: float = 1.0
) -> dict:
    """Decide the claim that ``series[a]`` took less than ``series[b]`` in every one of their
    paired measurements (attempt by attempt: a slow moment of a shared machine slows both of
    a pair), and say it with ``verdict``'s sentence on the medians and their noise."""
    from page_tools import figures, results

    if len(series[a]) != len(series[b]):
        raise ValueError("paired measurements come in pairs")
    said, diff = verdict(a, series[a], b, series[b], unit, scale)
    pairs = list(zip(series[a], series[b], strict=True))
    shown = ", ".join(f"{x * scale:.3g} < {y * scale:.3g}" for x, y in pairs)
    results.claim(
        claim,
        all(x < y for x, y in pairs),
        figures.wrapped(f"{a} took less than {b} in each attempt ({shown} {unit}); {said}"),
        **diff,
    )
    return diff
