"""What a page ran on: CPU, cores, memory, the storage its checkpoints went to, the GPUs,
the torch version (the launcher's ``machine_facts``, which also writes the run stamp), and
whether the machine hands free memory back to its host.

Where a virtual machine's balloon device offers *free page reporting*
(``VIRTIO_BALLOON_F_REPORTING``, as Firecracker and some clouds enable it), the kernel
reports memory that stays free for about a second to the host, in blocks of
``2 ** page_reporting_order`` pages, and the host takes it back. Whatever needs that
memory next waits for the host to supply every page again. A save writes into the page
cache first: it fills fast where it reuses memory freed a moment before (the previous
checkpoint's pages, just removed) and slowly where its memory has been free for a while,
so the same save, on the same disk, can take much longer a minute later.

``reporting()`` says whether this machine reports free memory, from the balloon device's
negotiated features in sysfs (nothing is changed); ``describe`` and ``title`` say it too.
``page_cache_fills`` measures it on a rank: in alternating rounds, it writes a file's
worth of page cache right after removing a file of the same size (the kernel hands those
pages straight back) and after that memory stayed free until the kernel had reported half
of it (this machine's kernel counts what it reported; elsewhere, for a few seconds). No
byte reaches the disk: a removed file's dirty pages are dropped, never written. ``fills``
turns every rank's seconds into GB/s, all bytes over the slowest rank's time, and decides
on the ratio scale (``stats``) whether idle memory fills slower beyond noise;
``fills_table`` renders it.

``memory_in_use_before`` takes that chance out of a page's timings: before each call it
is given, it writes every page of new memory, then frees it, untimed, so that the call
fills memory freed a moment before, wherever the host had taken some back.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from rank_launcher import machine_facts

from page_tools import disk, figures, observe, stats

BALLOON_DEVICES = Path("/sys/bus/virtio/drivers/virtio_balloon")
REPORTING_FEATURE_BIT = 5  # VIRTIO_BALLOON_F_REPORTING, in the virtio specification
REPORTING_PARAMETERS = Path("/sys/module/page_reporting/parameters")
FILL_KINDS = {"just_freed": "right after as much was freed", "idle": "after it stayed free"}
# The host takes memory back a few blocks at a time: a small file may find none of its
# memory taken (here, 32 MB found none in some rounds; 128 MB and more, some in every one).
LEAST_FILL_BYTES = 2**28
REPORTED_KIB = REPORTING_PARAMETERS / "reported_kib"
# Here half a file's worth was reported 0.5 to 2 s after the file went, at times later
# or never; the fill after 8 s was slow either way.
IDLE_S, LONGEST_IDLE_S = 2.0, 8.0


def reporting(devices: Path = BALLOON_DEVICES, parameters: Path = REPORTING_PARAMETERS) -> dict:
    """Whether a balloon device reports free memory to the host (``reports``), and where it
    does, the block it reports in (KiB: ``2 ** page_reporting_order`` pages of 4 KiB)."""
    features = [path.read_text().strip() for path in devices.glob("virtio*/features")]
    reports = any(len(bits) > REPORTING_FEATURE_BIT and bits[REPORTING_FEATURE_BIT] == "1"
                  for bits in features)  # fmt: skip
    order = parameters / "page_reporting_order"
    block_kib = 4 << int(order.read_text()) if reports and order.exists() else None
    return {"reports": reports, "block_kib": block_kib}


def describe(directory: str | None = None) -> dict:
    """The machine, as a page's results file records it, with the storage under
    ``directory`` (the temporary directory by default). Asks NVML, never starts CUDA."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return machine_facts(directory) | {
        "gpus": gpus,
        "torch": torch.__version__,
        "free_page_reporting": reporting()["reports"],
    }


def title(directory: str | None = None) -> str:
    """Two lines for a figure's title: "AMD EPYC, 2 cores, 23.5 GiB memory (free page
    reporting); CPU ranks (gloo)" and "checkpoints on ext4 (/dev/vda, 271 GB); torch
    2.13.0+cpu"."""
    facts = describe(directory)
    ranks = f"{facts['gpus']} GPU(s)" if facts["gpus"] else "CPU ranks (gloo)"
    memory = f"{facts['memory_gib']} GiB memory"
    memory += " (free page reporting)" if facts["free_page_reporting"] else ""
    return (
        f"{facts['cpu']}, {facts['cores']} cores, {memory}; {ranks}\n"
        f"checkpoints on {facts['storage']}; torch {facts['torch']}"
    )


def _fill(path: str, source: memoryview) -> float:
    """Seconds to write ``source`` into a new file's page cache (no ``fsync``)."""
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as file:
        data = source
        while data:  # a write may take fewer bytes than it was given
            data = data[file.write(data) :]
    return time.perf_counter() - started


def _until_reported(nbytes: int, longest_s: float) -> tuple[float, float | None]:
    """Leave freed memory alone until the kernel has reported half of ``nbytes`` to the host
    since now (where it counts what it reported: this machine's kernel does, not every
    one), or for ``longest_s``; returns the seconds waited and the MB reported (or None)."""
    started = time.perf_counter()
    if not REPORTED_KIB.exists():
        time.sleep(longest_s)
        return longest_s, None
    first = int(REPORTED_KIB.read_text())
    while (int(REPORTED_KIB.read_text()) - first) * 1024 < nbytes // 2:
        if time.perf_counter() - started > longest_s:
            break
        time.sleep(0.05)
    return time.perf_counter() - started, (int(REPORTED_KIB.read_text()) - first) / 1024


def page_cache_fills(directory: str, nbytes: int, repeats: int = 3) -> dict:
    """This rank's seconds to fill ``nbytes`` (``LEAST_FILL_BYTES`` at least) of page cache,
    per round: right after removing a file of that size (``just_freed``), then once that
    memory stayed free until the kernel reported half of it to the host (``idle``: at most
    ``LONGEST_IDLE_S``; ``IDLE_S`` where the machine does not report); the seconds waited
    and the MB reported meanwhile."""
    nbytes = max(nbytes, LEAST_FILL_BYTES)
    longest_s = LONGEST_IDLE_S if reporting()["reports"] else IDLE_S
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"fill-{rank}")
    source = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())  # touched: ours
    _fill(path, source)  # the first file: the pages each round frees
    found: dict[str, list] = {kind: [] for kind in [*FILL_KINDS, "waited_s", "reported_mb"]}
    for _ in range(repeats):
        os.remove(path)
        found["just_freed"].append(_fill(path, source))
        os.remove(path)
        waited_s, reported_mb = _until_reported(nbytes, longest_s)
        found["idle"].append(_fill(path, source))
        found["waited_s"].append(waited_s)
        found["reported_mb"].append(reported_mb)
    os.remove(path)  # unsynced: its pages are dropped, never written
    return {"bytes": nbytes, "seconds": {kind: found.pop(kind) for kind in FILL_KINDS}, **found}


def fills(runs: Sequence[dict]) -> dict:
    """Every rank's ``page_cache_fills`` as GB/s per kind and round (all ranks' bytes over
    the slowest rank's time), ``idle`` against ``just_freed`` on the ratio scale, the
    machine's ``reporting()``, and the raw seconds, by rank. Only the rounds in which the
    host was told of some of the freed memory (``tested``: every rank's kernel reported
    some, or cannot count what it reports) decide: in one make bench run, 2 of 3 rounds
    reported none in 8 s, filled as fast as right after freeing, and made "slower" read
    "within noise"; no such round, no verdict ("not tested")."""
    total = sum(run["bytes"] for run in runs)
    speeds = {
        kind: [disk.gbps(total, per_round) for per_round in
               zip(*(run["seconds"][kind] for run in runs), strict=True)]
        for kind in FILL_KINDS
    }  # fmt: skip
    reported = zip(*(run["reported_mb"] for run in runs), strict=True)
    tested = [i for i, mbs in enumerate(reported) if all(mb is None or mb > 0 for mb in mbs)]
    slower, said = "not tested", "in no round was the host told of the freed memory"
    if tested:
        said, diff = stats.verdict(
            "page cache after it stayed free", [speeds["idle"][i] for i in tested],
            "right after freeing", [speeds["just_freed"][i] for i in tested], "GB/s", factor=True,
        )  # fmt: skip
        slower = stats.word(diff, more="slower", less="faster")
    return {"bytes": total, "GBps": speeds, "tested": tested,
            "waited_s": [max(r) for r in zip(*(run["waited_s"] for run in runs), strict=True)],
            "reported_mb_per_rank": [run["reported_mb"] for run in runs],
            "slower": slower, "said": said,
            "reporting": reporting(),
            "seconds_per_rank": [run["seconds"] for run in runs]}  # fmt: skip


def fills_table(found: dict) -> figures.Table:
    """GB/s of each fill, median (lowest-highest), with whether the machine reports."""
    rows = [[name, stats.median_range(found["GBps"][kind])] for kind, name in FILL_KINDS.items()]
    waited = stats.median_range(found["waited_s"], ".1f")
    block = found["reporting"]["block_kib"]
    reports = f"reports free memory in {block} KiB blocks" if found["reporting"]["reports"] else ""
    caption = (
        f"{found['bytes'] / 1e6:,.0f} MB of page cache, median (lowest-highest) of "
        f"{len(found['GBps']['idle'])}; this machine {reports or 'does not report free memory'}"
        f"; free for {waited} s: {found['slower']}"
    )
    rounds = len(found["GBps"]["idle"])
    if len(found["tested"]) < rounds:  # the others' hosts were told of none of it
        caption += f" (from the {len(found['tested'])} of {rounds} rounds the host was told of)"
    print(figures.wrap(found["said"]))
    return figures.Table(["page cache filled", "GB/s"], rows, caption=caption)


@contextlib.contextmanager
def memory_in_use_before(
    name: str, nbytes: int, where: Callable[[observe.Call], bool]
) -> Iterator[observe.Calls]:
    """Before each call of the page's function ``name`` that ``where`` accepts, ``nbytes`` of
    new memory with every page written, then freed, outside the call: what the host had
    taken back it supplies here, and the call fills memory freed a moment before. Yields
    the bytes and seconds of each, by rank, once the block ends.

    Without it, in 8 runs of the speed page at make bench's size (5 rounds each), the
    profiled save's torch.save + write took 204-628 ms in 17 of 40 rounds and 100-177 ms
    in the rest, its fsync no longer; with it (twice the checkpoint's size; 4 runs, taking
    turns with the last 4 of those), 92-143 ms in 18 of 20 rounds, 363 and 420 ms in 2,
    and in 4 make bench runs after them, 90-142 ms in 10 of 12, 462 and 996 ms in 2 (of
    a run in which every save was slow): the kernel reports what is free when its own
    timer fires, a save's first moments included."""

    def body(original: Callable, call: observe.Call, keep: Callable) -> object:
        if where(call):
            started = time.perf_counter()
            torch.ones(nbytes, dtype=torch.uint8)  # written, then freed: never kept
            keep({"bytes": nbytes, "seconds": time.perf_counter() - started})
        return original(*call.args, **call.kwargs)

    with observe.around(observe.page_module(), name, body) as calls:
        yield calls


def in_use_shown(by_rank: dict) -> str:
    """``memory_in_use_before``'s records in words: "1.04 GB of memory written and freed,
    untimed (median 0.41 s, at most 1.9 s)"."""
    records = [record for per_rank in by_rank.values() for record in per_rank]
    gb = max(record["bytes"] for record in records) / 1e9
    took = stats.summary([record["seconds"] for record in records])
    return (
        f"{gb:.2f} GB of memory written and freed, untimed"
        f" (median {took['median']:.2g} s, at most {took['max']:.2g} s)"
    )
