import csv
import json
import re
from collections import Counter

import datasets
import huggingface_hub.constants
import pandas as pd
import pytest

from layertune.corpora import (
    GLUE_COLA, GLUE_MRPC, GLUE_RTE, GLUE_SST2, GLUE_STSB, IMDB, TASKS, DataUnavailableError, load_corpus,
)

# Official GLUE row counts and label counts, as in ../shared/data/SOURCES.md.
GLUE_EXPECTED = {
    "cola": (GLUE_COLA, 8551, 1043, {1: 6023, 0: 2528}, {1: 721, 0: 322}),
    "sst2": (GLUE_SST2, 67349, 872, {1: 37569, 0: 29780}, {1: 444, 0: 428}),
    "mrpc": (GLUE_MRPC, 3668, 408, {1: 2474, 0: 1194}, {1: 279, 0: 129}),
    "rte": (GLUE_RTE, 2490, 277, {0: 1249, 1: 1241}, {0: 146, 1: 131}),  # 0 = entailment
    "stsb": (GLUE_STSB, 5749, 1500, None, None),
}


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    """Local csv/json files go through `datasets.load_dataset`; keep its cache out of the home folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))


@pytest.fixture
def offline(monkeypatch):
    """Force the hub offline: the libraries read HF_HUB_OFFLINE at import time, so patch their copies too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def fake_hub(monkeypatch, dataset_dict: datasets.DatasetDict) -> list:
    """Route `datasets.load_dataset` to an in-memory DatasetDict shaped like the hub's; returns the calls made."""
    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        return dataset_dict

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def write_csv(path, rows: list[dict]) -> str:
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


# --------------------------------------------------------------------------------------------- real data mirror


@pytest.mark.parametrize("task", list(GLUE_EXPECTED))
def test_glue_task_loads_from_mirror_with_official_counts(task, data_mirror):
    constructor, n_train, n_dev, train_counts, dev_counts = GLUE_EXPECTED[task]
    corpus = constructor(data_mirror=data_mirror)
    assert (corpus.name, len(corpus.train), len(corpus.dev), corpus.test) == (task, n_train, n_dev, None)
    assert corpus.train.column_names == [*TASKS[task].text_columns, "label"]
    assert corpus.metrics == TASKS[task].metrics and corpus.max_length == 128
    assert "data mirror" in corpus.notes[0]
    if train_counts is None:  # STS-B: a float similarity score
        assert corpus.task_type == "regression" and corpus.num_classes == 1
        labels = corpus.train["label"][:]
        assert all(isinstance(x, float) and 0 <= x <= 5 for x in labels)
        assert sum(labels) / len(labels) == pytest.approx(2.7010, abs=1e-3)
    else:
        assert corpus.task_type == "classification" and corpus.num_classes == 2
        assert Counter(corpus.train["label"]) == train_counts
        assert Counter(corpus.dev["label"]) == dev_counts


def test_mirror_text_is_read_verbatim(data_mirror):
    """QUOTE_NONE keeps GLUE's quote characters; the MRPC BOM does not leak into the header."""
    mrpc = GLUE_MRPC(data_mirror=data_mirror)
    assert mrpc.train[0]["sentence1"].startswith('Amrozi accused his brother, whom he called "the witness"')
    assert GLUE_SST2(data_mirror=data_mirror).train[0]["sentence"] == "hide new secretions from the parental units "
    rte = GLUE_RTE(data_mirror=data_mirror)
    assert rte.label_names == ("entailment", "not_entailment") and rte.train[0]["label"] == 1


def test_registry_names_and_hub_ids_resolve_to_the_same_task(data_mirror):
    reference = load_corpus("mrpc", data_mirror=data_mirror).fingerprint
    for args in [("glue", "mrpc"), ("nyu-mll/glue", "mrpc"), ("MRPC",), ("mrpc", "mrpc")]:
        assert load_corpus(*args, data_mirror=data_mirror).fingerprint == reference
    assert load_corpus("STS-B", data_mirror=data_mirror).name == "stsb"


def test_mirror_from_environment(data_mirror, monkeypatch):
    monkeypatch.setenv("LAYERTUNE_DATA_MIRROR", str(data_mirror))
    assert len(load_corpus("rte").dev) == 277


def test_imdb_balanced_subsample_is_deterministic(data_mirror):
    corpus = IMDB(train_size=800, test_size=200, data_mirror=data_mirror)
    assert (len(corpus.train), len(corpus.dev), corpus.test) == (800, 200, None)
    assert Counter(corpus.train["label"]) == {0: 400, 1: 400}
    assert Counter(corpus.dev["label"]) == {0: 100, 1: 100}
    assert corpus.metrics == ("accuracy", "f1") and corpus.main_metric == "f1" and corpus.max_length == 512
    assert any("no validation split" in n and "test" in n for n in corpus.notes)
    again = IMDB(train_size=800, test_size=200, data_mirror=data_mirror)
    assert again.train[:] == corpus.train[:] and again.dev[:] == corpus.dev[:]
    assert again.fingerprint == corpus.fingerprint
    other_seed = IMDB(train_size=800, test_size=200, seed=7, data_mirror=data_mirror)
    assert other_seed.train["text"][:] != corpus.train["text"][:]
    assert other_seed.fingerprint != corpus.fingerprint


def test_stratified_subsample_keeps_class_proportions(data_mirror):
    corpus = load_corpus("sst2", data_mirror=data_mirror, train_size=1000, dev_size=100)
    # 37569 / 67349 of 1000 = 557.8 -> 558 positive; 444 / 872 of 100 = 50.9 -> 51.
    assert Counter(corpus.train["label"]) == {1: 558, 0: 442}
    assert Counter(corpus.dev["label"]) == {1: 51, 0: 49}
    assert load_corpus("sst2", data_mirror=data_mirror, train_size=1000, dev_size=100).fingerprint == corpus.fingerprint


def test_regression_subsample(data_mirror):
    corpus = GLUE_STSB(data_mirror=data_mirror, train_size=300)
    assert len(corpus.train) == 300 and len(corpus.dev) == 1500
    assert corpus.train[:] == GLUE_STSB(data_mirror=data_mirror, train_size=300).train[:]


def test_print_shows_splits_labels_and_metric(data_mirror, capsys):
    print(GLUE_COLA(data_mirror=data_mirror, train_size=100))
    out = capsys.readouterr().out
    assert "Corpus 'cola' (classification): train 100, dev 1,043" in out
    assert "labels ['unacceptable', 'acceptable']" in out
    assert "matthews_correlation (model selection by matthews_correlation)" in out
    assert "stratified subsample of 100 of 8,551" in out


# ---------------------------------------------------------------------------------------------- the hub code path


def hub_shaped_rte(data_mirror) -> datasets.DatasetDict:
    """RTE as the hub serves it (ClassLabel, idx, unlabeled test), rebuilt from the mirror's TSVs."""
    features = datasets.Features({"sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["entailment", "not_entailment"]),
                                  "idx": datasets.Value("int32")})
    splits = {}
    for split, file in (("train", "train.tsv"), ("validation", "dev.tsv")):
        with open(data_mirror / "glue" / "RTE" / file, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        splits[split] = datasets.Dataset.from_dict(
            {"sentence1": [r["sentence1"] for r in rows], "sentence2": [r["sentence2"] for r in rows],
             "label": [r["label"] for r in rows], "idx": [int(r["index"]) for r in rows]},
            features=datasets.Features({**features, "label": datasets.Value("string")}),
        ).cast(features)
    splits["test"] = splits["validation"].map(lambda _: {"label": -1})
    return datasets.DatasetDict(splits)


def test_task_missing_from_mirror_comes_from_hub(data_mirror, tmp_path, monkeypatch):
    calls = fake_hub(monkeypatch, hub_shaped_rte(data_mirror))
    corpus = load_corpus("rte", data_mirror=tmp_path)
    assert calls == [("nyu-mll/glue", "rte")]
    assert corpus.train.column_names == ["sentence1", "sentence2", "label"] and corpus.test is None
    assert "Hugging Face hub" in corpus.notes[0]
    from_mirror = load_corpus("rte", data_mirror=data_mirror)
    assert corpus.train[:] == from_mirror.train[:] and corpus.dev[:] == from_mirror.dev[:]


def test_any_hub_dataset_guesses_columns_and_drops_unlabeled_test(monkeypatch):
    names = ["world", "sports", "business"]
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names),
                                  "id": datasets.Value("int64")})
    train = datasets.Dataset.from_dict(
        {"text": [f"news {i}" for i in range(60)], "label": [i % 3 for i in range(60)], "id": list(range(60))},
        features=features)
    test = datasets.Dataset.from_dict({"text": ["x", "y"], "label": [-1, -1], "id": [0, 1]}, features=features)
    calls = fake_hub(monkeypatch, datasets.DatasetDict({"train": train, "test": test}))
    corpus = load_corpus("someone/news", train_size=30)
    assert calls == [("someone/news", None)]
    assert corpus.text_columns == ("text",) and corpus.label_names == tuple(names)
    assert corpus.metrics == ("accuracy",) and corpus.test is None
    assert len(corpus.dev) == 6 and Counter(corpus.dev["label"]) == {0: 2, 1: 2, 2: 2}  # carved, stratified
    assert Counter(corpus.train["label"]) == {0: 10, 1: 10, 2: 10}
    assert any("test split has no labels" in n for n in corpus.notes)


def test_class_empty_after_balancing_names_the_class(monkeypatch):
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "neutral", "pos"])})
    rows = {"text": [f"t{i}" for i in range(40)], "label": [0, 2] * 20}  # no "neutral" at all
    fake_hub(monkeypatch, datasets.DatasetDict({
        "train": datasets.Dataset.from_dict(rows, features=features),
        "validation": datasets.Dataset.from_dict(rows, features=features),
    }))
    with pytest.raises(ValueError, match="Class 'neutral' would have no examples after balancing.*no 'neutral'"):
        load_corpus("someone/sentiment", balanced=True)


def test_offline_without_mirror_says_how_to_point_at_one(offline, monkeypatch):
    monkeypatch.delenv("LAYERTUNE_DATA_MIRROR", raising=False)
    with pytest.raises(DataUnavailableError) as error:
        load_corpus("rte")
    message = str(error.value)
    assert "Couldn't reach 'nyu-mll/glue'" in message and "No data mirror is set" in message
    assert "LAYERTUNE_DATA_MIRROR=/path/to/data" in message and "glue/RTE/train.tsv" in message
    assert isinstance(error.value, ConnectionError)


def test_offline_with_mirror_lacking_the_task(offline, tmp_path):
    with pytest.raises(DataUnavailableError, match=f"data mirror {tmp_path} has no imdb/train.parquet"):
        IMDB(data_mirror=tmp_path)


def test_offline_hub_dataset_suggests_local_files(offline):
    with pytest.raises(DataUnavailableError, match=r"Couldn't reach 'someone/thing'.*data_files="):
        load_corpus("someone/thing")



@pytest.mark.parametrize("name", ["{tmp}/nothere.csv", "nothere.jsonl", "{tmp}/train.conll"])
def test_a_missing_file_is_a_missing_file_not_a_hub_dataset(offline, name, tmp_path):
    """A path that does not exist used to be asked of the hub, which answered about being offline. A hub id that
    ends as a file does, its owner no local folder, is still the hub's."""
    name = name.format(tmp=tmp_path)
    with pytest.raises(FileNotFoundError, match=f"^Data file {re.escape(name)} does not exist"):
        load_corpus(name)
    with pytest.raises(DataUnavailableError, match="Couldn't reach 'someone/reviews.json'"):
        load_corpus("someone/reviews.json")


# ------------------------------------------------------------------------------------------------- local files


def test_local_csv_with_string_labels_gets_a_carved_stratified_dev(tmp_path):
    rows = [{"review": f"text number {i}", "sentiment": "good" if i % 10 < 7 else "bad"} for i in range(200)]
    path = write_csv(tmp_path / "reviews.csv", rows)
    corpus = load_corpus(path, text_columns=["review"], label_column="sentiment")
    assert corpus.name == "reviews" and corpus.label_names == ("bad", "good")
    assert (len(corpus.train), len(corpus.dev)) == (180, 20)
    assert Counter(corpus.dev["label"]) == {1: 14, 0: 6}  # 70/30 kept
    assert any("carved from train" in n and "stratified" in n for n in corpus.notes)
    again = load_corpus(path, text_columns=["review"], label_column="sentiment")
    assert again.dev[:] == corpus.dev[:] and again.train[:] == corpus.train[:]
    assert again.fingerprint == corpus.fingerprint
    assert load_corpus(path, text_columns=["review"], label_column="sentiment", seed=1).dev[:] != corpus.dev[:]


def test_local_files_per_split_json_jsonl_parquet(tmp_path):
    train = [{"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % 3, "extra": i} for i in range(30)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in train))
    (tmp_path / "dev.json").write_text(json.dumps(train[:9]))
    pd.DataFrame(train[:6]).to_parquet(tmp_path / "test.parquet")
    corpus = load_corpus("nli", data_files={"train": tmp_path / "train.jsonl", "validation": tmp_path / "dev.json",
                                           "test": tmp_path / "test.parquet"})
    assert corpus.name == "nli" and corpus.text_columns == ("premise", "hypothesis")
    assert [len(s) for s in corpus.splits().values()] == [30, 9, 6]
    assert corpus.label_names == ("0", "1", "2") and corpus.dev["label"][:3] == [0, 1, 2]
    assert corpus.train.column_names == ["premise", "hypothesis", "label"]


def test_local_folder_and_regression(tmp_path):
    write_csv(tmp_path / "train.csv", [{"text": f"t{i}", "score": i / 10} for i in range(20)])
    write_csv(tmp_path / "validation.csv", [{"text": f"d{i}", "score": i / 4} for i in range(4)])
    corpus = load_corpus(str(tmp_path))
    assert corpus.task_type == "regression" and corpus.metrics == ("spearmanr", "pearsonr")
    assert corpus.dev["label"][:] == [0.0, 0.25, 0.5, 0.75]


def test_local_tsv_in_official_glue_layout_is_recognised(tmp_path):
    cola = 'gj04\t1\t\tThe "big" dog barked.\ngj04\t0\t*\tDog the barked.\n' * 10
    (tmp_path / "train.tsv").write_text(cola)
    (tmp_path / "dev.tsv").write_text(cola[: cola.index("\n") + 1] * 3)
    corpus = load_corpus(str(tmp_path))
    assert corpus.name == "cola" and corpus.metrics == ("matthews_correlation",)
    assert corpus.train[0] == {"sentence": 'The "big" dog barked.', "label": 1} and len(corpus.dev) == 3


def test_local_files_read_as_a_named_registry_task(tmp_path):
    header = "index\tsentence1\tsentence2\tlabel\n"
    (tmp_path / "train.tsv").write_text(header + "".join(f"{i}\ta{i}\tb{i}\t{'not_' * (i % 2)}entailment\n"
                                                         for i in range(20)))
    corpus = load_corpus("rte", data_files={"train": tmp_path / "train.tsv", "dev": tmp_path / "train.tsv"})
    assert corpus.label_names == ("entailment", "not_entailment")
    assert corpus.train["label"][:4] == [0, 1, 0, 1] and len(corpus.dev) == 20


# --------------------------------------------------------------------------------------------------- bad input


def test_unknown_task_suggests_close_match():
    with pytest.raises(ValueError, match=r"Unknown task 'cols'\. Did you mean 'cola'\?.*Valid choices: cola, sst2"):
        load_corpus("cols")


def test_unknown_config_suggests_close_match():
    with pytest.raises(ValueError, match=r"Unknown GLUE config 'mrcp'\. Did you mean 'mrpc'\?"):
        load_corpus("glue", "mrcp")
    with pytest.raises(ValueError, match=r"'glue' needs a config.*Valid choices: cola, sst2, mrpc, rte, stsb"):
        load_corpus("glue")
    with pytest.raises(ValueError, match=r"Unknown cola config 'rte'"):
        load_corpus("cola", "rte")


def test_missing_label_column_lists_the_columns(tmp_path):
    path = write_csv(tmp_path / "data.csv", [{"text": "a", "stars": 1}, {"text": "b", "stars": 2}])
    with pytest.raises(ValueError, match=r"column 'rating' not in .*data.csv; columns: text, stars"):
        load_corpus(path, label_column="rating")


def test_unguessable_text_columns_lists_the_columns(tmp_path):
    path = write_csv(tmp_path / "data.csv", [{"title": "a", "body": "b", "label": 0}] * 4)
    expected = r"Cannot guess the text column\(s\) of .*data.csv; its columns are title \(\w*string\), body"
    with pytest.raises(ValueError, match=expected):
        load_corpus(path)


def test_bad_local_inputs(tmp_path):
    (tmp_path / "train.txt").write_text("x")
    with pytest.raises(ValueError, match=r"Unknown file type '\.txt'.*\.csv, \.tsv"):
        load_corpus("mine", data_files=tmp_path / "train.txt")
    with pytest.raises(ValueError, match=r"Unknown split 'eval'.*Valid choices: train, dev, validation"):
        load_corpus("mine", data_files={"train": tmp_path / "train.txt", "eval": tmp_path / "train.txt"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus("mine", data_files={"train": tmp_path / "missing.csv"})


def test_bad_sizes_and_options(data_mirror):
    with pytest.raises(ValueError, match="train_size must be a positive int or None, not 0"):
        load_corpus("cola", train_size=0)
    with pytest.raises(ValueError, match="balanced=True needs a classification task; 'stsb' is regression"):
        load_corpus("stsb", balanced=True)
    with pytest.raises(ValueError, match="dev_size=2,000 but the dev split has only 1,043 examples"):
        load_corpus("cola", data_mirror=data_mirror, dev_size=2000)
    with pytest.raises(ValueError, match="Class 'pos' would have no examples after balancing: train_size=1"):
        IMDB(train_size=1, data_mirror=data_mirror)
    with pytest.raises(FileNotFoundError, match="data_mirror='/no/such/folder' is not a folder"):
        load_corpus("cola", data_mirror="/no/such/folder")


def _csv(path, text: str, encoding: str = "utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))
    return path


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ("sentence,label\ngood film,1\nbad film,\nfine,0\nawful,\n",
         r"train.csv: column 'label' is blank or missing in 2 of 4 rows \(2, 4;"),
        ("sentence,label\ngood film,1\n,0\nfine,0\n", r"train.csv: column 'sentence' is blank or missing in 1 of 3 rows \(2;"),
        ("sentence,label\ngood film,pos\nbad film,pos\n", "every label is 'pos'. A classifier needs at least two classes"),
        ("", r"train.csv is empty: no header and no rows"),
        ("sentence,label\n", r"train.csv has a header \(sentence,label\) but no rows"),
    ],
)
def test_bad_local_files_are_named_with_what_is_wrong(tmp_path, train, message):
    _csv(tmp_path / "data" / "train.csv", train)
    labels = ("pos", "pos") if "pos" in train else (1, 0)
    _csv(tmp_path / "data" / "dev.csv", f"sentence,label\ngood,{labels[0]}\nbad,{labels[1]}\n")
    with pytest.raises(ValueError, match=message):
        load_corpus(str(tmp_path / "data"))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    _csv(tmp_path / "data" / "train.csv", "sentence,label\ncafé crème,1\nbad,0\n", encoding="latin-1")
    with pytest.raises(ValueError, match=r"train.csv is not UTF-8 text \(line 2: byte b'\\xe9'\): save it as UTF-8"):
        load_corpus(str(tmp_path / "data"))


# ------------------------------------------------------------------------------------------------------ labels


def _split_files(folder, **splits: list[tuple[str, object]]) -> str:
    """A folder with one ``<split>.csv`` per keyword: rows of (sentence, label)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        write_csv(folder / f"{split}.csv", [{"sentence": s, "label": label} for s, label in rows])
    return str(folder)


TRAIN = [("good film", "pos"), ("bad film", "neg"), ("great", "pos"), ("awful", "neg")]


def test_labels_are_stripped_of_surrounding_whitespace(tmp_path):
    data = _split_files(tmp_path / "data", train=[("good film", "pos "), ("bad film", " neg"), *TRAIN],
                        dev=[("fine", "pos"), ("dull", "neg\t")])
    corpus = load_corpus(data)
    assert corpus.label_names == ("neg", "pos")
    assert corpus.train["label"] == [1, 0, 1, 0, 1, 0] and corpus.dev["label"] == [1, 0]


def test_labels_differing_only_in_case_are_an_error_naming_both_files(tmp_path):
    data = _split_files(tmp_path / "data", train=TRAIN, dev=[("fine", "Pos"), ("dull", "neg")])
    with pytest.raises(ValueError) as error:
        load_corpus(data)
    message = str(error.value)
    assert f"'Pos' (in {tmp_path / 'data' / 'dev.csv'})" in message
    assert f"'pos' (in {tmp_path / 'data' / 'train.csv'})" in message
    assert "differ only in case" in message and "spell each class the same way" in message


def test_a_dev_label_never_seen_in_train_is_an_error(tmp_path):
    data = _split_files(tmp_path / "data", train=TRAIN, dev=[("fine", "pos"), ("meh", "neutral")])
    expected = (rf"{tmp_path / 'data' / 'dev.csv'}: label\(s\) 'neutral' never occur in the train data "
                rf"\({tmp_path / 'data' / 'train.csv'}\), whose labels are 'neg', 'pos'")
    with pytest.raises(ValueError, match=expected):
        load_corpus(data)
    numbers = _split_files(tmp_path / "numbers", train=[("a", 0), ("b", 1)], test=[("c", 2), ("d", 1)])
    with pytest.raises(ValueError, match=r"test.csv: label\(s\) '2' never occur .* whose labels are '0', '1'"):
        load_corpus(numbers)


def test_a_train_split_of_one_class_is_an_error_even_when_dev_has_two(tmp_path):
    data = _split_files(tmp_path / "data", train=[("good", "pos"), ("great", "pos")],
                        dev=[("fine", "pos"), ("bad", "neg")])
    with pytest.raises(ValueError, match=r"train.csv: every label is 'pos'\. A classifier needs at least two"):
        load_corpus(data)


def test_a_hub_train_split_of_one_class_is_an_error(monkeypatch):
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b"])})
    rows = {"text": [f"t{i}" for i in range(20)], "label": [0] * 20}
    fake_hub(monkeypatch, datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}))
    with pytest.raises(ValueError, match=r"train split of 'someone/one-class': every label is 'a'"):
        load_corpus("someone/one-class")


@pytest.mark.parametrize(("column", "role"), [("text", "text"), ("label", "label")])
def test_a_list_valued_column_is_named_with_its_type(tmp_path, column, role):
    rows = {"text": [["good", "film"], ["bad", "film"]] if column == "text" else ["good film", "bad film"],
            "label": [[1, 0], [0, 1]] if column == "label" else [1, 0]}
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    kind = "list<item: string>" if column == "text" else "list<item: int64>"
    with pytest.raises(ValueError, match=rf"train.parquet: column '{column}' has type {kind}, not one {role} per row"):
        load_corpus(str(tmp_path / "train.parquet"))


def test_a_class_with_one_example_cannot_be_carved_into_dev(tmp_path):
    rows = [(f"text {i}", "pos" if i % 2 else "neg") for i in range(20)] + [("odd one", "neutral")]
    data = _split_files(tmp_path / "data", train=rows)
    expected = rf"{tmp_path / 'data' / 'train.csv'}: class 'neutral' has 1 example, and a dev split carved from train"
    with pytest.raises(ValueError, match=expected):
        load_corpus(data)


def test_many_classes_of_one_example_are_counted_in_one_short_line(tmp_path):
    """300 classes in 300 rows (a label column that is an id, say) gave a 7,254-character message."""
    data = _split_files(tmp_path / "data", train=[(f"text {i}", f"class{i:03}") for i in range(300)])
    with pytest.raises(ValueError) as error:
        load_corpus(data)
    message = str(error.value)
    assert len(message) < 600 and "\n" not in message, message
    assert ("300 classes have 1 example ('class000', 'class001', 'class002', 'class003', 'class004' and 295 more), "
            "and a dev split carved from train (stratified by class) needs 2 examples of each class. Every class has "
            "1 (300 in 300 rows): is the label column the label?") in message
    assert "splits: {train: <file>, dev: <file>}" in message


def test_a_carved_dev_holds_every_class(tmp_path):
    rows = [(f"text {i}", "abc"[i % 3]) for i in range(12)]  # 10 % of 12 rounds to 1 example: too few for 3 classes
    corpus = load_corpus(_split_files(tmp_path / "data", train=rows))
    assert sorted(corpus.dev["label"]) == [0, 1, 2] and len(corpus.train) == 9
