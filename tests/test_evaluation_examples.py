"""A decided study's evaluation examples (#29): labelled data of the task that the study neither trains nor evaluates
on, carved the same way every time, and the saved cells scored on it as their training scored dev."""

import dataclasses
import json
from collections import Counter

import pytest
import yaml

from layertune.cell import CellFolder, train_cell
from layertune.specs import CellSpec, CorpusSpec
from layertune.study import DecidedWith, StudySpec


def texts(dataset, columns) -> set[str]:
    return {json.dumps(row) for row in zip(*(dataset[column] for column in columns))}


@pytest.mark.parametrize("task, columns", [("sst2", ("sentence",)), ("stsb", ("sentence1", "sentence2"))])
def test_the_evaluation_sample_is_labelled_data_the_study_does_not_use_the_same_every_time(data_mirror, task,
                                                                                           columns):
    spec = CorpusSpec(task=task, train_size=300, seed=42)
    study = spec.load(data_mirror)
    sample = spec.evaluation_sample(500, data_mirror)
    assert len(sample) == 500 and sample.column_names == study.train.column_names
    assert not texts(sample, columns) & (texts(study.train, columns) | texts(study.dev, columns))
    assert sample[:] == spec.evaluation_sample(500, data_mirror)[:]
    assert sample[:] != CorpusSpec(task=task, train_size=300, seed=7).evaluation_sample(500, data_mirror)[:]
    if task == "sst2":  # stratified: the classes in train's proportions, to the example
        train = Counter(spec.load(data_mirror).train["label"])
        share = train[1] / sum(train.values())
        assert abs(Counter(sample["label"])[1] - share * 500) <= 1


def test_a_dev_split_carved_from_train_is_left_out_too(tmp_path):
    import pandas as pd

    rows = pd.DataFrame({"text": [f"review {i}" for i in range(400)], "label": ["good", "bad"] * 200})
    rows.to_csv(tmp_path / "reviews.csv", index=False)
    spec = CorpusSpec(path=str(tmp_path / "reviews.csv"), train_size=100, seed=1)
    study = spec.load()
    sample = spec.evaluation_sample(1000, None)  # more than is left: all of it
    used = texts(study.train, ("text",)) | texts(study.dev, ("text",))
    assert not texts(sample, ("text",)) & used
    assert len(sample) + len(used) == 400
    with pytest.raises(ValueError, match="none is left to evaluate on"):
        CorpusSpec(path=str(tmp_path / "reviews.csv"), seed=1).evaluation_sample(10, None)


@pytest.mark.integration
@pytest.mark.parametrize("tunable_layers", [0, 2])
def test_a_saved_cell_scored_again_gives_the_predictions_its_training_saved(minilm_l3, data_mirror, tmp_path,
                                                                          tunable_layers):
    """What the evaluate stage does with the evaluation examples, checked on dev: the cell folder's model, its own
    training settings, the frozen-prefix cache its training filled."""
    spec = CellSpec.model_validate({
        "corpus": {"task": "sst2", "train_size": 64, "dev_size": 48, "seed": 0},
        "encoders": [{"model": str(minilm_l3), "tunable_layers": tunable_layers, "pooling": "mean"}],
        "training": {"epochs": 1, "batch_size": 16, "seed": 3, "max_length": 48, "learning_rate": 1e-4}})
    cache = tmp_path / "cache"
    trained = train_cell(spec, tmp_path / "cell", data_mirror=data_mirror, cache_dir=cache, progress=False)
    corpus = spec.corpus.load(data_mirror)
    again = CellFolder(tmp_path / "cell").predict(dataclasses.replace(corpus, test=None), cache_dir=cache)
    assert again["dev"] == trained.result.predictions["dev"]


def test_the_evaluate_stage_scores_only_the_cells_it_has_not_scored_on_the_same_examples(tmp_path, monkeypatch):
    """A decided study's evaluate stage reruns at every round: the cells it scored on the same evaluation examples
    before come from the feature cache (`pipelines.evaluate.nodes.evaluation_predictions`), the same predictions
    byte for byte, and only the others are scored."""
    from tests.projects import make_project, run, study

    decided = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2], data={"seed": 1, "train_size": 16},
                    decide={"looks": 3, "evaluation_size": 20})
    project = make_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"s": decided}})
    # round 2 gave this question its evaluation examples: recorded in the record of rounds, as --decide writes it
    spec = StudySpec.model_validate(decided)
    decided_with = DecidedWith.of(spec.report, spec.decide).model_dump()
    (project / "rounds.yaml").write_text(yaml.safe_dump({"decided": {"s": {
        "evaluation_rounds": {"sst2": {"tiny": 2}}, "decided_with": decided_with}}}))
    rows = [f"review number {i} was {'good' if i % 2 else 'bad'}\t{i % 2}" for i in range(80)]  # distinct texts:
    (project / "mirror/glue/SST-2/train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")  # some unused
    for stage in ("plan", "download"):
        run(project, stage)
    for stage in ("prepare", "tokenize", "train"):
        run(project, stage, study="s")

    scored = Counter()
    predict = CellFolder.predict

    def counted(self, corpus, **kwargs):
        scored[self.path.name] += 1
        return predict(self, corpus, **kwargs)

    monkeypatch.setattr(CellFolder, "predict", counted)
    written = project / "data/05_model_output/s/evaluation.json"
    run(project, "evaluate", study="s")
    first = written.read_bytes()
    predictions = json.loads(first)["sst2"]["predictions"]
    assert sorted(predictions) == [f"sst2-tiny-{k}-{seed}" for k in (0, 1) for seed in (1, 2)]
    assert all(len(p) == 20 for p in predictions.values()) and set(scored.values()) == {1}

    entries = sorted((project / "data/cache/evaluation").glob("*.json"))
    assert len(entries) == 4
    scored.clear()
    run(project, "evaluate", study="s")  # a rerun: every cell from the cache
    assert not scored and written.read_bytes() == first

    entries[0].unlink()  # one cell's entry gone: that cell alone is scored again
    run(project, "evaluate", study="s")
    assert sum(scored.values()) == 1 and written.read_bytes() == first
