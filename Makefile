# Set-up and the two everyday commands: `make demo` trains the built-in example,
# `make test` runs the test suite. Both create .venv/ on first use.
VENV       ?= .venv
PYTHON     ?= python3
# A pinned CPU build of torch is installed first: a bare `torch` requirement would pull a
# CUDA build of several GB. Override with e.g. `make test TORCH_SPEC='torch==2.5.1'`.
TORCH_SPEC ?= torch==2.13.0
PY          = $(VENV)/bin/python
STAMP       = $(VENV)/.leantrain-installed

.PHONY: install demo test test-slurm test-gpu mutate lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null && echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,hf,mlflow,wandb]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/leantrain fit

# Lint first (cheap), then the suite on TEST_WORKERS processes (pytest-xdist: while one test
# starts its interpreters or waits on a launch, another uses the CPU; `worksteal`, so that an
# idle worker takes tests queued on a busy one instead of waiting), then the tests marked
# `serial` alone (they measure time), collected from the test files that name the marker (collecting
# every file again costs that part 5 s). pytest exits 5 when it collected no test: that is a
# failure, not a pass (the serial part may select none). The `slurm` tests run in `make test-slurm`.
# The byte-code is written first: where PYTHONDONTWRITEBYTECODE is set (CI machines, containers) Python
# writes none, and each of the hundreds of processes the tests start would compile leantrain again.
# The workers and the ranks they launch share the cores by design: OpenMP's threads there wait for each
# other asleep (OMP_WAIT_POLICY=PASSIVE unless set) instead of spinning on the CPU the others need, which
# took 2-3x the CPU of an in-process test file. The serial part runs alone and keeps the default.
TEST_WORKERS ?= 2
SERIAL_TEST_FILES = $(shell grep -rlw serial tests --include='test_*.py')
test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	@$(PY) -m compileall -q src tests
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not serial and not slurm" $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; \
	  $(PY) -m pytest -m serial $(SERIAL_TEST_FILES) $(PYTEST_ARGS); serial=$$?; \
	  if [ $$serial -ne 0 ] && [ $$serial -ne 5 ]; then exit $$serial; fi; exit $$rc

# The tests against a real SLURM (tests/slurm, about 2 min): Debian's SLURM and munge are installed
# when missing (needs root and apt), a one-node cluster starts on this machine, and the tests run;
# they skip, saying why, where SLURM cannot start.
SLURM_PACKAGES = slurmctld slurmd slurm-client munge
test-slurm: $(STAMP)
	@command -v slurmctld >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $(SLURM_PACKAGES)) >/dev/null 2>&1 || echo "warning: SLURM could not be installed; its tests will be skipped"
	$(PY) -m pytest -m slurm -s -rs $(PYTEST_ARGS) tests/slurm

# The tests marked `cuda` (skipped without a GPU; `make test` runs them too where one exists).
# Results on a GPU machine go to benchmarks/results/gpu.md.
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda -q -rs $(PYTEST_ARGS)

# The mutation check (tests/MUTATION.md): each line of every module changed one at a time; the tests
# that reach it must fail. Slow, not part of `make test` or CI. Incremental: only the mutants of code
# changed since the last run, or reached by tests changed since then. `make mutate MUTANTS='leantrain.log.*'`
# checks those modules; `make mutate FULL=1` runs every mutant again from an empty mutants/ folder.
MUTANTS ?=
FULL ?=
mutate: $(STAMP)
	$(PY) -m pip install --quiet -e ".[mutate]"
	$(PY) tests/mutation_run.py $(if $(FULL),--full) $(MUTANTS)

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
	rm -rf $(VENV) runs .pytest_cache mutants
