# The two commands of the README: `make demo` (service + local Ray + SQLite + an example job to the end)
# and `make test` (the whole suite). Both create the environment first when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[workers,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	bash deploy/demo.sh

test: install
	$(PY) -m workers.warmup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf shunter-data shunter.db shunter.db-wal shunter.db-shm
