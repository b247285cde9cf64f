# Set-up and run targets. Each works on a fresh machine with Python >= 3.10: no Redis, no Docker.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: up check test bench clean

$(BIN)/splitbus: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench,paddle]'
	touch $@

## Run the whole system (embedded Redis unless SPLITBUS_REDIS_URL is set).
up: $(BIN)/splitbus
	$(BIN)/splitbus up

## Static checks (CI runs them before the tests): ruff's lint rules and format, mypy over splitbus/ and tools/, and
## no function or method in splitbus/ over complexity 10 by radon's count (tools/complexity.py).
## Each runs even when one before it failed, so one run shows everything; the target fails if any did.
check: $(BIN)/splitbus
	@status=0; \
	$(BIN)/ruff check splitbus tests examples tools || status=1; \
	$(BIN)/ruff format --check splitbus tests examples tools || status=1; \
	$(BIN)/mypy || status=1; \
	$(BIN)/python -m tools.complexity splitbus || status=1; \
	exit $$status

## Run the test suite against a real redis-server that the fixtures start.
test: $(BIN)/splitbus
	$(BIN)/pytest

## Bus benchmark: Redis Streams vs a ZeroMQ baseline, JSON + PNG under bench-results/.
bench: $(BIN)/splitbus
	$(BIN)/splitbus bench bus --out bench-results

clean:
	rm -rf $(VENV) .splitbus bench-results
