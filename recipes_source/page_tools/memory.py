"""Host memory: how big a state is, where its staged copies live, and what pinning costs.

``tensor_bytes`` and ``storages`` read a (nested) state dict on a rank: the bytes of the
tensors it holds (of a ``DTensor``, this rank's shard), and the storages they live in (a
stager that reuses its buffers returns the same storages at every save).
``staged_copies_shared`` watches a rank's stager and saves: whether each staged copy is in
shared memory right after staging, and again once its upload completed (a checkpoint
process receives it through ``/dev/shm``). ``pinned_staging_bytes`` measures, on a GPU
machine, the host memory that pinned staging buffers take.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from typing import Any

import psutil
import torch

from page_tools import observe, proofs, timing


def _local_tensors(state: Any) -> list[torch.Tensor]:
    tensors = []
    for value in proofs.flatten(state).values():
        if isinstance(value, torch.Tensor):
            tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a state dict that this rank holds."""
    return sum(t.numel() * t.element_size() for t in _local_tensors(state))


def storages(state: Any) -> list[int]:
    """The address of the storage of every tensor this rank holds, in the state's order."""
    return [t.untyped_storage().data_ptr() for t in _local_tensors(state)]


def all_shared(state: Any) -> bool:
    """Every tensor of the state is in shared memory."""
    return all(t.is_shared() for t in _local_tensors(state))


@contextlib.contextmanager
def staged_copies_shared(stager_class: Any, owner: Any, name: str = "async_save"):
    """Watch ``stager_class.stage`` (staging in the caller's thread) and ``owner.name``
    (``dcp.async_save``) on every rank: for each save, whether its staged copy was in shared
    memory when staging returned, and when its upload completed. Records by rank, in call
    order: ``{"checkpoint_id", "after_staging", "after_upload"}``. Both are restored on exit.
    """
    local = threading.local()
    spool, calls = observe._Spool(), observe.Calls()

    def stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        local.staged = original_stage(self, *args, **kwargs)
        local.shared = all_shared(local.staged)
        return local.staged

    def save(*args: Any, **kwargs: Any) -> Any:
        local.staged = local.shared = None
        future = original_save(*args, **kwargs)
        staged = local.staged
        record = {"checkpoint_id": str(kwargs.get("checkpoint_id")), "after_staging": local.shared}

        def completed(_: Any) -> None:
            spool.put({**record, "after_upload": staged is not None and all_shared(staged)})

        tracked.track(getattr(future, "upload_completion", future), completed)
        return future

    with (
        timing.completions() as tracked,
        observe.replaced(stager_class, "stage", stage) as original_stage,
        observe.replaced(owner, name, save) as original_save,
    ):
        try:
            yield calls
        finally:
            calls.by_rank = spool.collect()


def dev_shm_bytes() -> int | None:
    """The size of ``/dev/shm``, the one tmpfs that every rank on this machine shares."""
    return shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None


def pinned_staging_bytes(shapes: dict[str, tuple[int, ...]], options: Any, directory: str) -> dict:
    """On a GPU: the host memory that pinned staging buffers take, for a state of ``shapes``
    (fp32), staged once through ``FileSystemWriter(cache_staged_state_dict=True)`` and once
    through a ``DefaultStager(options)`` (available memory before and after each, both
    copies alive). Run it in a process of its own: the writer's pinned memory stays cached
    by the process."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager

    state = {key: torch.rand(shape, device="cuda") for key, shape in shapes.items()}
    writer = FileSystemWriter(directory, cache_staged_state_dict=True)
    stager = DefaultStager(options)
    taken = {}
    copies = []
    for what, stage in (("writer", writer.stage), ("stager", stager.stage)):
        before = psutil.virtual_memory().available
        copies.append(stage(state))
        taken[what] = before - psutil.virtual_memory().available
    stager.close()
    return {"state": sum(t.nbytes for t in state.values()), **taken}


# Three of GPT-2 small's fp32 weights: the token embedding, an MLP's and an attention's.
GPT2_SMALL = {"wte": (50257, 768), "mlp.c_fc": (768, 3072), "attn.c_proj": (768, 768)}


def pinning_on_gpu(directory: str, repeats: int = 3, shapes: dict | None = None) -> dict | None:
    """On a machine with a GPU: ``pinned_staging_bytes`` ``repeats`` times and
    ``timing.copy_to_host_seconds`` once, each in a process of its own (the launching
    process never starts CUDA), recorded as the value ``pinning``; None without a GPU."""
    from rank_launcher import run_on_one_process
    from torch.distributed.checkpoint.staging import StagingOptions

    from page_tools import results, timing

    if not torch.cuda.is_available():
        return results.record("pinning", None)
    pinned = StagingOptions(True, False, False, True)  # pinned, non-blocking, in the caller
    staging = [
        run_on_one_process(pinned_staging_bytes, shapes or GPT2_SMALL, pinned, directory)
        for _ in range(repeats)
    ]
    copies = run_on_one_process(timing.copy_to_host_seconds)
    return results.record("pinning", {"staging": staging, "copies_s": copies})


def pinning_numbers(pinning: dict | None, nbytes: int = 2**28) -> dict:
    """What ``pinning_on_gpu`` measured, as a few named numbers (medians): {} without a GPU."""
    numbers = {}
    if pinning is None:
        return numbers
    for what in ("writer", "stager"):
        ratios = sorted(p[what] / p["state"] for p in pinning["staging"])
        numbers[f"{what} pinned x state"] = ratios[len(ratios) // 2]
    for into, seconds in pinning["copies_s"].items():
        numbers[f"copy into {into} GB/s"] = nbytes / sorted(seconds)[len(seconds) // 2] / 1e9
    return numbers


def claim_pins_the_state_size(claim: str, pinning: dict | None, tolerance: float = 0.1) -> None:
    """Decide that each ``DefaultStager`` staging of ``pinning_on_gpu`` took the state's own
    size in host memory, within ``tolerance`` (not measured without a GPU)."""
    from page_tools import results

    if pinning is None:
        return results.not_measured_here(claim, f"{claim}: not measured, no GPU here")
    ratios = [p["stager"] / p["state"] for p in pinning["staging"]]
    results.claim(
        claim,
        all(abs(ratio - 1) < tolerance for ratio in ratios),
        "DefaultStager's pinned buffers: " + ", ".join(f"{r:.2f}x" for r in ratios) + " the state",
        ratios=ratios,
    )


def claim_writer_pins_more(claim: str, pinning: dict | None) -> None:
    """Decide that the writer's cache took more host memory than ``DefaultStager``, beyond
    noise (not measured without a GPU)."""
    from page_tools import results, stats

    if pinning is None:
        return results.not_measured_here(claim, f"{claim}: not measured, no GPU here")
    staging = pinning["staging"]
    stats.claim_less(
        claim,
        "DefaultStager's pinned buffers",
        [p["stager"] for p in staging],
        "the writer's cache",
        [p["writer"] for p in staging],
        "MB",
        1e-6,
    )
