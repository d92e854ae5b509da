# swarmloco developer commands. `make demo` and `make test` work on a fresh machine:
# both depend on `install`, which builds .venv once (and again when the pins change).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test protos clean

install: $(STAMP)

# torch==2.13.0 is pinned so pip takes the local CPU wheel instead of pulling CUDA packages.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/python -m peer.cli.demo --config configs/demo.toml

# Lint and type checks first (seconds), then the tests.
test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q tests

# Regenerate peer/proto/*_pb2.py from protos/*.proto (a test fails when they are stale).
protos: install
	$(BIN)/python -m peer.proto.build

clean:
	rm -rf $(VENV) build *.egg-info
