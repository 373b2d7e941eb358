# Two entry points for users: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test protos check-protos lint bench fuzz load test-gpu bench-gpu dashboard clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned, so no dependency can pull another build. Where pip
	# is configured with a local CPU wheel (our CI machines) that is what it takes.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[worker,dev,gateway,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvstash demo

test: $(STAMP) check-protos lint
	$(BIN)/python -m pytest -q

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

# Fails when the committed generated code differs from what the protos produce.
check-protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy kvstash scheduler_svc cache_svc gpu_worker bench scripts
	$(BIN)/python scripts/gen_dashboard.py --check

# The Grafana dashboard (helm/kvstash/files/grafana-dashboard.json) from
# scripts/gen_dashboard.py, and docs/dashboard.png drawn from a real run.
dashboard: $(STAMP)
	$(BIN)/python scripts/gen_dashboard.py
	$(BIN)/python -m bench.dashboard_snapshot --out docs/dashboard.png

bench: $(STAMP)
	$(BIN)/python -m bench

# Every RPC of every service, 10,000 hypothesis examples each, against real
# processes (CI runs 25 each as part of make test).
fuzz: $(STAMP)
	KVSTASH_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q --timeout=0 tests/integration/test_fuzz.py

# A bounded load test on loopback: 32 streaming clients below the scheduler's
# queue limit, then 96 (a flood above it), 30 s each; requests/s, TTFT and TPOT
# p50/p99, errors by status code, peak RSS and CPU per service. Fails if the
# steady phase sees any error or the flood any code but RESOURCE_EXHAUSTED.
# CI runs a short version (tests/integration/test_load.py).
load: $(STAMP)
	$(BIN)/python -m bench.load_test --clients 32 --duration 30

# On a CUDA machine: the tests marked gpu (batch invariance, the preemption
# oracle and sampling on the device, in bf16, the arena's pinned DMA), then the
# worker benchmark on a random-weight Llama-3.2-1B-shaped checkpoint and the KV
# transfer benchmark (offload + restore through the arena vs raw D2H + H2D, for
# 1B and 8B KV shapes), mixed vs P/D and offload vs recompute on the 1B shape:
# each step runs even if one before it failed (scripts/gpu_checks.sh). Without
# CUDA the tests skip. On a lent machine without network, with its own
# python3: scripts/device_wheels.sh here, then scripts/device_run.sh there.
test-gpu: $(STAMP)
	scripts/gpu_checks.sh $(BIN)/python versions tests

bench-gpu: $(STAMP)
	scripts/gpu_checks.sh $(BIN)/python all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
