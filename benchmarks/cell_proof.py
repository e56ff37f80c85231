"""What it costs a build to check that each cell folder proves what it holds (`pipelines.trained_cells.proof_problem`:
its build record, its cell.json and the digest of every file), per cell, on a built project's cells and on 1,000 tiny
cells. The train stage pays it for every planned cell at every build (a second build that trains nothing included).

    python benchmarks/cell_proof.py --json reports/benchmarks/cell_proof.json     # the default build, if built here
    python benchmarks/cell_proof.py --project ../clone --tiny-cells 1000

Timed with the folders' files in the page cache, as a build finds the cells it wrote or pulled a moment before
(a cold read is the disk's speed: the bytes are in the output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(Path(__file__).resolve().parent)]


def timed_proofs(folders: list[Path], repeats: int = 3) -> dict:
    """Every folder proved ``repeats`` times (the first warms the page cache); the median pass's seconds."""
    from pipelines.trained_cells import proof_problem, recorded_build_key

    keys = {folder: recorded_build_key(folder) for folder in folders}
    passes = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        problems = [proof_problem(folder, keys[folder]) for folder in folders]
        passes.append(time.perf_counter() - started)
    if any(problems):
        raise SystemExit(f"cell_proof: {sum(map(bool, problems))} folder(s) do not prove their build: {problems}")
    seconds = statistics.median(passes[1:])
    size = sum(path.stat().st_size for folder in folders for path in folder.rglob("*") if path.is_file())
    return {"cells": len(folders), "seconds": round(seconds, 3), "ms_per_cell": round(1000 * seconds / len(folders), 2),
            "mb": round(size / 2**20, 1), "mb_per_s": round(size / 2**20 / seconds, 1) if seconds else None}


def built_project(project: Path) -> dict | None:
    """The proof of every cell folder of a built project (its studies, where the catalog puts their cells)."""
    from pipelines.catalog import catalog_path

    models = catalog_path("study_cells", "-", project).parent
    folders = sorted(folder for study in models.glob("*") if study.is_dir() and not study.name.startswith(".")
                     for folder in study.iterdir() if (folder / "build.json").is_file())
    return timed_proofs(folders) if folders else None


def tiny_cells(count: int) -> dict:
    """``count`` cells of a tiny random model, each written as the train stage writes it (one trained model, written
    under ``count`` seeds' specs), then proved."""
    from layertune.cell import TrainedCell, train_cell
    from layertune.specs import CellSpec, CorpusSpec, EncoderSpec
    from layertune.testing import make_tiny_model
    from layertune.study import StudyCell
    from pipelines.trained_cells import TrainedCells, build_record
    from tests.conftest import toy_sentiment_corpus

    with tempfile.TemporaryDirectory(prefix="cell-proof-") as folder:  # ~50 MB for 1,000 cells: removed after
        work = Path(folder)
        model = make_tiny_model(work / "tiny", "bert")
        spec = CellSpec(corpus=CorpusSpec(task="sst2"), encoders=[EncoderSpec(model=str(model), tunable_layers=1)],
                        training={"epochs": 1, "learning_rate": 1e-3})
        trained = train_cell(spec, corpus=toy_sentiment_corpus(), progress=False)
        cells = TrainedCells(work / "models" / "tiny", work / "models" / ".retired" / "tiny")
        for seed in range(count):
            cell = StudyCell(study="tiny", task="sst2", encoder="m", tunable_layers=1, seed=seed,
                             spec=spec.model_copy(update={"training": spec.training.model_copy(update={"seed": seed})}))
            cells.write(cell.key, TrainedCell(cell.spec, trained.result, trained.model),
                        build_record(cell, "code", "data"))
        return timed_proofs(sorted(cells.path.iterdir()))


def main() -> int:
    from layertune.io import write_json
    from machine_speed import describe, reference

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, default=ROOT, help="a built project (default: this one)")
    parser.add_argument("--tiny-cells", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {"machine": reference(), "built": built_project(args.project.resolve()),
              "tiny": tiny_cells(args.tiny_cells)}
    print(f"on {describe(report['machine'])}")
    for name, found in (("built project", report["built"]), (f"{args.tiny_cells:,} tiny cells", report["tiny"])):
        if found:
            print(f"{name}: {found['cells']} cells, {found['mb']} MB: {found['seconds']} s, "
                  f"{found['ms_per_cell']} ms a cell ({found['mb_per_s']} MB/s)")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
