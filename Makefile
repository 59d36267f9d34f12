# Two entry points (see README): `make serve` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
PORT ?= 30000
# Claude Code, the real client tests/e2e/test_anthropic_messages.py drives (npm, offline);
# pinned, since the fields it sends change between releases.
NODE_DIR := .node
CLAUDE_CODE_VERSION := 2.1.197
CLAUDE_CODE_STAMP := $(NODE_DIR)/.installed-$(CLAUDE_CODE_VERSION)

.PHONY: serve check test bench setup system-deps node-deps clean

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

# Without npm the Claude Code test skips on a laptop; in CI (CI=true) it fails instead.
node-deps:
	@if [ -f $(CLAUDE_CODE_STAMP) ]; then :; \
	elif command -v npm >/dev/null; then \
		npm install --prefix $(NODE_DIR) --no-fund --no-audit --loglevel=error \
			@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) && touch $(CLAUDE_CODE_STAMP); \
	else echo "note: npm missing; the Claude Code test will skip"; fi

# The gate the tests stand behind: layout, lint, then types (all configured in pyproject.toml).
check: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: check system-deps node-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/output_path.py

clean:
	rm -rf $(VENV) $(NODE_DIR) build *.egg-info
