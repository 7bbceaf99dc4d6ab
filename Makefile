# DCP Recipes. `make html` and `make test` set up everything on a machine with python3.

PYTHON      ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
PY          := $(BIN)/python
READY       := $(VENV)/.requirements-installed
BUILD       := _build
SPHINXBUILD := $(PY) -m sphinx
# Warnings are errors; --keep-going reports all of them before failing. Pages execute one at
# a time either way; -j reads and writes them on every core (a cold html-noplot: 31 s -> 26 s).
SPHINXOPTS  ?= -W --keep-going -j auto
HOST        ?= 127.0.0.1
PORT        ?= 8000
# Where a CPU wheel of torch lies on disk, pip takes it instead of a CUDA build.
WHEELS      := $(wildcard /opt/wheels)
# gpu-check runs a bare PY=python3 from this PATH, not the venv's (it must not need the venv).
SYSTEM_PATH := $(PATH)
export PATH := $(abspath $(BIN)):$(PATH)
# Where PYTHONDONTWRITEBYTECODE is set (as on this machine), every process would compile what
# it imports again (6.6 s more per `import torch`): the project's commands write bytecode, into
# the venv and the repository's ignored __pycache__ folders.
unexport PYTHONDONTWRITEBYTECODE
# PyTorch's allocator starts every tensor of 2 MB or more at a 2 MB page (transparent huge
# pages): direct I/O, which reads page-aligned memory only, then writes the stall page's
# training tensors where they lie (recipes_source/direct_io.py). Every process make starts
# runs with it, so the pages' numbers compare; the stall page's results say whether it held.
export THP_MEM_ALLOC_ENABLE := 1
# What the build's first processes (the quick start's, the first page, Sphinx) all import: one
# process compiles it (about 20 s on one core) before several would compile it side by side.
WARM_IMPORTS := torch.distributed.checkpoint, torch.distributed.fsdp, torch._dynamo, sphinx_gallery.gen_gallery

.PHONY: help venv html html-noplot test lint pytest pytest-beside-the-build reruns serve bench stress restart-trials gpu-check versions clean browser-deps

help:
	@echo "make html         execute every recipe and build the site into $(BUILD)/html"
	@echo "make html-noplot  render every page without executing anything (fast)"
	@echo "make test         lint, build the site, run the tests (what CI runs)"
	@echo "make lint         lintrunner --all-files"
	@echo "make reruns       each page's download alone and under torchrun, its claims at other ranks"
	@echo "make serve        serve $(BUILD)/html on http://$(HOST):$(PORT)/"
	@echo "make bench        the benchmark recipes at full size (1 GB stalls, 256 MB speeds), into $(BUILD)/bench;"
	@echo "                  a second run lists the verdicts that changed since the first"
	@echo "make stress       every page's script and notebook at 3 ranks, the HF page 30 times"
	@echo "make restart-trials  torchrun restarts on 1 and 2 agents, three ways to form the group"
	@echo "make gpu-check    every recipe on this machine's GPUs (PY=python-with-torch), into $(BUILD)/gpu-check"
	@echo "make versions     every recipe's download on torch 2.9-2.15 (TORCH=2.15.0 for one), into _versions/"
	@echo "make clean        remove build output"
	@echo "GALLERY_PATTERN=<regex> make html   execute only the matching recipes"

venv: $(READY)

# uv installs the pinned requirements (its own pin is among them): 4 s here with a warm cache,
# where pip took 151 s. pip brings uv into the venv, and nothing else. No process compiles all
# of the venv (uv's --compile-bytecode: 52 s on both cores, 86 CPU-seconds, most of it modules
# nothing here imports): Python writes a module's bytecode the first time a process imports
# it, and every later process reads it (see WARM_IMPORTS).
$(READY): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $$(grep '^uv==' requirements.txt)
	$(BIN)/uv pip install --quiet --python $(PY) \
		$(if $(WHEELS),--find-links $(WHEELS)) -r requirements.txt
	$(PY) -c "import $(WARM_IMPORTS)"
	touch $@

html: $(READY)
	$(SPHINXBUILD) -b html $(SPHINXOPTS) . $(BUILD)/html

html-noplot: $(READY)
	$(SPHINXBUILD) -b html $(SPHINXOPTS) -D plot_gallery=0 . $(BUILD)/html

lint: $(READY)
	$(BIN)/lintrunner init >/dev/null
	$(BIN)/lintrunner --all-files --force-color

# The browser tests drive Debian's chromium (through Playwright's pip wheel, which downloads no
# browser); install it where it is missing, as root or with sudo. Its recommends (printing
# tools, upower, notification-daemon, mesa) pull in dozens of desktop packages a headless
# browser never uses; fonts-liberation, one of them, is kept: the pages ask for Arial/Helvetica.
browser-deps:
	@command -v chromium >/dev/null || { \
		echo "installing chromium (apt-get)"; \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install \
			-y -qq --no-install-recommends chromium fonts-liberation >/dev/null; }

# One worker per core and one more: some tests mostly wait (the browser, S3 servers starting,
# deadlines), and a third worker fills that time here (pytest 172 s -> 157 s, side by side;
# a fourth was slower). A worker takes over another's tests when it runs out (worksteal).
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST_ARGS ?= -n $(PYTEST_WORKERS) --dist worksteal

# make test reads what the build executed and runs one page's code again: the getting-started
# page's copy buttons, pasted into one script beside the launcher. (The build itself runs
# torchrun: the quick start, twice, and the restart page's jobs on one agent and on two.)
# Running every page again (its notebook alone, compared with the page; its script under
# torchrun and on two agents; its claims at 1 or 3 ranks: about 1,150 CPU-seconds here) is
# `make reruns`, CI's second test job on every change.
RERUNS := torchrun or ranks or download

pytest: $(READY) browser-deps
	$(PY) -m pytest $(PYTEST_ARGS) $(PYTEST_SKIP) -m "not ($(RERUNS))"

# The test of `make html-noplot` builds a copy of the site without executing anything: it
# reads nothing the executed build writes, and in make test it runs beside that build, at
# the lowest priority, on the core the build leaves idle (its pages execute one at a time),
# and is done within the first pages, long before the performance pages run.
BESIDE_THE_BUILD := tests/test_site.py::test_noplot_build_renders_every_page_without_running_it

pytest-beside-the-build: $(READY)
	nice -n 19 $(PY) -m pytest -q -p no:cacheprovider $(BESIDE_THE_BUILD)

reruns: $(READY)
	@test -f $(BUILD)/html/index.html || $(MAKE) html
	$(PY) -m pytest $(PYTEST_ARGS) -m "$(RERUNS)"

# chromium's install (apt: network and disk) beside the venv's (uv: both cores, compiling);
# lint and the noplot build's test beside the build (the build rarely has both cores busy).
# The other tests run after the build, never beside it: they would load the machine that
# the performance pages measure.
test:
	$(MAKE) -j2 --output-sync=target venv browser-deps
	$(MAKE) -j3 --output-sync=target lint html pytest-beside-the-build
	$(MAKE) pytest PYTEST_SKIP="--deselect $(BESIDE_THE_BUILD)"

serve: $(READY)
	@test -f $(BUILD)/html/index.html || $(MAKE) html
	@echo "Serving $(BUILD)/html at http://$(HOST):$(PORT)/  (Ctrl-C to stop)"
	$(PY) -m http.server --bind $(HOST) --directory $(BUILD)/html $(PORT)

# The last run's results move to $(BUILD)/bench-previous; a run that has them ends by
# comparing its verdicts with theirs: two runs on one machine should reach the same ones.
# The speed page runs 6 rounds at 256 MB, in about the time 3 took at 512 MB: on 2026-12-06
# here, three 6-round runs at each size, the advice's 14 verdicts agreed on 12.7 on average
# between two runs at 256 MB and 10.7 at 512 MB; with 3 rounds (each run's first 3, and
# its last 3), on 11.6 and 10.1. Later, in 11 runs in a row, the stall page's 52 verdicts
# agreed between every two consecutive runs, and the speed page's 17 did once its load
# verdicts came from warm loads (replayed on the first 9 runs' rounds, then run twice).
bench: $(READY)
	rm -rf $(BUILD)/bench-previous && if [ -d $(BUILD)/bench ]; then mv $(BUILD)/bench $(BUILD)/bench-previous; fi
	DCP_RECIPES_BENCH=1 DCP_RECIPES_RESULTS_DIR=$(BUILD)/bench $(PY) -m torch.distributed.run --standalone --nproc-per-node=1 recipes_source/checkpoint_stall_benchmark.py
	DCP_RECIPES_BENCH=1 DCP_RECIPES_SPEED_REPEATS=6 DCP_RECIPES_RESULTS_DIR=$(BUILD)/bench $(PY) -m torch.distributed.run --standalone --nproc-per-node=1 recipes_source/save_load_speed_recipe.py && PYTHONPATH=recipes_source $(PY) -m page_tools.results $(BUILD)/bench/save_load_speed_recipe.json
	if [ -d $(BUILD)/bench-previous ]; then PYTHONPATH=recipes_source $(PY) -m page_tools.results --compare $(BUILD)/bench-previous $(BUILD)/bench; fi

# Not part of `make test` (about 20 minutes here): launches counted for hangs. It runs the
# downloads of the site in $(BUILD)/html, built without executing anything if there is none.
stress: $(READY)
	@test -f $(BUILD)/html/index.html || $(MAKE) html-noplot
	$(PY) tools/stress.py $(STRESS_ARGS)

# Not part of `make test` (about 10 minutes here): real torchrun jobs, one agent or two, a worker
# killed at every restart, counted per way of creating the group. RESTART_TRIALS_ARGS passes
# options (--nodes 2 --ways plain-own-store --survivor frozen --jobs 10).
restart-trials: $(READY)
	$(PY) tools/restart_trials.py $(RESTART_TRIALS_ARGS)

# Every recipe as a plain script, one rank per GPU (DCP_RECIPES_WORLD_SIZE=N for fewer), into
# $(BUILD)/gpu-check/. It needs torch, not Sphinx, and never builds the venv: it runs with PY
# when given on the command line (make gpu-check PY=/usr/bin/python3), else the venv's python
# if there is one, else python3. GPU_CHECK_ARGS passes options (--recipes a,b --timeout 120).
GPU_CHECK_PY = $(if $(or $(filter command line,$(origin PY)),$(wildcard $(PY))),$(PY),python3)

gpu-check:
	@echo "$(GPU_CHECK_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)"
	@PATH='$(SYSTEM_PATH)' $(GPU_CHECK_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

# Not part of `make test` (about 5 minutes a release here, plus its first install): every
# recipe's script download run alone on each torch release of dcp_site.TORCH_VERSIONS, each
# in a venv of its own outside the repository (~/.cache/dcp-recipes/torch-X, kept), at low
# priority; the results go into _versions/results.json (committed), which the site renders.
# TORCH=2.15.0 for one release; CROSS=1: instead, checkpoints saved by each release with a
# venv, loaded by each, three kinds (a model, the same FSDP2-sharded on 2 ranks, a Hugging
# Face export); VERSIONS_ARGS passes options (--recipes a,b --timeout 600 --kinds dtensor,hf).
# The downloads come from $(BUILD)/html, built without executing anything if there is none.
versions:
	@test -n "$(wildcard $(BUILD)/html/_downloads/*/save_load_recipe.py)" || $(MAKE) html-noplot
	nice -n 19 $(PYTHON) tools/versions.py $(if $(TORCH),--torch $(TORCH)) $(if $(CROSS),--cross) $(VERSIONS_ARGS)

clean:
	rm -rf $(BUILD) recipes
