"""The troubleshooting page's quoted messages are checked against what the code raises.

``tests/troubleshooting_errors.py`` triggers every quoted failure on 2 ranks, once for
the module, and prints what DCP raised. Each ```text block on troubleshooting.md must
match one of those messages, with ``...`` standing for the parts that vary (a ``...``
inside a line matches the rest of that line's variable part, a line that is only ``...``
matches any number of lines); so must every inline-quoted error. The facts the page
states next to them (which files a torn or reused directory holds, what
``except Exception`` catches) are checked from the same run.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest
import torch.distributed.constants
import torch.distributed.distributed_c10d as c10d
from recipe_runner import ROOT, RecipeRunner, assert_ok
from torch.distributed.checkpoint.api import CheckpointException

PAGE = ROOT / "troubleshooting.md"
SCRIPT = Path(__file__).with_name("troubleshooting_errors.py")
TEXT_BLOCK = re.compile(r"^```text\n(.*?)^```$", re.MULTILINE | re.DOTALL)
QUOTE = re.compile(r"^=== (\S+)\n(.*?)\n=== end$", re.MULTILINE | re.DOTALL)
FACT = re.compile(r"^fact (.+?): (.*)$", re.MULTILINE)
# Every failure the script triggers is quoted on the page.
QUOTED = {
    "no-cpu-backend",
    "upload-after-destroy",
    "load-torn",
    "overwrite-warning",
    "differs-load-rank0-path",
    "differs-load-own-path",
    "missing-key",
    "newer-torch-checkpoint",
}
INLINE_QUOTED = {"default-stager-on-cpu", "cached-stager-on-cpu", "reused-stager-torch-2.11"}


class Run:
    def __init__(self, output: str):
        self.output = output
        self.quotes: dict[str, list[str]] = {}  # name -> what each rank printed
        self.facts: dict[str, str] = {}
        for rank in (0, 1):
            prefix = f"[rank{rank}] "
            text = "".join(
                line[len(prefix) :] + "\n"
                for line in output.splitlines()
                if line.startswith(prefix)
            )
            for name, message in QUOTE.findall(text):
                self.quotes.setdefault(name, []).append(message)
            self.facts.update(FACT.findall(text))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    runner = RecipeRunner(tmp_path_factory.mktemp("troubleshooting"))
    output = assert_ok(runner.script(SCRIPT, world_size=2, timeout=120))
    assert runner.leftovers() == [], "the script removes its checkpoints"
    return Run(output)


def page() -> str:
    return PAGE.read_text()


def prose() -> str:
    """The page with every run of whitespace as one space: prose wraps anywhere."""
    return " ".join(page().split())


def pattern(block: str) -> re.Pattern:
    """A quoted block as a regex: ``...`` for what varies, everything else literal."""
    lines = []
    for line in block.rstrip("\n").split("\n"):
        if line == "...":
            lines.append(r"(?:[^\n]*\n)*?[^\n]*")
        else:
            lines.append(r"[^\n]*?".join(re.escape(part) for part in line.split("...")))
    return re.compile(r"\n".join(lines))


def matches(block: str, message: str) -> bool:
    return pattern(block).fullmatch(message) is not None


def test_the_script_triggers_every_failure_on_every_rank(run):
    assert set(run.quotes) == QUOTED | INLINE_QUOTED, sorted(run.quotes)
    for name, messages in run.quotes.items():
        assert len(messages) == 2, f"{name}: printed by {len(messages)} ranks"


def test_every_quoted_block_is_what_dcp_raises(run):
    blocks = TEXT_BLOCK.findall(page())
    assert len(blocks) >= len(QUOTED)
    matched = set()
    for block in blocks:
        names = {n for n, ms in run.quotes.items() if any(matches(block, m) for m in ms)}
        assert names, f"no failure raises this quoted text:\n{block}\nraised:\n{run.quotes}"
        matched |= names
    assert matched >= QUOTED, f"raised but not quoted: {QUOTED - matched}"


def test_quotes_are_not_so_loose_that_anything_matches(run):
    blocks = TEXT_BLOCK.findall(page())
    for block in blocks:
        names = {n for n, ms in run.quotes.items() if any(matches(block, m) for m in ms)}
        assert len(names) == 1, f"ambiguous quote (matches {names}):\n{block}"


def test_inline_quoted_errors_are_what_dcp_raises(run):
    for name in INLINE_QUOTED:
        message = run.quotes[name][0]
        assert f"`{message}`" in prose(), f"{message!r} is not quoted on the page"


def test_a_torn_checkpoint_is_what_the_page_says(run):
    # Both ranks wrote their data, nobody wrote .metadata; except Exception misses the error.
    assert run.facts["torn files rank0"] == "['__0_0.distcp', '__1_0.distcp']"
    assert run.facts["except Exception caught it"] == "False"
    assert not issubclass(CheckpointException, Exception)
    assert "`CheckpointException` derives from `BaseException`" in prose()


def test_a_reused_directory_looks_complete_while_torn(run):
    for rank in (0, 1):
        assert run.facts[f"reused has .metadata rank{rank}"] == "True"
        assert run.facts[f"reused loads the torn save rank{rank}"] == "True"
    assert "Never reuse a checkpoint directory" in prose()


def test_without_collectives_every_rank_writes_its_own_metadata(run):
    files = run.facts["use_collectives=False files"]
    assert files == "['__0.metadata', '__0_0.distcp', '__1.metadata', '__1_0.distcp']"
    assert "`__0.metadata`, `__1.metadata`, ... (one per rank) and no `.metadata`" in prose()


def test_directories_that_differ_and_replicated_tensors_that_hide_it(run):
    assert run.facts["differs files rank0"] == "['.metadata', '__0_0.distcp']"
    assert run.facts["differs files rank1"] == "['__1_0.distcp']"
    # Replicated plain tensors are written once, by rank 0 here: the wrong path loads.
    assert run.facts["replicated loads from rank 0's path rank0"] == "7"
    assert run.facts["replicated loads from rank 0's path rank1"] == "7"


def test_the_stated_timeouts_are_torch_defaults():
    assert torch.distributed.constants.default_pg_timeout == datetime.timedelta(minutes=30)
    assert "gloo's default timeout is 30 minutes" in prose()
    # A group of both backends is not ``backend="nccl"``: both halves get gloo's default.
    mixed = torch.distributed.Backend("cpu:gloo,cuda:nccl")
    assert c10d._get_default_timeout(mixed) == datetime.timedelta(minutes=30)


def test_pattern_helper():
    assert matches("a ... c", "a bb c") and not matches("a ... c", "a b\nb c")
    assert matches("x\n...\nz", "x\n1\n2\nz") and matches("x\n...\nz", "x\n\nz")
    assert not matches("a.c", "abc"), "a quote's own dots are literal"


def test_a_reused_stager_on_torch_2_11_fails_at_its_second_save(run):
    for rank in (0, 1):
        assert run.facts[f"reused stager save 0 rank{rank}"] == "complete"
        assert f"reused stager save 1 rank{rank}" not in run.facts
    assert "torch 2.11.0" in prose() and "a `DefaultStager` per save" in prose()
