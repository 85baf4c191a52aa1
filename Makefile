# Two commands do everything on a fresh machine:
#   make run   - set up ./.venv and serve the default model (OpenAI-compatible, http://127.0.0.1:8000/v1)
#   make test  - set up ./.venv (with test deps) and run the test suite
.PHONY: run test lint bench setup

setup:
	scripts/setup/setup.sh dev,bench,server,native

run: setup
	.venv/bin/warmkv serve

bench: setup
	mkdir -p out
	.venv/bin/warmkv bench coding-loop --turns 10 --workspaces 4 --restart \
		--json out/coding-loop.json --plot out/coding-loop.png

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check src tests
	.venv/bin/ruff format --check src tests
	.venv/bin/lint-imports
