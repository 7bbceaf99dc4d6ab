"""Host memory: the host copies a stager makes, and whether a save reuses them.

``host_copies()`` watches ``DefaultStager._stage`` inside a ``with`` block: for every copy
a stager makes on a rank, the host storages it copied into (address and size) and how
many entries the stager's cache holds then. While the block lasts, every copy it saw is
kept alive, so that an address seen at one save cannot be handed to a later copy: the
same address at two saves is the same buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

from page_tools import observe, proofs, results


def storages(state: Any) -> list[tuple[int, int]]:
    """(address, bytes) of every distinct storage behind the tensors of a state dict (of a
    ``DTensor``, its local shard's), by address."""
    found: dict[int, int] = {}
    for value in proofs.flatten(state).values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            storage = local.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return sorted(found.items())


def cached_entries(stager: DefaultStager) -> int:
    """How many source storages a ``DefaultStager`` keeps a host copy for (its cache holds
    them weakly: an entry goes when its source tensor is freed)."""
    return len(stager._state_dict_stager._cached_storage_mapping)


@contextlib.contextmanager
def host_copies(stager_class: type = DefaultStager) -> Iterator[observe.Calls]:
    """Record, at every copy a ``stager_class`` makes inside the block, ``{"storages":
    [(address, bytes), ...], "cached": entries}`` by rank, in the order of the copies."""
    kept: list[Any] = []  # the copies, alive until the block ends: no address is reused

    def record(call: observe.Call) -> dict:
        kept.append(call.result)
        return {"storages": storages(call.result), "cached": cached_entries(call.args[0])}

    with observe.watch(stager_class, "_stage", record) as copies:
        try:
            yield copies
        finally:
            kept.clear()


def same_buffers(records: list[dict]) -> bool:
    """Every copy went into the storages of the first one (``host_copies`` records)."""
    return all(record["storages"] == records[0]["storages"] for record in records)


def megabytes(record: dict) -> float:
    return sum(size for _, size in record["storages"]) / 1e6


def reused_at_every_save(claim: str, copies: observe.Calls) -> None:
    """Decide that, on every rank, every copy (``host_copies``) went into the host storages
    of the first, and say how many and how large they are."""
    first = copies.by_rank[0][0]
    saves = {rank: len(records) for rank, records in copies.by_rank.items()}
    results.claim(
        claim,
        all(n > 1 for n in saves.values())
        and all(same_buffers(records) for records in copies.by_rank.values()),
        f"{saves[0]} saves, rank 0: {len(first['storages'])} host storages "
        f"({megabytes(first):.1f} MB), the same ones at every save, on every rank",
        saves=saves,
        storages=len(first["storages"]),
        megabytes=megabytes(first),
    )


def save_pairs(copies: observe.Calls) -> list[dict]:
    """Copies recorded in pairs (two saves of the same state, then two of another): for each
    pair, its storages and size (rank 0's first copy), and per rank whether the second copy
    went into the first's storages and how many cache entries there were after it."""
    pairs = []
    for first in range(0, len(copies.by_rank[0]), 2):
        both = [records[first : first + 2] for _, records in sorted(copies.by_rank.items())]
        pairs.append(
            {
                "storages": len(both[0][0]["storages"]),
                "megabytes": megabytes(both[0][0]),
                "reused": [same_buffers(pair) for pair in both],
                "cached": [pair[1]["cached"] for pair in both],
            }
        )
    return pairs


def second_save_reused(claim: str, pair: dict, expected: bool, what: str) -> None:
    """Decide, for a pair of ``save_pairs``, that on every rank the second copy did (or, with
    ``expected=False``, did not) go into the first copy's host storages."""
    where = "the first's host buffers" if expected else "new host buffers"
    results.claim(
        claim,
        pair["reused"] == [expected] * len(pair["reused"]),
        f"{what}: the second save copied into {where}, on every rank",
        reused=pair["reused"],
    )


def cache_holds_one_save(claim: str, pair: dict, what: str) -> None:
    """Decide that after a pair's second copy the stager's cache held one entry per storage
    of one save, on every rank: the first save's entries did not stay."""
    results.claim(
        claim,
        all(n == pair["storages"] for n in pair["cached"]),
        f"{what}: {pair['storages']} cache entries after the second save "
        f"({2 * pair['storages']} if the first save's had stayed)",
        cached=pair["cached"],
    )


def pairs_table(pairs: dict[str, dict]):
    """``save_pairs`` side by side, one row each (rank 0's counts)."""
    from page_tools import figures

    return figures.Table(
        ["state_dict() returns", "host storages", "MB", "2nd save reused them", "cache after it"],
        [
            [what, p["storages"], round(p["megabytes"], 1), all(p["reused"]), p["cached"][0]]
            for what, p in pairs.items()
        ],
    )
