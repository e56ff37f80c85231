#!/usr/bin/env bash
# Reproduction check: build the three studies of the `ci` profile from scratch twice, each time in a fresh clone with
# an empty DVC cache (so nothing is restored from a run cache), then require that
#   - every study's reports/<study>.json is byte-identical between the two builds,
#   - `dvc status` is clean after each build (a second `dvc repro` would do nothing),
#   - MLflow holds exactly one run per cell of every study, each FINISHED.
# Needs the data mirror: $LAYERTUNE_DATA_MIRROR, else ../shared/data beside the repository (and ../shared/models).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
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
    dvc exp run --quiet $(python -m layertune.profiles ci)
    echo "repro-check: $1 built in $((SECONDS - started)) s"
    dvc status --quiet || { echo "repro-check: dvc status is not clean after build $1:" >&2; dvc status >&2; exit 1; }
    python - <<'PY'
import yaml
from mlflow import MlflowClient

from layertune.study import plan_studies

client = MlflowClient()
for name, study in plan_studies(yaml.safe_load(open("params.yaml"))).studies.items():
    runs = client.search_runs([client.get_experiment_by_name(f"layertune-{name}").experiment_id])
    found = sorted((run.info.run_name, run.info.status) for run in runs)
    expected = sorted((cell.key, "FINISHED") for cell in study.cells)
    assert found == expected, f"{name}: expected one FINISHED run per cell {expected}, got {found}"
print("repro-check: one FINISHED MLflow run per cell of every study")
PY
  )
}

build first
build second
status=0
for metrics in "$work"/first/reports/*.json; do
  name="$(basename "$metrics")"
  if cmp "$metrics" "$work/second/reports/$name"; then
    echo "repro-check: two builds from scratch gave byte-identical reports/$name"
  else
    diff "$metrics" "$work/second/reports/$name" >&2 || true
    echo "repro-check: reports/$name differs between two builds from scratch" >&2
    status=1
  fi
done
exit $status
