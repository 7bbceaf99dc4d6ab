"""Run a recipe the ways a reader would: python, torchrun, two torchrun agents."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes_source"
RECIPE_TIMEOUT_S = 300
CHECKPOINT_FILE = re.compile(r"\.distcp$|^\.metadata$|\.pt$")
TORCH_OWN_TMP_DIRS = ("torchelastic_", "torchinductor_")


def recipe_path(name: str) -> Path:
    path = RECIPES / f"{name}.py"
    assert path.exists(), f"no recipe {path}"
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RecipeRunner:
    """Runs a recipe as a subprocess, with its own TMPDIR so leftovers are visible."""

    def __init__(self, tmp_path: Path):
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("DCP_RECIPES_STAMP_DIR", None)
        env.update(TMPDIR=str(self.tmpdir), PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def python(self, name: str, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """``python recipes_source/<name>.py`` with the gallery launcher."""
        return self._run(
            [sys.executable, str(recipe_path(name))],
            self.env(DCP_RECIPES_WORLD_SIZE=str(world_size), **env),
            timeout,
        )

    def torchrun(self, name: str, nproc: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """``torchrun --standalone --nproc-per-node=N recipes_source/<name>.py``."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", str(recipe_path(name))]
        return self._run(cmd, self.env(**env), timeout)

    def torchrun_two_nodes(self, name: str, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """Two torchrun agents (``--nnodes=2``), one rank each, c10d rendezvous on 127.0.0.1."""
        port = _free_port()
        procs = []
        for node in range(2):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
            ]
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
            cmd += [f"--rdzv-id=test-{port}", f"--node-rank={node}", str(recipe_path(name))]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=self.env(**env),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
        return results

    def script(self, path, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """``python <path>``: a test's own script that uses the launcher."""
        return self._run(
            [sys.executable, str(path)],
            self.env(DCP_RECIPES_WORLD_SIZE=str(world_size), **env),
            timeout,
        )

    def _run(self, cmd: list[str], env: dict[str, str], timeout: float):
        return subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def leftovers(self) -> list[str]:
        """Files a run left in its TMPDIR.

        torch's own per-user folders are not ours: torchrun's logs
        (``torchelastic_*``) and the compile cache that importing torch._dynamo
        creates (``torchinductor_<user>``).
        """
        return sorted(
            p.name for p in self.tmpdir.iterdir() if not p.name.startswith(TORCH_OWN_TMP_DIRS)
        )


def assert_ok(result: subprocess.CompletedProcess) -> str:
    """The run exited 0; returns stdout+stderr for further checks."""
    output = (result.stdout or "") + (result.stderr or "")
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-6000:]}"
    return output


def checkpoint_files_in_repo() -> list[str]:
    """Checkpoint files anywhere in the working tree (the virtualenv aside)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in (".venv", ".git")]
        found += [os.path.join(dirpath, f) for f in filenames if CHECKPOINT_FILE.search(f)]
    return found
