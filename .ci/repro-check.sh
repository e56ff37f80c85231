#!/usr/bin/env bash
# Reproduction check, against the contract of docs/pipeline.md#reproducibility: build the three studies of the `ci`
# profile from scratch twice, side by side, each in a fresh clone with an empty DVC cache (so nothing is restored from a run
# cache), then require that
#   - on this machine, bit for bit: every study's reports/<study>.json, reports/<study>/details.json and its plots'
#     tables (reports/<study>.scores.csv, .losses.csv) are byte-identical between the two builds;
#   - across machines, within tolerance: the first build's reports equal tests/expected/ci/ (a ci build committed
#     with the code) within 1e-4 on every score, with every answer the same (python -m layertune.reports.compare);
#   - `dvc status` lists nothing but the plan after each build (it runs every time: a second `dvc repro` would
#     rerun it and nothing else);
#   - MLflow holds exactly one run per cell of every study, each FINISHED, under one FINISHED build run per study.
# `--update-expected` writes the first build's reports to tests/expected/ci/ instead of comparing with them (after
# a change that moves the scores on purpose; commit them with it).
# Needs the data mirror: $LAYERTUNE_DATA_MIRROR, else ../shared/data beside the repository (and ../shared/models).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
expected="$root/tests/expected/ci"
update=false
case "${1:-}" in
  --update-expected) update=true ;;
  "") ;;
  *) echo "usage: $0 [--update-expected]" >&2; exit 2 ;;
esac
export KEDRO_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export LAYERTUNE_DATA_MIRROR="${LAYERTUNE_DATA_MIRROR:-$(cd "$root/.." && pwd)/shared/data}"
test -d "$LAYERTUNE_DATA_MIRROR" || { echo "repro-check: no data mirror at $LAYERTUNE_DATA_MIRROR" >&2; exit 1; }
# Models beside the data (the multi-encoder study's second encoder); the clones live elsewhere.
export LAYERTUNE_MODEL_MIRROR="${LAYERTUNE_MODEL_MIRROR:-$(cd "$root/.." && pwd)/shared/models}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

build() {  # build <name>: clone HEAD, run the ci profile as a DVC experiment, check status and MLflow
  local copy="$work/$1"
  git clone --quiet "$root" "$copy"
  (
    cd "$copy"
    export MLFLOW_TRACKING_URI="sqlite:///$copy/mlflow.db"
    export PYTHONPATH="$copy/src"  # this clone's library, whichever checkout `pip install -e` last pointed at
    started=$SECONDS
    # shellcheck disable=SC2046  # the profile expands to several `-S key=value` arguments
    dvc exp run --quiet $(python -m pipelines.profiles ci)
    echo "repro-check: $1 built in $((SECONDS - started)) s"
    status="$(dvc status --json)"
    test "$status" = '{"plan": ["always changed"]}' || {
      echo "repro-check: after build $1, dvc status lists more than the plan:" >&2; dvc status >&2; exit 1; }
    python - <<'PY'
import yaml
from mlflow import MlflowClient

from pipelines.plans import plan_studies

client = MlflowClient()
for name, study in plan_studies(yaml.safe_load(open("params.yaml"))).studies.items():
    runs = client.search_runs([client.get_experiment_by_name(f"layertune-{name}").experiment_id])
    builds = [run for run in runs if run.info.run_name.startswith("build ")]
    assert [run.info.status for run in builds] == ["FINISHED"], f"{name}: one FINISHED build run, got {builds}"
    found = sorted((run.info.run_name, run.info.status, run.data.tags["mlflow.parentRunId"])
                   for run in runs if run not in builds)
    expected = sorted((cell.key, "FINISHED", builds[0].info.run_id) for cell in study.cells)
    assert found == expected, f"{name}: expected one FINISHED run per cell {expected}, got {found}"
print("repro-check: one FINISHED MLflow run per cell of every study, under its build's run")
PY
  )
}

# The two builds run side by side: each is a chain of short stage processes (most of a ci build is their start-up),
# so two chains on two cores take little more than one; and neither may disturb the other's numbers.
build first >"$work/first.log" 2>&1 & first=$!
build second >"$work/second.log" 2>&1 & second=$!
status=0
wait "$first" || status=1
wait "$second" || status=1
for name in first second; do grep '^repro-check' "$work/$name.log" || true; done
if [ "$status" -ne 0 ]; then
  for name in first second; do echo "--- build $name, its last lines:" >&2; tail -n 60 "$work/$name.log" >&2; done
  exit 1
fi
cd "$work/first/reports"
for report in *.json */details.json *.scores.csv *.losses.csv; do  # the plots' tables too
  if cmp --quiet "$report" "$work/second/reports/$report"; then
    echo "repro-check: two builds from scratch gave byte-identical reports/$report"
  else
    diff "$report" "$work/second/reports/$report" >&2 || true
    echo "repro-check: reports/$report differs between two builds from scratch" >&2
    status=1
  fi
done
if $update; then
  rm -rf "$expected" && mkdir -p "$expected"
  cp --parents -- *.json */details.json "$expected/"
  echo "repro-check: wrote the first build's reports to tests/expected/ci/ (commit them)"
else
  PYTHONPATH="$work/first/src" python -m layertune.reports.compare "$expected" "$work/first/reports" || status=1
fi
exit $status
