"""evaluate: every cell of a study scored from the predictions it saved (dev, and test where it has labels); the
references beside them (no-model baselines, linear probes, an untrained model's similarity); and, for a decided study
whose rounds added evaluation examples, the saved cells scored on those."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# What the nodes run is imported as they run: every stage's `kedro run` imports every pipeline's nodes (the
# registry), and a stage should not pay for another's libraries (the reports' import scipy and matplotlib).
if TYPE_CHECKING:
    import pandas as pd

    from layertune.cell import CellFolder
    from layertune.corpus import Corpus
    from layertune.study import StudyPlan
    from pipelines.plans import PreparePlan


EVALUATION_CACHE = "evaluation"  # below the feature cache: saved cells' predictions on evaluation examples


def evaluate(plan: StudyPlan, cells: dict[str, CellFolder], corpora: dict[str, Callable[..., Corpus]]) -> pd.DataFrame:
    """One row per cell of the plan (cells left over from older grids are ignored)."""
    from layertune.reports.scores import score_cells

    return score_cells(plan, cells, {task: corpora[task]() for task in plan.spec.tasks})


REFERENCES_CACHE = "references"  # below the feature cache: a study's references, by what they are computed from


def reference_scores(plan: StudyPlan, corpora: dict[str, Callable[..., Corpus]], cache_root: Path) -> dict:
    """The references the report sets beside the cells: no-model baselines, linear probes on the frozen encoders
    (from the head-only cells' cache entries), an untrained model's cosine (`layertune.probes.study_references`).
    Kept in the feature cache by everything they are computed from (the study's data, encoders, head and training
    settings, the models' files, the corpora, the code: `layertune.probes` and every library file it imports, and
    the device and precision they are computed in here): a decided study reruns this stage every round, and its
    references do not change."""
    import hashlib
    import json

    import layertune
    from layertune import probes
    from layertune.io import write_json
    from layertune.training_config import resolve_mixed_precision, training_device
    from pipelines.provenance import code_fingerprint

    loaded = {task: corpora[task]() for task in plan.spec.tasks}
    spec = plan.spec.model_dump(mode="json", include={"tasks", "encoders", "data", "encoder", "head", "training",
                                                      "per_tunable_layers", "seeds"})
    fingerprints = sorted({fingerprint for cell in plan.cells for fingerprint in cell.model_fingerprints})
    library = Path(layertune.__file__).resolve().parent
    device = training_device().type  # what "auto" precision is depends on the machine, as the features do
    what = json.dumps([spec, fingerprints, {task: corpus.fingerprint for task, corpus in loaded.items()},
                       code_fingerprint([Path(probes.__file__)], {"layertune": library}),
                       device, resolve_mixed_precision("auto", device)], sort_keys=True)
    entry = cache_root / REFERENCES_CACHE / f"{hashlib.sha256(what.encode()).hexdigest()[:32]}.json"
    if entry.is_file() and not entry.is_symlink():
        return json.loads(entry.read_text())
    found = probes.study_references(plan, loaded, cache_dir=cache_root)
    write_json(entry, found)  # atomically: a stopped stage leaves the entry whole or absent
    return found


def score_evaluation_examples(plan: StudyPlan, cells: dict[str, CellFolder],
                              corpora: dict[str, Callable[..., Corpus]], downloaded: dict[str, dict[str, str]],
                              prepare: PreparePlan, cache_root: Path) -> dict:
    """Per task whose questions a round gave evaluation examples (``decide.evaluation_rounds``): the examples'
    references, and the predictions on them of every cell of those questions, from its saved folder (nothing
    trains; the frozen-prefix cache serves the cells of one boundary). Empty for every other study."""
    from tqdm.auto import tqdm

    from layertune.io import dataset_digest

    decide = plan.spec.decide
    found = {}
    for task, encoders in sorted(decide.evaluation_rounds.items() if decide else ()):
        folder = prepare.downloaded[task]
        try:
            examples = prepare.corpora[task].evaluation_sample(decide.evaluation_size,
                                                               files=downloaded[folder] if folder else None)
        except ValueError as error:
            raise ValueError(f"studies.{plan.name}.decide.evaluation_size: {task}: {error}; set it to null, and "
                             f"studies.{plan.name}.decide.evaluation_rounds to {{}}, or train on fewer examples "
                             "(data.train_size)") from None
        corpus = dataclasses.replace(corpora[task](), dev=examples, test=None)
        keys = [cell.key for cell in plan.cells if cell.task == task and cell.encoder in encoders]
        examples_digest = dataset_digest(examples)
        scored = {key: evaluation_predictions(cells[key], corpus, examples_digest, cache_root)
                  for key in tqdm(keys, desc=f"{task}: {len(examples):,} evaluation examples", unit="cell")}
        found[task] = {"references": scored[keys[0]]["references"],
                       "predictions": {key: result["predictions"] for key, result in scored.items()}}
    return found


def evaluation_predictions(cell: CellFolder, corpus: Corpus, examples_digest: str, cache_root: Path) -> dict:
    """A saved cell's predictions and the references on ``corpus``'s dev split (the evaluation examples, whose
    digest is ``examples_digest``), kept in the feature cache by that digest and the cell's build key (which changes
    with anything that changes its predictions): each round reruns this stage, and scores only its new cells."""
    import hashlib
    import json

    from layertune.io import write_json
    from pipelines.trained_cells import recorded_build_key

    build_key = recorded_build_key(cell.path)
    if build_key is None:  # a folder no build wrote: nothing to key it by
        return cell.predict(corpus, cache_dir=cache_root)["dev"]
    name = hashlib.sha256(f"{build_key}|{examples_digest}".encode()).hexdigest()[:32]
    entry = cache_root / EVALUATION_CACHE / f"{name}.json"
    if entry.is_file() and not entry.is_symlink():
        return json.loads(entry.read_text())
    predicted = cell.predict(corpus, cache_dir=cache_root)["dev"]
    write_json(entry, predicted)  # atomically: a stopped stage leaves the entry whole or absent
    return predicted
