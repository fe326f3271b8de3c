# Quick start: `make serve` (set up, build the example repository, serve it on
# 127.0.0.1:8000) and `make test` (set up, run the whole test suite).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
REPOSITORY := examples/model_repository

.PHONY: setup serve test lint bench bench-batching bench-pipelines bench-multi-model bench-ray bench-soak bench-compare bench-dali-inception bench-streaming clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(REPOSITORY)/.built: $(STAMP) examples/build_repository.py examples/seed_ensemble.py
	$(PY) examples/build_repository.py $(REPOSITORY)
	touch $@

serve: $(REPOSITORY)/.built
	$(VENV)/bin/quiver serve --model-repository $(REPOSITORY) $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m benchmarks.http_throughput

bench-batching: $(STAMP)
	$(PY) -m benchmarks.batching $(ARGS)

bench-multi-model: $(STAMP)
	$(PY) -m benchmarks.eviction
	$(PY) -m benchmarks.multi_model $(ARGS)

bench-ray: $(STAMP)
	$(PY) -m benchmarks.ray_scale $(ARGS)

bench-soak: $(STAMP)
	$(PY) -m benchmarks.soak $(ARGS)

bench-pipelines: $(REPOSITORY)/.built
	$(PY) -m benchmarks.pipelines --repository $(REPOSITORY) $(ARGS)

bench-dali-inception: $(STAMP)
	$(PY) -m benchmarks.dali_inception $(ARGS)

bench-streaming: $(STAMP)
	$(PY) -m benchmarks.streaming $(ARGS)

bench-compare: $(REPOSITORY)/.built
	$(PY) -m benchmarks.compare $(ARGS)

clean:
	rm -rf $(VENV) $(REPOSITORY)
