# Two commands do everything on a fresh machine:
#   make run   - set up ./.venv and serve the default model (OpenAI-compatible, http://127.0.0.1:8000/v1)
#   make test  - set up ./.venv (with test deps) and run the test suite
.PHONY: run test lint bench setup harness-latest test-harnesses

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

# The newest release of each pinned harness (harnesses/package.json), installed into a scratch
# prefix and driven by the same tests. Not part of `make test`: the versions move.
HARNESS_LATEST ?= /tmp/warmkv-harness-latest
HARNESS_TESTS = tests/test_harness_cli.py tests/test_harness_opencode.py tests/test_harness_pi.py \
	tests/test_harness_qwen.py tests/test_harness_launch.py tests/test_harness_codex_socket.py
harness-latest: setup
	rm -rf $(HARNESS_LATEST) && mkdir -p $(HARNESS_LATEST)
	cd $(HARNESS_LATEST) && echo '{"private": true}' > package.json && npm install --no-audit --no-fund \
		--loglevel=error $$(node -p 'Object.keys(require("$(CURDIR)/harnesses/package.json").dependencies).map(p => p + "@latest").join(" ")')
	cd $(HARNESS_LATEST) && npm ls --depth=0
	WARMKV_HARNESS_PREFIX=$(HARNESS_LATEST) .venv/bin/python -m pytest -q -rP $(HARNESS_TESTS)

# Every harness test at the pinned versions, the long ones (`warmkv launch claude`, compaction) too.
test-harnesses: setup
	WARMKV_HARNESS_LONG=1 .venv/bin/python -m pytest -q -rP $(HARNESS_TESTS)
