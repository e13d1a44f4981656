# Set-up and the two everyday commands: `make demo` trains the built-in example,
# `make test` runs the test suite. Both create .venv/ on first use.
VENV       ?= .venv
PYTHON     ?= python3
# A pinned CPU build of torch is installed first: a bare `torch` requirement would pull a
# CUDA build of several GB. Override with e.g. `make test TORCH_SPEC='torch==2.5.1'`.
TORCH_SPEC ?= torch==2.13.0
PY          = $(VENV)/bin/python
STAMP       = $(VENV)/.leantrain-installed

.PHONY: install demo test test-gpu lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null && echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/leantrain fit

# Lint first (cheap), then the suite. pytest exits 5 when it collected no test: that
# is a failure, not a pass.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; exit $$rc

# The tests marked `cuda` (skipped without a GPU; `make test` runs them too where one exists).
# Results on a GPU machine go to benchmarks/results/gpu.md.
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda -q -rs $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/precision.py
	$(PY) benchmarks/data.py
	$(PY) benchmarks/recompute.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/doctor.py
	$(PY) benchmarks/parallelism.py
	$(PY) benchmarks/startup.py

clean:
	rm -rf $(VENV) runs .pytest_cache
