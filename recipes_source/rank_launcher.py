"""Run a recipe's per-rank function on N ranks, wherever the recipe runs.

This is the gallery's scaffolding, not part of any recipe: it starts ranks so
that the DCP code on each page can stay exactly what you would write in a
training script. It works in three places:

* inside Sphinx-Gallery and as ``python recipes_source/<recipe>.py``: the
  launcher forks ``DCP_RECIPES_WORLD_SIZE`` ranks (default: 2 on CPU, one per
  GPU on a GPU machine, and never more than the GPUs there are), which meet
  through a file in the launch's work directory (no port, and no server thread
  in the parent), captures each rank's output and prints it, labelled by
  rank, under the cell that launched it;
* under ``torchrun`` (one or several agents): it uses the ranks torchrun made
  and starts nothing itself.

CPU ranks use gloo. With GPUs each rank gets one device and the process group
``"cpu:gloo,cuda:nccl"`` (``dcp.async_save`` needs the CPU backend). The parent
never initialises CUDA and runs no threads of its own when it forks, and it
refuses to fork beside a thread it does not know to be safe (a forked rank
inherits every lock that thread held, and can wait for it for ever). Process
clean-up is the launcher's too: each forked rank limits OpenMP to one thread,
freezes the objects it inherited, stops the helper processes a recipe started
(DCP's checkpoint process) and removes their temporary folders before it exits.

A rank that raises fails the launch at once, and the error names the recipe,
the rank, its traceback and its output. Every launch has a deadline
(``DCP_RECIPES_TIMEOUT`` seconds, default 300), so nothing hangs.
"""

import atexit
import contextlib
import datetime
import gc
import hashlib
import importlib.machinery
import io
import json
import multiprocessing.util
import os
import pickle
import platform
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE_ENV = "DCP_RECIPES_WORLD_SIZE"
TIMEOUT_ENV = "DCP_RECIPES_TIMEOUT"
STAMP_DIR_ENV = "DCP_RECIPES_STAMP_DIR"  # set by the site build: where run stamps go
RECIPE_ENV = "DCP_RECIPES_RECIPE"  # set in a notebook, which has no script name

DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 300.0

# torch.cuda.is_available() (and torch.accelerator.is_available()) otherwise ask the CUDA
# runtime, which initialises the driver in the launching process: every rank forked after
# that fails at its first CUDA call. With this set they ask NVML, which is safe to fork
# after; torch reads it at every call, so the recipe's own checks are safe too.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"


class RankFailedError(RuntimeError):
    """A rank raised, crashed or ran past the launch deadline."""


class UnsafeToForkError(RuntimeError):
    """The launching process runs a thread that a forked rank could deadlock on."""


# --------------------------------------------------------------------------
# What the machine has
# --------------------------------------------------------------------------


def _world_size() -> int:
    """The number of ranks a launch uses: torchrun's, or ``DCP_RECIPES_WORLD_SIZE``."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count() if _use_gpus() else 0
    raw = os.environ.get(WORLD_SIZE_ENV, str(gpus or DEFAULT_WORLD_SIZE))
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{WORLD_SIZE_ENV} must be a positive integer, got {raw!r}")
    if gpus and size > gpus:
        raise ValueError(
            f"{WORLD_SIZE_ENV}={size} asks for more ranks than this machine has GPUs ({gpus}): "
            "NCCL needs one GPU per rank"
        )
    return size


def _use_gpus() -> bool:
    """True when ranks should run on GPUs; never initialises CUDA (NVML answers)."""
    return torch.cuda.is_available()


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if _use_gpus() else "gloo"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ
    )


# The launching process only orchestrates, and it must run no OpenMP thread pool when it
# forks (see "No fork beside a running thread" below): torch computes on one thread in
# it, as on every forked rank. Under torchrun nothing forks, and nothing changes.
if not under_torchrun():
    torch.set_num_threads(1)


def _timeout_s(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def _recipe_name() -> str:
    # Sphinx-Gallery sets sys.argv[0] to the example's path; so does python/torchrun.
    # A Jupyter kernel's is its launcher's: the notebook's launcher cell names the recipe.
    return os.environ.get(RECIPE_ENV) or Path(sys.argv[0]).stem or "<recipe>"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _storage(path: str) -> str:
    """The file system ``path`` is on, from /proc/mounts: "ext4 (/dev/vda, 271 GB)"."""
    path = os.path.realpath(path)
    device, fs_type, mount_point = "", "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(mount_point):
                device, mount_point, fs_type = fields[0], mount, fields[2]
    stats = os.statvfs(path)
    size = f"{stats.f_blocks * stats.f_frsize / 1e9:,.0f} GB"
    if not fs_type:
        return size
    return f"{fs_type} ({device}, {size})" if device.startswith("/dev/") else f"{fs_type} ({size})"


def machine_facts(directory: str | None = None) -> dict:
    """The host a page ran on: CPU, cores, memory, and the storage under ``directory``
    (the temporary directory, where ``shared_tempdir`` puts checkpoints, by default)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "storage": _storage(directory or tempfile.gettempdir()),
    }


def _device_description() -> str:
    """Called on a rank (never in the launching parent): may touch CUDA."""
    if _use_gpus():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} (GPU)"
    return f"{_cpu_name()}, {os.cpu_count()} cores (CPU)"


def _write_stamp(device: str, ranks: int) -> None:
    stamp_dir = os.environ.get(STAMP_DIR_ENV)
    if not stamp_dir:
        return
    host = machine_facts()
    stamp = {
        "recipe": _recipe_name(),
        "torch": torch.__version__,
        "device": device,
        "memory_gib": host["memory_gib"],
        "storage": host["storage"],
        "backend": _backend(),
        "world_size": ranks,
        "launcher": "torchrun" if under_torchrun() else "fork",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    os.makedirs(stamp_dir, exist_ok=True)
    path = Path(stamp_dir) / f"{stamp['recipe']}.json"
    # A page's stamp names the machine its launches ran on: the first launch's, unless a
    # later one ran on GPUs where it did not (a page may show something on CPU ranks too).
    if path.exists() and ("nccl" in json.loads(path.read_text())["backend"] or not _use_gpus()):
        return
    path.write_text(json.dumps(stamp, indent=1) + "\n")


# --------------------------------------------------------------------------
# Shared scratch space
# --------------------------------------------------------------------------


def shared_tempdir(prefix: str = "dcp-recipe-") -> str:
    """A fresh temporary directory whose path is the same on every rank.

    Forked ranks inherit the parent's path. Under torchrun every rank derives
    the same name from the rendezvous (address, port and run id), so agents on
    one machine agree without talking. The directory is removed at exit if the
    recipe has not removed it itself.
    """
    if under_torchrun():
        key = ":".join(
            os.environ.get(k, "")
            for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE")
        )
        digest = hashlib.sha1(f"{key}:{prefix}".encode()).hexdigest()[:12]
        path = os.path.join(tempfile.gettempdir(), f"{prefix}{digest}")
        os.makedirs(path, exist_ok=True)
    else:
        path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# --------------------------------------------------------------------------
# Output capture
# --------------------------------------------------------------------------


def _label(rank: int, text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    return "".join(f"[rank{rank}] {line}\n" for line in lines)


class _RankLabeller(io.TextIOBase):
    """A stream that prefixes every line with the rank (used under torchrun)."""

    def __init__(self, rank: int, target: Any):
        self._rank, self._target, self._pending = rank, target, ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._target.write(f"[rank{self._rank}] {line}\n")
        self._target.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.write("\n")


# --------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------


def run_on_ranks(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on every rank inside an initialised process group.

    Returns the list of per-rank return values (rank order). Output printed
    by each rank is printed here, labelled by rank, once the ranks finish.
    """
    _no_main_script_to_rerun()
    if under_torchrun():
        return _run_under_torchrun(fn, args)
    return _run_forked(fn, args, _world_size(), _timeout_s(timeout))


def run_on_one_process(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a single-process step (no process group needed) exactly once.

    In the gallery and as a script it runs in one forked process, so that the
    launching process never starts the threads that libraries leave behind
    (thread pools, progress-bar monitors): forking the next ranks from a process
    with such threads can deadlock them. Under torchrun rank 0 runs it while the
    other ranks wait, so files are written once.
    """
    _no_main_script_to_rerun()
    if not under_torchrun():
        return _run_forked(fn, args, 1, _timeout_s(None), group=False)[0]
    _ensure_torchrun_group()
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        with _labelled_output(0):
            result[0] = fn(*args)
    dist.barrier()
    dist.broadcast_object_list(result, src=0)
    return result[0]


def run_as_torchrun(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on every rank as ``torchrun`` would start a training script.

    Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and no process group: ``fn`` sets its device and
    creates and destroys its own groups, as a script's ``main()`` does. Under torchrun it
    runs on torchrun's ranks, once the launcher's own group is gone.
    """
    _no_main_script_to_rerun()
    if under_torchrun():
        _destroy_torchrun_group()
        with _labelled_output(int(os.environ["RANK"])):
            fn(*args)
        return
    _run_forked(fn, args, _world_size(), _timeout_s(None), group=False, torchrun_env=True)


def _no_main_script_to_rerun() -> None:
    """Keep processes that torch spawns (DCP's checkpoint process) from running the recipe again.

    A spawned child imports the parent's main script unless ``__main__.__spec__``
    names a module called ``__main__``. A recipe runs its code at the top level,
    so importing it again would start the whole recipe in the checkpoint process.
    """
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None:
        main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)


def _run_forked(
    fn: Callable[..., Any],
    args: tuple,
    ranks: int,
    timeout: float,
    group: bool = True,
    torchrun_env: bool = False,
) -> list[Any]:
    """Fork ``ranks`` processes that run ``fn``, each in the process group unless not ``group``
    (with ``torchrun_env``, in torchrun's environment instead, to create its own)."""
    recipe = _recipe_name()
    # fully_shard and optimizers import torch._dynamo lazily (~2 s); import it
    # once here so that every forked rank inherits it instead of paying again.
    import torch._dynamo  # noqa: F401

    _refuse_to_fork_beside_unknown_threads(recipe, ranks)
    # The ranks meet through a file (a FileStore) in the launch's work directory: the
    # parent hosts no store, so it runs no server thread while it forks.
    workdir = tempfile.mkdtemp(prefix="dcp-recipe-ranks-")
    try:
        context = mp.start_processes(
            _rank_entry,
            args=(fn, args, ranks, workdir, timeout, group, _torchrun_environment(torchrun_env)),
            nprocs=ranks,
            join=False,
            start_method="fork",
        )
        failure = _wait_for_ranks(context, timeout)
        outputs = [_read(Path(workdir, f"rank{r}.log")) for r in range(ranks)]
        if failure is not None:
            killed = _killed_from_outside(context, workdir)
            if killed is not None and "timed out" not in failure[1]:
                failure = killed
            raise RankFailedError(_describe_failure(recipe, failure, outputs, workdir))
        for rank, text in enumerate(outputs):
            sys.stdout.write(_label(rank, text) if group or torchrun_env else text)
        results = [
            pickle.loads(Path(workdir, f"rank{r}.result").read_bytes()) for r in range(ranks)
        ]
        if group:  # a page's stamp names the ranks it ran on, not a one-process step
            _write_stamp(results[0][1], ranks)
        return [value for value, _ in results]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------
# No fork beside a running thread
# --------------------------------------------------------------------------
# A forked process has one thread, but a copy of all the memory of the others, with every
# lock they held at that instant held for ever. A rank that then needs such a lock waits
# for ever. (The rendezvous store that the parent used to host ran a server thread, which
# formats each connecting rank's address with getnameinfo under glibc's resolver lock; a
# rank forked at that instant hung in its own getnameinfo.) So the parent runs no thread
# of the launcher's, and before it forks it looks at every thread it has.


def _is_jupyter_kernel_thread(thread: threading.Thread) -> bool:
    """ipykernel's own threads (ZeroMQ I/O, heartbeat, output capture): a rank never uses
    what they hold, since it writes to its own log from its first line."""
    target = getattr(thread, "_target", None)
    modules = (type(thread).__module__, getattr(target, "__module__", None) or "")
    return any(module.startswith("ipykernel.") for module in modules)


# Native threads that libraries start and that are safe to fork beside, by their OS names.
# NVML's: on a GPU machine the first NVML query (torch.cuda.device_count(), the launcher's
# own GPU check) starts a thread named "cuda" and digits ('cuda00001800007' on an H200).
# torch documents forking after an NVML query as safe, and after CUDA itself was initialised
# its own fork guard makes a rank that touches CUDA raise at once. jemalloc's purging
# threads (a library transformers loads there starts them): jemalloc takes its locks around
# a fork and starts them again in the child.
FORK_SAFE_NATIVE_THREADS = (r"cuda\d+", r"jemalloc_bg_thd")  # NVML's; jemalloc's


def _fork_safe_native_thread(name: str) -> bool:
    return any(re.fullmatch(pattern, name) for pattern in FORK_SAFE_NATIVE_THREADS)


def _native_threads() -> dict[int, str]:
    """Every thread of this process by its OS id, with its OS name (Linux); else {}."""
    try:
        ids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    names = {}
    for tid in ids:
        with contextlib.suppress(OSError):
            names[tid] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    return names


def _unknown_threads() -> dict[int, str]:
    """The threads beside this one that are not known to be safe to fork beside, described."""
    me = threading.get_native_id()
    python_threads = {t.native_id: t for t in threading.enumerate() if t.native_id != me}
    unknown = {}
    for tid, thread in python_threads.items():
        if not _is_jupyter_kernel_thread(thread):
            target = getattr(thread, "_target", None)
            started_by = getattr(target, "__qualname__", None) or type(thread).__qualname__
            unknown[tid] = f"Python thread {thread.name!r} (runs {started_by})"
    for tid, name in _native_threads().items():
        # ZeroMQ's I/O threads are a Jupyter kernel's, like the Python threads above.
        known = name.startswith("ZMQbg/") or _fork_safe_native_thread(name)
        if tid != me and tid not in python_threads and not known:
            unknown[tid] = (
                f"native thread {name!r} (tid {tid}; a C library's, such as an OpenMP pool "
                "that torch started before the launcher was imported)"
            )
    return unknown


def _refuse_to_fork_beside_unknown_threads(recipe: str, ranks: int) -> None:
    """Raise ``UnsafeToForkError`` naming every thread that could deadlock a forked rank."""
    unknown = _unknown_threads()
    if any(description.startswith("native") for description in unknown.values()):
        # Some libraries stop their threads whenever the process forks (OpenBLAS, which
        # numpy loads, parks its thread pool): fork once, a child that exits at once, and
        # keep only the threads that outlived it.
        probe = os.fork()
        if probe == 0:
            os._exit(0)
        os.waitpid(probe, 0)
        unknown = {tid: unknown[tid] for tid in _unknown_threads() if tid in unknown}
    if unknown:
        raise UnsafeToForkError(
            f"recipe {recipe!r}: will not fork {ranks} rank(s): the launching process runs "
            f"{len(unknown)} other thread(s): " + "; ".join(unknown.values()) + ". A process "
            "forked beside a running thread inherits the locks that thread holds, and can "
            "wait for them for ever. Start what runs the thread inside run_on_one_process "
            "or run_on_ranks, or stop it before this launch."
        )


def _torchrun_environment(wanted: bool) -> dict[str, str] | None:
    """What torchrun sets for every rank but the rank numbers, or None when not ``wanted``."""
    if not wanted:
        return None
    import socket

    with socket.socket() as probe:  # a free port for rank 0's store: nothing listens here
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _wait_for_ranks(context: Any, timeout: float) -> tuple[int, str] | None:
    """Join the ranks; return (rank, cause) of the first failure, or None."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if context.join(timeout=0.5):
                return None
        except mp.ProcessExitedException as exc:
            return exc.error_index, str(exc)
        except mp.ProcessRaisedException as exc:  # pragma: no cover - ranks never raise out
            return exc.error_index, str(exc)
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            return alive[0] if alive else 0, (
                f"timed out after {timeout:.0f} s ({TIMEOUT_ENV}); ranks still running: {alive}"
            )


def _killed_from_outside(context: Any, workdir: str) -> tuple[int, str] | None:
    """(rank, cause) of a rank that a signal killed (SIGKILL, the OOM killer), if one did.

    Its peers then fail in their next collective and raise first, but they are not the
    cause. SIGTERM is what the launch sends the others once one rank failed: not a cause.
    """
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        raised = Path(workdir, f"rank{rank}.failed").exists()
        if code is not None and code < 0 and -code != signal.SIGTERM and not raised:
            return rank, f"killed by {signal.Signals(-code).name}"
    return None


def _describe_failure(
    recipe: str, failure: tuple[int, str], outputs: list[str], workdir: str
) -> str:
    rank, cause = failure
    # The rank that raised first is the cause; others were stopped because of it (a record
    # without its time counts last: its rank was stopped while it wrote it).
    raised = sorted(
        (float(Path(workdir, f"rank{r}.failed").read_text() or "inf"), r)
        for r in range(len(outputs))
        if Path(workdir, f"rank{r}.failed").exists()
    )
    if raised and not cause.startswith("killed by"):
        rank = raised[0][1]
        cause = f"rank {rank} raised"
    parts = [f"recipe {recipe!r}: rank {rank} failed: {cause}"]
    parts.append(f"----- output and traceback of rank {rank} -----")
    parts.append(outputs[rank].rstrip() or "(no output)")
    for other, text in enumerate(outputs):
        if other != rank and text.strip():
            parts.append(f"----- output of rank {other} -----")
            parts.append(text.rstrip())
    return "\n".join(parts)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    ranks: int,
    workdir: str,
    timeout: float,
    group: bool,
    torchrun_env: dict[str, str] | None,
) -> None:
    """Body of one forked rank. Never returns: it leaves with os._exit."""
    log = open(Path(workdir, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # The rank inherits the parent's objects (all of Sphinx in the gallery);
    # keep the garbage collector from walking them during timed work.
    gc.freeze()
    # The parent may have used OpenMP before forking; a forked child that
    # starts its own thread pool can hang in its first matmul.
    torch.set_num_threads(1)
    try:
        if _use_gpus():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # Collectives time out after the launch deadline, never before it: a hang is then
        # reported by the launcher, with every rank still running and its output.
        beyond_the_deadline = datetime.timedelta(seconds=timeout + 60)
        if group:
            store = dist.FileStore(str(Path(workdir, "rendezvous")), ranks)
            store.set_timeout(beyond_the_deadline)
            dist.init_process_group(
                _backend(),
                store=store,
                rank=rank,
                world_size=ranks,
                timeout=beyond_the_deadline,
            )
        if torchrun_env is not None:
            os.environ.update(torchrun_env, WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
        value = fn(*args)
        if torchrun_env is not None and dist.is_initialized():
            raise RuntimeError("the script's main() returned without destroy_process_group()")
        if group:
            # Everyone reaches here before teardown: tearing gloo down while a
            # peer is still sending aborts the process now and then.
            dist.barrier()
            dist.destroy_process_group()
        device = _device_description() if rank == 0 else ""
        Path(workdir, f"rank{rank}.result").write_bytes(pickle.dumps((value, device)))
        code = 0
    except BaseException:
        # Written whole or not at all (a rank stopped while writing it leaves no empty record).
        writing = Path(workdir, f"rank{rank}.failing")
        writing.write_text(repr(time.time()))
        os.replace(writing, writing.with_suffix(".failed"))
        traceback.print_exc()
        code = 1
    log.flush()
    # os._exit skips multiprocessing's exit handling: run it, so that helper
    # processes a recipe started (DCP's checkpoint process) are stopped and
    # their pymp-* folders removed.
    multiprocessing.util._exit_function()
    os._exit(code)


# --------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------


_TORCHRUN_GROUPS: list[str] = []  # the launcher's groups under torchrun, in order


def _ensure_torchrun_group() -> None:
    if dist.is_initialized():
        return
    if _use_gpus():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=_timeout_s(None))
    # torchrun --max-restarts keeps its store across the attempts it restarts: workers of a
    # new attempt would find the previous attempt's addresses there (gloo then fails with
    # "connectFullMesh ... Connection refused"). Keys of this attempt only, under a prefix.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        ranks,
        is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # A group created again after run_as_torchrun has keys of its own, too.
    _TORCHRUN_GROUPS.append(attempt)
    dist.init_process_group(
        _backend(),
        store=dist.PrefixStore(f"attempt-{attempt}/group-{len(_TORCHRUN_GROUPS)}", store),
        rank=rank,
        world_size=ranks,
        timeout=timeout,
    )
    atexit.register(_destroy_torchrun_group)


# The teardown barrier's handle, kept until Python clears this module on the main thread.
_TEARDOWN_BARRIER: list[Any] = []


def _destroy_torchrun_group() -> None:
    if dist.is_initialized():
        # gloo's worker thread lets go of its last collectives when it lets go of this barrier.
        # Were that the last reference, it would free their tensors while Python shuts down
        # (the group outlives destroy_process_group: DTensor caches keep fully_shard's mesh),
        # and the process aborts: "terminate called without an active exception".
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        _TEARDOWN_BARRIER.append(barrier)
        dist.destroy_process_group()


@contextlib.contextmanager
def _labelled_output(rank: int):
    labeller = _RankLabeller(rank, sys.stdout)
    with contextlib.redirect_stdout(labeller):
        yield
    labeller.flush()


def _run_under_torchrun(fn: Callable[..., Any], args: tuple) -> list[Any]:
    _ensure_torchrun_group()
    rank = dist.get_rank()
    try:
        with _labelled_output(rank):
            value = fn(*args)
    except BaseException:
        # Exit now, without the teardown barrier: torchrun sees this rank
        # fail and stops the others, instead of them waiting for it.
        print(f"recipe {_recipe_name()!r}: rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if rank == 0:
        _write_stamp(_device_description(), dist.get_world_size())
    return values
