"""What the speed page decides from its rounds: the best durable save and the best cold load
against the disk's limits (``headline``, ``best_table``), and what each knob bought against
the defaults (``advice``), every comparison round by round (``stats.factor_cells``).

``knobs`` is the page's ``stats.group`` of its rounds: per knob, lists of ``save_GBps``,
``cold_load_GBps``, ``warm_load_GBps`` and planning seconds; ``limits``, ``disk.bandwidths``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from page_tools import disk, figures, reads, results, stats


def best(knobs: dict, key: str, leave_out: Sequence[str] = ()) -> str:
    """The knob with the highest median in ``key`` (``leave_out``: not durable, say); of two
    as high, the faster fastest round. Not the fastest round alone, as ``timeit`` reads its
    fastest repeat: noise on this host speeds a save up too, where the host has not yet
    taken back the memory it fills (the page's fills), and in one make bench run of twelve
    (38), one round of thread_count=4 at 1.93 GB/s (its medians: 1.39-1.69 GB/s) put it
    ahead of thread_count=4, compute_crc32=False, ahead by median in all twelve."""
    names = [n for n in knobs if n not in leave_out]
    return max(names, key=lambda n: (stats.median(knobs[n][key]), max(knobs[n][key])))


def headline(knobs: dict, limits: dict, not_durable: Sequence[str]) -> dict:
    """The best durable save and the best cold load (``best``), their medians in GB/s and
    as fractions of the write + fsync and read-from-storage limits (medians too), their
    fastest rounds, and the next best by the same rule with its median over theirs."""
    found = {}
    for kind, key, limit, leave_out in (
        ("save", "save_GBps", "write_fsync", not_durable),
        ("load", "cold_load_GBps", "read_storage", ()),
    ):
        top = best(knobs, key, leave_out)
        after = best(knobs, key, (*leave_out, top))
        gbps = stats.median(knobs[top][key])
        found |= {
            f"best_{kind}": top,
            f"best_{kind}_GBps": gbps,
            f"best_{kind}_of_limit": gbps / limits["limit"][limit],
            f"best_{kind}_fastest_GBps": max(knobs[top][key]),
            f"best_{kind}_next": after,
            f"best_{kind}_next_factor": stats.median(knobs[after][key]) / gbps,
        }
    return found


def best_table(found: dict, limits: dict, caption: str) -> figures.Table:
    """``headline``'s numbers as a table, with what one writer and one reader thread of
    ``FileSystemWriter`` / ``FileSystemReader`` can reach at most (``disk.one_thread``)."""

    def row(kind: str, what: str, limit: str) -> list[str]:
        nearest = f"next best: x{found[f'best_{kind}_next_factor']:.2f}"  # a factor, no name
        return [
            f"best {what}",
            f"{'checkpoint of ' if kind == 'load' else ''}{found[f'best_{kind}']} ({nearest})",
            f"{found[f'best_{kind}_GBps']:.2f} GB/s"
            f" (fastest round {found[f'best_{kind}_fastest_GBps']:.2f})",
            f"{found[f'best_{kind}_of_limit']:.2f} of {limit}",
        ]

    rows = [
        row("save", "save", "write + fsync"),
        row("load", "cold load", "read from storage"),
        ["one FileSystemWriter thread", "serializes, then writes"]
        + [f"at most {disk.one_thread(limits, 'torch_save', 'write_fsync'):.2f} GB/s", ""],
        ["one FileSystemWriter thread", "the same, no CRC-32"]
        + [f"at most {disk.one_thread(limits, 'torch_save_no_crc32', 'write_fsync'):.2f} GB/s"]
        + [""],
        ["one FileSystemReader thread", "reads, then deserializes"]
        + [f"at most {disk.one_thread(limits, 'torch_load', 'read_storage'):.2f} GB/s", ""],
    ]
    caption += (
        "; best: the knob with the highest median; next best: the median of the knob after it,"
        " over the best's (which knob that is, the advice below shows); GB/s: medians"
    )
    return figures.Table(["", "with", "measured", ""], rows, caption=caption)


def advice(knobs: dict, replicated: dict, loads: Sequence[str] = ()) -> list[list[Any]]:
    """Rows of "against the defaults, verdict, factor": each knob's save GB/s; the warm
    load GB/s of each knob in ``loads``; planning with plan caching; and the lowest rank
    writing every replicated tensor (``replicated``: the page's replicated section). Each
    against the defaults of its own round (``stats.factor_cells``): a change only where
    most rounds' factors (over half: 4 of make bench's 6) are beyond
    ``stats.SMALLEST_FACTOR``. Not every round's:
    with each save's memory in use a moment before (``machine.memory_in_use_before``), a
    save's torch.save + write still took 3 to 9 times as long in some rounds (4 of the 32
    profiled saves of 8 runs), and one such round turned "faster" to "within noise".
    Replayed on those 4 runs (their first 3 rounds, then their last 3), two runs agreed
    on 15.2 and 13.8 of the 17 verdicts on average, with every round on 11.5 and 12.2.
    Where a knob's effect lies near 10% (``single_file_per_rank=False``, torch_checkpointing:
    x0.76-0.96 and x0.94-1.26 by median in 8 make bench runs at 512 MB), more rounds decide
    it more often alike, and so did a smaller checkpoint: hence make bench's 6 rounds at
    256 MB (the Makefile says how often two runs agreed).

    A load's verdict is the warm load's (from the page cache): what a reader changes, how
    it turns a file's bytes into the model's tensors, apart from the disk. A cold load adds
    the disk's speed of the moment, which two readers follow unequally: in 8 make bench
    runs (read limits 2.01-2.47 GB/s), the defaults' cold loads took 0.88-1.56 GB/s by
    median and the stock safetensors reader's 1.01-1.40, which made it x1.02-1.22 the
    defaults' in the 3 runs where they read 1.03 GB/s or less and x0.83-0.97 in the 5
    others (runs 13 and 14: +4% and -14%, the rounds of each within a standard deviation
    of 4-6%): more rounds would not make that verdict hold still. Warm, both safetensors
    readers were faster in every round of the 8 runs (x2.53-3.25 and x3.40-4.39 by
    median). The page shows each cold load against its own rounds' read limit."""
    defaults = knobs["defaults"]

    def cells(a: Sequence[float], b: Sequence[float], words=("faster", "slower")) -> list[str]:
        return stats.factor_cells(a, b, words, every=False)

    rows = [
        [name, *cells(defaults["save_GBps"], knob["save_GBps"])]
        for name, knob in list(knobs.items())[1:]
    ]
    rows += [
        [f"warm load, {name}", *cells(defaults["warm_load_GBps"], knobs[name]["warm_load_GBps"])]
        for name in loads
    ]
    planning = (knobs[n]["save_planning_s"] for n in ("defaults", "enable_plan_caching=True"))
    rows.append(["planning seconds, with plan caching", *cells(*planning, ("longer", "shorter"))])
    timed = (replicated["timed"][b]["save_GBps"] for b in (False, True))
    rows.append(["dedup_save_to_lowest_rank=True", *cells(*timed)])
    return rows


def replicated(per_rank: list[dict]) -> dict:
    """The replicated section's runs, every rank's: the bytes each rank holds, the bytes each
    wrote per planner (``dedup_save_to_lowest_rank`` False, True), and the timed saves."""
    return {
        "bytes_held": per_rank[0]["bytes_held"],
        "written": {b: [run["bytes_written"][b] for run in per_rank] for b in (False, True)},
        "timed": stats.group(per_rank[0]["measured"], "lowest"),
    }


# Each knob measurement against the limit that bounds it.
BOUNDED_BY = {"save_GBps": "write_fsync", "cold_load_GBps": "read_storage",
              "warm_load_GBps": "read_cache"}  # fmt: skip


def beyond_limits(knobs: dict, limits: dict, not_durable: Sequence[str] = ()) -> list[dict]:
    """Every knob measurement whose median beats its limit (the best median of the probe's
    thread counts) by more than noise: the larger spread of the knob's rounds and of the
    probe's repeats at that thread count. A probe that measures something slower than what it
    bounds shows here; a cold load within noise of this machine's storage does not (its
    reads vary twofold from minute to minute). ``not_durable`` saves are not bounded."""
    # per kind, the repeats of the thread count that set the limit
    probes = {
        kind: limits["GBps"][kind][limits["limit_threads"][kind]] for kind in BOUNDED_BY.values()
    }
    found = []
    for name, knob in knobs.items():
        for key, kind in BOUNDED_BY.items():
            if key == "save_GBps" and name in not_durable:
                continue
            ours = stats.summary(knob[key])
            noise = max(ours["spread"], probes[kind]["spread"])
            if ours["median"] > limits["limit"][kind] + noise:
                found.append({"knob": name, "measured": key, "median": ours["median"],
                              "limit": limits["limit"][kind], "noise": noise})  # fmt: skip
    return found


def claim_within_limits(name: str, knobs: dict, limits: dict, not_durable: Sequence[str]) -> None:
    """Decide that no durable save beat write + fsync, and no load the read it does, by more
    than noise (``beyond_limits``): a limit is a limit only if nothing beats it."""
    beyond = beyond_limits(knobs, limits, not_durable)
    said = "no durable save beat write + fsync, and no load the read it does, beyond noise"
    results.claim(name, not beyond, said, beyond=beyond)


def claim_written_once(name: str, found: dict) -> None:
    """Decide that the files hold one copy of the model with either planner (the bytes each
    rank holds, and less than 5% more: the records around each tensor), that by default
    every rank wrote some of it, and with ``dedup_save_to_lowest_rank=True`` rank 0 all."""
    held, written = found["bytes_held"], found["written"]
    results.claim(
        name,
        all(held <= sum(w) < 1.05 * held for w in written.values())
        and all(written[False])
        and written[True][0] > 0
        and not any(written[True][1:]),
        "one copy of the model either way; by default every rank wrote, with lowest rank 0 only",
    )


def replicated_table(found: dict, repeats: int) -> figures.Table:
    ranks = len(found["written"][False])
    return figures.Table(
        ["DefaultSavePlanner(...)", *(f"rank {r} MB" for r in range(ranks)), "GB/s"],
        [
            [f"dedup_save_to_lowest_rank={lowest}", *(round(b / 1e6, 1) for b in written)]
            + [stats.median_range(found["timed"][lowest]["save_GBps"])]
            for lowest, written in found["written"].items()
        ],
        caption=f"MB each rank wrote, of the {found['bytes_held'] / 1e6:.1f} MB that every rank "
        f"holds; save GB/s: median (lowest-highest) of {repeats}",
    )


def save_beside_probe(saves: dict[int, list[dict]], limits: dict, threads: int = 4) -> dict:
    """Every measured round's profiled save (``reads.save_phases``'s records, by rank) beside
    the probe's write and ``fsync`` with as many threads, in the same round on the same
    rank, each per writer thread (``disk.WRITE_PHASES``); and the save's over the probe's,
    per phase, over every round and rank (``stats.summary``)."""
    rows: list[dict] = []
    over: dict[str, list[float]] = {phase: [] for phase in disk.WRITE_PHASES}
    for rank, records in sorted(saves.items()):
        probed = limits["seconds_per_rank"][rank]["write_phases"]  # kept rounds: 1, 2, ...
        for record in records:
            number = int(re.search(r"/round(\d+)/", record["checkpoint_id"]).group(1))
            probe = probed[number - 1][threads]
            timed = [record["phases"][phase] for phase in reads.SAVE_PHASES[1:3]]
            save = dict(zip(disk.WRITE_PHASES, timed, strict=True))  # torch.save + write, fsync
            rows.append({"rank": rank, "round": number, "save_s": record["total_s"],
                         "save": save, "probe": probe})  # fmt: skip
            for phase in disk.WRITE_PHASES:
                over[phase].append(save[phase] / probe[phase])
    return {"threads": threads, "rounds": rows,
            "over_probe": {phase: stats.summary(v) for phase, v in over.items()}}  # fmt: skip


def save_beside_probe_table(found: dict) -> figures.Table:
    """``save_beside_probe``'s rounds, in ms, with the save's over the probe's per phase."""

    def pair(row: dict, phase: str) -> str:
        return f"{row['save'][phase] * 1e3:.0f} / {row['probe'][phase] * 1e3:.0f}"

    rows = [
        [row["round"], row["rank"], f"{row['save_s'] * 1e3:.0f}"]
        + [pair(row, phase) for phase in disk.WRITE_PHASES]
        for row in found["rounds"]
    ]
    over = "; ".join(
        f"{p} {stats.median_range(found['over_probe'][p])}x" for p in disk.WRITE_PHASES
    )
    threads = found["threads"]
    return figures.Table(
        ["round", "rank", "save ms", "write ms, save / probe", "fsync ms, save / probe"],
        rows,
        caption=f"per writer thread, {threads} each (the save's write: torch.save + write); "
        f"the save's over the probe's, median (lowest-highest): {over}",
    )
