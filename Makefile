# Quick start: `make serve` (set up, build the example repository, serve it on
# 127.0.0.1:8000) and `make test` (set up, run the whole test suite).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
REPOSITORY := examples/model_repository

.PHONY: setup serve test lint bench bench-batching bench-pipelines bench-multi-model bench-ray bench-soak bench-compare bench-dali-inception clean

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
	$(PY) benchmarks/http_throughput.py

bench-batching: $(STAMP)
	$(PY) benchmarks/batching.py $(ARGS)

bench-multi-model: $(STAMP)
	$(PY) benchmarks/multi_model.py $(ARGS)

bench-ray: $(STAMP)
	$(PY) benchmarks/ray_scale.py $(ARGS)

bench-soak: $(STAMP)
	$(PY) benchmarks/soak.py $(ARGS)

bench-pipelines: $(REPOSITORY)/.built
	$(PY) benchmarks/pipelines.py --repository $(REPOSITORY) $(ARGS)

bench-dali-inception: $(STAMP)
	$(PY) benchmarks/dali_inception.py $(ARGS)

bench-compare: $(REPOSITORY)/.built
	$(PY) benchmarks/compare.py $(ARGS)

clean:
	rm -rf $(VENV) $(REPOSITORY)
