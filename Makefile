# Every target does its own set-up on a fresh clone: the virtual environment is created and the project installed
# on first use, with requirements.lock as pip's constraints, so every install is the set CI passed with (see `lock`).
# `make quickstart` and `make ui` install the project alone (a laptop's install: no Triton, lm-evaluation-harness,
# servers' or tests' packages); `make setup`, `make test` and the benchmarks add every extra (`dev`).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed

# torch: without a GPU, the lock's CPU build (torch==X+cpu: no multi-GB CUDA build is pulled), from PyTorch's CPU
# index where it answers (pip retries an index it cannot reach for minutes; elsewhere the wheel comes from pip's own
# sources, such as a find-links folder). With a GPU, or off Linux, where PyTorch has no +cpu builds: the locked
# release from PyPI, with the lock's other pins but not torch's and Triton's (the CUDA build requires its own
# Triton), as docker/Dockerfile does.
LOCKED_TORCH := $(shell grep '^torch==' requirements.lock)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
CPU_TORCH := $(if $(shell nvidia-smi -L 2>/dev/null),,$(filter Linux,$(shell uname -s)))
ifeq ($(CPU_TORCH),)
TORCH       := $(firstword $(subst +, ,$(LOCKED_TORCH)))
CONSTRAINTS := $(VENV)/constraints.txt
else
TORCH       := $(LOCKED_TORCH)
CONSTRAINTS := requirements.lock
endif
TORCH_INDEX = $(if $(CPU_TORCH),$$($(PYTHON) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], \
	timeout=10)' $(TORCH_CPU_INDEX) 2>/dev/null && echo --extra-index-url $(TORCH_CPU_INDEX)))

.PHONY: setup test test-fast lint test-latest quickstart ui bench bench-study docs lock image clean

setup: $(STAMP)

$(BASE): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(if $(CPU_TORCH),,grep -v -E '^(torch|triton)==' requirements.lock > $(CONSTRAINTS))
	$(BIN)/pip install --quiet $(TORCH_INDEX) -c $(CONSTRAINTS) $(TORCH)
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e .
	touch $@

$(STAMP): $(BASE)
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

# The full suite, Ray end-to-end and fault tests included (this is what CI runs), in TEST_WORKERS processes
# (pytest-xdist), a test module to each at a time so that a module's Ray cluster and studies are set up once, the
# costliest modules first (tests/conftest.py orders them by their `slow` marks' seconds; xdist's own reordering, by
# number of tests, is off: it handed the long Ray modules out last, and one worker waited on the other). The Ray
# studies wait on process start-up a good part of the time: on two cores the suite took 23 minutes in two workers where
# one took 34 (the same day). Each worker runs its own Ray clusters; every one pins its processes to its own address
# (study/ray_address.py), or Train's placement-group cleaner asks whichever cluster it finds and removes live groups.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest --numprocesses=$(TEST_WORKERS) --dist=loadfile --no-loadscope-reorder --durations=15

# Skip the slow Ray end-to-end and fault tests while developing.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" --numprocesses=$(TEST_WORKERS) --dist=loadfile --no-loadscope-reorder

# The lint alone (the suite runs it too, tests/test_lint.py); `make lint FIX=--fix` applies ruff's safe fixes.
lint: $(STAMP)
	$(BIN)/python -m ruff check $(FIX) .

# The suite on the newest releases pyproject.toml allows, without the lock, in a virtual environment of its own made
# afresh (.venv-latest; torch chosen as for the set-up, its newest release in range): drift is found on purpose, before
# `make lock UPGRADE=--upgrade` takes it in. The lock comparison (tests/test_install.py) is left out: it would only say
# that the set is not the lock's. A part of the suite: make test-latest LATEST_TESTS='-m "not slow"'
LATEST ?= .venv-latest
LATEST_TESTS ?=
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --quiet --upgrade pip
	$(if $(CPU_TORCH),$(LATEST)/bin/pip install --quiet $(TORCH_INDEX) "$$(sed -n 's/^ *"\(torch[<>=].*\)",$$/\1/p' pyproject.toml)")
	$(LATEST)/bin/pip install --quiet -e '.[dev]'
	$(LATEST)/bin/pip list --format=freeze > $(LATEST)/installed.txt
	$(LATEST)/bin/python -m pytest --numprocesses=$(TEST_WORKERS) --dist=loadfile --no-loadscope-reorder --durations=15 \
	    --deselect tests/test_install.py::test_every_locked_distribution_is_installed_at_its_locked_version $(LATEST_TESTS)

# The quickstart study on the embedded default: local Ray, SQLite MLflow store in studies/quickstart, digits.
quickstart: $(BASE)
	$(BIN)/lapstudy run search_spaces/quickstart.yaml
	@echo "Open the MLflow UI with: make ui   (then http://127.0.0.1:5000)"

ui: $(BASE)
	$(BIN)/lapstudy ui studies/quickstart

bench: $(STAMP)
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/stlt.py --threads 1
	$(BIN)/python bench/data.py

# lapstudy against a plain in-process Optuna loop on the same trials (about 10 minutes).
bench-study: $(STAMP)
	$(BIN)/python bench/study_overhead.py

# docs/config.md's key tables, written from the schemas (study/docs.py; tests/test_docs.py fails while they differ).
docs: $(BASE)
	$(BIN)/python -m study.docs

# requirements.lock: the tested set pinned, for Python 3.11 on Linux x86_64 with torch's CPU build and every extra
# (what every set-up above, CI and the cluster image, docker/Dockerfile, install as constraints). Re-run after any edit
# to the dependencies in pyproject.toml: the locked releases that still satisfy it are kept (uv reads the lock as its
# preferences); `make lock UPGRADE=--upgrade` takes the newest of everything (what `make test-latest` tests). uv runs
# from its own small venv (build/uv), not the project's. The torch CPU build comes from PyTorch's CPU index; where
# that index cannot be reached but the wheel is on disk, point at it:
#   make lock TORCH_CPU='--find-links /opt/wheels'
TORCH_CPU ?= --extra-index-url $(TORCH_CPU_INDEX)
UPGRADE ?=
LOCK_COMMAND = uv pip compile pyproject.toml --all-extras --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match --no-header --quiet
lock:
	test -x build/uv/bin/uv || { $(PYTHON) -m venv build/uv && build/uv/bin/pip install --quiet 'uv>=0.9'; }
	cp requirements.lock requirements.lock.tmp
	build/uv/bin/$(LOCK_COMMAND) $(TORCH_CPU) $(UPGRADE) --output-file requirements.lock.tmp
	{ echo "# The tested set: Python 3.11, Linux x86_64, torch's CPU build, every extra of pyproject.toml."; \
	  echo "# Made by \`make lock\` (Makefile), that is, from the repository root:"; \
	  echo "#   $$(echo '$(LOCK_COMMAND) $(TORCH_CPU)' | tr -s ' \t' ' ')"; \
	  echo "# Installed as pip's constraints (-c requirements.lock) by the Makefile's set-up, CI and docker/Dockerfile."; \
	  cat requirements.lock.tmp; } > requirements.lock
	rm requirements.lock.tmp

# The cluster images (docker/Dockerfile), tagged <Ray>-py311-cpu (head, CPU workers) and -gpu (GPU workers) with the
# Ray of requirements.lock. Push both where the nodes pull from: cluster.env's LAPSTUDY_IMAGE / LAPSTUDY_IMAGE_TAG,
# k8s/ through `kustomize edit set image` (docs/cluster.md). For example:
#   make image IMAGE=123456789012.dkr.ecr.us-west-2.amazonaws.com/lapstudy
RAY_VERSION := $(shell sed -n 's/^ray==//p' requirements.lock)
IMAGE ?= lapstudy
IMAGE_TAG ?= $(RAY_VERSION)-py311
image:
	docker build -f docker/Dockerfile --build-arg RAY_VERSION=$(RAY_VERSION) --build-arg FLAVOUR=cpu -t $(IMAGE):$(IMAGE_TAG)-cpu .
	docker build -f docker/Dockerfile --build-arg RAY_VERSION=$(RAY_VERSION) --build-arg FLAVOUR=gpu -t $(IMAGE):$(IMAGE_TAG)-gpu .

clean:
	rm -rf $(VENV) $(LATEST) studies .pytest_cache
