"""The page's results file: every value a page measures, and every claim it makes, decided.

``claim(name, held, said, **evidence)`` decides one of the page's claims: it prints
``said`` (the sentence the reader sees under the cell) and records the outcome with its
evidence; a claim that does not hold raises ``ClaimFailed``, which fails the build, on
CPU and on GPU alike. ``record(name, value)`` keeps a measured value. Both go into one
JSON file per page, ``$DCP_RECIPES_RESULTS_DIR/<recipe>.json``: the site build sets the
directory (``recipes/.results``), checks every page's file against its list of claims
(``claims/<recipe>.toml``), and the tests read the file instead of running the page
again. Where the variable is not set (a plain run of the script), nothing is written,
and the claims are still decided.

Under torchrun every rank runs the page's top level and decides the same claims from
the same gathered values: only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from page_tools import stats

RESULTS_DIR_ENV = "DCP_RECIPES_RESULTS_DIR"
RECIPE_ENV = "DCP_RECIPES_RECIPE"  # as the launcher: a notebook has no script name
CLAIMS_DIR = Path(__file__).parent / "claims"


class ClaimFailed(AssertionError):
    """A page's claim does not hold on this machine: the page must not say it."""


def recipe_name() -> str:
    return os.environ.get(RECIPE_ENV) or Path(sys.argv[0]).stem or "<recipe>"


def results_path(recipe: str | None = None) -> Path | None:
    directory = os.environ.get(RESULTS_DIR_ENV)
    return Path(directory, f"{recipe or recipe_name()}.json") if directory else None


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: tensors and numpy numbers become numbers or lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # a tensor or a numpy value
        return _plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _update(section: str, name: str, entry: Any) -> None:
    path = results_path()
    if path is None or os.environ.get("RANK", "0") != "0":
        return
    data = read(path) if path.exists() else {"recipe": recipe_name(), "claims": {}, "values": {}}
    data[section][name] = _plain(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def record(name: str, value: Any) -> Any:
    """Keep a measured value in the results file; returns it."""
    _update("values", name, value)
    return value


def claim(name: str, held: bool, said: str, **evidence: Any) -> None:
    """Decide a claim: print ``said`` and record it if ``held``, else raise ``ClaimFailed``."""
    _update("claims", name, {"held": bool(held), "said": said, "evidence": evidence})
    if not held:
        shown = ", ".join(f"{key}={value!r}" for key, value in evidence.items())
        raise ClaimFailed(f"{recipe_name()}: claim {name!r} does not hold: {said} ({shown})")
    print(said)


def not_measured_here(name: str, why: str) -> None:
    """A claim this machine cannot decide (a GPU claim on CPU): recorded, and said."""
    _update("claims", name, {"held": None, "said": why, "evidence": {}})
    print(why)


def read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def manifest(recipe: str) -> dict:
    """The page's list of claims and values (``claims/<recipe>.toml``), or {} if it has none."""
    path = CLAIMS_DIR / f"{recipe}.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def problems(recipe: str, results: dict, on_gpu: bool) -> list[str]:
    """What is wrong with a page's results against its manifest, one sentence each.

    Every listed claim must have held (a GPU claim may be "not measured" where there is
    no GPU); every listed value must be there; nothing may be recorded that is not listed.
    """
    listed = manifest(recipe)
    claims = results.get("claims", {})
    values = results.get("values", {})
    found = []
    gpu_claims = listed.get("gpu_claims", {})
    for name in {**listed.get("claims", {}), **gpu_claims}:
        outcome = claims.get(name)
        if outcome is None:
            found.append(f"claim {name!r} was not decided")
        elif outcome["held"] is None and (on_gpu or name not in gpu_claims):
            found.append(f"claim {name!r} was not measured: {outcome['said']}")
        elif outcome["held"] is False:
            found.append(f"claim {name!r} does not hold: {outcome['said']}")
    found += [
        f"value {name!r} was not recorded"
        for name in listed.get("values", {})
        if name not in values
    ]
    unlisted = (set(claims) - set(listed.get("claims", {})) - set(gpu_claims)) | (
        set(values) - set(listed.get("values", {}))
    )
    found += [
        f"{name!r} is recorded but not listed in claims/{recipe}.toml" for name in sorted(unlisted)
    ]
    return found


def headline_line(path: Path) -> str:
    """A results file's ``headline`` value (a dict of named numbers) as one line,
    ``<recipe>: name value, ...``: what ``make bench`` prints after each benchmark."""
    data = read(path)
    headline = data.get("values", {}).get("headline")
    if not isinstance(headline, dict):
        raise ValueError(f"{path}: no headline recorded")
    shown = ", ".join(
        f"{name} {value:.3g}" if isinstance(value, float) else f"{name} {value}"
        for name, value in headline.items()
    )
    return f"{data.get('recipe', Path(path).stem)}: {shown}"


# Where a page records a decision rather than a number (a noise verdict, a goal met, the
# strategy or knob it names): what two runs of ``make bench`` on one machine must agree on.
# The speed page's next-best knob is not one: the page shows its median over the best's,
# not its name (two knobs a few percent apart took turns at it: 1.63 and 1.64 GB/s).
VERDICT_KEYS = frozenset(
    {"within_noise", "overhead_within_noise", "met", "holds_back", "verdict", "slower"}
    | {"strategy", "best", "rival", "choose"}
    | {"best_save", "best_load"}
)


def verdicts(values: dict) -> dict[str, Any]:
    """A results file's verdicts, each by where it lies in the recorded values (a path
    such as ``summary/async_save/overhead_s/within_noise``): every value under one of
    ``VERDICT_KEYS``, and the verdict of each row of an ``advice`` table (its name, its
    verdict, its numbers). The raw records of the runs (``runs``) hold none. Of an advice
    the page names the ``rival`` beside the best where no choice was made; its runner-up
    (``second``) beside a choice is the strategy whose median the page shows, unnamed:
    which of two near-equal strategies that was changed in 5 of 9 consecutive runs."""
    return {path: verdict for path, (verdict, _) in _decisions(values).items()}


def _decisions(values: dict) -> dict[str, tuple[Any, str | None]]:
    """``verdicts``, each with the numbers the page decided it from where it records them
    beside it (an advice row's numbers; a median and its rounds' range), else None."""
    found = {}

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key in VERDICT_KEYS and not isinstance(inner, dict | list):
                    found["/".join((*path, key))] = (inner, _numbers_beside(value))
                else:
                    walk(inner, (*path, key))
        elif isinstance(value, list) and path == ("advice",):
            found.update(
                {f"advice/{row[0]}": (row[1], " ".join(map(str, row[2:])) or None) for row in value}
            )
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk(inner, (*path, str(index)))

    walk({name: value for name, value in values.items() if name != "runs"}, ())
    return found


def _numbers_beside(entry: dict) -> str | None:
    """An entry's ``stats.summary`` ("median 0.42 (0.31-0.57)"), where it has one."""
    if not all(isinstance(entry.get(key), int | float) for key in ("min", "median", "max")):
        return None
    return f"median {stats.median_range(entry, '.3g')}"


def _verdict(found: dict, key: str) -> str:
    return repr(found[key][0]) if key in found else "not recorded"


def _shown(found: dict, key: str) -> str:
    numbers = found[key][1] if key in found else None
    return _verdict(found, key) + (f" ({numbers})" if numbers else "")


def compare_verdicts(before: Path, after: Path) -> list[str]:
    """Per results file in the directory ``after`` that ``before`` holds too: how many of
    its verdicts are the same as there, and each one that is not (or is in one only), with
    the numbers each run decided it from: a verdict that changes sits near its line."""
    lines = []
    for path in sorted(Path(after).glob("*.json")):
        if not (Path(before) / path.name).exists():
            continue
        old, new = (_decisions(read(d / path.name)["values"]) for d in (Path(before), Path(after)))
        keys = list(dict.fromkeys([*old, *new]))  # both runs', in the order they lie
        changed = [
            f"  {key}: {_shown(old, key)}, now {_shown(new, key)}"
            for key in keys
            if _verdict(old, key) != _verdict(new, key)
        ]
        summary = f"{path.stem}: {len(keys) - len(changed)} of {len(keys)} verdicts the same"
        lines += [summary + (", these differ:" if changed else ""), *changed]
    return lines


if __name__ == "__main__":
    # python -m page_tools.results RESULTS.json ...: their headlines;
    # python -m page_tools.results --compare BEFORE_DIR AFTER_DIR: their verdicts
    if sys.argv[1:2] == ["--compare"]:
        before, after = sys.argv[2:4]
        print(f"verdicts in {after} against {before}:")
        print("\n".join(compare_verdicts(Path(before), Path(after))))
    else:
        for argument in sys.argv[1:]:
            print(headline_line(Path(argument)))
