"""What checkpoints cost a training loop, from the loop's own timings, over interleaved rounds.

A benchmark page runs the same loop once per strategy in every round (A B C ... A B C),
after a warm-up round, every run from the same starting point. A run checkpoints at one
or more intervals (``multiples`` of an upload's time, ``steps_between`` steps each); per
interval a *segment*: a checkpoint, that many steps, and the wait until it is durable.
Each run returns, on every rank, its ``segments`` (``stall_s``: what the loop waited;
``steps``: each step's seconds and whether a save was in flight; ``wall_s``; ``upload_s``:
from before the call until its save was on disk, None for a save that blocks) and every
step's loss (``losses``). In the warm-up round, a run checkpoints once, the strategy's
first checkpoint (with no steps, or a few beside it: the page's choice).
``collect`` joins those with what the page watched (when each checkpoint became durable:
``timing.checkpoint_saves``; the run's peak host memory: ``memory.peak_between``; the
checks of the checkpoints it removed: ``disk.checked_before_removal``). Then, per run and
interval, against the run without checkpoints of the same round and thread budget
(``metrics``):

* *stall per checkpoint*: the slowest rank's wait;
* *slow-down of steps that overlap a save*: their median over a step beside no save: the
  median of the run's own steps that overlapped none (``quiet_step``; where fewer
  than ``FEWEST_QUIET_STEPS`` did, with the run's other intervals'; where none did and no
  other interval has any, the baseline's: ``beside_no_save``);
* *total overhead*: the stall plus what the steps that overlapped a save took beyond that
  step beside no save. A run is its
  own reference: between runs a minute apart the same step drifts by more (1.5x on an
  H200, 2x on 2 CPU cores) than a background save costs it;
* *extra peak host memory* per rank, over the baseline's;
* *time until durable*, from the save call;
* *seconds lost per second in the background*: the total overhead beyond the stall, over
  the time from the stall until durable, while the save ran beside the steps (none for a
  save that blocks until durable). ``against_goal`` turns it into how soon a save must be
  on disk to meet an overhead goal.

``summarize`` gives every metric's median over the rounds, its spread, and for effects
whether they are within noise (``stats.effect``: noise unless most rounds had some; of a
total overhead, more than ``STEP_RESOLUTION`` of a step); the rest renders tables from
that. Stalls, which differ by factors of a hundred between strategies, compare on the
ratio scale (``WAITS``).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from page_tools import disk, figures, machine, observe, results, stats, timing

BASELINE = "no checkpoint"
# metric: (heading, format, unit, the value of "no effect"; None: shown, not judged). The
# slow-down of the steps beside a save is not judged on its own: it is part of the total
# overhead, judged below (direct I/O overlap's one step ran a few percent slower, about
# as much as a step's own time varies, and its verdict flipped from run to run).
METRICS = {
    "stall_per_checkpoint_s": ("stall per checkpoint", ".3g", " s", 0.0),
    "overlapped_step_slowdown": ("slow-down of steps that overlap a save", ".3g", "x", None),
    "overhead_s": ("total overhead: stall and slower steps", "+.3g", " s", 0.0),
    "extra_memory_mb": ("extra peak host memory per rank", "+.0f", " MB", 0.0),
    "time_until_durable_s": ("time from save call until durable", ".3g", " s", None),
    # a real job's regime: 2x or more (the interval's steps without a save, over that time)
    "interval_vs_upload": ("interval over that time", ".3g", "x", None),
    "lost_per_background_s": ("step time lost per s, from stall to durable", ".3g", " s", None),
    "wall_s": ("wall time of the interval", ".3g", " s", None),
}

TIMES = ["stall_per_checkpoint_s", "time_until_durable_s", "interval_vs_upload"]  # per checkpoint
# A total overhead no larger than this share of one step (the round's reference step), in
# most rounds, is within noise. Overhead is measured in step times, and a step's time is
# not known closer than that: without any checkpoint, the first step of an interval ran
# up to 7.3% above the others' lower quartile (28 of 30 rounds of make bench runs 30-39;
# the other two, 28% and 30%, a hiccup of the machine). Direct I/O's overhead is one such
# step's: at 5% of a step it read "effect" in 2 of 10 runs and "noise" in the rest; at
# 10%, "noise" in 11 of 12 (run 36: all three rounds 0.12-0.20 s, above its 0.115 s).
# Decided by most rounds (``stats.effect``), it read "effect" in 3 of 8 later runs against
# the quiet steps' lower quartile, in 1 against their median (``quiet_step``): run 9,
# 0.16 and 0.19 s in two rounds, beside 0.12 s, its step slower than any quiet one.
STEP_RESOLUTION = 0.10
# waits the loop timed itself: compared as factors, noise only where a round waited none
WAITS = ("stall_per_checkpoint_s",)
# a goal's ``met``, in words: met, not met, or undecided (rounds on both sides of the goal,
# or dcp.save's own cost within noise: the goals table says which)
GOAL_VERDICTS = {True: "met", False: "not met", None: "undecided"}
# per interval at the headline multiple (the peak memory: over the whole run)
COSTS = [
    "overlapped_step_slowdown",
    "overhead_s",
    "lost_per_background_s",
    "extra_memory_mb",
]


def label(strategy: str, threads: int, default_threads: int) -> str:
    """A run's name: its strategy, and its thread budget where it is not the default."""
    return strategy if threads == default_threads else f"{strategy} ({threads} threads)"


def baseline_of(name: str) -> str:
    """The run without checkpoints that ``name`` is compared with: same thread budget."""
    strategy = name.split(" (")[0]
    return name.replace(strategy, BASELINE, 1)


# --------------------------------------------------------------------------
# Joining the loop's numbers with what the page watched
# --------------------------------------------------------------------------


def collect(
    per_rank: list[list[dict]],
    saves: observe.Calls,
    peaks: observe.Calls,
    removals: observe.Calls,
    default_threads: int,
    memory_kept: Sequence[str] = (),
) -> dict:
    """Every run of every rank, with its checkpoints' durable times and its peak memory.
    A strategy in ``memory_kept`` keeps its host buffers and writer process from one run to
    the next (torch_checkpointing's one manager per job): after the warm-up, a run's peak
    above its start cannot see them, and its runs say so (``memory_kept``).

    Returns ``{"order": [(round, name)], "runs": {name: [[rank run] per measured round]},
    "warmup": {name: [rank run]}, "removals": [records]}``; round 0 is the warm-up. Raises
    ``ValueError`` where the watches and the runs do not match one to one.
    """
    durable = timing.by_checkpoint(saves)
    order, runs, warmup = [], {}, {}
    for rank, rank_runs in enumerate(per_rank):
        rank_peaks = peaks.by_rank.get(rank, [])
        if len(rank_peaks) != len(rank_runs):
            raise ValueError(f"rank {rank}: {len(rank_runs)} runs, {len(rank_peaks)} memory peaks")
        for index, (run, peak) in enumerate(zip(rank_runs, rank_peaks, strict=True)):
            name = label(run["strategy"], run["threads"], default_threads)
            if rank == 0:
                order.append((run["round"], name))
            elif order[index] != (run["round"], name):
                raise ValueError(f"rank {rank} ran {name} where rank 0 ran {order[index]}")
            saved = [
                [r for r in durable.get(p, []) if r["rank"] == rank] for p in run["checkpoints"]
            ]
            if any(len(records) != 1 for records in saved):
                raise ValueError(f"rank {rank}, {name}: a checkpoint saved other than once")
            entry = {
                **run,
                "peak_memory_mb": peak["peak_mb"],
                "saves": [records[0] for records in saved],
                "memory_kept": run["strategy"] in memory_kept and run["round"] > 0,
            }
            if run["round"] == 0:
                warmup.setdefault(name, []).append(entry)
            else:
                rounds = runs.setdefault(name, [])
                while len(rounds) < run["round"]:
                    rounds.append([])
                rounds[run["round"] - 1].append(entry)
    removed = [record for _, records in sorted(removals.by_rank.items()) for record in records]
    return {"order": order, "runs": runs, "warmup": warmup, "removals": removed}


def interleaved(order: Sequence[Sequence[Any]], schedule: Sequence[str], rounds: int) -> bool:
    """The runs ran as a warm-up round then ``rounds`` rounds, each the whole ``schedule``."""
    expected = [(r, name) for r in range(rounds + 1) for name in schedule]
    return [tuple(entry) for entry in order] == expected


def complete_checkpoints(collected: dict) -> dict:
    """Evidence that every checkpoint the runs wrote was complete: every save durable,
    without an error; every checkpoint on disk with its ``.metadata`` and all its bytes when
    its directory was removed; the newest of each removal read back, all values finite."""
    runs = [run for name, ranks in collected["warmup"].items() for run in ranks]
    runs += [run for rounds in collected["runs"].values() for ranks in rounds for run in ranks]
    saves = [save for run in runs for save in run["saves"]]
    on_disk = {}
    for removal in collected["removals"]:
        for name, check in removal["checkpoints"].items():
            on_disk[f"{removal['directory']}/{name}"] = check
    written = {path for run in runs for path in run["checkpoints"]}
    incomplete = sorted(
        path
        for path in written
        if path not in on_disk or not on_disk[path]["metadata"] or on_disk[path]["missing"]
    )
    removals = collected["removals"]
    loaded = [r["loaded"] for r in removals if r["checkpoints"]]
    loaded += [  # torch_checkpointing's newest, in every removal that held one of its own
        r["loaded_torch_checkpointing"]
        for r in removals
        if any(c.get("library") == "torch_checkpointing" for c in r["checkpoints"].values())
    ]
    return {
        "checkpoints": len(written),
        "saves": len(saves),
        "not_durable": sum(1 for s in saves if s["durable"] is None or s["error"]),
        "manager_saves": written_by_manager(saves),
        "checked_on_disk": len(set(on_disk) & written),
        "incomplete": incomplete[:20],
        "read_back": len(loaded),
        "read_back_tensors": sorted({r["tensors"] for r in loaded if r}),
        "all_finite": all(r and r["finite"] for r in loaded),
        "held": bool(written)
        and not incomplete
        and all(s["durable"] is not None and not s["error"] for s in saves)
        and len(loaded) >= len(removals)
        and all(r and r["tensors"] > 0 and r["finite"] for r in loaded),
    }


def written_by_manager(saves: Sequence[dict]) -> int:
    """How many of the saves a torch_checkpointing manager made (``timing.checkpoint_saves``)."""
    return sum(1 for save in saves if save.get("call") == "manager.save")


def same_losses(collected: dict) -> dict:
    """Per rank and thread budget, every run's loss at each step (every run starts from the
    same state), and whether each step has one loss only."""
    losses: dict[str, list[set]] = {}
    groups = [*collected["warmup"].items()] + [
        (name, run) for name, rounds in collected["runs"].items() for run in rounds
    ]
    for _, ranks in groups:
        for rank, run in enumerate(ranks):
            steps = losses.setdefault(f"rank {rank}, {run['threads']} threads", [])
            for step, loss in enumerate(run["losses"]):
                if step == len(steps):
                    steps.append(set())
                steps[step].add(loss)
    return {
        "losses": {key: [sorted(values) for values in steps] for key, steps in losses.items()},
        "held": bool(losses) and all(len(v) == 1 for steps in losses.values() for v in steps),
    }


def timers_enclose_blocking_saves(collected: dict) -> dict:
    """For ``dcp.save`` (which blocks until durable), on every rank of every run: each
    interval's stall, as the loop timed it, is at least the time its save took, as the
    page's watch saw it."""
    runs = list(collected["warmup"].get("dcp.save", []))
    runs += [run for ranks in collected["runs"].get("dcp.save", []) for run in ranks]
    rows = []
    for run in runs:
        timed = [segment["stall_s"] for segment in run["segments"]]
        watched = [save["durable"] - save["called"] for save in run["saves"]]
        rows.append({"timed_s": timed, "watched_s": watched})
    held = bool(rows) and all(
        len(r["timed_s"]) == len(r["watched_s"])
        and all(t >= w for t, w in zip(r["timed_s"], r["watched_s"], strict=True))
        for r in rows
    )
    return {"runs": rows, "held": held}


def claim_interleaved(
    name: str, collected: dict, schedule: Sequence[Sequence[Any]], rounds: int, threads: int
) -> None:
    """Decide that the runs took turns: a warm-up round, then every round the whole schedule."""
    names = [label(strategy, budget, threads) for strategy, budget in schedule]
    order = collected["order"]
    results.claim(
        name,
        interleaved(order, names, rounds),
        f"{len(order)} runs per rank: a warm-up round, then {rounds} rounds of the same "
        f"{len(names)} runs in order",
        order=[list(entry) for entry in order],
        schedule=names,
    )


def claim_complete(name: str, collected: dict) -> None:
    """Decide that every checkpoint the runs wrote was durable, complete, and read back."""
    evidence = complete_checkpoints(collected)
    held = evidence.pop("held")
    results.claim(
        name,
        held,
        f"{evidence['checkpoints']} checkpoints: all durable and complete; each library's newest "
        "per round reads back",
        **evidence,
    )


def claim_same_losses(name: str, collected: dict) -> None:
    """Decide that no strategy changed what the loop computes: the same final loss."""
    evidence = same_losses(collected)
    held = evidence.pop("held")
    results.claim(
        name,
        held,
        "at every step, every run that reached it computes the same loss, bit for bit",
        **evidence,
    )


def claim_timers_enclose_blocking_saves(name: str, collected: dict) -> None:
    """Decide that the loop's timers saw every blocking ``dcp.save`` whole."""
    evidence = timers_enclose_blocking_saves(collected)
    held = evidence.pop("held")
    results.claim(
        name,
        held,
        f"the loop's timers saw all of every blocking dcp.save ({len(evidence['runs'])} runs "
        "on all ranks)",
        **evidence,
    )


def adam_checkpoint_bytes(make_model: Any) -> int:
    """Bytes of a checkpoint of ``make_model()`` trained with Adam: each parameter and its
    two moments (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = make_model()
    return sum(3 * p.numel() * p.element_size() for p in model.parameters())


# --------------------------------------------------------------------------
# Metrics, summaries, ratios
# --------------------------------------------------------------------------


# Runs whose costs no interval changes (nothing to overlap: no checkpoint, or a save that
# blocks until durable) checkpoint at one interval, which stands for every other.
ANY_INTERVAL = (BASELINE, "dcp.save")


def covers(run: dict, multiple: float) -> bool:
    """Whether a run (one rank's) gives its numbers at the interval ``multiple``."""
    return multiple in run["multiples"] or run["strategy"] in ANY_INTERVAL


def _segment(run: dict, multiple: float) -> tuple[int, dict]:
    multiples = list(run["multiples"])
    if multiple not in multiples and run["strategy"] in ANY_INTERVAL and len(multiples) == 1:
        return 0, run["segments"][0]
    index = multiples.index(multiple)  # ValueError: the run never checkpointed at that interval
    return index, run["segments"][index]


# The fewest steps beside no save a reference step is taken from: where a segment has fewer,
# the same run's other intervals' join them (``beside_no_save``). One step is no reference:
# in make bench run 42, DefaultStager's 2x interval (4 steps, one after its save was
# durable, 1.30 s, beside 1.21-1.24 s in the run's 8-step interval) read an overhead of
# 0.10 s, "within noise"; with the other intervals' quiet steps, 0.36 s (its 4x: 0.21 s).
FEWEST_QUIET_STEPS = 3


def quiet_step(seconds: Sequence[float]) -> float:
    """A step beside no save, from the times of such steps: their median. The machine's
    noise slows the steps that overlap a save as often as those that do not, so the
    reference is the typical quiet step, not a fast one: in the runs without a checkpoint
    of 8 make bench runs (123 steps), a step was 0.049 s above the lower quartile of the
    others in its interval on average (0.022 s by median), 0.011 s above their median
    (0.002 s). Against the lower quartile, as before, every overlapped step counted that
    as cost: direct I/O's one step read "effect" in 3 of those 8 runs (most rounds over a
    tenth of a step), "noise" in 5; against the median, "effect" in 1, and no other
    verdict changed. The lower quartile was chosen when one round decided: in make bench
    run 39, 4 of 7 quiet steps ran slow and read one round's overhead 0.047 s (its other
    rounds 0.33 and 0.45 s); most rounds (``stats.effect``) now decide."""
    if not seconds:
        raise ValueError("no step beside no save")
    return statistics.median(seconds)


def beside_no_save(own: list[float], fallbacks: Sequence[dict]) -> list[float]:
    """The step times a step beside no save is taken from: a segment's own steps that
    overlapped no save (``own``); where they are fewer than ``FEWEST_QUIET_STEPS``, with the
    steps of ``fallbacks`` (``reference_segment``'s, one per rank) where those are the same
    run's; where it has none, with the steps of ``fallbacks`` whatever they are."""
    if len(own) >= FEWEST_QUIET_STEPS or (own and not all(f.get("same_run") for f in fallbacks)):
        return own
    return own + [t for fallback in fallbacks for t, _ in fallback["steps"]]


def overhead(segment: dict, baseline_segment: dict) -> float:
    """One rank's total overhead in a segment: its stall, plus what its steps that overlapped
    a save took beyond a step without one (``quiet_step``): of the segment's own steps that
    overlapped none, with the run's other intervals' where they are fewer than
    ``FEWEST_QUIET_STEPS``, or ``baseline_segment``'s where it has none (``beside_no_save``;
    a save outlasting the interval: ``reference_segment``). Steps after the save is durable
    are the reference, not steps of a run minutes away, on a machine whose speed drifts
    more than a save costs; a median, not a mean: one quiet step that a hiccup of the
    machine slowed would raise a mean of seven by a seventh of its delay, for each
    overlapped step (one bench: 1.31 s among quiet steps of 1.13 s made a 0.04 s overhead
    read -0.02 s)."""
    quiet = [t for t, over in segment["steps"] if not over]
    reference = quiet_step(beside_no_save(quiet, [baseline_segment]))
    return segment["stall_s"] + sum(t - reference for t, over in segment["steps"] if over)


def extra_memory_mb(run: list[dict], baseline: list[dict]) -> int:
    """The run's peak host memory over its baseline's (the highest rank's each), in whole MB,
    as the tables show it: the sampler reads every 10 ms, and below a MB the Python objects
    of a save (its plan, a pickle) come and go from run to run (+0.1 MB in one, -0.01 in
    the next): a difference a reader cannot use, and a verdict that would not hold still."""
    peak = max(r["peak_memory_mb"] for r in run) - max(r["peak_memory_mb"] for r in baseline)
    return round(peak)


def reference_segment(rank_run: dict, segment: dict, baseline_segment: dict) -> dict:
    """What ``overhead`` adds where fewer than ``FEWEST_QUIET_STEPS`` steps of ``segment``
    overlapped no save (an interval not much longer than the upload): the steps of the same
    run's other intervals that overlapped none (seconds away, on the same rank: marked
    ``same_run``), else ``baseline_segment`` (a run minutes away: only where ``segment`` has
    no such step at all)."""
    quiet = [
        [t, False]
        for other in rank_run["segments"]
        if other is not segment
        for t, over in other["steps"]
        if not over
    ]
    return {"steps": quiet, "same_run": True} if quiet else baseline_segment


def metrics(run: list[dict], baseline: list[dict], multiple: float) -> dict[str, float | None]:
    """One run's metrics at the interval ``multiple``, from every rank's numbers;
    ``baseline``: its round's run without checkpoints, same thread budget."""
    index, _ = _segment(run[0], multiple)
    segments = [_segment(r, multiple)[1] for r in run]
    base = [r["segments"][0] for r in baseline]
    fallbacks = [reference_segment(*rsb) for rsb in zip(run, segments, base, strict=True)]
    steps_between = segments[0]["steps_between"]
    base_wall = max(s["wall_s"] for s in base) * (steps_between / base[0]["steps_between"])
    overlapped = [t for s in segments for t, over in s["steps"] if over]
    quiet = [t for s in segments for t, over in s["steps"] if not over]
    quiet = beside_no_save(quiet, fallbacks)  # see ``overhead``
    reference_step = quiet_step(quiet)
    saving = bool(run[0]["checkpoints"])
    wall = max(s["wall_s"] for s in segments)
    stall = max(s["stall_s"] for s in segments) if saving else None
    total = max(map(overhead, segments, fallbacks)) if saving else 0.0
    durable = (
        max(r["saves"][index]["durable"] - r["saves"][index]["called"] for r in run)
        if saving
        else None
    )
    background = durable - stall if saving else 0.0  # after the stall, until durable
    return {
        "stall_per_checkpoint_s": stall,
        "overlapped_step_slowdown": statistics.median(overlapped) / reference_step
        if overlapped
        else None,
        "overhead_s": total,  # without checkpoints 0 (its loop timed microseconds)
        "extra_memory_mb": None  # what it kept from earlier runs is not in its peak
        if run[0].get("memory_kept")
        else extra_memory_mb(run, baseline),
        "time_until_durable_s": durable,
        "interval_vs_upload": base_wall / durable if saving else None,
        # what the steps lost per second the save ran beside them (none for a blocking save)
        "lost_per_background_s": (total - stall) / background if background > 0 else None,
        "wall_s": wall,
        "interval_s": base_wall,  # what the interval's steps take without checkpoints
        "reference_step_s": reference_step,  # a step beside no save (``overhead``'s)
        # how many steps the slow-down is of (a rank's; the most of any rank)
        "overlapped_steps": max(sum(over for _, over in s["steps"]) for s in segments),
    }


def overhead_resolution(per_round: Sequence[dict]) -> list[float]:
    """Per round (``metrics``'s): the least total overhead told from none, in seconds."""
    return [STEP_RESOLUTION * m["reference_step_s"] for m in per_round]


def summarize(
    runs: dict[str, list[list[dict]]], multiple: float
) -> dict[str, dict[str, dict | None]]:
    """Per run name and metric, at the interval ``multiple``: the median over the rounds
    with its spread and each round's value, and for an effect (``METRICS``) whether it is
    within noise. None where a metric does not apply (no overlapped step, no checkpoint).
    Runs that did not checkpoint at that interval (``covers``) are left out."""
    summary = {}
    for name, rounds in runs.items():
        if not covers(rounds[0][0], multiple):
            continue
        baseline = runs[baseline_of(name)]
        per_round = [metrics(run, baseline[i], multiple) for i, run in enumerate(rounds)]
        summary[name] = {}
        for metric, (_, _, _, neutral) in METRICS.items():
            values = [m[metric] for m in per_round]
            if any(v is None for v in values):
                summary[name][metric] = None
            elif neutral is None or name == baseline_of(name):
                summary[name][metric] = stats.summary(values)
            else:
                floor = overhead_resolution(per_round) if metric == "overhead_s" else None
                summary[name][metric] = stats.effect(values, neutral, floor)
        steps = [m["overlapped_steps"] for m in per_round]  # how many the slow-down is of
        summary[name]["overlapped_steps"] = stats.summary(steps)
    return summary


def sweep(
    runs: dict[str, list[list[dict]]],
    names: Sequence[str],
    multiples: Sequence[float] | None = None,
):
    """Per run in ``names`` that ran (each once) and interval (``multiples``, else every
    interval the run checkpointed at): the steps between checkpoints, the interval over
    dcp.save's time until durable and over the run's own (per round, then the median), and
    the stall and total overhead with their spread and noise verdict."""
    saves = [  # dcp.save's time until durable, per round (the same at every interval)
        metrics(run, runs[BASELINE][i], run[0]["multiples"][-1])["time_until_durable_s"]
        for i, run in enumerate(runs["dcp.save"])
    ]
    found = {}
    for name in [name for name in dict.fromkeys(names) if name in runs]:
        found[name] = {}
        for multiple in multiples or runs[name][0][0]["multiples"]:
            per_round = [
                metrics(run, runs[baseline_of(name)][i], multiple)
                for i, run in enumerate(runs[name])
            ]
            ratios = [m["interval_s"] / save for m, save in zip(per_round, saves, strict=True)]
            own = [m["interval_vs_upload"] for m in per_round]
            found[name][str(multiple)] = {
                "steps_between": _segment(runs[name][0][0], multiple)[1]["steps_between"],
                "interval_vs_save": statistics.median(ratios),
                "interval_vs_upload": statistics.median(own),
                "stall_per_checkpoint_s": stats.effect(
                    [m["stall_per_checkpoint_s"] for m in per_round]
                ),
                "overhead_s": stats.effect(
                    [m["overhead_s"] for m in per_round], 0.0, overhead_resolution(per_round)
                ),
            }
    return found


def at_interval(found_sweep: dict, multiple: float) -> dict[str, dict]:
    """The sweep's entries at one interval, by run name, shaped as ``summarize``'s: each has
    ``stall_per_checkpoint_s`` and ``overhead_s``."""
    return {
        name: intervals[str(multiple)]
        for name, intervals in found_sweep.items()
        if str(multiple) in intervals
    }


def _median(summary: dict, name: str, metric: str) -> float:
    return summary[name][metric]["median"]


def ratios(summary: dict, strategies: Sequence[str], copy_seconds: float) -> dict:
    """Per strategy: its stall per checkpoint over one copy of a rank's share, and its stall
    and total overhead over ``dcp.save``'s (ratios of the medians)."""
    return {
        name: {
            "stall_vs_copy_time": _median(summary, name, "stall_per_checkpoint_s") / copy_seconds,
            "stall_vs_dcp_save": _median(summary, name, "stall_per_checkpoint_s")
            / _median(summary, "dcp.save", "stall_per_checkpoint_s"),
            "overhead_vs_dcp_save": _median(summary, name, "overhead_s")
            / _median(summary, "dcp.save", "overhead_s"),
            # a ratio of two overheads says little where either is noise
            "overhead_within_noise": summary[name]["overhead_s"]["within_noise"]
            or summary["dcp.save"]["overhead_s"]["within_noise"],
        }
        for name in strategies
    }


def goals(summary: dict, name: str, goals_vs_dcp_save: dict[str, float]) -> dict:
    """Whether ``name`` meets each goal "at most g times dcp.save's": its values, round by
    round, against g times dcp.save's median over the rounds (``stats.below_goal``: met
    where every round is below, not met where every round is above), with the rounds that
    say so. dcp.save's round-to-round spread is the disk's, which the background strategies
    do not share (a stall is a wait for the GIL or a copy): pairing each round with that
    round's dcp.save would add its noise to theirs. Where dcp.save's own effect is within
    noise, a multiple of it says nothing: the goal is neither met nor missed (None). Where
    the metric has a ``resolution`` (an overhead: a round's is known no closer than that),
    a round is below the goal only with it, and above only without it; a goal within that
    of the rounds is undecided, and the rounds' resolution is said beside them. Without
    it, direct I/O's overhead goal (0.057-0.12 s, beside rounds of -0.06 to 0.19 s, each
    known to 0.06 s) read met in 6 of 12 make bench runs and undecided in the others."""
    found = {}
    for metric, goal in goals_vs_dcp_save.items():
        heading, spec, unit, _ = METRICS[metric]
        values = summary[name][metric]["values"]
        resolution = summary[name][metric].get("resolution")
        reference = summary["dcp.save"][metric]
        limit = goal * reference["median"]
        factor = metric in WAITS
        outcome = stats.below_goal(values, limit, factor, resolution)
        rounds = ", ".join(f"{v:.3g}" for v in values)
        below = f"below {limit:.3g}{unit} in {outcome['rounds_below']} of {len(values)} rounds"
        said = f"{below} ({rounds}{unit})"
        if resolution:
            said += f"; a round resolves {min(resolution):.3g}-{max(resolution):.3g}{unit}"
            if outcome["met"] is None and outcome["rounds_below"] in (0, len(values)):
                said += ": too near the goal to tell"  # every round on one side, not by that
        met = outcome["met"]
        if reference.get("within_noise"):
            met = None
            said = f"dcp.save's own is within noise: {stats.shown_entry(reference, spec, unit)}"
        found[metric] = {
            "heading": heading,
            "goal": goal,
            "ratio": outcome["a"]["median"] / reference["median"],
            "limit": limit,  # in the metric's unit
            "resolution": resolution,  # per round, or None
            "met": met,
            "said": said,
        }
    return found


def against_goal(summary: dict, strategy: str, goal_s: float) -> dict:
    """``strategy``'s overhead, as its stall plus what its steps lost per second it ran in
    the background (medians): how soon after its start a save losing as much per second must
    be on disk to meet the overhead goal of ``goal_s`` seconds (None: its stall alone is
    above it; inf: its steps lost nothing), beside dcp.save's time until durable."""
    entry = summary[strategy]
    stall_s, rate = _median(summary, strategy, "stall_per_checkpoint_s"), 0.0
    if entry["lost_per_background_s"] is not None:
        rate = max(0.0, entry["lost_per_background_s"]["median"])
    durable_s = _median(summary, strategy, "time_until_durable_s")
    blocking_s = _median(summary, "dcp.save", "time_until_durable_s")
    if stall_s >= goal_s:
        within_s, needs = None, "is below its stall alone"
    elif not rate:
        within_s, needs = math.inf, "holds however long the save runs"
    else:
        within_s = stall_s + (goal_s - stall_s) / rate
        needs = f"allows it {within_s:.3g} s to reach disk: it took {durable_s:.3g} s"
        if within_s < durable_s:
            needs = f"needs it on disk {within_s:.3g} s after it starts, "
            needs += f"{durable_s / within_s:.2g}x sooner than it was"
        needs += f" (dcp.save is on disk {blocking_s:.3g} s after its call)"
    said = (
        f"{strategy} stalls the loop {stall_s:.3g} s, is on disk {durable_s:.3g} s after it "
        f"starts, and its steps lose {rate:.3g} s per second in between. The overhead goal, "
        f"{goal_s:.3g} s, {needs}."
    )
    return {"strategy": strategy, "stall_s": stall_s, "durable_s": durable_s,
            "lost_per_background_s": rate, "goal_s": goal_s, "durable_within_s": within_s,
            "dcp_save_durable_s": blocking_s, "said": said}  # fmt: skip


def goals_of(summary: dict, names: Sequence[str], **goals_vs_dcp_save: float) -> dict:
    """``goals`` for each of ``names``: strategy -> metric -> verdict."""
    return {name: goals(summary, name, goals_vs_dcp_save) for name in names}


CRITERIA = {
    "stall_per_checkpoint_s": "the pause per checkpoint matters most",
    "overhead_s": "the total training time matters most",
    "extra_memory_mb": "host memory is tight",
}


# Per metric, how far apart two strategies' values must be, in most rounds, for one to
# lead: stalls less than one GIL turn apart (Python's default ``sys.getswitchinterval()``,
# 5 ms) tie. A thread that holds the GIL keeps the loop waiting that long before it lets
# go, wherever the loop is; beside a step of a second, no job can tell them apart.
TIES = {"stall_per_checkpoint_s": 0.005}


def advice(
    summary: dict,
    strategies: Sequence[str],
    criteria: dict[str, str] = CRITERIA,
    ties: dict[str, float] = TIES,
) -> dict:
    """Per criterion (metric: when it matters), the strategy with the lowest median, and
    whether it leads beyond noise: below each other strategy in most rounds (a round's runs
    took turns on the same machine: ``stats.below_in_most_rounds``), by more than the
    metric's ``ties`` where it has one. ``second``: the runner-up where it leads, else the
    strategy (lowest median first) that was as low, or that close, in half the rounds or
    more; that one is also the ``rival``, the strategy the page names beside the best
    (None where the best leads: the page then shows the runner-up's median, not its name)."""
    found = {}
    for metric, when in criteria.items():
        _, spec, unit, _ = METRICS[metric]
        measured = [name for name in strategies if summary[name][metric] is not None]
        best, *rest = sorted(measured, key=lambda n: _median(summary, n, metric))
        values = {name: summary[name][metric]["values"] for name in measured}
        if not rest:
            raise ValueError(f"{metric}: one strategy measured, {best}; no runner-up")
        tie = ties.get(metric, 0.0)
        ahead = [value + tie for value in values[best]]  # what another must stay above
        rivals = [n for n in rest if not stats.below_in_most_rounds(ahead, [values[n]])]
        second = (rivals or rest)[0]
        medians = f"medians {_median(summary, best, metric):{spec}} and "
        medians += f"{_median(summary, second, metric):{spec}}{unit}"
        rounds, by = len(values[best]), f"{tie:.3g}{unit}"
        said = (
            f"{best} is {f'more than {by} ' if tie else ''}below every other in most of the "
            f"{rounds} rounds ({medians})"
            if not rivals
            else f"{best} and {second} are within noise of each other: {second} was "
            f"{f'within {by} of it, or lower,' if tie else 'as low or lower'} in half or more"
            f" of the {rounds} rounds ({medians})"
        )
        found[metric] = {
            "when": when,
            "best": best,
            "second": second,
            "choose": None if rivals else best,
            "rival": second if rivals else None,
            "tie": tie,
            "said": said,
        }
    return found


def thread_knob(summary: dict, strategy: str, default_threads: int, every_core: int) -> dict:
    """``strategy``'s total overhead with the default thread budget and with every core for
    training, paired round by round (``stats.in_most_rounds``, each round's resolution the
    larger of the two runs'): ``verdict``, every core's overhead "more" or "less" than the
    default budget's, or "within noise". In most rounds, not in every one: with every core
    training, the upload takes turns with it for the CPU, and cost 0.5-2.5 s more than with
    a core to spare in 35 of 36 rounds (make bench runs 30-41); in one (run 38), done
    within 2 steps instead of 3, no more."""
    if every_core <= default_threads or label(strategy, every_core, default_threads) not in summary:
        spare = every_core > default_threads
        why = (
            "forked ranks train with one thread (make bench runs it)"
            if spare
            else ("no core to spare")
        )
        return {"ran": False, "why": why}
    budgets = {default_threads: strategy, every_core: label(strategy, every_core, default_threads)}
    recommended, every = (summary[budgets[t]]["overhead_s"] for t in budgets)
    floors = (e.get("resolution") or [0.0] * e["n"] for e in (recommended, every))
    resolution = [max(pair) for pair in zip(*floors, strict=True)]
    found = stats.in_most_rounds(recommended["values"], every["values"], resolution)
    verdict = found["change"] or "within noise"
    rounds = len(resolution)
    medians = f"medians {recommended['median']:.3g} and {every['median']:.3g} s"
    if found["change"] is None:
        said = (
            f"{every_core} training threads and {default_threads} are within noise of each "
            f"other: neither's total overhead more in most of the {rounds} rounds ({medians})"
        )
    else:
        agreeing = found["above" if verdict == "more" else "below"]  # the rounds that say so
        said = (
            f"{every_core} training threads: {verdict} total overhead than {default_threads} "
            f"in {agreeing} of the {rounds} rounds ({medians})"
        )
    return {
        "ran": True,
        "threads": {"recommended": default_threads, "every_core": every_core},
        "labels": {str(threads): name for threads, name in budgets.items()},
        "verdict": verdict,  # every core's overhead against the recommended's
        "resolution": resolution,
        "said": said,
    }


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------


def summary_table(
    summary: dict, names: Sequence[str], metrics_shown: Sequence[str]
) -> figures.Table:
    """One row per run, one column per metric: median [lowest .. highest], and "within noise"."""
    columns = ["run"] + [METRICS[m][0] for m in metrics_shown]

    def cell(name: str, metric: str) -> str:
        text = stats.shown_entry(summary[name][metric], METRICS[metric][1], METRICS[metric][2])
        if metric == "overlapped_step_slowdown" and summary[name][metric]:
            counts = summary[name]["overlapped_steps"]  # per round
            fewest, most = round(counts["min"]), round(counts["max"])
            steps = str(most) if fewest == most else f"{fewest}-{most}"
            text += f", {steps} step{'s' if most > 1 else ''}"
        return text

    rows = [[name] + [cell(name, m) for m in metrics_shown] for name in names]
    rounds = next(e["n"] for e in summary[names[0]].values() if e)
    caption = f"medians over {rounds} rounds [lowest .. highest]"
    shown = [summary[n]["overhead_s"] or {} for n in names if "overhead_s" in metrics_shown]
    floors = [floor for entry in shown for floor in entry.get("resolution", [])]
    if floors:  # the rule, with its numbers
        caption += (
            "; within noise: an effect that most rounds did not have, or an overhead that"
            f" most rounds had no more than {STEP_RESOLUTION:.0%} of a step of"
            f" ({min(floors):.3g}-{max(floors):.3g} s), about what an interval's first step"
            " strays by without a save; the slow-down is not judged alone: it is part of the"
            " overhead, and is the median of the steps that overlapped a save, as many per"
            " round as it says"
        )
    if "extra_memory_mb" in metrics_shown:  # what a run's own peak cannot hold
        kept = [name for name in names if summary[name]["extra_memory_mb"] is None]
        caption += (
            "; peak memory: a writer process that lives for the job, started in the warm-up"
            " (DCP's checkpoint process, torch_checkpointing's), is in the first checkpoints'"
            " table"
            + "".join(f"; -: {name} keeps its buffers from the run before" for name in kept)
        )
    return figures.Table(columns, rows, caption=caption)


def ratios_table(found: dict, copy_seconds: float) -> figures.Table:
    rows = [
        [
            name,
            round(r["stall_vs_copy_time"], 1),
            round(r["stall_vs_dcp_save"], 3),
            f"{r['overhead_vs_dcp_save']:.2f} (noise)"
            if r["overhead_within_noise"]
            else round(r["overhead_vs_dcp_save"], 2),
        ]
        for name, r in found.items()
    ]
    return figures.Table(
        ["strategy", "stall / one copy", "stall / dcp.save's", "overhead / dcp.save's"],
        rows,
        caption=f"ratios of the medians (noise: an overhead within noise); one copy of a "
        f"rank's share into a reused buffer: {copy_seconds * 1e3:.3g} ms",
    )


def goals_table(found: dict) -> figures.Table:
    """One row per strategy and goal (``found``: strategy -> ``goals(...)``)."""
    rows = [
        [
            name,
            f"{g['heading']} <= {g['goal']}x dcp.save's median",
            round(g["ratio"], 3),
            GOAL_VERDICTS[g["met"]],
            g["said"],
        ]
        for name, found_goals in found.items()
        for g in found_goals.values()
    ]
    columns = ["strategy", "goal", "measured ratio", "verdict", "from the rounds"]
    return figures.Table(columns, rows)


def advice_table(found: dict) -> figures.Table:
    # Never an empty answer: within noise, the table says so, and what to measure instead.
    rows = [
        [
            f"when {a['when']}",
            a["choose"]
            or f"either: {a['best']} and {a['second']} within noise here; time both on your"
            " machine (make bench)",
            a["said"],
        ]
        for a in found.values()
    ]
    return figures.Table(["criterion", "choose", "from the rounds"], rows)


def thread_budget_table(
    summary: dict, knob: dict, strategy: str, ranks: int, threads: int
) -> figures.Table:
    cores = os.cpu_count() or 1
    rows = [
        ["cores", cores],
        ["ranks", ranks],
        ["training threads per rank", threads],
        ["cores left to the writers", max(0, cores - ranks * threads)],
    ]
    if not knob["ran"]:
        rows.append(["the knob (every core for training)", f"not run here: {knob['why']}"])
    for budget, name in (knob.get("labels") or {}).items():
        rows.append(
            [
                f"{strategy}, {budget} threads: total overhead",
                stats.shown_entry(summary[name]["overhead_s"], "+.3g", " s"),
            ]
        )
        rows.append(
            [
                f"{strategy}, {budget} threads: stall per checkpoint",
                stats.shown_entry(summary[name]["stall_per_checkpoint_s"], ".3g", " s"),
            ]
        )
    if knob["ran"]:
        rows.append(["overhead, recommended budget vs every core", knob["said"]])
    return figures.Table(["", "this run"], rows)


def limits(per_rank: list[dict], total_bytes: int) -> dict:
    """The machine's limits from every rank's ``disk.copy_and_write_speeds``: the slowest
    rank's speeds (GB/s), the share of a rank, and the seconds of one copy of it into a
    reused buffer (what a stall is measured against)."""
    slowest = disk.slowest(per_rank)
    share = per_rank[0]["bytes"]
    return {
        "GBps": slowest,
        "GBps_per_rank": per_rank,
        "checkpoint_bytes": total_bytes,
        "bytes_per_rank": share,
        "copy_s": share / (slowest["copy_reused"] * 1e9),
    }


def share(found: dict) -> str:
    """What the limits were measured for: the checkpoint, and each rank's share of it."""
    ranks = len(found["GBps_per_rank"])
    return (
        f"checkpoint: {found['checkpoint_bytes'] / 1e6:,.0f} MB in all, "
        f"{found['bytes_per_rank'] / 1e6:,.0f} MB per rank on {ranks} rank(s)"
    )


def limits_table(found: dict) -> figures.Table:
    names = {
        "copy_reused": "copy into a reused buffer",
        "copy_fresh": "copy into new pages",
        "write_fsync": "write + fsync",
    }
    share = found["bytes_per_rank"]
    rows = [
        [names[key], round(speed, 2), round(share / (speed * 1e9), 4)]
        for key, speed in found["GBps"].items()
    ]
    return figures.Table(
        ["limit", "GB/s per rank", "s per checkpoint"],
        rows,
        caption="the slowest rank's speeds, for its share",
    )


def config(
    checkpoint_gb: float,
    schedule: Sequence[Sequence[Any]],
    rounds: int,
    collected: dict,
    per_rank: list,
) -> dict:
    """The benchmark's settings as the results file keeps them (with the steps between
    checkpoints the warm-up round chose, per multiple of an upload's time), and where it ran."""
    from rank_launcher import under_torchrun

    aligned = big_tensors_start_at_a_page()
    if not aligned:  # the page's numbers for it are then a copy's: say so where they print
        print(figures.wrap(UNALIGNED))
    intervals = {}
    for rounds_of_run in collected["runs"].values():
        run = rounds_of_run[0][0]  # round 1, rank 0: every round and rank ran the same steps
        for multiple, segment in zip(run["multiples"], run["segments"], strict=True):
            intervals[str(multiple)] = segment["steps_between"]
    return {
        "checkpoint_gb": checkpoint_gb,
        "schedule": [list(entry) for entry in schedule],
        "rounds": rounds,
        "intervals": dict(sorted(intervals.items(), key=lambda item: float(item[0]))),
        "training_threads": schedule[0][1],
        "world_size": len(per_rank),
        "launcher": "torchrun" if under_torchrun() else "fork",
        "accelerator": torch.accelerator.is_available(),
        "big_tensors_start_at_a_page": aligned,
    }


UNALIGNED = (
    "THP_MEM_ALLOC_ENABLE is not 1 in this process: big tensors do not start at a page, so"
    " direct I/O overlap copies every one through its small aligned buffer (set it before"
    " Python starts, as the Makefile does)"
)


def big_tensors_start_at_a_page(tries: int = 4) -> bool:
    """Whether torch's allocator starts tensors of 2 MB or more at a page (as with
    ``THP_MEM_ALLOC_ENABLE=1``), so that direct I/O writes them where they lie. All of
    ``tries`` at once: one could start at a page by chance."""
    kept = [torch.empty(4 << 20, dtype=torch.uint8) for _ in range(tries)]
    return all(tensor.data_ptr() % 4096 == 0 for tensor in kept)


def first_checkpoints(collected: dict, names: Sequence[str]) -> dict[str, float]:
    """Each strategy's first checkpoint (the warm-up round's), from the call until durable
    as the page's watch saw it, the slowest rank's seconds."""
    warmup = collected["warmup"]
    return {
        name: max(r["saves"][0]["durable"] - r["saves"][0]["called"] for r in warmup[name])
        for name in names
    }


def first_checkpoints_table(collected: dict, names: Sequence[str]) -> figures.Table:
    """Each strategy's first checkpoint (with the steps beside it, if any), and the peak host
    memory of that run above its start on the highest rank (with every process it started)."""
    warmup = collected["warmup"]
    peaks = {name: max(r["peak_memory_mb"] for r in warmup[name]) for name in names}
    beside = {name: warmup[name][0]["segments"][0]["steps_between"] for name in names}
    rows = [
        [
            f"{name}, beside {beside[name]} steps" if beside[name] else name,
            f"{seconds:.3g} s",
            f"{peaks[name]:+.0f} MB",
        ]
        for name, seconds in first_checkpoints(collected, names).items()
    ]
    return figures.Table(
        ["strategy", "first checkpoint, until durable", "peak host memory above the start"],
        rows,
        caption="the warm-up round: it starts what a strategy starts once (host buffer, process)",
    )


def headline(
    found_ratios: dict,
    found_goals: dict,
    strategy: str,
    training_threads: int,
    interval_multiple: float,
) -> dict:
    """The page's headline numbers: ``strategy``'s stall and total overhead over dcp.save's,
    the goals, the thread budget, and the interval they were measured at (a multiple of
    the upload's time)."""
    return {
        "strategy": strategy,
        "stall_vs_dcp_save": found_ratios[strategy]["stall_vs_dcp_save"],
        "overhead_vs_dcp_save": found_ratios[strategy]["overhead_vs_dcp_save"],
        "stall_goal": found_goals["stall_per_checkpoint_s"]["goal"],
        "overhead_goal": found_goals["overhead_s"]["goal"],
        "training_threads": training_threads,
        "interval_multiple": interval_multiple,
    }


def figure(summary: dict, names: Sequence[str], found_limits: dict, multiple: float, rounds: int):
    """Left: the stall per checkpoint (log scale), with one copy of a rank's share for
    reference. Right: the total overhead (stall and slower steps). Medians, with
    the lowest and highest round as whiskers. The title names the machine (with the
    storage of the temporary directory, where ``shared_tempdir`` puts checkpoints), the
    size, the interval (``multiple`` times an upload's time) and the rounds."""
    copy_seconds = found_limits["copy_s"]
    title = (
        f"{machine.title()}\ncheckpoint {found_limits['checkpoint_bytes'] / 1e9:.2f} GB, "
        f"{len(found_limits['GBps_per_rank'])} rank(s), every {multiple}x an upload's time, "
        f"{rounds} rounds"
    )
    stalls_ = [summary[n]["stall_per_checkpoint_s"] for n in names]
    totals = [summary[n]["overhead_s"] for n in names]
    return figures.medians_with_whiskers(
        names,
        [
            {
                "entries": stalls_,
                "labels": [f"{e['median']:.3g} s" for e in stalls_],
                "xlabel": "stall per checkpoint (s, log scale)",
                "log": True,
                "reference": (copy_seconds, "one memcpy of a rank's share"),
                "color": "tab:blue",
            },
            {
                "entries": totals,
                "labels": [
                    f"{e['median']:+.2f} s" + (" (noise)" if e["within_noise"] else "")
                    for e in totals
                ],
                "xlabel": "total overhead: stall and slower steps (s)",
                "color": "tab:orange",
            },
        ],
        title,
    )


def sweep_table(found: dict) -> figures.Table:
    """One row per swept strategy and interval: steps, the interval over dcp.save's time,
    stall and total overhead (median [lowest .. highest], and "within noise")."""
    rows = [
        [
            name,
            f"{multiple}x: {entry['steps_between']} step" + "s" * (entry["steps_between"] != 1),
            round(entry["interval_vs_save"], 2),
            round(entry["interval_vs_upload"], 2),
            stats.shown_entry(entry["stall_per_checkpoint_s"], ".3g", " s"),
            stats.shown_entry(entry["overhead_s"], "+.3g", " s"),
        ]
        for name, intervals in found.items()
        for multiple, entry in intervals.items()
    ]
    columns = ["strategy", "interval", "over dcp.save's", "over its upload", "stall"]
    columns.append("total overhead")
    caption = "medians over the rounds [lowest .. highest]"
    for name, steps, multiples in shared_intervals(found):
        caption += (
            f"; {name}'s {_listed([f'{m}x' for m in multiples])} are one interval here,"
            f" {steps} step{'s' * (steps != 1)}: the fewest steps that last each"
        )
    return figures.Table(columns, rows, caption=caption)


def _listed(words: Sequence[str]) -> str:
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


def shared_intervals(found: dict) -> list[tuple[str, int, list[str]]]:
    """The swept multiples that came to the same number of steps (a step that outlasts the
    shorter intervals: at a page's small size, say), per strategy: (name, steps, multiples)."""
    by_steps: dict[tuple[str, int], list[str]] = {}
    for name, intervals in found.items():
        for multiple, entry in intervals.items():
            by_steps.setdefault((name, entry["steps_between"]), []).append(multiple)
    return [(name, steps, ms) for (name, steps), ms in by_steps.items() if len(ms) > 1]


def sweep_figure(found: dict, found_limits: dict, what: str):
    """Stall (log scale) and total overhead per checkpoint against the interval over the
    run's own upload's time, one line per strategy: medians, whiskers the lowest and highest
    round. The title names the machine."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, intervals in found.items():
        x = [entry["interval_vs_upload"] for entry in intervals.values()]
        for axis, metric in zip(axes, ("stall_per_checkpoint_s", "overhead_s"), strict=True):
            entries = [entry[metric] for entry in intervals.values()]
            medians = [e["median"] for e in entries]
            whiskers = [
                [e["median"] - e["min"] for e in entries],
                [e["max"] - e["median"] for e in entries],
            ]
            axis.errorbar(x, medians, yerr=whiskers, marker="o", capsize=3, label=name)
    for axis, label in zip(
        axes,
        ("stall per checkpoint (s, log scale)", "total overhead per checkpoint (s)"),
        strict=True,
    ):
        axis.axvline(1.0, color="gray", linestyle=":", label="interval = its upload's time")
        axis.axvline(2.0, color="gray", linestyle="--", label="2x: a real job's regime")
        axis.set_xlabel("checkpoint interval / its own upload's time, call to durable")
        axis.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[0].legend(fontsize="small")
    checkpoint_gb = found_limits["checkpoint_bytes"] / 1e9
    figure.suptitle(f"{machine.title()}\ncheckpoint {checkpoint_gb:.2f} GB, {what}")
    figure.tight_layout()
    return figure


def print_summary_line(bench: bool, recipe: str, headline: dict, found_goals: dict) -> None:
    """Under ``make bench`` (``bench``), print its one line of headline numbers; a site build
    records them as the value ``headline`` instead, and prints nothing here."""
    if bench:
        print(summary_line(recipe, headline, found_goals))


def summary_line(recipe: str, headline: dict, found_goals: dict) -> str:
    """The one line ``make bench`` prints, from the recorded numbers."""
    stall, overhead = found_goals["stall_per_checkpoint_s"], found_goals["overhead_s"]
    return (
        f"{recipe}: {headline['strategy']} stall {headline['stall_vs_dcp_save']:.3f}x dcp.save's "
        f"(goal <= {stall['goal']}x: {GOAL_VERDICTS[stall['met']]}), total overhead "
        f"{headline['overhead_vs_dcp_save']:.2f}x (goal <= {overhead['goal']}x: "
        f"{GOAL_VERDICTS[overhead['met']]})"
    )


# --------------------------------------------------------------------------
# Several ways of saving from one loop, side by side (the object-storage async page)
# --------------------------------------------------------------------------


def side_by_side(
    per_rank: list[list[dict]], saves: observe.Calls, requests: observe.Calls, timed: slice
) -> dict:
    """Join every rank's runs (``{"round", "way", "stalls_s", "checkpoints", "loss"}``, one
    per way and round; round 0 the warm-up) with when each checkpoint became durable
    (``timing.checkpoint_saves``) and the server's requests of each run (rank 0's
    ``object_store.requests_between``, one record per run in order).

    A run's ``stalls_s`` has a pair per save: the seconds the loop waited in the call and for
    staging, and the seconds it waited for the upload. Per way, over the measured rounds:
    ``stall_s`` (per round, the median over the ``timed`` saves of the slowest rank's total
    wait), ``call_s`` (the same for the first part alone), ``upload_s`` (the same for the
    time from the save call until durable) and ``requests_per_save`` (round 1's, by action);
    and every save's record with its way, for the claims. Raises ``ValueError`` where the
    records do not match the runs.
    """
    durable = timing.by_checkpoint(saves)
    counted = requests.by_rank.get(0, [])
    if len(counted) != len(per_rank[0]):
        raise ValueError(f"{len(per_rank[0])} runs, {len(counted)} request counts")
    ways: dict[str, dict] = {}
    every_save = []
    for index, runs in enumerate(zip(*per_rank, strict=True)):
        run = runs[0]
        if any((r["round"], r["way"]) != (run["round"], run["way"]) for r in runs):
            raise ValueError(f"run {index}: the ranks ran different ways")
        records = [durable.get(path, []) for path in run["checkpoints"]]
        if any(len(found) != len(runs) for found in records):
            raise ValueError(f"{run['way']}, round {run['round']}: a save not once per rank")
        every_save += [{**r, "way": run["way"]} for found in records for r in found]
        uploads = [max(_until_durable(r) for r in found) for found in records]
        waits = list(zip(*(r["stalls_s"] for r in runs), strict=True))  # per save, by rank
        stalls = [max(sum(pair) for pair in column) for column in waits]
        calls = [max(pair[0] for pair in column) for column in waits]
        entry = ways.setdefault(run["way"], {"requests_per_save": {}, "losses": []})
        entry["losses"].append(run["loss"])
        if run["round"] == 0:
            continue
        for metric, values in (("stall_s", stalls), ("call_s", calls), ("upload_s", uploads)):
            entry.setdefault(metric, []).append(statistics.median(values[timed]))
        if run["round"] == 1:
            per_save = {k: v / len(run["checkpoints"]) for k, v in counted[index].items()}
            entry["requests_per_save"] = per_save
    return {"ways": ways, "saves": every_save}


def _until_durable(record: dict) -> float:
    """Seconds from a save call until its checkpoint was durable (infinite: it failed)."""
    return float("inf") if record["durable"] is None else record["durable"] - record["called"]


def _shown_ms(values: Sequence[float]) -> str:
    return stats.median_range(values, ".1f", 1e3)


def side_by_side_table(found: dict, rounds: int) -> figures.Table:
    """One row per way: stall, of which in the call, and upload per save (ms, median
    (lowest-highest) over the rounds), and the requests it sent per save."""
    rows = [
        [
            way,
            _shown_ms(entry["stall_s"]),
            _shown_ms(entry["call_s"]),
            _shown_ms(entry["upload_s"]),
            round(sum(entry["requests_per_save"].values()), 1),
            round(entry["requests_per_save"].get("PUT", 0), 1),
        ]
        for way, entry in found["ways"].items()
    ]
    columns = ["way", "stall per save (ms)", "in the call (ms)", "upload (ms)", "requests"]
    columns.append("of which PUT")
    return figures.Table(columns, rows, caption=f"medians over {rounds} rounds (lowest-highest)")


def side_by_side_verdicts(found: dict, pairs: Sequence[tuple[str, str, str]]) -> dict[str, str]:
    """``stats.verdict``'s sentence for each ``(way a, way b, "stall_s" or "upload_s")``,
    printed in lines that fit the page; returns them by ``"a vs b: metric"``."""
    said = {}
    words = {"stall_s": "stall", "call_s": "stall in the call", "upload_s": "upload"}
    for a, b, metric in pairs:
        ways = found["ways"]
        sentence, _ = stats.verdict(
            f"{words[metric]}, {a}", ways[a][metric], b, ways[b][metric], "ms", 1e3
        )
        print(figures.wrap(sentence))
        said[f"{a} vs {b}: {metric}"] = sentence
    return said


def all_durable(found: dict) -> dict:
    """Evidence that every save of every run became durable without an error."""
    saves = found["saves"]
    errors = sorted({r["error"] for r in saves if r["error"] is not None})
    return {
        "saves": len(saves),
        "durable": sum(r["durable"] is not None and r["error"] is None for r in saves),
        "errors": errors,
    }
