# The two commands of the README. Each one sets up what it needs first.
SHELL := /bin/bash
export PATH := $(CURDIR)/.venv/bin:$(CURDIR)/node_modules/.bin:$(PATH)

.PHONY: demo test lint setup

setup:
	@scripts/bootstrap.sh

# Options for the demo, e.g. make demo DEMO_ARGS="--port 8300" (mig-spawner demo --help).
DEMO_ARGS ?=

demo: setup
	mig-spawner demo --simulate $(DEMO_ARGS)

# setup installs PostgreSQL and Chromium, so the tests that need them must run, never skip.
test: export MIG_SPAWNER_REQUIRE_SYSTEM = 1
test: setup
	ruff check mig_spawner tests benchmarks
	pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	ruff check mig_spawner tests benchmarks
