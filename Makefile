# The two commands of the README: `make demo` (service + local Ray + SQLite + an example job to the end)
# and `make test` (the whole suite). Both create the environment first when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test lint bench clean screenshots gpu-wheels

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[workers,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	bash deploy/demo.sh

# Two runs, one after the other: the fast tier on four pytest-xdist workers for the two cores (many of its cases wait
# on a tick, a timeout, a subprocess or a browser, which leaves a core idle: 5:46 with four workers, the machine 92 %
# busy, against 6:38 with three, one after the other on 2026-12-07; 6:56 with three, 7:51 with two, on 2026-12-06), handed out one case at a time (--maxschedchunk 1) in the order tests/conftest.py gives
# (longest and heaviest first): xdist's default first hands each worker a quarter of its share in one block, so one
# worker got every long case while the others ran out of work (8:11-8:52 so; 6:35 one at a time). Then the slow
# tier (real Ray, real processes) on two lanes: each lane runs whole groups (a module, or every multi-node test:
# tests/conftest.py), the longest groups first, with its own session Ray head. One lane alone left a core idle a quarter of the time (an attempt's start is a chain of
# single-threaded process starts); the slow tier's waits are bounded by events and generous timeouts, not by the
# machine being otherwise idle. Both runs always run.
# The warm-up (DeepSpeed's shm_comm op, ~38 s of one core when not cached) builds beside the quick tier, whose last
# minutes leave a core idle, and is waited for before the slow tier, the one that needs it; a quick test that loads
# the op meanwhile waits on torch's build lock and then loads the same build.
# They do not run side by side. Tried on 2026-12-07 (the quick tier at nice 15, the niceness Ray gives its workers,
# beside the slow tier): a fresh-clone .ci/run took 28:12 against ~30:45, the machine 99-100 % busy, but the next
# run failed three tests on timing under that load (two quick ones, and a script job's last metrics read right after
# it ended), so the tiers went back to one after the other until those are made load-proof.
# compileall: every process the tests start imports shunter's own modules (the API, dispatchers, Ray Job drivers,
# Ray Train's controllers and workers), and where PYTHONDONTWRITEBYTECODE is set, as on these machines, each of them
# compiled them again from source: ~0.7 CPU-s more for each `shunter serve` start here (1.9 against 1.2).
# SHUNTER_TEST_DEADLINE (epoch seconds; .ci/run sets it below CI's own limit): a tier still running then gets
# SIGINT, so pytest stops with its summary, the test it was in and its slowest tests printed, instead of being cut
# off by CI with nothing kept. Unset: no limit.
LEFT = $$(( (left = $${SHUNTER_TEST_DEADLINE:-$$(( $$(date +%s) + 864000 ))} - $$(date +%s)) > 1 ? left : 1 ))
test: install
	$(PY) -m compileall -q -j 0 api service workers examples tests bench
	rc=0; \
	$(PY) -m workers.warmup > .warmup.log 2>&1 & warmup=$$!; \
	timeout -s INT -k 60 $(LEFT) $(PY) -m pytest -m "not slow" -n 4 --maxschedchunk 1 $(PYTEST_ARGS) || rc=$$?; \
	wait $$warmup || { cat .warmup.log; echo "workers.warmup failed" >&2; rc=1; }; \
	timeout -s INT -k 60 $(LEFT) $(PY) -m pytest -m slow -n 2 --dist loadscope $(PYTEST_ARGS) || rc=$$?; \
	exit $$rc

# What the GPU tier (tests/gpu/run.sh) carries to a device machine, whose image lacks them: DeepSpeed built here as a
# pure-Python wheel (its ops compile there, on first use), pydantic for the strategy spec, for the device's Python 3.12.
VERSION_OF = $$($(PY) -c 'import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))' $(1))
GPU_WHEELS = pydantic==$(call VERSION_OF,pydantic) pydantic_core==$(call VERSION_OF,pydantic_core) \
	annotated-types==$(call VERSION_OF,annotated-types) typing-inspection==$(call VERSION_OF,typing-inspection) \
	hjson==$(call VERSION_OF,hjson)
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps deepspeed==$(call VERSION_OF,deepspeed) -w .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

# The README's pictures of the web page (docs/ui-*.png), from a real API and Debian's Chromium (apt-get install chromium).
screenshots: install
	$(PY) -m tests.ui.screenshots docs

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy api service workers

clean:
	rm -rf shunter-data shunter.db shunter.db-wal shunter.db-shm
