# swarmloco developer commands. `make demo` and `make test` work on a fresh machine:
# both depend on `install`, which builds .venv once (and again when the pins change).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install os-packages demo test bench-gpu protos clean

install: $(STAMP)

# torch==2.13.0 is pinned so pip takes the local CPU wheel instead of pulling CUDA packages.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,hf]'
	touch $(STAMP)

demo: install
	$(BIN)/python -m peer.cli.demo --config configs/demo.toml

# Debian packages some tests need, when missing: chromium and chromedriver for the monitor's browser test
# (tests/test_control_swarm.py), iptables for the home routers of the NAT test (tests/test_nat.py). As root
# through apt (its package lists refreshed only if the first try fails); elsewhere those tests say they skip.
OS_PACKAGES = chromium chromium-driver iptables
os-packages:
	@{ test -x /usr/bin/chromedriver && command -v iptables > /dev/null; } || \
	  { test "$$(id -u)" = 0 && command -v apt-get > /dev/null && \
	  { apt-get install -y -q $(OS_PACKAGES) > /dev/null || \
	    { apt-get update -q > /dev/null && apt-get install -y -q $(OS_PACKAGES) > /dev/null; }; }; } || \
	  echo "note: could not apt install $(OS_PACKAGES): the browser and NAT tests will skip"

# Lint and type checks first (seconds), then the tests: those of one process on every core (pytest-xdist), then
# the swarm tests (`-m swarm`: each runs several processes) two modules at a time, the load bench/flaky.py
# checks them under (docs/benchmarks.md, "One digest for every applied round").
test: install os-packages
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=10 -n auto -m "not swarm" tests
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder -m swarm tests

# Everything that needs a GPU in one run (step overhead vs a plain loop, MFU, VRAM, host RAM, codec, CUDA
# tests); on a machine without CUDA it says so. The CPU comparison: bench/gpu.py --device cpu (docs/benchmarks.md).
bench-gpu: install
	$(BIN)/python bench/gpu.py

# Regenerate peer/proto/*_pb2.py from protos/*.proto (a test fails when they are stale).
protos: install
	$(BIN)/python -m peer.proto.build

clean:
	rm -rf $(VENV) build *.egg-info
