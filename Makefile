# Every target makes its own virtual environment; nothing relies on a hand install.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
# pytest-xdist processes for `make test`: the suite mostly waits on servers and worker
# processes, so two keep a 2-core machine busy; 0 runs it in this process alone
TEST_WORKERS ?= 2

.PHONY: demo test lint typecheck unit bench chaos clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/dicom-ingest demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -m 'not slow' -n $(TEST_WORKERS) --dist worksteal

bench: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,bench]'
	$(BIN)/dicom-ingest bench

chaos: $(STAMP)
	$(BIN)/python -m pytest -m slow -s

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
