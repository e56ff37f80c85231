#!/usr/bin/env bash
# Reproduction check: build the `ci` study from scratch twice, each time in a fresh clone with an empty DVC cache
# (so nothing is restored from a run cache), then require that
#   - the two reports/metrics.json are byte-identical,
#   - `dvc status` is clean after each build (no stage changed, nothing written outside a stage's outs),
#   - MLflow holds one FINISHED run per cell of each build.
# Needs the data mirror: $LAYERTUNE_DATA_MIRROR, else ../shared/data beside the repository (and ../shared/models).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export KEDRO_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export LAYERTUNE_DATA_MIRROR="${LAYERTUNE_DATA_MIRROR:-$(cd "$root/.." && pwd)/shared/data}"
test -d "$LAYERTUNE_DATA_MIRROR" || { echo "repro-check: no data mirror at $LAYERTUNE_DATA_MIRROR" >&2; exit 1; }
# Models shipped beside the data (the multi-encoder study's second encoder); the clones live elsewhere.
export LAYERTUNE_SHARED_MODELS="${LAYERTUNE_SHARED_MODELS:-$(cd "$root/.." && pwd)/shared/models}"
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
    # The layer ablation (dvc.yaml) and the NER and multi-encoder studies (studies/dvc.yaml), shrunk by the profile.
    dvc exp run --quiet $(python -m layertune.study ci) dvc.yaml studies/dvc.yaml
    echo "repro-check: $1 built in $((SECONDS - started)) s"
    dvc status --quiet || { echo "repro-check: dvc status is not clean after build $1:" >&2; dvc status >&2; exit 1; }
    python - <<'PY'
import yaml
from mlflow import MlflowClient

from layertune.study import validate_params

study = validate_params(yaml.safe_load(open("params.yaml"))).study
client = MlflowClient()
runs = client.search_runs([client.get_experiment_by_name(f"layertune-{study.name}").experiment_id])
statuses = sorted(run.info.status for run in runs)
assert statuses == ["FINISHED"] * len(study.cells()), f"expected one FINISHED run per cell, got {statuses}"
PY
  )
}

build first
build second
if cmp "$work/first/reports/metrics.json" "$work/second/reports/metrics.json"; then
  echo "repro-check: two builds from scratch gave byte-identical reports/metrics.json"
else
  diff "$work/first/reports/metrics.json" "$work/second/reports/metrics.json" >&2 || true
  echo "repro-check: reports/metrics.json differs between two builds from scratch" >&2
  exit 1
fi
