# The two commands of the README: `make up` runs the job, `make test` runs the tests.
# Both set up everything they need on a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GROUPS ?= 2
NPROC ?= 2
STEPS ?= 2000

.PHONY: setup up test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/ftctl up --groups $(GROUPS) --nproc-per-group $(NPROC) --steps $(STEPS)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) ftstate .pytest_cache
