# mmcast build, test and run targets. Every target installs what it needs.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTEST_TIMEOUT ?= 300
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml client/pyproject.toml | sha256sum | cut -c1-12)
PROTOS := $(wildcard proto/mmcast/v1/*.proto)

.PHONY: install oracle-install proto proto-baseline proto-check lint test test-fast demo bench bench-quick bench-aiperf bench-peer bench-peer-quick peer-install soak fuzz chaos tools clean

install: $(STAMP)

$(STAMP): pyproject.toml client/pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 comes from local disk; anything else pulls CUDA builds.
	$(BIN)/pip install -q "torch==2.13.0"
	# Both distributions, editable, in one pip call so the server's mmcast-client requirement is this checkout.
	$(BIN)/pip install -q -e ./client -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

# Generated code lives in mmcast/v1 (committed). One target produces it from proto/.
proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch mmcast/__init__.py mmcast/v1/__init__.py

proto-check: install
	@tmp=$$(mktemp -d) && \
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp $(PROTOS) && \
	for f in $$tmp/mmcast/v1/*; do \
	  cmp -s $$f mmcast/v1/$$(basename $$f) || { echo "stale generated code: mmcast/v1/$$(basename $$f) (run make proto)"; rm -rf $$tmp; exit 1; }; \
	done; \
	for f in mmcast/v1/*_pb2*.py*; do test -e $$tmp/$$f || { echo "generated file without a proto: $$f"; rm -rf $$tmp; exit 1; }; done; \
	rm -rf $$tmp; echo "generated code is current"

# The proto contract: buf's STANDARD lint rules, and no breaking change against the committed baseline image
# (proto/baseline.json). A deliberate breaking change regenerates the baseline with `make proto-baseline`.
lint: install tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy tests/typing_checks
	$(BIN)/python scripts/check_client_surface.py
	.tools/bin/buf lint proto
	.tools/bin/buf breaking proto --against proto/baseline.json

proto-baseline: tools
	.tools/bin/buf build proto --exclude-source-info -o proto/baseline.json

# Tools the deployment and observability checks use (helm, promtool, prometheus, grpcurl, kubernetes-validate).
tools: install
	bash scripts/install-tools.sh

# The video tests' reference: transformers' own video processors, with torchvision's Python part, in .venv-oracle
# (test-only; about a minute from the local wheels, then skipped by its stamp). The tests install it themselves too.
oracle-install:
	bash scripts/install-oracle-venv.sh .venv-oracle

test: install tools oracle-install proto-check lint
	$(BIN)/python -m pytest -q --timeout=$(PYTEST_TIMEOUT) tests

test-fast: install oracle-install
	$(BIN)/python -m pytest -q --timeout=$(PYTEST_TIMEOUT) -m "not slow" tests

demo: install
	$(BIN)/mmcast demo

bench: install
	$(BIN)/python -m benchmarks.run --full

bench-quick: install
	$(BIN)/python -m benchmarks.run --quick

# A benchmark client written elsewhere: AIPerf in its own venv (never the project's, never in `make test`), a multimodal
# chat load against serve-local on the tiny model, then the same load through the SDK (benchmarks/http_api/aiperf_load.py).
AIPERF_VENV := .venv-aiperf
AIPERF_VERSION ?= 0.13.0
AIPERF_MODEL := benchmarks/results/.model/mmcast-tiny
AIPERF_ARGS ?=

$(AIPERF_VENV)/.installed-$(AIPERF_VERSION):
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(AIPERF_VENV)/bin/python || $(PY) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q "aiperf==$(AIPERF_VERSION)"
	rm -f $(AIPERF_VENV)/.installed-* && touch $@

bench-aiperf: install $(AIPERF_VENV)/.installed-$(AIPERF_VERSION)
	$(BIN)/mmcast make-tiny-model $(AIPERF_MODEL)
	$(BIN)/python -m benchmarks.http_api.aiperf_load --aiperf $(AIPERF_VENV)/bin/aiperf --model-dir $(AIPERF_MODEL) $(AIPERF_ARGS)

# Beside vLLM (benchmarks/peer/compare.py): vLLM's CPU build in its own .venv-peer (it pins another transformers), then
# vLLM, mmcast TP1 and TP2 in turn on one random Qwen2-VL with 64-wide heads. Quick: <= 10 min after the installs.
peer-install:
	bash scripts/install-vllm-peer.sh .venv-peer

bench-peer-quick: install peer-install
	$(BIN)/python -m benchmarks.peer.compare --quick

bench-peer: install peer-install
	$(BIN)/python -m benchmarks.peer.compare --full --profile

soak: install
	$(BIN)/python -m pytest -q --timeout=3600 -m soak tests --run-soak

fuzz: install
	$(BIN)/python -m pytest -q --timeout=3600 -m fuzz tests --run-fuzz

# Network faults (docs/RELIABILITY.md, "Network faults"): every test of these modules, the long ones (`chaos` marker)
# included; each process in its own network namespace, so it needs root (skipped otherwise). One NETFAULT line per
# fault; MMCAST_SOAK_REPORT=path collects them as JSON lines.
CHAOS_TESTS := tests/faults/test_net_partitions.py tests/faults/test_net_transfer_modes.py tests/faults/test_net_envoy.py \
  tests/faults/test_http_door.py
chaos: install
	$(BIN)/python -m pytest -q -s --timeout=1200 --run-chaos $(CHAOS_TESTS)

clean:
	rm -rf $(VENV) $(AIPERF_VENV) .venv-peer .venv-oracle .pytest_cache .ruff_cache .hypothesis build *.egg-info client/build client/*.egg-info
