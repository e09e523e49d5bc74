# Quickstart: `make run` serves, `make test` tests. Both run `setup` first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test mutation bench-grammar clean

setup: $(STAMP)
	$(PY) -m shared.protogen

# Reinstall only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: it resolves to the local CPU wheel, not a CUDA download.
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	# The services, the gateway, the benchmarks and the tests: what `make run` and `make test` use.
	$(PY) -m pip install --quiet --no-compile -e '.[inference,gateway,bench,test]'
	# The bytecode pip would write, on every core rather than one file at a time (every process reads it: where
	# PYTHONDONTWRITEBYTECODE is set nothing compiled at import is kept). torch ships one helper for a newer
	# Python, left out as pip leaves it; any other failure is said (uncompiled, every process compiles it again).
	$(PY) -m compileall -q -j 0 -x '/torch/testing/_internal/py312_intrinsics\.py$$' $(VENV)/lib \
	  > $(VENV)/compileall.log || echo "warning: some installed files did not byte-compile: see $(VENV)/compileall.log"
	touch $(STAMP)

run: setup
	$(VENV)/bin/structd up

# Two workers, each taking whole files: a module's servers start once, on the worker that runs it
# (a session fixture's start once per worker). Files are handed out in collection order, which
# tests/scheduling.py makes longest first. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Mutation testing of the critical modules (docs/mutation.md); MUTATION_ARGS='--only shared/status.py' for one.
mutation: setup
	$(PY) -m pip install --quiet -e '.[mutation]'
	$(PY) scripts/mutation/run $(MUTATION_ARGS)

bench-grammar: setup
	$(VENV)/bin/structd bench grammar

clean:
	rm -rf $(VENV) shared/gen .pytest_cache
