# pdserve: `make serve` (installs on first use) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch 2.13.0 (CPU build) is what this machine's pip serves from disk; a bare `torch` would pull CUDA.
TORCH  ?= torch==2.13.0

.PHONY: install lock serve lint typecheck test test-fast bench-kv bench-router clean

# SGLang's import-only dependencies for the live plugin test, kept apart from the venv's site-packages
# (tests/sglang_live_requirements.txt says why).
SGLANG_LIVE := $(VENV)/sglang-live

install: $(VENV)/.installed $(SGLANG_LIVE)/.installed

# Debian packages when root: Mooncake's libraries, and prometheus (with promtool) for the monitoring
# tests, which start their own Prometheus; RUNLEVEL=1 keeps the package's own service from starting.
# The environment is locks/cpu.txt exactly (locks/README.md; `make lock` refreshes it): torch from $(TORCH) first (the
# lock holds none), its pure-Python dependencies at the lock's pins; then the lock without dependencies, the project
# without dependencies, and pip check, which fails where the lock does not meet pyproject or the torch build.
$(VENV)/.installed: pyproject.toml locks/cpu.txt
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  dpkg -s libibverbs1 librdmacm1 libnuma1 prometheus >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
	    libibverbs1 librdmacm1 libnuma1 prometheus); \
	fi
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)" -c locks/cpu.txt
	# pip check judges the lock, not the SGLang installed below without its dependencies: a previous one goes first.
	$(PIP) uninstall -q -y sglang 2>/dev/null || true
	$(PIP) install -q --no-deps -r locks/cpu.txt
	# (setuptools tells every editable install to beware of same-named folders: ours are handled, docs/design.md)
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -q --no-deps -e .
	$(PIP) check
	# The pinned SGLang (pyproject's gpu extra) without its GPU dependencies: contract tests parse our
	# command lines with its own argument parser.
	$(PIP) install -q --no-deps "$$($(PY) -c 'from pd.commands.sglang import pinned_sglang_requirement as r; print(r())')"
	touch $@

$(SGLANG_LIVE)/.installed: tests/sglang_live_requirements.txt $(VENV)/.installed
	rm -rf $(SGLANG_LIVE)
	$(PIP) install -q --no-deps --target $(SGLANG_LIVE) -r tests/sglang_live_requirements.txt
	touch $@

# Refreshes locks/cpu.txt and locks/gpu.txt (locks/README.md) to the newest releases pyproject admits; `make lock
# LOCK_ARGS=` keeps each pin that still fits, `LOCK_ARGS="-P transformers"` moves one package. uv resolves for Linux
# x86_64 / CPython 3.11 whatever machine runs it; it is installed for this only, into the git-ignored .tools/.
UV_VERSION ?= 0.13.9
UV := .tools/uv/bin/uv
LOCK_ARGS ?= --upgrade
lock:
	$(UV) --version 2>/dev/null | grep -q "^uv $(UV_VERSION) " || \
	  { rm -rf .tools/uv && $(PYTHON) -m pip install -q --target .tools/uv "uv==$(UV_VERSION)"; }
	$(UV) pip compile pyproject.toml --extra cpu --extra dev --extra monitoring --extra bench \
	  -c locks/cpu-constraints.txt --excludes locks/cpu-excludes.txt --no-emit-package torch \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 $(LOCK_ARGS) -o locks/cpu.txt
	# sglang 0.5.23 ships manylinux_2_34 wheels only, hence glibc 2.34 here.
	$(UV) pip compile pyproject.toml --extra gpu --extra monitoring --extra bench \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_34 $(LOCK_ARGS) -o locks/gpu.txt

serve: install
	$(VENV)/bin/pdserve up $(CONFIG)

# ruff's config is pyproject's [tool.ruff]; `make test` lints first.
lint: install
	$(VENV)/bin/ruff check .

# mypy (pyproject's [tool.mypy]) on the packages below. It cannot see the editable install's import hook, so it reads
# a tree of links laid out as installed: pd/ plus the top-level folders pyproject's package-dir maps under pd.
TYPECHECKED := -p pd.router -p pd.util -p pd.engines -m pd.config
typecheck: install
	rm -rf .typecheck/pd && mkdir -p .typecheck/pd
	for f in pd/*; do ln -s ../../$$f .typecheck/pd/; done
	for d in router kernels monitoring deploy; do ln -s ../../$$d .typecheck/pd/$$d; done
	cd .typecheck && ../$(PY) -m mypy --config-file ../pyproject.toml $(TYPECHECKED)

# Two xdist workers (conftest.py: a module stays on one worker, the Ray and namespace modules run in turn on one);
# `make test TEST_WORKERS=0` runs in one process. test-fast: no Ray, no namespaces, nothing slow, for the edit loop.
TEST_WORKERS ?= 2
test: lint typecheck
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=10 tests

test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not cluster and not slow" tests

bench-kv: install
	$(PY) benchmarks/kv_transfer.py

# Router vs SGLang's Rust gateway and mini_lb, and the Shepherd Model Gateway (benchmarks/router.py). Its
# contenders and load generator are installed for the benchmark only, never as project dependencies: Debian's
# wrk, and PyPI sglang-router and smg (each + setproctitle, which their launchers import) and py-spy (the
# profile) into the git-ignored .bench/.
SGLANG_ROUTER ?= sglang-router==0.3.2
SMG ?= smg==1.13.0
bench-router: install
	@command -v wrk >/dev/null || { [ "$$(id -u)" = "0" ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk); } || \
	  { echo "bench-router needs wrk: apt-get install wrk"; exit 1; }
	test -f .bench/sglang-router/sglang_router/launch_router.py || \
	  $(PIP) install -q --no-deps --target .bench/sglang-router "$(SGLANG_ROUTER)" setproctitle
	test -f .bench/smg/smg/launch_router.py || \
	  $(PIP) install -q --no-deps --target .bench/smg "$(SMG)" setproctitle
	test -x $(VENV)/bin/py-spy || test -x .bench/tools/bin/py-spy || \
	  $(PIP) install -q --no-deps --target .bench/tools py-spy
	$(PY) benchmarks/router.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
