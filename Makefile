# Every target does its own set-up on a fresh clone: the virtual environment is created and the project
# installed on first use (CPU torch first when no GPU is present, so no multi-GB CUDA build is pulled).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test test-fast quickstart ui bench bench-study lock image clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "GPU found: keeping the default (CUDA) torch build"; \
	else \
	    echo "No GPU: installing the CPU build torch==2.13.0"; \
	    $(BIN)/pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The full suite, Ray end-to-end and fault tests included (this is what CI runs), in TEST_WORKERS processes
# (pytest-xdist), a test module to each at a time so that a module's Ray cluster and studies are set up once. The Ray
# studies wait on process start-up a good part of the time: on two cores the suite took 23 minutes in two workers where
# one took 34 (the same day). Each worker runs its own Ray clusters; every one pins its processes to its own address
# (study/ray_address.py), or Train's placement-group cleaner asks whichever cluster it finds and removes live groups.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest --numprocesses=$(TEST_WORKERS) --dist=loadfile --durations=15

# Skip the slow Ray end-to-end and fault tests while developing.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" --numprocesses=$(TEST_WORKERS) --dist=loadfile

# The quickstart study on the embedded default: local Ray, SQLite MLflow store in studies/quickstart, digits.
quickstart: $(STAMP)
	$(BIN)/lapstudy run search_spaces/quickstart.yaml
	@echo "Open the MLflow UI with: make ui   (then http://127.0.0.1:5000)"

ui: $(STAMP)
	$(BIN)/lapstudy ui studies/quickstart

bench: $(STAMP)
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/stlt.py --threads 1
	$(BIN)/python bench/data.py

# lapstudy against a plain in-process Optuna loop on the same trials (about 10 minutes).
bench-study: $(STAMP)
	$(BIN)/python bench/study_overhead.py

# requirements.lock: the tested set pinned, for Python 3.11 on Linux x86_64 with torch's CPU build and every extra
# (what CI installs, and the constraints the cluster image is built with: docker/Dockerfile). Re-run after any edit to
# the dependencies in pyproject.toml. uv runs from its own small venv (build/uv), not the project's. The torch CPU
# build comes from PyTorch's CPU index; where that index cannot be reached but the wheel is on disk, point at it:
#   make lock TORCH_CPU='--find-links /opt/wheels'
TORCH_CPU ?= --extra-index-url https://download.pytorch.org/whl/cpu
LOCK_COMMAND = uv pip compile pyproject.toml --all-extras --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match --no-header --quiet
lock:
	test -x build/uv/bin/uv || { $(PYTHON) -m venv build/uv && build/uv/bin/pip install --quiet 'uv>=0.9'; }
	{ echo "# The tested set: Python 3.11, Linux x86_64, torch's CPU build, every extra of pyproject.toml."; \
	  echo "# Made by \`make lock\` (Makefile), that is, from the repository root:"; \
	  echo "#   $$(echo '$(LOCK_COMMAND) $(TORCH_CPU)' | tr -s ' \t' ' ')"; \
	  echo "# Install: pip install -r requirements.lock --extra-index-url https://download.pytorch.org/whl/cpu"; \
	  build/uv/bin/$(LOCK_COMMAND) $(TORCH_CPU); } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock

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
	rm -rf $(VENV) studies .pytest_cache
