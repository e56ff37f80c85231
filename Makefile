# Two entry points, each doing its own set-up on a fresh machine:
#   make study   install, then rebuild the default CPU layer-ablation study (`dvc repro`)
#   make test    install, then run the test suite
SHELL := /bin/bash
PYTHON ?= python
export KEDRO_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1

# Real data and a second real model ship beside the repository in ../shared; without it the Hugging Face hub is used.
SHARED ?= $(abspath ../shared)
ifneq ($(wildcard $(SHARED)/data),)
export LAYERTUNE_DATA_MIRROR ?= $(SHARED)/data
export LAYERTUNE_MODEL_MIRROR ?= $(SHARED)/models
endif

.PHONY: setup study test benchmark
setup:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[test]"

study: setup
	dvc repro

test: setup
	OMP_WAIT_POLICY=PASSIVE $(PYTHON) -m pytest -n 2  # idle OpenMP threads sleep: two workers share two cores

benchmark: setup
	$(PYTHON) benchmarks/frozen_prefix_speed.py --json reports/benchmark_frozen_prefix.json
