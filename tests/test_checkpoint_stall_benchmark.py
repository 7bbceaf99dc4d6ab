"""The checkpoint-stall benchmark: what the build measured and proved, and its download alone.

No timing is asserted (the machine is shared and noisy). The build's results file holds
every run of every rank, as the loop measured it, with what the page watched; from those
raw numbers alone this module recomputes the intervals the warm-up round chose, every
median, spread, "within noise", ratio, goal verdict, point of the interval sweep and piece
of advice the page shows, and checks that the runs took turns (a warm-up round, then
A B C ... A B C, also in time), that every checkpoint was complete and that no strategy
changed what the loop computes, step by step. The download runs alone and computes the losses
the page shows; the source runs once more under torchrun, where the thread knob runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from recipe_runner import (
    HTML,
    RECIPES,
    assert_no_traceback,
    assert_ok,
    build_results,
    checkpoint_files_in_repo,
    numbers_in,
    page_outputs,
    parsed_html,
    recipe_path,
)

RECIPE = "checkpoint_stall_benchmark"
SMALLEST_GB = "0.02"  # two 1024x1024 layers: about 25 MB of checkpoint
STRATEGIES = [
    "no checkpoint",
    "dcp.save",
    "async_save",
    "DefaultStager overlap",
    "process writer",
    "direct I/O overlap",
    "torch_checkpointing",
]
CHECKPOINTING = STRATEGIES[1:]
KEPT = ["torch_checkpointing"]  # one manager per job: its memory outlives a run
CLAIMS = [
    "rounds-interleaved",
    "every-checkpoint-complete",
    "checkpoints-leave-training-unchanged",
    "loop-timers-see-blocking-saves",
]
# metric: the value of "no effect", or None where the metric is not judged
NEUTRAL = {
    "stall_per_checkpoint_s": 0.0,
    "overlapped_step_slowdown": None,  # shown; judged as part of the total overhead
    "overhead_s": 0.0,
    "extra_memory_mb": 0.0,
    "time_until_durable_s": None,
    "interval_vs_upload": None,
    "lost_per_background_s": None,
    "wall_s": None,
}
MULTIPLES = [0.5, 1, 1.5, 2.5]  # checkpoint intervals, in multiples of the warm-up's upload
HEADLINE = 2.5  # a real job's regime: 2x the upload or more, with room for a slower strategy
UPLOAD_STEPS = 2  # beside the warm-up's upload (DefaultStager overlap's first checkpoint)
KNOB_AT = 1  # the thread knob's runs
BASELINE_AT = 1.5  # the run without checkpoints, at the default thread budget
SWEPT = ["DefaultStager overlap"]
ANY_INTERVAL = ["no checkpoint", "dcp.save"]  # costs no interval changes: run at one only
BACKGROUND = [
    "DefaultStager overlap",
    "process writer",
    "direct I/O overlap",
    "torch_checkpointing",
]
GOALS = {"stall_per_checkpoint_s": 0.02, "overhead_s": 0.05}
TIES = {"stall_per_checkpoint_s": 0.005}  # Python's default GIL turn, sys.getswitchinterval()
CRITERIA = ["stall_per_checkpoint_s", "overhead_s", "extra_memory_mb"]
# What the recipe prints for every run (rank 0), and the steps per interval the warm-up chose.
RUN_LINE = (
    r"^\[rank0\] (warm-up|round \d+) +(.+?) +threads (\d+), "
    r"(?:first save [\d.]+ s|stall [\d.]+ s, loss (\S+))$"
)
INTERVALS_LINE = r"^\[rank0\] upload [\d.e+-]+ s, step [\d.e+-]+ s; steps per interval: (.+)$"


# --------------------------------------------------------------------------
# The numbers, recomputed from the raw per-rank measurements
# --------------------------------------------------------------------------


def label(strategy: str, threads: int, default: int) -> str:
    return strategy if threads == default else f"{strategy} ({threads} threads)"


def baseline_label(name: str) -> str:
    return name.replace(name.split(" (")[0], "no checkpoint", 1)


def intervals_of(strategy: str, threads: int, default: int) -> list[float]:
    """The multiples a run checkpoints at, as the page decides them."""
    if threads != default:
        return [KNOB_AT]
    if strategy == "no checkpoint":
        return [BASELINE_AT]
    if strategy == "dcp.save":
        return [MULTIPLES[0]]
    return MULTIPLES if strategy in SWEPT else [HEADLINE]


def covers(run: list[dict], multiple: float) -> bool:
    return multiple in run[0]["multiples"] or run[0]["strategy"] in ANY_INTERVAL


def quiet_elsewhere(rank_run: dict, index: int, base: dict) -> tuple[list[float], bool]:
    """A rank's steps that overlapped no save in the run's other intervals (True: the same
    run's), else every step of its baseline (False)."""
    others = [s for i, s in enumerate(rank_run["segments"]) if i != index]
    quiet = [t for s in others for t, over in s["steps"] if not over]
    return (quiet, True) if quiet else ([t for t, _ in base["steps"]], False)


def typical_step(seconds: list[float]) -> float:
    """A step beside no save: the median of such steps."""
    return statistics.median(seconds)


def with_elsewhere(own: list[float], elsewhere: list[tuple[list[float], bool]]) -> list[float]:
    """The steps a step beside no save comes from: ``own``, where at least 3; with the same
    run's other intervals' where fewer; with whatever ``elsewhere`` holds where none."""
    if len(own) >= 3 or (own and not all(same for _, same in elsewhere)):
        return own
    return own + [t for steps, _ in elsewhere for t in steps]


def overhead_of(segment: dict, elsewhere: tuple[list[float], bool]) -> float:
    """A rank's stall plus its overlapped steps' time beyond the median of its steps
    that overlapped no save (``with_elsewhere``)."""
    quiet = [t for t, over in segment["steps"] if not over]
    reference = typical_step(with_elsewhere(quiet, [elsewhere]))
    overlapped = [t for t, over in segment["steps"] if over]
    return segment["stall_s"] + sum(overlapped) - reference * len(overlapped)


def run_metrics(run: list[dict], baseline: list[dict], multiple: float) -> dict:
    """A run's numbers at one interval: its segment for ``multiple`` on every rank, against
    the run's own quiet steps (``with_elsewhere``). A run whose costs no interval changes
    ran at one interval only, which stands for every one."""
    assert covers(run, multiple)
    multiples = run[0]["multiples"]
    index = multiples.index(multiple) if multiple in multiples else 0
    assert all(r["multiples"] == multiples for r in run)
    segments = [r["segments"][index] for r in run]
    base = [r["segments"][0] for r in baseline]
    elsewhere = [quiet_elsewhere(r, index, b) for r, b in zip(run, base, strict=True)]
    overlapped = [t for s in segments for t, over in s["steps"] if over]
    quiet = [t for s in segments for t, over in s["steps"] if not over]
    step = typical_step(with_elsewhere(quiet, elsewhere))  # a step beside no save
    saving = bool(run[0]["checkpoints"])
    wall = max(s["wall_s"] for s in segments)
    found = {
        "stall_per_checkpoint_s": max(s["stall_s"] for s in segments) if saving else None,
        "overlapped_step_slowdown": statistics.median(overlapped) / step if overlapped else None,
        "overhead_s": (max(map(overhead_of, segments, elsewhere)) if saving else 0.0),
        "extra_memory_mb": None
        if run[0]["memory_kept"]
        else round(
            max(r["peak_memory_mb"] for r in run) - max(r["peak_memory_mb"] for r in baseline)
        ),
        "time_until_durable_s": (
            max(r["saves"][index]["durable"] - r["saves"][index]["called"] for r in run)
            if saving
            else None
        ),
        "lost_per_background_s": None,  # a save that blocks until durable has no background
        "interval_vs_upload": None,
        "wall_s": wall,
        "step_s": step,
        "overlapped_steps": max(sum(over for _, over in s["steps"]) for s in segments),
    }
    # the interval: its steps at the pace of its round's baseline (its own thread budget)
    per_step = max(b["wall_s"] for b in base) / base[0]["steps_between"]
    found["interval_s"] = per_step * segments[0]["steps_between"]
    if saving:  # over the time to disk
        found["interval_vs_upload"] = found["interval_s"] / found["time_until_durable_s"]
    if saving and found["time_until_durable_s"] > found["stall_per_checkpoint_s"]:
        beyond = found["overhead_s"] - found["stall_per_checkpoint_s"]
        background = found["time_until_durable_s"] - found["stall_per_checkpoint_s"]
        found["lost_per_background_s"] = beyond / background
    return found


def recompute(runs: dict, multiple: float = HEADLINE) -> dict:
    """name -> metric -> each round's value at one interval, from the raw runs alone."""
    return {
        name: {
            metric: [
                run_metrics(run, runs[baseline_label(name)][i], multiple)[metric]
                for i, run in enumerate(rounds)
            ]
            for metric in [*NEUTRAL, "step_s", "overlapped_steps", "interval_s"]
        }
        for name, rounds in runs.items()
        if covers(rounds[0], multiple)
    }


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def resolutions(steps: list[float]) -> list[float]:
    """Each round's least overhead told from none: a tenth of its step beside no save."""
    return [step / 10 for step in steps]


def within_noise(values: list[float], neutral: float, steps: list[float] | None = None) -> bool:
    """The page's rule: an effect is noise unless most rounds (over half) showed it (above
    "no effect"); a total overhead (``steps``: each round's step beside no save), unless
    most rounds' was more than a tenth of that step."""
    floors = [neutral + r for r in resolutions(steps)] if steps else [neutral] * len(values)
    beyond = sum(value > floor for value, floor in zip(values, floors, strict=True))
    return 2 * beyond <= len(values)


def overhead_within_noise(per_round: dict) -> bool:
    return within_noise(per_round["overhead_s"], 0.0, per_round["step_s"])


def leads(best: list[float], others: list[list[float]]) -> bool:
    """Below each other in most rounds (over half), paired round by round."""
    return all(
        2 * sum(x < y for x, y in zip(best, other, strict=True)) > len(best) for other in others
    )


# --------------------------------------------------------------------------
# Checks on a results file (the build's, and the torchrun run's)
# --------------------------------------------------------------------------


def check_results(results: dict, ranks: int) -> dict:
    """Everything a results file says, checked against its raw runs; returns the values."""
    claims, values = results["claims"], results["values"]
    assert {name: claims[name]["held"] for name in CLAIMS} == dict.fromkeys(CLAIMS, True)
    config, runs = values["config"], values["runs"]
    assert config["world_size"] == ranks and config["rounds"] >= 2
    threads = config["training_threads"]
    schedule = [label(strategy, budget, threads) for strategy, budget in config["schedule"]]
    assert schedule[: len(STRATEGIES)] == STRATEGIES

    # A warm-up round, then every round the whole schedule, in order, and so in time.
    assert runs["order"] == [[r, name] for r in range(config["rounds"] + 1) for name in schedule]
    assert list(runs["warmup"]) == schedule and list(runs["runs"]) == schedule
    in_order = [runs["warmup"][name] for name in schedule] + [
        rounds[i] for i in range(config["rounds"]) for rounds in runs["runs"].values()
    ]
    started = [run[0]["saves"][0]["called"] for run in in_order if run[0]["saves"]]
    assert started == sorted(started), "the runs ran in the order the results file lists"
    for (strategy, budget), name in zip(config["schedule"], schedule, strict=True):
        rounds = runs["runs"][name]
        assert len(rounds) == config["rounds"] and all(len(run) == ranks for run in rounds)
        assert all(
            r["strategy"] == strategy and r["threads"] == budget for run in rounds for r in run
        )
        assert all(r["memory_kept"] == (strategy in KEPT) for run in rounds for r in run)
        assert not any(r["memory_kept"] for r in runs["warmup"][name]), "its first: measured"

    # The intervals: from the warm-up round, ceil(multiple x the upload / the median step
    # without checkpoints), both the slowest rank's; the upload: DefaultStager overlap's first
    # checkpoint, from the call until durable (the loop's own timing), with steps beside it;
    # the swept runs ran every one.
    warmup = runs["warmup"]
    upload_s = max(r["segments"][0]["upload_s"] for r in warmup[SWEPT[0]])
    step_s = max(
        statistics.median(t for t, _ in r["segments"][0]["steps"]) for r in warmup[STRATEGIES[0]]
    )
    chosen = {str(m): max(1, math.ceil(m * upload_s / step_s)) for m in MULTIPLES}
    assert config["intervals"] == chosen
    in_rounds = [run for rounds in runs["runs"].values() for run in rounds]
    for run in in_rounds:
        multiples = intervals_of(run[0]["strategy"], run[0]["threads"], threads)
        for r in run:
            assert r["multiples"] == multiples
            assert [s["steps_between"] for s in r["segments"]] == [
                chosen[str(m)] for m in multiples
            ]
            assert all(len(s["steps"]) == s["steps_between"] for s in r["segments"])
    for name, run in warmup.items():  # the first checkpoint; steps without one
        steps = {"no checkpoint": 3, SWEPT[0]: UPLOAD_STEPS}.get(name.split(" (")[0], 0)
        assert all([s["steps_between"] for s in r["segments"]] == [steps] for r in run), name

    # Every checkpoint: one per interval (in the warm-up, the first), its own path, saved
    # once, durable, checked on disk; every round's directory removed, and checked, once.
    every_run = in_order
    written = [p for run in every_run for r in run for p in r["checkpoints"]]
    for run in every_run:
        count = len(run[0]["segments"]) if run[0]["strategy"] != "no checkpoint" else 0
        assert all(len(r["checkpoints"]) == len(r["saves"]) == count for r in run)
        assert all(r["checkpoints"] == run[0]["checkpoints"] for r in run), "one path, all ranks"
        for r in run:
            assert all(s["called"] <= s["returned"] <= s["durable"] for s in r["saves"])
        # The loop's time to disk, from before its call: the watch's (called inside the call,
        # told first of the upload's end), and a little more; none without an upload
        for r in run:
            uploads = [s["upload_s"] for s in r["segments"]]
            if run[0]["strategy"] in ("no checkpoint", "dcp.save"):
                assert uploads == [None] * len(uploads)
                continue
            watched = [s["durable"] - s["called"] for s in r["saves"]]
            assert all(w <= u < w + 0.1 for u, w in zip(uploads, watched, strict=True)), (
                run[0]["strategy"], uploads, watched)  # fmt: skip
    assert len(set(written)) == len(written) // ranks, "no run wrote over another's checkpoint"
    complete = claims["every-checkpoint-complete"]["evidence"]
    assert complete["checkpoints"] == complete["checked_on_disk"] == len(set(written))
    assert complete["incomplete"] == [] and complete["not_durable"] == 0
    assert complete["saves"] == len(written) and complete["all_finite"]
    # torch_checkpointing's saves, made through its manager
    manager_saves = [s for run in every_run for r in run for s in r["saves"]]
    manager_saves = [s for s in manager_saves if s["call"] == "manager.save"]
    assert complete["manager_saves"] == len(manager_saves) > 0
    assert {s["checkpoint_id"] for s in manager_saves} == {
        p for run in every_run if run[0]["strategy"] in KEPT for r in run for p in r["checkpoints"]
    }
    # the newest checkpoint of each library, in every round's directory
    assert complete["read_back"] == 2 * len(runs["removals"]) == 2 * (config["rounds"] + 1)
    assert all(tensors > 0 for tensors in complete["read_back_tensors"])

    # No strategy changes what the loop computes: every run starts from the same state, so
    # per rank and thread budget, step n has one loss in every run that took n steps.
    for rank in range(ranks):
        for budget in {r["threads"] for run in every_run for r in run}:
            same_budget = [run[rank] for run in every_run if run[rank]["threads"] == budget]
            losses = [r["losses"] for r in same_budget]
            longest = max(losses, key=len)
            steps = max(sum(s["steps_between"] for s in r["segments"]) for r in same_budget)
            assert len(longest) == steps > 0, "the check compares whole runs"
            assert all(steps == longest[: len(steps)] for steps in losses), (rank, budget)

    # dcp.save blocks until durable: the loop's timers see at least what the watch saw.
    for run in [warmup["dcp.save"]] + runs["runs"]["dcp.save"]:
        for r in run:
            timed = [segment["stall_s"] for segment in r["segments"]]
            watched = [save["durable"] - save["called"] for save in r["saves"]]
            assert len(timed) == len(watched) and all(map(float.__ge__, timed, watched))

    # Every median, spread and noise verdict is what the raw numbers give.
    summary, recomputed = values["summary"], recompute(runs["runs"])
    at_headline = [name for name in schedule if covers(runs["runs"][name][0], HEADLINE)]
    assert list(summary) == list(recomputed) == at_headline
    assert set(CHECKPOINTING) <= set(at_headline), "every strategy at the headline interval"
    for name in at_headline:
        for metric, neutral in NEUTRAL.items():
            entry, raw = summary[name][metric], recomputed[name][metric]
            if any(v is None for v in raw):
                assert entry is None, (name, metric)
                continue
            assert entry["values"] == pytest.approx(raw), (name, metric)
            assert entry["median"] == pytest.approx(statistics.median(raw))
            assert entry["spread"] == pytest.approx(spread(raw))
            if neutral is None or name.startswith("no checkpoint"):
                assert "within_noise" not in entry, (name, metric)
            elif metric == "overhead_s":
                assert entry["within_noise"] == overhead_within_noise(recomputed[name]), name
            else:
                assert entry["within_noise"] == within_noise(raw, neutral), (name, metric)
    for name in at_headline:  # the steps each round's slow-down is of
        steps = summary[name]["overlapped_steps"]["values"]
        assert steps == recomputed[name]["overlapped_steps"], name
    assert summary["no checkpoint"]["overhead_s"]["values"] == [0.0] * config["rounds"]
    assert summary["no checkpoint"]["stall_per_checkpoint_s"] is None
    assert summary["dcp.save"]["overlapped_step_slowdown"] is None, "dcp.save blocks"
    for name in CHECKPOINTING:
        for metric in ("stall_per_checkpoint_s", "time_until_durable_s"):
            assert all(v > 0 for v in recomputed[name][metric]), (name, metric)
    for name in STRATEGIES[2:]:  # the step right after an async save overlaps its write
        assert summary[name]["overlapped_step_slowdown"] is not None, name

    # The sweep: each swept strategy at every interval, and the thread knob's run at its one,
    # against dcp.save's time until durable.
    sweep = values["sweep"]
    knob_runs = [n for n in schedule if n.startswith("DefaultStager overlap (")]
    assert list(sweep) == SWEPT + knob_runs
    for name in sweep:
        multiples = runs["runs"][name][0][0]["multiples"]
        assert list(sweep[name]) == [str(m) for m in multiples]
        for multiple in multiples:
            entry, raw = sweep[name][str(multiple)], recompute(runs["runs"], multiple)[name]
            assert entry["steps_between"] == chosen[str(multiple)]
            for metric in ("stall_per_checkpoint_s", "overhead_s"):
                assert entry[metric]["values"] == pytest.approx(raw[metric]), (name, multiple)
            noise = entry["stall_per_checkpoint_s"]["within_noise"]
            assert noise == within_noise(raw["stall_per_checkpoint_s"], 0.0)
            assert entry["overhead_s"]["within_noise"] == overhead_within_noise(raw)
            saves = recomputed["dcp.save"]["time_until_durable_s"]  # at the headline interval
            ratios = [i / save for i, save in zip(raw["interval_s"], saves, strict=True)]
            assert entry["interval_vs_save"] == pytest.approx(statistics.median(ratios))
            own = raw["interval_vs_upload"]
            assert entry["interval_vs_upload"] == pytest.approx(statistics.median(own))

    # The limits: the slowest rank's, and one copy of a rank's share.
    limits = values["limits"]
    for key, speed in limits["GBps"].items():
        assert speed == min(rank[key] for rank in limits["GBps_per_rank"]) > 0
    assert len(limits["GBps_per_rank"]) == ranks
    assert limits["bytes_per_rank"] == limits["checkpoint_bytes"] // ranks
    assert limits["checkpoint_bytes"] == pytest.approx(config["checkpoint_gb"] * 1e9, rel=0.3)
    copy_s = limits["bytes_per_rank"] / (limits["GBps"]["copy_reused"] * 1e9)
    assert limits["copy_s"] == pytest.approx(copy_s)

    # The ratios to dcp.save, the goals and the headline, from the medians.
    def med(name, metric):
        return statistics.median(recomputed[name][metric])

    for name, ratio in values["ratios"].items():
        stall = med(name, "stall_per_checkpoint_s")
        assert ratio["stall_vs_copy_time"] == pytest.approx(stall / copy_s)
        assert ratio["stall_vs_dcp_save"] == pytest.approx(
            stall / med("dcp.save", "stall_per_checkpoint_s")
        )
        assert ratio["overhead_vs_dcp_save"] == pytest.approx(
            med(name, "overhead_s") / med("dcp.save", "overhead_s")
        )
        noise = overhead_within_noise(recomputed[name]) or overhead_within_noise(
            recomputed["dcp.save"]
        )
        assert ratio["overhead_within_noise"] == noise, name
    best = min(BACKGROUND, key=lambda name: med(name, "overhead_s"))  # the least total cost
    assert list(values["goals"]) == [best], "the goals are the recommended strategy's"
    for metric, goal in GOALS.items():
        found = values["goals"][best][metric]
        ours = recomputed[best][metric]
        reference = recomputed["dcp.save"][metric]
        limit = goal * statistics.median(reference)  # dcp.save's median, every round
        # round by round, each known to its resolution (an overhead's; a stall: exactly)
        margins = resolutions(recomputed[best]["step_s"]) if metric == "overhead_s" else None
        rounds = list(zip(ours, margins or [0.0] * len(ours), strict=True))
        below = all(value + margin < limit for value, margin in rounds)
        above = all(value - margin > limit for value, margin in rounds)
        met = True if below else False if above else None
        noise = (
            overhead_within_noise(recomputed["dcp.save"])
            if metric == "overhead_s"
            else within_noise(reference, 0.0)
        )
        if noise:
            met = None  # no multiple of a noise says anything
        assert found["goal"] == goal and found["met"] is met, (best, metric, found)
        assert found["limit"] == pytest.approx(limit)
        assert found["resolution"] == (pytest.approx(margins) if margins else None)
    headline = values["headline"]
    assert headline["strategy"] == best
    assert headline["stall_vs_dcp_save"] == values["ratios"][best]["stall_vs_dcp_save"]
    assert headline["overhead_vs_dcp_save"] == pytest.approx(
        med(best, "overhead_s") / med("dcp.save", "overhead_s")
    )
    assert (headline["stall_goal"], headline["overhead_goal"]) == (0.02, 0.05)
    assert headline["training_threads"] == threads
    assert headline["interval_multiple"] == HEADLINE

    # Why steps slow down: each helper's rounds give its slow-down (it holds the step back
    # where the step beside it took over 2x each step alone around it, in every round), its speed
    # and the seconds the step lost per second beside it; the headline strategy, at its
    # medians' loss per second in the background, meets the overhead goal if on disk
    # within the time the page gives.
    work = values["background_work"]
    assert list(work["helpers"]) == ["spin", "copy", "write", "tensor copy", "storage copy"]
    for kind, found in work["helpers"].items():
        alone, beside, gb = (found["rounds"][k] for k in ("alone_s", "beside_s", "gb_moved"))
        before, after = found["rounds"]["before_s"], found["rounds"]["after_s"]
        assert len(alone) == len(beside) == len(gb) == len(before) == config["rounds"]
        assert alone == pytest.approx([(b + a) / 2 for b, a in zip(before, after, strict=True)])
        ratios = [b / a for a, b in zip(alone, beside, strict=True)]
        assert found["slowdown"]["values"] == pytest.approx(ratios)
        held = all(s > 2 * max(b, a) for s, b, a in zip(beside, before, after, strict=True))
        assert found["holds_back"] == held, kind
        speeds = [g / b for g, b in zip(gb, beside, strict=True)]
        assert found["gb_per_s"] == pytest.approx(statistics.median(speeds))
        assert (gb == [0] * len(gb)) == (kind == "spin"), (kind, gb)
        per_s = statistics.median((b - a) / b for a, b in zip(alone, beside, strict=True))
        assert found["lost_per_s_beside"] == pytest.approx(per_s)
    against, goal_s = work["against_goal"], GOALS["overhead_s"] * med("dcp.save", "overhead_s")
    assert against["strategy"] == best and against["goal_s"] == pytest.approx(goal_s)
    assert against["dcp_save_durable_s"] == pytest.approx(med("dcp.save", "time_until_durable_s"))
    stall_s, lost = med(best, "stall_per_checkpoint_s"), recomputed[best]["lost_per_background_s"]
    rate = max(0.0, statistics.median(lost))
    assert against["lost_per_background_s"] == pytest.approx(rate)
    if rate and stall_s < goal_s:  # on disk this soon after its start: the goal, at that rate
        assert stall_s + rate * (against["durable_within_s"] - stall_s) == pytest.approx(goal_s)
    else:
        assert against["durable_within_s"] in (None, math.inf)

    # The advice: the lowest median leads only where it is below each other in most rounds
    # (stalls: by more than a GIL turn); else the runner-up named is one that was as low,
    # or that close, in half the rounds or more.
    for metric in CRITERIA:
        measured = [n for n in CHECKPOINTING if None not in recomputed[n][metric]]
        assert (metric != "extra_memory_mb") == (measured == CHECKPOINTING), metric
        best, *rest = sorted(measured, key=lambda n: med(n, metric))
        found = values["advice"][metric]
        ahead = [value + TIES.get(metric, 0.0) for value in recomputed[best][metric]]
        rivals = [n for n in rest if not leads(ahead, [recomputed[n][metric]])]
        lead = leads(ahead, [recomputed[n][metric] for n in rest])
        assert lead == (not rivals)
        assert (found["best"], found["second"]) == (best, (rivals or rest)[0]), metric
        assert found["rival"] == (rivals[0] if rivals else None), metric
        assert found["choose"] == (best if lead else None), (metric, found)
        assert found["tie"] == TIES.get(metric, 0.0), metric
    return values


# --------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build():
    return build_results(RECIPE)


def test_the_build_proved_and_measured_what_the_page_says(build):
    values = check_results(build, ranks=2)
    assert values["config"]["launcher"] == "fork" and values["config"]["training_threads"] == 1
    assert values["thread_knob"]["ran"] is False, "forked ranks train with one thread: no knob"
    assert values["machine"]["cores"] == os.cpu_count()


def test_direct_io_writes_the_training_tensors_where_they_lie_with_no_copy(build):
    """make runs every page with THP_MEM_ALLOC_ENABLE=1: torch starts big tensors at a page,
    and direct I/O overlap holds no copy of the state (DefaultStager overlap holds one).
    Half a share tells one copy from none: a round's baseline peaks a few MB apart (at the
    build's 31 MB share, DefaultStager's copy has read +28 MB)."""
    values = build["values"]
    assert values["config"]["big_tensors_start_at_a_page"]
    share_mb = values["limits"]["bytes_per_rank"] / 1e6
    extra = {
        n: values["summary"][n]["extra_memory_mb"]["values"]
        for n in ("DefaultStager overlap", "direct I/O overlap")
    }
    assert all(mb < share_mb / 2 for mb in extra["direct I/O overlap"]), (share_mb, extra)
    assert all(mb > share_mb / 2 for mb in extra["DefaultStager overlap"]), (share_mb, extra)


def test_the_page_shows_the_runs_the_results_file_holds(build):
    """What the recipe printed for each run is the results file's run, in order."""
    shown = "".join(page_outputs(RECIPE))
    printed = numbers_in(shown, RUN_LINE)
    runs = build["values"]["runs"]
    expected = []
    for number, name in runs["order"]:
        run = runs["warmup"][name] if number == 0 else runs["runs"][name][number - 1]
        where = f"round {number}" if number else "warm-up"
        losses = run[0]["losses"]
        loss = f"{losses[-1]:.6g}" if losses else ""  # none: the first checkpoint alone
        expected.append((where, run[0]["strategy"], str(run[0]["threads"]), loss))
    assert printed == expected
    for name in (RECIPE, f"{RECIPE}-sweep"):
        figure = RECIPES.parent / "recipes" / ".results" / f"{name}.png"
        assert figure.read_bytes().startswith(b"\x89PNG"), "the figures beside the results file"


def test_the_page_shows_the_sweep_the_results_file_holds(build):
    """Each swept strategy's row per interval, in the page's tables, as the results file has it."""
    page = parsed_html(HTML / "recipes" / f"{RECIPE}.html")
    rows = [[cell.get_text() for cell in row.select("td")] for row in page.select("table tr")]
    shown = {tuple(row[:3]) for row in rows if len(row) >= 3}
    for name, intervals in build["values"]["sweep"].items():
        for multiple, entry in intervals.items():
            steps = entry["steps_between"]
            label = f"{multiple}x: {steps} step" + "s" * (steps != 1)
            assert (name, label, str(round(entry["interval_vs_save"], 2))) in shown, label


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's watches do not change the recipe: the same runs, in the same order, and,
    where the download's warm-up chose the page's steps per interval (each run measures an
    upload's time over a step's, and they can fall on either side of a whole step), the same
    losses, run by run."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    ran, showed = numbers_in(output, RUN_LINE), numbers_in(shown, RUN_LINE)
    assert [row[:3] for row in ran] == [row[:3] for row in showed] != []
    chosen = numbers_in(output, INTERVALS_LINE), numbers_in(shown, INTERVALS_LINE)
    assert len(chosen[0]) == len(chosen[1]) == 1, "the warm-up says the steps per interval"
    if chosen[0] == chosen[1]:
        assert ran == showed
    assert "page_tools" not in output and "rounds of the same" not in output, "claims: the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left(grace_s=20.0) == []
    assert checkpoint_files_in_repo() == []


@pytest.mark.torchrun
def test_source_under_torchrun_runs_the_thread_knob(recipe_runner):
    """Under torchrun, with a core to spare, two runs also train with every core."""
    results_dir = recipe_runner.results_dir
    env = recipe_runner.env(
        DCP_RECIPES_BENCH_GB=SMALLEST_GB, DCP_RECIPES_RESULTS_DIR=str(results_dir)
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    run = subprocess.run(
        [*command, str(recipe_path(RECIPE))],
        env=env,
        cwd=recipe_runner.workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = assert_ok(run)
    assert " - INFO - " not in output, "the writer process's log reached the output"
    assert_no_traceback(output)
    results = json.loads((results_dir / f"{RECIPE}.json").read_text())
    values = check_results(results, ranks=1)
    cores = os.cpu_count()
    assert values["config"]["launcher"] == "torchrun"
    assert values["config"]["training_threads"] == max(1, cores - 1)  # one core left
    if cores == 1:
        assert values["thread_knob"] == {"ran": False, "why": "no core to spare"}
    else:
        knob = values["thread_knob"]
        assert knob["threads"] == {"recommended": cores - 1, "every_core": cores}
        every_core = f"DefaultStager overlap ({cores} threads)"
        assert knob["labels"] == {str(cores - 1): "DefaultStager overlap", str(cores): every_core}
        at_knob = recompute(values["runs"]["runs"], KNOB_AT)
        names = ("DefaultStager overlap", every_core)
        recommended, every = (at_knob[name]["overhead_s"] for name in names)
        steps = [at_knob[name]["step_s"] for name in names]
        # paired by round: more (less) where every core's is above (below) by more than the
        # round resolves (the larger of the two runs' resolution) in most rounds
        margins = [max(pair) for pair in zip(*(resolutions(s) for s in steps), strict=True)]
        rounds = list(zip(recommended, every, margins, strict=True))
        above = sum(b - a > m for a, b, m in rounds)
        below = sum(a - b > m for a, b, m in rounds)
        verdict = "more" if 2 * above > len(rounds) else "less" if 2 * below > len(rounds) else None
        assert knob["verdict"] == (verdict or "within noise"), (knob, rounds)
        assert knob["resolution"] == pytest.approx(margins)
        assert ("within noise" in knob["said"]) == (verdict is None)
    assert (results_dir / f"{RECIPE}.png").read_bytes().startswith(b"\x89PNG")
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left(grace_s=20.0) == []
    assert checkpoint_files_in_repo() == []
