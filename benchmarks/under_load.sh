#!/usr/bin/env bash
# The time-bound tests under load: every test that asserts a bound in seconds (a stop within seconds, a refusal before
# any work, an unreachable server costing seconds), 5 times each, as `make test` runs them (two workers) with two CPU
# hogs (busy loops) beside: on a 2-core machine, twice as many busy processes as cores. All must pass, 5 runs of 5.
#
#     bash benchmarks/under_load.sh              # after make setup; about 15 min on 2 cores
#     bash benchmarks/under_load.sh --count 2    # pytest arguments after the script's own
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || { echo "under_load: run make setup first (it creates .venv)" >&2; exit 1; }
export PATH="$PWD/.venv/bin:$PATH" OMP_WAIT_POLICY=PASSIVE  # as the Makefile's test targets run
export KEDRO_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1 DVC_NO_ANALYTICS=1 HF_HUB_OFFLINE=1
export LAYERTUNE_DATA_MIRROR="${LAYERTUNE_DATA_MIRROR:-$(cd .. && pwd)/shared/data}"
export LAYERTUNE_MODEL_MIRROR="${LAYERTUNE_MODEL_MIRROR:-$(cd .. && pwd)/shared/models}"
hogs=()
for _ in 1 2; do (while :; do :; done) & hogs+=("$!"); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
python - <<'PY'  # the machine's reference figure, taken under the load the tests run under
import sys; sys.path.insert(0, "benchmarks")
from machine_speed import describe, reference
print("under load:", describe(reference()))
PY
python -m pytest -n 2 --dist loadgroup -p no:cacheprovider -q --count 5 "$@" \
  "tests/test_repro.py::test_bad_options_are_refused_before_any_work" \
  "tests/test_repro.py::test_bad_params_or_environment_are_one_line_before_dvc_starts" \
  "tests/test_parallel.py::test_stopping_the_build_stops_every_cell_within_seconds" \
  "tests/test_tracking.py::test_an_unreachable_server_costs_seconds_and_one_warning_and_keeps_only_the_folders" \
  tests/test_reliability.py \
  "tests/test_ray_cluster.py::test_ctrl_c_stops_every_cell_on_the_nodes_within_seconds"
