# Two entry points (see README): `make serve` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
PORT ?= 30000

.PHONY: serve check test bench setup system-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build,
# while this version is the CPU wheel the machines have locally.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenpipe serve --port $(PORT) $(ARGS)

# The metrics tests run a real Prometheus server and promtool (Debian package). Without
# root or apt they skip on a laptop; in CI (CI=true) they fail instead.
system-deps:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
		else echo "note: prometheus/promtool missing and cannot apt-get install them; their tests will skip"; fi; \
	fi

# The gate the tests stand behind: layout, lint, then types (all configured in pyproject.toml).
check: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: check system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/output_path.py

clean:
	rm -rf $(VENV) build *.egg-info
