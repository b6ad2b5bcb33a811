# The two commands a newcomer needs: `make run` and `make test`. Both set up ./.venv first (idempotent).
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup run test test-fast plan clean

setup:
	@bash scripts/setup.sh

run: setup
	@$(PY) -m cluster run deploy.yaml

test: setup
	@$(PY) -m pytest -q $(PYTEST_ARGS)

# planner, layouts, configs: no engines, seconds
test-fast: setup
	@$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)

clean:
	rm -rf .venv models results .pytest_cache .hypothesis
