# Two entry points, each doing its own set-up on a fresh machine:
#   make study   install, then build the four default studies (`layertune repro` → reports/), study by study; JOBS=4
#                trains four cells at a time (`layertune repro --jobs 4`, one GPU each when there are GPUs)
#   make test    install, then run the fast tier of the tests (a few minutes); make test-slow runs the rest (whole
#                DVC builds, Ray clusters, servers, long simulations), make test-all both; .ci/run runs both tiers
# Everything runs from a project virtual environment (.venv): a system Python may refuse packages (PEP 668), and
# the study should not depend on what else is installed. Set PYTHON to choose the interpreter that creates it.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export KEDRO_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1
# MLflow 3 sends usage data unless told no; it reads DO_NOT_TRACK only when set to "true", not "1".
export MLFLOW_DISABLE_TELEMETRY := true
# The tests' DVC projects are new repositories: without this each dvc command starts an analytics daemon.
export DVC_NO_ANALYTICS := 1
# Python keeps the bytecode it compiles (its default), also where the machine sets PYTHONDONTWRITEBYTECODE (this
# project's machines do): the install below compiles nothing, so without it every stage process would compile torch.
unexport PYTHONDONTWRITEBYTECODE

# Real data and a second real model ship beside the repository in ../shared; without it the Hugging Face hub is used.
SHARED ?= $(abspath ../shared)
ifneq ($(wildcard $(SHARED)/data),)
export LAYERTUNE_DATA_MIRROR ?= $(SHARED)/data
# `make study` finds models as a plain `dvc repro` does, through params.yaml's download.model_mirror. The tests
# check params.yaml outside Kedro, and they and the benchmarks build clones elsewhere (where ../shared/models is
# not beside them), so these two get the folder from the environment.
test test-slow test-all benchmark: export LAYERTUNE_MODEL_MIRROR ?= $(SHARED)/models
endif

.PHONY: setup study test test-slow test-all repro-check benchmark

setup: $(VENV)/installed

# Installed again only when the dependencies change: a second `make` starts at once. --no-compile (1:43 against 3:36
# here): of the 23,000 modules installed, the studies and tests import about 5,000, each compiled once as it is
# first imported, and kept (above).
$(VENV)/installed: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -e ".[test]"
	touch $@

# A current pip first: the one venv bundles (23.2 with Python 3.11) spends a minute resolving what pip 26 resolves in
# half (the whole install: 0:51 against 1:26, the same packages).
$(VENV)/bin/python:
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "make: '$(PYTHON) -m venv' could not create $(VENV)." \
	  "On Debian or Ubuntu: sudo apt install python3-venv (or set PYTHON=/path/to/python3 with venv)." >&2; exit 1; }
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip

# Study by study, the fewest cells first: each report lands as soon as its study is trained (the same stages, reports
# and dvc.lock as a plain `dvc repro`).
JOBS ?= 1
study: setup
	layertune repro --jobs $(JOBS)

# Two tiers, by the `slow` mark (pyproject.toml). OMP_WAIT_POLICY: idle OpenMP threads sleep, two workers share two cores.
PYTEST := OMP_WAIT_POLICY=PASSIVE python -m pytest -n 2 --dist loadgroup
test: setup
	$(PYTEST) -m "not slow"
	@echo "make test: the fast tier passed; the slow tier (whole DVC builds, Ray clusters, servers, long simulations): make test-slow"

# Every slow test's duration at the end, slowest first: CI's log says where its time goes (machines of one kind differ 2x).
test-slow: setup
	$(PYTEST) -m slow --durations=0

test-all: setup
	$(PYTEST)

# Two builds of the `ci` profile from scratch must give byte-identical reports (.ci/run runs this after the tests).
repro-check: setup
	bash .ci/repro-check.sh

benchmark: setup
	python benchmarks/frozen_prefix_speed.py --json reports/benchmarks/frozen_prefix.json
	python benchmarks/pipeline_speed.py --json reports/benchmarks/pipeline.json
	python benchmarks/tuning_methods_speed.py --json reports/benchmarks/tuning_methods.json
	python benchmarks/cluster_speed.py --json reports/benchmarks/cluster.json
	python benchmarks/plan_speed.py --json reports/benchmarks/plan.json
