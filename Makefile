# Two commands do everything on a fresh machine:
#   make run   - set up ./.venv and run the coding-loop benchmark on the default model
#   make test  - set up ./.venv (with test deps) and run the test suite
.PHONY: run test lint bench setup

setup:
	scripts/setup.sh dev,bench,server,native

run: setup
	mkdir -p out
	.venv/bin/warmkv bench coding-loop --turns 10 --json out/coding-loop.json --plot out/coding-loop.png

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check src tests
