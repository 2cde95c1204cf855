# Two entry points for a fresh clone (see README): `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint clean

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/llumnix up -f deploy/examples/local-cpu.yaml --demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache
