# Both targets do all of their own set-up on a fresh machine: .venv, torch (pinned CPU wheel), the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
UV := $(VENV)/bin/uv
UV_FLAGS := -q --python $(PY)
# Bytecode is written lazily, by the first process that imports a module, for every recipe (CI sets
# PYTHONDONTWRITEBYTECODE, under which the suite's hundreds of processes would each compile torch anew).
# Compiling the whole environment at install time instead (uv --compile-bytecode) cost ~70 s of CPU on the
# 2-core VM, most of it for modules no test imports; lazily, the first import of torch + DCP + Lightning
# pays ~13 s once (measured in tests/torture/README.md).
unexport PYTHONDONTWRITEBYTECODE
WHEELS := $(VENV)/.wheels
LINT_PATHS := $(wildcard src tests benchmarks examples)
# Test processes side by side (pytest-xdist); each test file stays on one worker (module fixtures run once).
# Files are handed out longest first (tests/conftest.py LONG_FIRST; --no-loadscope-reorder keeps that
# order, which xdist would otherwise re-sort by each file's number of tests). Three on two cores: a worker
# spends much of its time waiting on the processes, pipes, disks and emulators its tests drive, and two
# left a core idle a third of the run (pytest used ~1.3 cores on average); measured on the 2-core VM in
# tests/torture/README.md ("The default suite").
TEST_WORKERS ?= 3
# The set-up side by side (the venv's install beside Azurite's), then the checks beside the suite: the
# suite's workers wait on processes, pipes and disks a good share of the time, and mypy (~80 s of one core,
# cold) fills that instead of running before the suite's first test (measured in tests/torture/README.md).
# A failed check still fails `make test`. (No --output-sync: it would hold back the suite's progress
# until its end.) Five: Azurite's install, the three checks and the suite all at once; with four the suite
# waited for a slot until lint ended.
MAKEFLAGS += --jobs=5

TOOLS := .tools
AZURITE_STAMP := $(TOOLS)/.azurite-3.37.0

.PHONY: test suite demo lint typecheck docs bench slow clean tools

$(STAMP): pyproject.toml constraints-dev.txt requirements-dev.lock requirements-torchtitan.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv installs the locked environment: about 4x faster than pip on 2 cores (parallel unpacking and
	# bytecode compilation; measured in tests/torture/README.md). pip only bootstraps uv and fetches torch's
	# wheel, because pip's configuration (find-links to the CPU wheel on disk) decides where torch comes
	# from, and uv does not read pip's configuration.
	$(PY) -m pip install -q -c constraints-dev.txt uv
	rm -rf $(WHEELS) && $(PY) -m pip download -q --no-deps -c constraints-dev.txt -d $(WHEELS) torch==2.13.0
	$(UV) pip install $(UV_FLAGS) -c constraints-dev.txt $(WHEELS)/torch-*.whl -r requirements-dev.lock
	# --no-deps: torchtitan's declared deps (datasets, wandb, ...) are not used here (requirements-torchtitan.lock).
	$(UV) pip install $(UV_FLAGS) -c constraints-dev.txt --no-deps -r requirements-torchtitan.lock
	$(UV) pip install $(UV_FLAGS) --no-deps -e .
	rm -rf $(WHEELS)
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml) into site/: strict, so a broken link, a page missing from the nav or
# an API reference that no longer resolves fails it. `make test` builds it (about 15 s). Never --quiet:
# mkdocs then drops the warnings before strict mode counts them, and a broken link passed for weeks.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Azurite (the Azure Blob emulator) for the az:// tests, from npm; tests skip az:// without it (or node).
# `make test` installs it beside the venv and the suite instead of before the suite (npm's ~40 s of CPU
# were the longest part of the set-up): while AZURITE_PENDING stands, the az:// fixture waits for it
# (tests/helpers/stores.py), so no az:// test is skipped for having come early.
AZURITE_PENDING := $(TOOLS)/.azurite-installing
$(AZURITE_STAMP):
	mkdir -p $(TOOLS) && touch $(AZURITE_PENDING)
	(command -v npm >/dev/null && npm install -s --no-audit --no-fund --prefix $(TOOLS) azurite@3.37.0 \
		&& touch $(AZURITE_STAMP) || echo "no npm: az:// tests will be skipped"); rm -f $(AZURITE_PENDING)

tools: $(AZURITE_STAMP)

test: lint typecheck docs tools suite

# Bytecode for the package and the tests first, so the test workers do not each compile them; beside it,
# one collection without workers, so that what every worker's collection imports (torch, DCP, numpy, ...)
# is compiled once and pytest's assertion rewriting of each test module is written once: the three workers
# start together and would each compile torch (~13 s of CPU each; the xdist controller no longer imports
# torch, so it is no longer the first importer). Not after `tools`: Azurite installs beside the suite.
suite: $(STAMP)
	$(VENV)/bin/pytest -q --collect-only -p no:xdist >/dev/null & \
		$(PY) -m compileall -q -j 0 src tests examples benchmarks >/dev/null; wait
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

slow: $(STAMP) tools
	$(VENV)/bin/pytest -q -m slow

demo: $(STAMP)
	$(VENV)/bin/safepoint demo

bench: $(STAMP)
	$(VENV)/bin/safepoint bench

clean:
	rm -rf $(VENV) $(TOOLS) .mypy_cache .ruff_cache .pytest_cache demo-out bench-out site
