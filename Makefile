# pdserve: `make serve` (installs on first use) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch 2.13.0 (CPU build) is what this machine's pip serves from disk; a bare `torch` would pull CUDA.
TORCH  ?= torch==2.13.0

.PHONY: install serve lint test bench-kv bench-router clean

# SGLang's import-only dependencies for the live plugin test, kept apart from the venv's site-packages
# (tests/sglang_live_requirements.txt says why).
SGLANG_LIVE := $(VENV)/sglang-live

install: $(VENV)/.installed $(SGLANG_LIVE)/.installed

# Debian packages when root: Mooncake's libraries, and prometheus (with promtool) for the monitoring
# tests, which start their own Prometheus; RUNLEVEL=1 keeps the package's own service from starting.
$(VENV)/.installed: pyproject.toml
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  dpkg -s libibverbs1 librdmacm1 libnuma1 prometheus >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
	    libibverbs1 librdmacm1 libnuma1 prometheus); \
	fi
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[cpu,dev,monitoring]"
	# The pinned SGLang (pyproject's gpu extra) without its GPU dependencies: contract tests parse our
	# command lines with its own argument parser.
	$(PIP) install -q --no-deps "$$($(PY) -c 'from pd.commands.sglang import pinned_sglang_requirement as r; print(r())')"
	touch $@

$(SGLANG_LIVE)/.installed: tests/sglang_live_requirements.txt $(VENV)/.installed
	rm -rf $(SGLANG_LIVE)
	$(PIP) install -q --no-deps --target $(SGLANG_LIVE) -r tests/sglang_live_requirements.txt
	touch $@

serve: install
	$(VENV)/bin/pdserve up $(CONFIG)

# ruff's config is pyproject's [tool.ruff]; `make test` lints first.
lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q tests

bench-kv: install
	$(PY) benchmarks/kv_transfer.py

# Router vs SGLang's Rust gateway and mini_lb (benchmarks/router.py). Its contenders and load generator
# are installed for the benchmark only, never as project dependencies: Debian's wrk, and PyPI
# sglang-router (+ setproctitle, which its launcher imports) and py-spy (the profile) into the
# git-ignored .bench/.
SGLANG_ROUTER ?= sglang-router==0.3.2
bench-router: install
	@command -v wrk >/dev/null || { [ "$$(id -u)" = "0" ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk); } || \
	  { echo "bench-router needs wrk: apt-get install wrk"; exit 1; }
	test -f .bench/sglang-router/sglang_router/launch_router.py || \
	  $(PIP) install -q --no-deps --target .bench/sglang-router "$(SGLANG_ROUTER)" setproctitle
	test -x $(VENV)/bin/py-spy || test -x .bench/tools/bin/py-spy || \
	  $(PIP) install -q --no-deps --target .bench/tools py-spy
	$(PY) benchmarks/router.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
