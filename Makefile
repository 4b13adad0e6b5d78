# The two commands of the README: `make up` runs the job, `make test` runs the tests.
# Both set up everything they need on a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GROUPS ?= 2
RANKS ?= 2
STEPS ?= 2000
# torch 2.13.0's CPU build by default (PyPI's own is the CUDA build, several GB more); for CUDA:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cu128 setup   (in a fresh checkout, or after make clean)
# An extra index: pip takes the build it serves (2.13.0+cpu sorts above PyPI's 2.13.0), and falls
# back to the machine's own indexes and wheel folders (one retry) where it cannot be reached.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Debian packages the tests use: promtool and a real Prometheus, Chromium and its driver,
# iproute2's ip for the network-namespace hosts of the multi-host tests, and a real Slurm (munge,
# slurmctld, slurmd and its commands; the test starts its own daemons and stops them).
SYSTEM_TOOLS := prometheus promtool chromium chromedriver ip munged slurmctld slurmd sbatch

.PHONY: setup system-deps up test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --retries 1 --extra-index-url $(TORCH_INDEX) torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages for:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus chromium chromium-driver iproute2 munge slurmctld slurmd slurm-client >/dev/null; \
	fi

up: $(STAMP)
	$(VENV)/bin/ftctl up --groups $(GROUPS) --ranks-per-group $(RANKS) --steps $(STEPS)

test: $(STAMP) system-deps
	$(PY) -m pytest -q

# the unit tests alone (tests/unit): about a minute, no Chromium, Prometheus or namespaces needed
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit -m "not prometheus"

clean:
	rm -rf $(VENV) ftstate .pytest_cache test-artifacts
