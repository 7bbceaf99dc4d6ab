"""Launches a claim needs beyond what this machine's launch gives."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from rank_launcher import WORLD_SIZE_ENV, under_torchrun


@contextlib.contextmanager
def at_least(ranks: int) -> Iterator[int]:
    """Launches inside the block use ``ranks`` CPU ranks where this machine's launch would
    use fewer (one GPU, or ``DCP_RECIPES_WORLD_SIZE=1``): ranks that disagree need two.

    Under torchrun, whose ranks are given, nothing changes. The environment is restored
    on exit. Yields the number of ranks the launches inside will use.
    """
    saved = {name: os.environ.get(name) for name in (WORLD_SIZE_ENV, "CUDA_VISIBLE_DEVICES")}
    here = int(os.environ.get(WORLD_SIZE_ENV) or torch.cuda.device_count() or 2)
    if under_torchrun():
        yield int(os.environ["WORLD_SIZE"])
        return
    if here < ranks:  # fewer GPUs than that: the launcher puts one rank per GPU, so use none
        os.environ.update({WORLD_SIZE_ENV: str(ranks), "CUDA_VISIBLE_DEVICES": ""})
    try:
        yield max(here, ranks)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def cpu_only() -> Iterator[bool]:
    """Launches inside the block use CPU ranks (gloo), on a machine with GPUs too: a claim
    about what happens where there is no device stream needs them. The number of ranks is
    the launch's own (``DCP_RECIPES_WORLD_SIZE``, else 2).

    Under torchrun, whose ranks are given, nothing changes. Yields whether the launches
    inside run on CPU ranks. The environment is restored on exit.
    """
    if under_torchrun():
        yield not torch.cuda.is_available()
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the launcher then finds no GPU (it asks NVML)
    try:
        yield True
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@contextlib.contextmanager
def exactly(count: int) -> Iterator[int]:
    """Launches inside the block use ``count`` ranks: one per GPU where the machine has that
    many GPUs, else ``count`` CPU ranks (the launcher puts one rank on each GPU). A page that
    resumes on another number of ranks runs each launch in one.

    Under torchrun, whose ranks are given, nothing changes. The environment is restored
    on exit. Yields the number of ranks the launches inside will use.
    """
    if under_torchrun():
        yield int(os.environ["WORLD_SIZE"])
        return
    saved = {name: os.environ.get(name) for name in (WORLD_SIZE_ENV, "CUDA_VISIBLE_DEVICES")}
    os.environ[WORLD_SIZE_ENV] = str(count)
    if 0 < torch.cuda.device_count() < count:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield count
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
