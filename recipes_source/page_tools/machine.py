"""What a page ran on: CPU, cores, memory, the storage its checkpoints went to, the GPUs,
the torch version (the launcher's ``machine_facts``, which also writes the run stamp)."""

from __future__ import annotations

import torch
from rank_launcher import machine_facts


def describe(directory: str | None = None) -> dict:
    """The machine, as a page's results file records it, with the storage under
    ``directory`` (the temporary directory by default). Asks NVML, never starts CUDA."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return machine_facts(directory) | {"gpus": gpus, "torch": torch.__version__}


def title(directory: str | None = None) -> str:
    """Two lines for a figure's title: "AMD EPYC, 2 cores, 23.5 GiB memory; CPU ranks
    (gloo)" and "checkpoints on ext4 (/dev/vda, 271 GB); torch 2.13.0+cpu"."""
    facts = describe(directory)
    ranks = f"{facts['gpus']} GPU(s)" if facts["gpus"] else "CPU ranks (gloo)"
    return (
        f"{facts['cpu']}, {facts['cores']} cores, {facts['memory_gib']} GiB memory; {ranks}\n"
        f"checkpoints on {facts['storage']}; torch {facts['torch']}"
    )
