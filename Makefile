# The README's commands. Each target builds its own virtual environment (.venv) on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch==2.13.0 is pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test test-slow torture lint typecheck browser bench docs gpu-check gpu-wheels clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]' $(TORCH)
	touch $(STAMP)

# the demo needs only torch and the package itself (no test extra: moto, lightning, ...)
DEMO_STAMP := $(VENV)/.demo-installed
$(DEMO_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e . $(TORCH)
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/flashckpt demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# The report tests render the HTML report in headless Chromium, which pip cannot install: take
# Debian's package when this user may install packages (root, or sudo without a password);
# otherwise say in one line what to install and stop (the tests never skip for want of it).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make test: installing chromium (Debian package) for the report tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  elif command -v apt-get >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    echo "make test: installing chromium (Debian package) for the report tests"; \
	    sudo -n apt-get update -qq && sudo -n DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "make test: the report tests need Chromium; install it (Debian/Ubuntu: sudo apt-get install chromium) and run make test again" >&2; \
	    exit 1; \
	  fi; \
	  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	    echo "make test: installing chromium failed; install it by hand (sudo apt-get install chromium)" >&2; exit 1; }; }

# The documentation site (mkdocs + material, API reference by mkdocstrings), built offline in
# strict mode (a broken link, anchor or API reference fails) into build/docs/. make test builds
# it as well, in tests/test_docs.py.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/docs

# two pytest workers (pytest-xdist; the tests wait on subprocesses, ranks and disks a lot, so
# two workers overlap that waiting on 2 cores); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
test: lint typecheck browser
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The full torture run (tests/torture): >= 10,000 simulated operations over a fault-injecting
# backend and >= 200 SIGKILLs of real processes; prints the counts at the end. Override the sizes
# with FLASHCKPT_TORTURE_OPS / FLASHCKPT_TORTURE_KILLS / FLASHCKPT_TORTURE_DIST_RUNS (runs of the
# 2-rank distributed torture), replay one seed with FLASHCKPT_TORTURE_SEED.
torture: $(STAMP)
	FLASHCKPT_TORTURE_OPS=$${FLASHCKPT_TORTURE_OPS:-10000} \
	FLASHCKPT_TORTURE_KILLS=$${FLASHCKPT_TORTURE_KILLS:-200} \
	FLASHCKPT_TORTURE_DIST_RUNS=$${FLASHCKPT_TORTURE_DIST_RUNS:-40} \
	$(BIN)/python -m pytest -q -W ignore::RuntimeWarning -W ignore::UserWarning tests/torture

bench: $(STAMP)
	$(BIN)/flashckpt bench

gpu-check:
	bash benchmarks/gpu_check.sh

# Wheels the GPU machine needs but cannot download (it reaches no package index).
gpu-wheels: $(STAMP)
	for v in 3.10 3.11 3.12 3.13; do $(BIN)/pip download -q --only-binary=:all: --python-version $$v \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu_wheels \
	  xxhash zstandard pytest pytest-timeout; done

clean:
	rm -rf $(VENV) build dist *.egg-info
