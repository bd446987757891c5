# The two commands: `make demo` (train the demo end to end) and `make test` (run the tests).
# Both create .venv first when it is missing or out of date (scripts/setup.sh).
PY := .venv/bin/python
export OMP_NUM_THREADS := 1
# The venv is installed without bytecode (scripts/setup.sh); each module is compiled on its first
# import and its bytecode kept. Where PYTHONDONTWRITEBYTECODE is set, every process of every run
# would compile its imports again (torch, vLLM: ~10 s each).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-fast test-gpu docs clean
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m asyncrl.cli train configs/demo.yaml $(ARGS)

# Two workers, whole modules at a time, longest first, heavy tests kept apart (tests/scheduling.py);
# ARGS="-n 0" runs in one process.
WORKERS := -n 2 --dist loadscope --no-loadscope-reorder

test: setup
	$(PY) -m pytest -q $(WORKERS) $(ARGS)

# Everything but the tests marked slow (real processes, vLLM, DeepSpeed, Ray): ~100 s on 2 cores.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(WORKERS) $(ARGS)

# The tests that need CUDA (never selected otherwise); the NCCL one needs two GPUs.
test-gpu: setup
	$(PY) -m pytest -q -m gpu $(ARGS)

# The documentation site (docs/, mkdocs.yml) into site/; strict: a broken link or an unknown config key fails.
docs: setup
	$(PY) -m mkdocs build --strict -d site

clean:
	rm -rf runs .pytest_cache site
