# Every target does its own set-up on a fresh clone: the virtual environment is created and the project
# installed on first use (CPU torch first when no GPU is present, so no multi-GB CUDA build is pulled).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test test-fast quickstart ui bench bench-study clean

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

# The full suite, Ray end-to-end and fault tests included (this is what CI runs).
test: $(STAMP)
	$(BIN)/python -m pytest --durations=15

# Skip the slow Ray end-to-end and fault tests while developing.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

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

clean:
	rm -rf $(VENV) studies .pytest_cache
