"""Medians, spreads, and whether a difference between two measurements is more than noise.

Every timing on these pages is repeated; a page shows the median with the spread
(highest minus lowest), and a difference between two medians that is smaller than the
larger of their two spreads is *within noise*: the page then says so, and draws no
conclusion from it. ``verdict`` renders that sentence from the numbers, so that no page
states a speed or memory claim in fixed prose.

Durations that differ by factors (a stall of 3 ms beside one of 1.4 s) compare on the
ratio scale (``factor=True``): a factor between two medians that is smaller than the
larger of their spreads as a factor (highest over lowest) is within noise. One slow
round of the larger then cannot hide a hundredfold difference.

Runs that took turns, one of each per round, compare round by round (``paired_factor``):
a change only where every round's factor is beyond ``SMALLEST_FACTOR`` (or, where a page
asks, most rounds': ``every=False``). A minute in which the disk slows down slows the
round's runs alike, and drops out of their factor. Two costs of the same rounds that
each vary twofold differ where most rounds say so (``in_most_rounds``); a goal is met
only where every round is below it by more than what a round resolves (``below_goal``).
An effect that cannot be negative is one where most rounds show it (``effect``), and one
strategy is below another where most rounds say so (``below_in_most_rounds``).
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Callable, Sequence
from typing import Any


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


def difference(a: Sequence[float], b: Sequence[float], factor: bool = False) -> dict:
    """``b``'s median minus ``a``'s, the noise it must beat, and whether it does; with
    ``factor``, decided on the ratio scale (positive measurements only): ``noise`` is then
    the larger spread as a factor, highest over lowest."""
    first, second = summary(a), summary(b)
    effect = second["median"] - first["median"]
    if not factor:
        noise = max(first["spread"], second["spread"])
        within = abs(effect) <= noise
    elif min(first["min"], second["min"]) <= 0:
        raise ValueError(f"a factor compares positive measurements, not {a} and {b}")
    else:
        noise = max(s["max"] / s["min"] for s in (first, second))
        within = abs(math.log(second["median"] / first["median"])) <= math.log(noise)
    return {
        "a": first,
        "b": second,
        "effect": effect,
        "noise": noise,
        "factor": factor,
        "within_noise": within,
        "ratio": first["median"] / second["median"] if second["median"] else float("inf"),
    }


def verdict(
    a_name: str,
    a: Sequence[float],
    b_name: str,
    b: Sequence[float],
    unit: str,
    scale: float = 1.0,
    factor: bool = False,
) -> tuple[str, dict]:
    """A sentence comparing two measured quantities (``scale`` converts to ``unit``), and the
    numbers it rests on: "a: 1.4 ms less than b (...)", or "... within noise ..."; with
    ``factor``, decided and said on the ratio scale (``difference``)."""
    diff = difference(a, b, factor)
    ma, mb = diff["a"]["median"] * scale, diff["b"]["median"] * scale
    if factor:
        shown = [f"x{diff[k]['max'] / diff[k]['min']:.2g}" for k in "ab"]
    else:
        shown = [f"{diff[k]['spread'] * scale:.2g} {unit}" for k in "ab"]
    numbers = f"medians {ma:.3g} and {mb:.3g} {unit}, spreads {shown[0]} and {shown[1]}"
    if diff["within_noise"]:
        return f"{a_name} and {b_name} are within noise of each other ({numbers})", diff
    word = "less" if ma < mb else "more"
    times = f", {ma / mb:.2g}x" if factor else ""
    return f"{a_name}: {abs(ma - mb):.3g} {unit} {word} than {b_name}{times} ({numbers})", diff


def _few_digits(value: float, digits: int) -> str:
    """``value`` with about ``digits`` significant digits, never in exponent form."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{round(value, decimals):.{decimals}f}"


def shown(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """Repeated measurements in a few characters, for a table's cell: the median and the
    highest, ``"0.05 ms (at most 1.7)"``."""
    s = summary(values)
    median, most = _few_digits(s["median"], digits), _few_digits(s["max"], digits)
    return f"{median} {unit} (at most {most})" if unit else f"{median} (at most {most})"


def wrapped(sentence: str, width: int = 88) -> str:
    """A long rendered sentence (a ``verdict``) in lines that fit a page's column: the
    numbers in its parentheses go on lines of their own."""
    if len(sentence) <= width:
        return sentence
    head, _, numbers = sentence.partition(" (")
    lines = textwrap.wrap(head, width) + textwrap.wrap(f"({numbers}" if numbers else "", width - 2)
    return "\n  ".join(lines)


def median_range(values: Sequence[float] | dict, spec: str = ".2f", scale: float = 1.0) -> str:
    """The "median (lowest-highest)" of repeated measurements (or of their ``summary``)."""
    s = values if isinstance(values, dict) else summary(values)
    low, mid, high = (s[key] * scale for key in ("min", "median", "max"))
    return f"{mid:{spec}} ({low:{spec}}-{high:{spec}})"


def word(diff: dict, more: str = "more", less: str = "less") -> str:
    """A ``difference`` in a word: "within noise", or which way ``b`` went from ``a``."""
    if diff["within_noise"]:
        return "within noise"
    return more if diff["effect"] > 0 else less


def median(values: Sequence[float] | dict) -> float:
    """The median of repeated measurements (or of their ``summary``)."""
    return values["median"] if isinstance(values, dict) else summary(values)["median"]


def group(
    records: Sequence[dict],
    by: str,
    where: Callable[[dict], bool] | None = None,
    order: Sequence[Any] = (),
) -> dict[Any, dict[str, list]]:
    """Measurements (dicts) grouped by their value of ``by``, in ``order`` (those it names,
    first), else in first-seen order: for each group, every other key's values as a list,
    in record order (one per repeat). ``where`` keeps only some records (the timed rounds,
    say). ``order``: where rounds take turns in a rotated order, the page's own."""
    groups: dict[Any, dict[str, list]] = {}
    for record in records:
        if where is None or where(record):
            entry = groups.setdefault(record[by], {})
            for key, value in record.items():
                if key != by:
                    entry.setdefault(key, []).append(value)
    return {value: groups[value] for value in dict.fromkeys([*order, *groups]) if value in groups}


# The least factor a paired comparison calls a change: as ``asv compare``'s default
# (``--factor 1.1``), a difference under 10% is not reported as one.
SMALLEST_FACTOR = 1.1


def _enough(count: int, rounds: int, every: bool) -> bool:
    """Whether ``count`` of ``rounds`` decide: all of them with ``every``, else most (over
    half: a sign test's majority; with 3 rounds, 2)."""
    return count == rounds if every else 2 * count > rounds


def _change(above: int, below: int, rounds: int, every: bool) -> str | None:
    """The change the rounds show: "more" where enough of them (``_enough``) were above,
    "less" where enough were below, else None (within noise)."""
    if _enough(above, rounds, every):
        return "more"
    return "less" if _enough(below, rounds, every) else None


def paired_factor(
    a: Sequence[float], b: Sequence[float], smallest: float = SMALLEST_FACTOR, every: bool = True
) -> dict:
    """``b`` over ``a`` round by round (runs that took turns: a slow minute of the disk slows
    the round's runs alike), positive measurements. ``change`` is "more" where every round's
    factor is above ``smallest``, "less" where every round's is below ``1 / smallest``, else
    None: within noise (the rounds' factors reach within ``smallest`` of 1, or fall on both
    sides: the spread of the effect crosses zero, or comes that close). With ``every=False``,
    most rounds (over half) decide, as in ``in_most_rounds``: one round that a slow moment
    of the machine hit alone does not undo the rest. ``factor``: the median of the rounds'
    factors."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired measurements come one per round, not {a} and {b}")
    if min(*a, *b) <= 0:
        raise ValueError(f"a factor compares positive measurements, not {a} and {b}")
    factors = [y / x for x, y in zip(a, b, strict=True)]
    above, below = sum(f > smallest for f in factors), sum(f < 1 / smallest for f in factors)
    change = _change(above, below, len(factors), every)
    return {"factors": factors, "factor": statistics.median(factors), "change": change}


def factor_cells(
    a: Sequence[float],
    b: Sequence[float],
    words: tuple[str, str] = ("faster", "slower"),
    every: bool = True,
) -> list[str]:
    """Two table cells comparing ``b`` with ``a`` (``paired_factor``, with ``every``): its
    word (``words`` for more and less, or "within noise"), and "x1.33 (x1.18-x1.45 by
    round)"."""
    found = paired_factor(a, b, every=every)
    word = {"more": words[0], "less": words[1], None: "within noise"}[found["change"]]
    low, high = min(found["factors"]), max(found["factors"])
    return [word, f"x{found['factor']:.2f} (x{low:.2f}-x{high:.2f} by round)"]


def _margins(resolution: Sequence[float] | None, values: Sequence[float]) -> list[float]:
    """Per round, how far off its value may be: ``resolution``'s, one per round, or 0 in
    every round where there is none."""
    margins = list(resolution) if resolution else [0.0] * len(values)
    if len(margins) != len(values):
        raise ValueError(f"one resolution per round, not {resolution} for {values}")
    return margins


def effect(
    values: Sequence[float], neutral: float = 0.0, resolution: Sequence[float] | None = None
) -> dict:
    """Repeated measurements of an effect that cannot be negative (a stall, a cost, extra
    memory, a slow-down above ``neutral``): their ``summary``, the ``effect`` (median minus
    ``neutral``) and whether it is ``within_noise``: unless most rounds (over half: 2 of 3,
    all of 2) had the effect, beyond ``neutral``. An effect in most rounds is an effect,
    however much it varies: a slow round of a shared machine does not hide it, nor does one
    round that came out without it (a sign test's majority, as ``in_most_rounds``): in 7
    make bench runs, the "every round" rule turned process writer's, torch_checkpointing's
    and DefaultStager's total overhead to "within noise" in one run each (one round each:
    0.016, 0.112 and -0.159 s, their other rounds 0.19-0.61 s); most rounds, none of them.
    ``resolution``, per round: the least effect its measurement tells from none (a round's
    effect no larger does not count)."""
    entry = summary(values)
    entry["effect"] = entry["median"] - neutral
    floors = [neutral + margin for margin in _margins(resolution, values)]
    beyond = sum(v > f for v, f in zip(values, floors, strict=True))
    entry["within_noise"] = not _enough(beyond, len(values), every=False)
    if resolution:
        entry["resolution"] = list(resolution)
    return entry


def below_goal(
    values: Sequence[float],
    limit: float,
    factor: bool = False,
    resolution: Sequence[float] | None = None,
) -> dict:
    """Whether measurements meet a goal "at most ``limit``", round by round: ``met`` is True
    where every round is below it, False where every round is above it, None where the
    rounds fall on both sides (the spread of the differences crosses zero: within noise).
    ``resolution``, per round: how far off a round's value may be (``effect``'s): a round
    then counts below only where its value plus that is, above only where its value minus
    that is; a goal within a round's resolution of it is undecided. Returns
    ``difference``'s numbers too (on the ratio scale with ``factor``: the same signs), and
    how many rounds were below (``rounds_below``, resolution or not)."""
    diff = difference(values, [limit] * len(values), factor)
    pairs = list(zip(values, _margins(resolution, values), strict=True))
    met = (
        True
        if all(value + margin < limit for value, margin in pairs)
        else False
        if all(value - margin > limit for value, margin in pairs)
        else None
    )
    below = sum(value < limit for value in values)
    return {**diff, "met": met, "within_noise": met is None, "rounds_below": below}


def in_most_rounds(
    a: Sequence[float], b: Sequence[float], resolution: Sequence[float] | None = None
) -> dict:
    """``b`` against ``a``, paired round by round (runs that took turns): ``change`` is
    "more" where ``b`` is above ``a`` by more than the round's ``resolution`` in most
    rounds (over half), "less" where below by more in most, else None (within noise).
    Most rounds, not every one: for a difference between two costs that each vary
    twofold from round to round, one round in which both came out alike does not undo
    the rounds that agree (a sign test's majority; with 3 rounds, 2)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired measurements come one per round, not {a} and {b}")
    margins = _margins(resolution, a)
    differences = [y - x for x, y in zip(a, b, strict=True)]
    above = sum(d > m for d, m in zip(differences, margins, strict=True))
    below = sum(-d > m for d, m in zip(differences, margins, strict=True))
    change = _change(above, below, len(a), every=False)
    return {"differences": differences, "above": above, "below": below, "change": change}


def below_in_most_rounds(values: Sequence[float], others: Sequence[Sequence[float]]) -> bool:
    """Whether ``values`` are below each of ``others`` in most rounds (over half), paired
    round by round (runs that took turns: a slow moment of the machine slows a round's runs
    alike): ``in_most_rounds`` finds each other one above ``values`` ("more"), as it
    decides a difference and ``effect`` an effect."""
    if any(len(other) != len(values) for other in others):
        raise ValueError("paired measurements come one per round")
    return all(in_most_rounds(values, other)["change"] == "more" for other in others)


def shown_entry(entry: dict | None, spec: str, unit: str) -> str:
    """``median unit [lowest .. highest]``, marked "within noise" where the entry says so."""
    if not entry:
        return "-"
    low, high = format(entry["min"], spec), format(entry["max"], spec)
    text = f"{format(entry['median'], spec)}{unit} [{low} .. {high}]"
    return text + (" within noise" if entry.get("within_noise") else "")


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
        claim, not diff["within_noise"] and diff["effect"] > 0, figures.wrap(said), **diff
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
    print(figures.wrap(said))
    return {"said": said, **diff}


def claim_less_paired(
    claim: str,
    series: dict[str, Sequence[float]],
    a: str,
    b: str,
    unit: str,
    scale: float = 1.0,
    every: bool = False,
) -> dict:
    """Decide the claim that ``series[a]`` took less than ``series[b]`` in most of their
    paired measurements (attempt by attempt: a slow moment of a shared machine slows both of
    a pair; over half: one attempt that a slow moment hit on one side alone does not undo
    the rest), or with ``every``, in every one, and say it with ``verdict``'s sentence on
    the medians and their noise."""
    from page_tools import figures, results

    if len(series[a]) != len(series[b]):
        raise ValueError("paired measurements come in pairs")
    said, diff = verdict(a, series[a], b, series[b], unit, scale)
    pairs = list(zip(series[a], series[b], strict=True))
    shown = ", ".join(f"{x * scale:.3g} {'<' if x < y else '>='} {y * scale:.3g}" for x, y in pairs)
    less = sum(x < y for x, y in pairs)
    held = _enough(less, len(pairs), every)
    attempts = "in each attempt" if every else f"in {less} of {len(pairs)} attempts"
    results.claim(
        claim,
        held,
        figures.wrap(f"{a} took less than {b} {attempts} ({shown} {unit}); {said}"),
        **diff,
    )
    return diff
