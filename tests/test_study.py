"""params.yaml: the schema of every study, errors that name the key, the plan, profiles, and agreement between DVC,
Kedro, the library and the code."""

import copy
import inspect
import re
from pathlib import Path

import pytest
import yaml

from layertune.specs import CombineSpec, CorpusSpec, EncoderSpec, HeadSpec
from pipelines.profiles import apply_overrides, dvc_arguments, load_profile
from layertune.specs import DatasetSpec, SampleSpec
from layertune.study import ParamsError, ReportKind
from pipelines.params import read_yaml, validate_params
from pipelines.plans import dvc_stage, plan_studies
from layertune.training_config import TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


@pytest.fixture(scope="module")
def params() -> dict:
    """params.yaml less the records of its decided studies' later rounds, which tie them to today's grid (a test
    that edits a grid would meet the record first; tests/test_rounds.py tests the records)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for study in params["studies"].values():
        if study.get("decide"):
            study["decide"]["rounds"] = {}
            study["decide"]["evaluation_rounds"] = {}
    return params


def error_of(params: dict) -> str:
    with pytest.raises(ParamsError) as raised:
        validate_params(params)
    return str(raised.value)


def edited(params: dict, path: str, value) -> dict:
    changed = copy.deepcopy(params)
    *parents, key = path.split(".")
    node = changed
    for part in parents:
        node = node[part]
    node[key] = value
    return changed


def test_params_yaml_is_valid(params):
    checked = validate_params(params)
    assert set(checked.studies) == {"ablation", "ner", "multi_encoder", "methods"}
    assert all(len(study.seeds) >= 2 for study in checked.studies.values())  # every default study has seeds


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_validates(params, profile, fake_hub):  # GPU profiles name hub models: their configs, offline
    validate_params(apply_overrides(params, load_profile(profile, ROOT)))


def test_ci_profile_is_small(params):
    plan = plan_studies(apply_overrides(params, load_profile("ci", ROOT)))
    assert len(plan.cells()) <= 11
    # the default studies' per-K budgets (30 or 100 epochs) would not reach CI through a profile's training.epochs
    assert max(cell.spec.training.epochs for cell in plan.cells()) <= 6
    assert all(cell.spec.training.mixed_precision == "no" for cell in plan.cells())  # what every machine computes


def test_early_stopping_without_a_validation_slice_is_refused_at_plan_time(params):
    no_slice = edited(params, "studies.ner.data", {"train_size": 100, "seed": 42})
    study_wide = edited(no_slice, "studies.ner.per_tunable_layers", {})
    assert ("studies.ner: training.early_stopping_patience: 2, but data.validation_size is not set: early stopping "
            "needs a validation slice" in error_of(study_wide))
    per_k = edited(study_wide, "studies.ner.training.early_stopping_patience", None)
    validate_params(per_k)  # no patience, no slice: every epoch trains, dev picks the best, as before slices
    per_k = edited(per_k, "studies.ner.per_tunable_layers", {0: {"early_stopping_patience": 10}})
    assert "studies.ner: per_tunable_layers.0.early_stopping_patience: 10, but" in error_of(per_k)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("studies.ablation.training.learnin_rate", 1.0,
         r"studies.ablation.training.learnin_rate: unknown key. Did you mean 'learning_rate'"),
        ("studies.ablation.training.learning_rate", "1e-3",
         r"studies.ablation.training.learning_rate: Input should be a valid number .*got '1e-3'"),
        ("studies.ablation.tasks", ["sst2", "sst3"], r"unknown task 'sst3'. Did you mean 'sst2'"),
        ("studies.ablation.tunable_layers", [0, 9], r"studies.ablation.tunable_layers\[1\]: 9 is out of range: encoder "
                                                    r"'all-MiniLM-L6-v2' \(sentence-transformers/all-MiniLM-L6-v2\) "
                                                    r"has 6 layers"),
        ("studies.ablation.tunable_layers", [0, "some"], r"studies.ablation.tunable_layers\[1\]"),
        ("studies.ablation.seeds", [1, 1], "seeds must not repeat; 1 appear"),
        ("studies.ablation.report", {"kind": "layer"}, r"studies.ablation.report.kind: Input should be 'layers'"),
        ("studies.ablation.encoders", {"bad/name": "m"}, "studies.ablation.encoders.bad/name: 'bad/name' is not a "
                                                          "valid name: a name is letters, digits"),
        ("studies.ablation.encoders", {"on": "m"}, "studies.ablation.encoders.on: 'on' is not a valid name: YAML "
                                                   "reads it as a boolean or null"),
        ("studies.ablation.encoders", {"m.2": "m"}, "studies.ablation.encoders.m.2: 'm.2' is not a valid name"),
        ("studies.ablation.seeds", [-1, 2], r"studies.ablation.seeds\[0\]: Input should be greater than or equal to 0"),
        ("studies.ablation.seeds", [1, 2**32], r"studies.ablation.seeds\[1\]: Input should be less than or equal to "
                                               "4294967295"),
        ("studies.ablation.data.seed", -1, r"studies.ablation.data.seed: Input should be greater than or equal to 0"),
        ("studies.ablation.training.max_length", 100_000,
         r"studies.ablation.training.max_length: 100000 is longer than encoder 'all-MiniLM-L6-v2' "
         r"\(sentence-transformers/all-MiniLM-L6-v2\) takes: at most 512 tokens"),
        ("studies.ablation.encoders", {"x": "no-such-org/no-such-model"}, "studies.ablation.encoders.x: unknown model"),
        ("studies.ablation.encoders", {"x": {"model": "sentence-transformers/all-MiniLM-L6-v2", "poolin": "cls"}},
         r"studies.ablation.encoders.x.poolin: unknown key. Did you mean 'pooling'"),
        ("studies.multi_encoder.encoders.dme", {"combine": "dme", "members": ["all-MiniLM-L6-v2", "nope"]},
         "encoders.dme.members: 'nope' is not a single encoder of this study"),
        ("studies.ner.per_tunable_layers", {2: {"epochs": 0}},  # off the grid, checked all the same
         r"per_tunable_layers\[2\].epochs: Input should be greater than 0"),
        ("studies.ner.per_tunable_layers", {0: {"max_length": 64}}, "max_length can only be set for the whole study"),
        ("studies.ner.per_tunable_layers", {0: {"learning_rate": -1.0}},
         r"per_tunable_layers.0.learning_rate: Value error, learning rates must be positive|learning rates must be"),
        ("studies.ablation.training.seed", 3, "studies.ablation.training.seed: each cell's seed comes from"),
        ("studies.ablation.data.train_size", 0, r"studies.ablation.data.train_size: Input should be greater than 0"),
        # a study of tuning methods: each setting names its method and layers
        ("studies.methods.methods.lora-top2.tunable_layers", 9,
         r"studies.methods.methods.lora-top2.tunable_layers: 9 is out of range: encoder 'all-MiniLM-L6-v2'"),
        ("studies.methods.methods.lora-top2.tunable_layers", 0,
         r"studies.methods.methods.lora-top2: .*tunable_layers=0 with method 'lora'.*method 'top_k' with "
         r"tunable_layers=0 to train the head alone"),
        ("studies.methods.methods.lora-all.method", {"name": "lora", "r": 0},
         r"studies.methods.methods.lora-all.method.r: Input should be greater than 0"),
        ("studies.methods.methods.lora-all.method", {"name": "lorra"}, r"lorra.*Did you mean 'lora'"),
        # an encoder entry's keys are its form's (pydantic's Tag names it: a combination's, not a single one's)
        ("studies.multi_encoder.encoders.dme", {"combine": "dme", "memebrs": ["a", "b"]},
         r"studies.multi_encoder.encoders.dme.memebrs: unknown key. Did you mean 'members'\?"),
        # a method's keys are its own (IA3's, not the first method's of the union)
        ("studies.methods.methods.lora-all.method", {"name": "ia3", "target_module": ["query"]},
         r"studies.methods.methods.lora-all.method.target_module: unknown key. Did you mean 'target_modules' or "
         r"'feedforward_modules'\? Valid choices: name, target_modules, feedforward_modules\."),
        # a key the user chose that equals a union's tag (a setting named lora, an encoder named single) stays
        ("studies.methods.methods.lora", {"method": {"name": "lora", "rr": 8}, "tunable_layers": 2},
         r"studies.methods.methods.lora.method.rr: unknown key. Did you mean 'r'\?"),
        ("studies.ablation.encoders.single", {"model": "sentence-transformers/all-MiniLM-L6-v2", "poolin": "cls"},
         r"studies.ablation.encoders.single.poolin: unknown key. Did you mean 'pooling'"),
        ("studies.methods.tunable_layers", [0, 2], r"studies.methods: .*give tunable_layers .* or methods .*not both"),
        ("studies.methods.encoders.all-MiniLM-L6-v2", {"model": "sentence-transformers/all-MiniLM-L6-v2",
                                                       "method": "lora"},
         r"encoders.all-MiniLM-L6-v2.method: the study's methods axis sets each cell's method"),
        ("studies.methods.methods.Lora", {"tunable_layers": 2},
         r"studies.methods.methods.Lora: 'Lora' is not a valid name"),
    ],
)
def test_bad_values_are_named_by_their_key(params, path, value, message):
    assert len(__import__("re").findall(message, error_of(edited(params, path, value)))) > 0


@pytest.mark.parametrize(("name", "problem"), [
    ("yes", "YAML reads it as a boolean or null"), ("null", "YAML reads it as a boolean or null"),
    ("01", "a name is lower-case letters"), ("Ablation", "a name is lower-case letters"),
    ("a.b", "a name is lower-case letters"), (True, "YAML read it as a boolean, not as text"),
    (1, "YAML read it as a number, not as text")])
def test_study_names_that_kedro_or_dvc_would_misread_are_refused(params, name, problem):
    """`kedro run --params study=yes` reads the value as YAML (True), `01` as 1; DVC reads `${studies.a.b}` as a
    path. The error names the study by its key, not by the whole mapping of studies."""
    changed = copy.deepcopy(params)
    changed["studies"][name] = changed["studies"].pop("ner")
    message = error_of(changed)
    assert f"studies.{name}: {name!r} is not a valid name" in message and problem in message
    assert "per_tunable_layers" not in message and len(message) < 400


def test_seeds_at_the_edges_of_numpys_range_are_valid(params):
    checked = validate_params(edited(edited(params, "studies.ablation.seeds", [0, 2**32 - 1]),
                                     "studies.ablation.data.seed", 0))
    assert checked.studies["ablation"].seeds == [0, 2**32 - 1]


def test_every_task_has_a_valid_name():
    from pipelines.params import name_problem
    from layertune.corpora.registry import TASKS

    assert {task: name_problem(task) for task in TASKS} == {task: None for task in TASKS}


def test_max_length_is_checked_against_the_models_config_and_tokenizer(params, tmp_path):
    """The tiny model has 128 positions; a tokenizer that says 100 lowers the limit, as `LanguageModel.max_length`
    has it."""
    import json

    from layertune.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", "bert")
    study = edited(edited(params, "studies.ablation.encoders", {"tiny": str(model)}), "studies.ablation.tunable_layers",
                   [0, 1])
    validate_params(edited(study, "studies.ablation.training.max_length", 128))
    assert "max_length: 129 is longer than encoder 'tiny'" in error_of(
        edited(study, "studies.ablation.training.max_length", 129))
    tokenizer = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": 100}))
    changed = edited(edited(study, "studies.ablation.training.max_length", 101), "studies.ablation.encoders",
                     {"tiny": str(model) + "/"})  # another name: the config is read again
    assert "at most 100 tokens" in error_of(changed)


def test_the_plan_records_the_files_each_cell_starts_from(tmp_path):
    """A model changed in place changes the plan files of the cells (and the tokenize slice) built on it, and only
    those: DVC reruns exactly them. The same files elsewhere give the same fingerprint."""
    import shutil

    from layertune.testing import make_tiny_model

    make_tiny_model(tmp_path / "a", "bert", seed=0)
    make_tiny_model(tmp_path / "b", "bert", seed=1)
    params = {"download": {"mirror": None}, "studies": {"s": {
        "report": {"kind": "encoders"}, "tasks": ["sst2"], "tunable_layers": [1], "seeds": [1],
        "encoders": {"a": str(tmp_path / "a"), "b": str(tmp_path / "b"),
                     "ab": {"combine": "concat", "members": ["a", "b"]}}}}}
    before = plan_studies(params)
    cells = {cell.encoder: cell for cell in before.cells()}
    assert cells["ab"].model_fingerprints == [cells["a"].model_fingerprints[0], cells["b"].model_fingerprints[0]]
    assert None not in cells["ab"].model_fingerprints and len(set(cells["ab"].model_fingerprints)) == 2

    make_tiny_model(tmp_path / "b", "bert", seed=2)  # new weights, same config and tokenizer, in place
    after = plan_studies(params)
    changed = {cell.encoder for cell in after.cells() if cell != cells[cell.encoder]}
    assert changed == {"b", "ab"}
    assert after.features["s"].fingerprints[0] == before.features["s"].fingerprints[0]
    assert after.features["s"].fingerprints[1] != before.features["s"].fingerprints[1]

    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    moved = edited(params, "studies.s.encoders.a", str(tmp_path / "elsewhere"))
    assert {c.encoder: c.model_fingerprints for c in plan_studies(moved).cells()}["a"] == cells["a"].model_fingerprints


def test_a_hub_model_has_no_fingerprint(params):
    from layertune.model_paths import model_fingerprint

    assert model_fingerprint("bert-base-cased") is None  # no files here: known by name only


def test_a_missing_section_is_named(params):
    del (changed := copy.deepcopy(params))["studies"]["ablation"]["report"]
    assert "studies.ablation.report: required key is missing" in error_of(changed)


def test_cells_are_the_grid_named_like_dvc(params):
    plan = plan_studies(params)
    for name, study in plan.studies.items():
        spec = study.spec
        assert len(study.cells) == len(spec.tasks) * len(spec.encoders) * len(spec.grid_settings) * len(spec.seeds)
    cell = plan.studies["multi_encoder"].cells[-1]
    assert cell.key == "sst2-dme-2-3"  # the last seed of the grid
    assert [e.model for e in cell.spec.encoders] == ["sentence-transformers/all-MiniLM-L6-v2",
                                                     "sentence-transformers/paraphrase-MiniLM-L3-v2"]
    assert cell.spec.combine.method == "dme" and cell.spec.training.seed == 3


def test_the_default_studies_keep_the_keys_of_their_trained_cells():
    """Keys name cell folders, report rows and MLflow runs: the default studies keep theirs (the committed
    reports' rows), their recorded rounds included."""
    import pandas as pd

    from pipelines.params import read_params

    for name, study in plan_studies(read_params(ROOT)).studies.items():
        recorded = set(pd.read_csv(ROOT / "reports" / name / "cells.csv")["key"])
        assert {cell.key for cell in study.cells} == recorded, name


def test_two_cells_with_one_key_are_refused_naming_both(params):
    """'-' joins a key's parts and may appear in names: tasks a and a-b with encoders b-c and c would both name
    a-b-c-0-1, and one cell would overwrite the other."""
    model = "sentence-transformers/all-MiniLM-L6-v2"
    layers = edited(params, "studies.ablation.tasks", {"a": {"task": "sst2"}, "a-b": {"task": "stsb"}})
    layers = edited(layers, "studies.ablation.encoders", {"b-c": model, "c": model})
    layers = edited(layers, "studies.ablation.per_task", {})  # its sst2 is not a task here
    assert ("studies.ablation: cells (task a, encoder b-c, tunable layers 0) and (task a-b, encoder c, tunable "
            "layers 0) would both be named a-b-c-0-1" in error_of(layers))
    methods = edited(params, "studies.methods.encoders", {"b": model, "b-lora": model})
    methods = edited(methods, "studies.methods.methods", {"lora-top2": {"method": "lora", "tunable_layers": 2},
                                                          "top2": {"tunable_layers": 2}})
    methods = edited(methods, "studies.methods.per_tunable_layers", {})  # its K = 0 is off this grid
    message = error_of(methods)
    assert ("studies.methods: cells (task sst2, encoder b, method lora-top2) and (task sst2, encoder b-lora, method "
            "top2) would both be named sst2-b-lora-top2-1" in message and "rename one of them" in message)
    assert "(got {" not in message  # the whole study is not repeated after the message
    validate_params(edited(layers, "studies.ablation.encoders", {"b_c": model, "c": model}))  # distinct keys pass


def test_per_tunable_layers_overrides_reach_only_their_cells(params):
    ner = edited(params, "studies.ner.per_tunable_layers", {0: {"head_learning_rate": 3e-3}, 1: {"epochs": 7}})
    cells = plan_studies(ner).studies["ner"].cells
    rates = {(c.tunable_layers, c.seed): c.spec.training.head_learning_rate for c in cells}
    head = params["studies"]["ner"]["training"]["head_learning_rate"]
    assert rates[0, 1] == rates[0, 2] == 3e-3 and rates[1, 1] == rates["all", 2] == head != 3e-3
    epochs = {(c.tunable_layers, c.seed): c.spec.training.epochs for c in cells}
    assert epochs[1, 1] == epochs[1, 2] == 7 != epochs["all", 1] == params["studies"]["ner"]["training"]["epochs"]


def test_a_tasks_own_overrides_win_over_per_tunable_layers_for_that_task_only(params):
    """An ablation over SST-2 and STS-B whose K = 2 rate STS-B chose: SST-2 keeps its own."""
    ablation = edited(params, "studies.ablation.per_tunable_layers", {2: {"learning_rate": 4e-4, "epochs": 20}})
    ablation = edited(ablation, "studies.ablation.per_task", {"sst2": {"2": {"learning_rate": 5e-5}}})  # "2": as JSON
    cells = plan_studies(ablation).studies["ablation"].cells
    training = {(c.task, c.tunable_layers): c.spec.training for c in cells if c.seed == 1}
    assert (training["sst2", 2].learning_rate, training["sst2", 2].epochs) == (5e-5, 20)  # the rest of K's kept
    assert (training["stsb", 2].learning_rate, training["stsb", 2].epochs) == (4e-4, 20)
    assert training["sst2", 1] == training["stsb", 1]  # another K: the same for both tasks


def test_a_per_k_head_override_reaches_only_its_cells_and_leaves_the_others_keys_as_they_were(params):
    """The head alone on STS-B without dropout: its cells' head changes; every other cell's spec, so its build key
    (what decides whether it retrains), stays as it was."""
    before = {c.key: c.spec for c in plan_studies(params).studies["ablation"].cells}
    dropless = edited(params, "studies.ablation.per_task.stsb", {0: {"head_dropout": 0.0, "epochs": 40}})
    after = {c.key: c.spec for c in plan_studies(dropless).studies["ablation"].cells}
    changed = sorted(key for key in before if before[key] != after[key])
    assert changed == ["stsb-all-MiniLM-L6-v2-0-1", "stsb-all-MiniLM-L6-v2-0-2"]
    assert after["stsb-all-MiniLM-L6-v2-0-1"].head.head_dropout == 0.0
    assert after["stsb-all-MiniLM-L6-v2-0-1"].training.epochs == 40  # training keys beside it still reach training
    assert after["sst2-all-MiniLM-L6-v2-0-1"].head.head_dropout == 0.1
    assert before["sst2-all-MiniLM-L6-v2-0-1"].model_dump_json() == after["sst2-all-MiniLM-L6-v2-0-1"].model_dump_json()


@pytest.mark.parametrize(("value", "message"), [
    ({0: {"head_dropot": 0.0}}, r"per_tunable_layers.0.head_dropot: not a training or head argument. Did you mean "
                                r"'head_dropout'.*Valid choices: learning_rate, .*head_dropout\."),
    ({0: {"head_dropout": 1.5}}, r"per_tunable_layers\[0\].head_dropout: Input should be less than 1"),
])
def test_a_bad_per_k_key_is_named_with_the_valid_ones(params, value, message):
    assert re.search(message, error_of(edited(params, "studies.ner.per_tunable_layers", value)))


@pytest.mark.parametrize(("value", "message"), [
    ({"sst": {2: {"epochs": 3}}}, "studies.ablation: per_task.sst: not a task of this study. Did you mean 'sst2'.*"
                                  "Valid choices: sst2, stsb."),
    ({"sst2": {2: {"epochs": 0}}}, r"per_task.sst2\[2\].epochs: Input should be greater than 0"),
    ({"stsb": {0: {"max_length": 64}}}, "per_task.stsb.0: max_length can only be set for the whole study"),
])
def test_a_bad_per_task_override_is_named_by_its_key(params, value, message):
    assert re.search(message, error_of(edited(params, "studies.ablation.per_task", value))), \
        error_of(edited(params, "studies.ablation.per_task", value))


def test_per_encoder_settings_and_rates(params):
    changed = edited(params, "studies.multi_encoder.encoders.paraphrase-MiniLM-L3-v2",
                     {"model": "sentence-transformers/paraphrase-MiniLM-L3-v2", "learning_rate": 3e-5,
                      "hidden_dropout_prob": 0.3})
    changed = edited(changed, "studies.multi_encoder.per_tunable_layers", {})  # a setting's rate would win
    cells = {c.encoder: c for c in plan_studies(changed).studies["multi_encoder"].cells if c.seed == 0}
    assert cells["dme"].spec.training.learning_rate == [params["studies"]["multi_encoder"]["training"]["learning_rate"],
                                                        3e-5]
    assert [e.hidden_dropout_prob for e in cells["dme"].spec.encoders] == [None, 0.3]
    assert [e.pooling for e in cells["dme"].spec.encoders] == ["mean", "mean"]  # the study's encoder settings
    assert cells["paraphrase-MiniLM-L3-v2"].spec.training.learning_rate == 3e-5


def test_a_learning_rate_has_one_spelling_per_level_and_the_most_specific_wins():
    """Study < encoder < setting of the grid, resolved once into each cell's TrainingConfig (one rate per language
    model of a combination); the study's and a setting's rate is one rate."""
    from layertune.study import StudySpec, study_cells

    model = "sentence-transformers/all-MiniLM-L6-v2"
    study = {"report": {"kind": "layers"}, "tasks": ["sst2"], "seeds": [1], "tunable_layers": [0, 2],
             "encoders": {"own": {"model": model, "learning_rate": 3e-5}, "plain": model,
                          "both": {"members": ["own", "plain"], "combine": "dme"}},
             "training": {"learning_rate": 1e-4}, "per_tunable_layers": {0: {"learning_rate": 1e-2}}}
    rates = {(c.encoder, c.tunable_layers): c.spec.training.learning_rate
             for c in study_cells("s", StudySpec.model_validate(study))}
    assert rates == {("own", 2): 3e-5, ("plain", 2): 1e-4, ("both", 2): [3e-5, 1e-4],  # the encoder's, else the study's
                     ("own", 0): 1e-2, ("plain", 0): 1e-2, ("both", 0): 1e-2}  # the setting's wins over both
    cells = study_cells("s", StudySpec.model_validate(study))
    assert all("learning_rate" not in e.model_dump() for c in cells for e in c.spec.encoders)  # one home: training
    methods = {**study, "per_tunable_layers": {}, "tunable_layers": None,
               "methods": {"top2": {"tunable_layers": 2}, "lora": {"method": "lora", "tunable_layers": 2,
                                                                  "learning_rate": 3e-3}}}
    rates = {(c.encoder, c.method): c.spec.training.learning_rate
             for c in study_cells("m", StudySpec.model_validate(methods))}
    assert rates[("both", "top2")] == [3e-5, 1e-4] and rates[("both", "lora")] == rates[("own", "lora")] == 3e-3
    for bad, where in (({**study, "training": {"learning_rate": [1e-4, 3e-5]}}, "learning_rate: the study's is one "
                                                                                 "rate, got [0.0001, 3e-05]"),
                       ({**study, "per_tunable_layers": {2: {"learning_rate": [1e-4]}}},
                        "per_tunable_layers.2.learning_rate: a setting's rate is one rate, got [0.0001]")):
        with pytest.raises(ValueError, match=re.escape(where) + ".*encoders.<name>.learning_rate"):
            StudySpec.model_validate(bad)


def test_a_cell_saved_with_an_encoders_own_rate_loads_with_it_as_its_training_rate():
    """Cells saved before the rate had one home kept an encoder's own rate in its EncoderSpec."""
    from layertune.specs import CellSpec

    old = {"corpus": {"task": "sst2"}, "combine": {"method": "dme"}, "training": {"learning_rate": 1e-4},
           "encoders": [{"model": "a", "learning_rate": 3e-5}, {"model": "b", "learning_rate": None}]}
    spec = CellSpec.model_validate(old)
    assert spec.training.learning_rate == [3e-5, 1e-4] and spec.encoders[1] == EncoderSpec(model="b")
    alone = CellSpec.model_validate({**old, "combine": None, "encoders": [{"model": "a", "learning_rate": None}]})
    assert alone.training.learning_rate == 1e-4 and alone.encoders == [EncoderSpec(model="a")]


def test_adding_a_seed_changes_no_existing_cell_and_no_earlier_slice(params):
    """What each stage reads: adding a seed adds cells and leaves every existing cell, prepare and tokenize slice
    as it was (so DVC reruns none of them)."""
    before = plan_studies(params)
    after = plan_studies(edited(params, "studies.ner.seeds", [1, 2, 3, 4, 5]))
    old = {c.path: c for c in before.cells()}
    new = {c.path: c for c in after.cells()}
    assert set(new) - set(old) == {f"ner/conll2003-all-MiniLM-L6-v2-{k}-5" for k in (0, 1, 3, "all")}
    assert all(new[path] == cell for path, cell in old.items())
    assert after.prepare == before.prepare and after.features == before.features


def test_adding_a_tunable_layers_value_adds_its_boundary_only(params):
    after = plan_studies(edited(params, "studies.ablation.tunable_layers", [0, 1, 2, 3, 4, "all"]))
    before = plan_studies(edited(params, "studies.ablation.tunable_layers", [0, 1, 2, 3, 4]))
    assert after.features["ablation"].boundaries == before.features["ablation"].boundaries  # "all" caches nothing
    assert all(after.features["ablation"].settings[key] == value
               for key, value in before.features["ablation"].settings.items())


def test_specs_take_exactly_the_library_arguments():
    """Every LanguageModel, MultiEncoder, head and ModelTrainer.train argument is reachable from params.yaml."""
    from layertune.heads import TextClassifier
    from layertune.language_model import LanguageModel
    from layertune.multi_encoder import MultiEncoder
    from layertune.trainer import ModelTrainer

    def arguments(function, skip=()):
        return {name for name in inspect.signature(function).parameters if name not in ("self", *skip)}

    assert arguments(LanguageModel.__init__, ("name_or_path", "frozen_layers")) == set(EncoderSpec.model_fields) - {
        "model", "learning_rate"}  # learning_rate: the trainer's, per language model
    assert arguments(TextClassifier.__init__, ("encoder", "num_classes", "label_names")) == set(HeadSpec.model_fields)
    assert {"method" if n == "combine_method" else n
            for n in arguments(MultiEncoder.__init__, ("language_models",))} == set(CombineSpec.model_fields)
    assert "args" in arguments(ModelTrainer.train)  # train(args=TrainingConfig(...)) or its fields as keywords
    # load_corpus's arguments: the dataset's (named as a study writes them) and the subsample's; the mirror is a
    # pipeline setting (download.mirror)
    from layertune.corpora import load_corpus

    renamed = {"text_columns": "text", "label_column": "label", "data_files": "splits", "name": "path"}
    assert {renamed.get(n, n) for n in arguments(load_corpus, ("data_mirror",))} | {"task", "hub", "test"} == set(
        CorpusSpec.model_fields) == set(SampleSpec.model_fields) | set(DatasetSpec.model_fields)
    assert {"learning_rate", "head_learning_rate", "epochs", "max_length"} <= set(TrainingConfig.model_fields)


def test_report_kinds_are_the_registered_report_functions():
    from typing import get_args

    from layertune.reports import REPORTS

    assert set(get_args(ReportKind)) == set(REPORTS)


def test_profiles_become_dvc_arguments_that_replace_mappings(params):
    overrides = load_profile("glue-bert-base", ROOT)
    arguments = dvc_arguments(overrides, params)
    assert "~studies.ablation.encoders" in arguments and "+studies.ablation.encoders={bert-base-cased:" \
        "'bert-base-cased'}" in arguments
    assert "++studies.ablation.tunable_layers=[0,1,2,3,4,5,'all']" in arguments
    with pytest.raises(FileNotFoundError, match="No profile 'glue-bert-bas'.*Did you mean 'glue-bert-base'"):
        load_profile("glue-bert-bas", ROOT)


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))
def test_dvc_writes_each_profile_into_params_yaml_as_the_profile_says(profile, params, tmp_path, fake_hub):
    """`dvc exp run -S` edits params.yaml in place (ruamel, comments kept): what it writes must parse, and be the
    profile applied. A comment on a replaced key's line once left DVC writing YAML it could not read back."""
    from dvc.utils.hydra import apply_overrides as dvc_apply

    copy = tmp_path / "params.yaml"
    copy.write_text((ROOT / "params.yaml").read_text())
    overrides = load_profile(profile, ROOT)
    arguments = [argument for argument in dvc_arguments(overrides, params) if argument != "-S"]
    dvc_apply(copy, [argument for argument in arguments if not argument.startswith("rounds.yaml:")])  # params' own
    written = {**read_yaml(copy), "decided": {}}  # as the stages read it (DVC writes 3e-05: a float in YAML 1.2)
    assert validate_params(written).model_dump() == validate_params(apply_overrides(params, overrides)).model_dump()


def test_dvc_stages_and_catalog_paths_agree_with_the_code(params):
    """The folders of a study's stages are written in dvc.yaml and conf/base/catalog.yml: they must name the same."""
    from dvc.repo import Repo
    from kedro.config import OmegaConfigLoader

    from pipelines.settings import CONFIG_LOADER_ARGS

    plan = plan_studies(params)
    with Repo(str(ROOT)) as repo:
        stages = {stage.addressing: stage for stage in repo.index.stages}

    def paths(files) -> set[str]:
        return {str(f.fs_path).removeprefix(str(ROOT) + "/") for f in files}

    assert {name for name in stages if name.startswith("train")} == {dvc_stage(study) for study in plan.studies}
    for study in plan.studies:
        catalog = OmegaConfigLoader(str(ROOT / "conf"), runtime_params={"study": study},
                                    **CONFIG_LOADER_ARGS)["catalog"]
        train = stages[dvc_stage(study)]
        assert paths(train.outs) == {catalog["study_cells"]["path"]} and train.outs[0].persist
        assert not catalog["study_cells"]["retired"].startswith(catalog["study_cells"]["path"] + "/")
        assert paths(train.deps) == {catalog["train_plan"]["filepath"], "data/00_plan/code/train.json",
                                     catalog["prepared_corpora"]["path"], catalog["feature_manifests"]["path"]}
        aggregate = stages[f"aggregate@{study}"]
        assert {catalog["report_markdown"]["filepath"], catalog["report_metrics"]["filepath"],
                catalog["report_tables"]["path"], catalog["plot_scores"]["filepath"],
                catalog["plot_losses"]["filepath"]} == paths(aggregate.outs)
        assert paths(o for o in aggregate.outs if o.plot) == {
            catalog["plot_scores"]["filepath"], catalog["plot_losses"]["filepath"]}


def test_a_new_study_is_a_section_of_params_yaml_and_nothing_else(params, tmp_path):
    """dvc.yaml, as committed, resolves a study added to params.yaml into its stages: no step writes them."""
    import subprocess

    from dvc.repo import Repo

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(edited(params, "studies.mine", params["studies"]["ner"])))
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    subprocess.run(["dvc", "init", "--no-scm", "--quiet"], cwd=tmp_path, check=True)
    with Repo(str(tmp_path)) as repo:
        resolved = {stage.name for stage in repo.index.stages}
    assert {f"{stage}@mine" for stage in ("prepare", "tokenize", "train", "evaluate", "aggregate")} <= resolved


def test_kedro_parameters_are_params_yaml_and_the_record_of_rounds_only():
    """What the stages read is what DVC tracks: params.yaml, and rounds.yaml beside it (`read_params`)."""
    from kedro.config import OmegaConfigLoader

    from pipelines.params import read_params
    from pipelines.settings import CONFIG_LOADER_ARGS

    assert not list((ROOT / "conf").rglob("parameters*"))
    loaded = OmegaConfigLoader(str(ROOT / "conf"), **CONFIG_LOADER_ARGS)["parameters"]
    assert loaded == read_params(ROOT) and set(loaded) == {"download", "studies", "decided"}


def test_a_local_model_config_without_a_layer_count_is_named(params, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "custom"}')
    message = error_of(edited(params, "studies.ablation.encoders", {"m": str(tmp_path / "m")}))
    assert "studies.ablation.encoders.m" in message and "not a model config with a layer count" in message


def test_an_encoder_entry_takes_its_tunable_layers_from_the_grid_and_reads_back_as_written():
    from layertune.study import StudyPlan, StudySpec, study_cells

    study = {"report": {"kind": "layers"}, "tasks": ["sst2"], "tunable_layers": [0, 2], "seeds": [1],
             "encoders": {"mean": {"model": "sentence-transformers/all-MiniLM-L6-v2", "pooling": "mean"},
                          "plain": "sentence-transformers/all-MiniLM-L6-v2",
                          "both": {"members": ["mean", "plain"], "combine": "dme"}}}
    spec = StudySpec.model_validate(study)
    plan = StudyPlan(name="p", spec=spec, cells=study_cells("p", spec))
    assert StudyPlan.model_validate_json(plan.model_dump_json()) == plan  # what the later stages read back
    assert [c.spec.encoders[0].tunable_layers for c in plan.cells if c.encoder == "mean"] == [0, 2]
    study["encoders"]["mean"]["tunable_layers"] = 2
    with pytest.raises(ValueError, match="encoders.mean.tunable_layers: an encoder's tunable layers come from"):
        StudySpec.model_validate(study)


def test_a_methods_study_keys_its_cells_by_method_and_shares_top_k_states(params):
    plan = plan_studies(params)
    cells = {cell.key: cell for cell in plan.studies["methods"].cells}
    lora = cells["sst2-all-MiniLM-L6-v2-lora-top2-1"]
    assert (lora.method, lora.tunable_layers, lora.spec.encoders[0].method.name) == ("lora-top2", 2, "lora")
    # the setting's own rate for the encoder, not the study's
    assert lora.spec.training.learning_rate == params["studies"]["methods"]["methods"]["lora-top2"]["learning_rate"]
    assert lora.spec.training.learning_rate != params["studies"]["methods"]["training"]["learning_rate"]
    top2 = params["studies"]["methods"].get("per_tunable_layers", {}).get(2, params["studies"]["methods"]["training"])
    assert cells["sst2-all-MiniLM-L6-v2-top_k-2-1"].spec.training.learning_rate == top2["learning_rate"]
    assert len(cells) == len(params["studies"]["methods"]["methods"]) * 2
    features = plan.features["methods"]
    assert len(features.models) == 1 and features.boundaries == [[4, 6]]  # LoRA on the top 2 reads top-2's states
    assert features.settings["sst2-all-MiniLM-L6-v2-lora-top2"].boundaries == [4]
    assert features.settings["sst2-all-MiniLM-L6-v2-lora-all"].boundaries == [None]  # every layer adapted


@pytest.mark.parametrize(("method", "key", "message"), [
    ({"name": "lora", "target_modules": ["nonexistent"]}, "target_modules",
     "'nonexistent' is not a linear module of encoder 'all-MiniLM-L6-v2' (sentence-transformers/all-MiniLM-L6-v2)'s "
     "layers (give a name within a layer, or its last part). Valid choices: dense, key, query, value, "
     "attention.self.query"),
    ({"name": "ia3", "feedforward_modules": ["query"]}, "feedforward_modules",
     "'query' is not among the target modules of encoder 'all-MiniLM-L6-v2' (sentence-transformers/all-MiniLM-L6-v2) "
     "('key', 'value', 'output.dense')"),
    ({"name": "lora", "r": 100000}, "r", "100000 is above the smaller side of target module 'attention.self.query' "
     "of encoder 'all-MiniLM-L6-v2' (sentence-transformers/all-MiniLM-L6-v2)'s layers (384 x 384): a rank-r update of "
     "that weight has rank at most 384. Give r <= 384."),
])
def test_tuning_method_settings_are_checked_against_the_models_structure_at_plan_time(params, method, key, message):
    """Before any cell trains (they failed in their own train stage, after other cells had trained), from the
    model's config alone, naming the params key."""
    changed = edited(params, "studies.methods.methods.lora-top2.method", method)
    assert f"studies.methods.methods.lora-top2.method.{key}: {message}" in error_of(changed)
    shared = edited(params, "studies.ablation.encoder", {"method": method})
    shared = edited(shared, "studies.ablation.tunable_layers", [1, "all"])
    shared = edited(shared, "studies.ablation.per_tunable_layers", {})
    assert f"studies.ablation.encoder.method.{key}: " in error_of(shared)


def test_the_cheapest_method_within_tolerance_or_cannot_decide():
    from layertune.reports.methods import MethodRow, cheapest
    from layertune.statistics import Comparison

    def row(name, parameters, verdict):
        setting = type("S", (), {"tunable_layers": name})()
        return MethodRow(setting, parameters, 1.0, 1.0, Comparison(0.0, 0.0, 0.0, verdict))

    rows = [row("full", 100, "yes"), row("lora", 10, "yes"), row("head", 1, "no")]
    assert cheapest(rows, "trainable_parameters") == ("lora", [])
    rows = [row("full", 100, "yes"), row("lora", 10, "yes"), row("bitfit", 5, "undecided"), row("head", 1, "no")]
    assert cheapest(rows, "trainable_parameters") == (None, ["bitfit", "lora"])


def test_keys_at_walks_mappings_lists_tuples_and_tagged_unions():
    from typing import Literal

    from pydantic import BaseModel

    from layertune.errors import keys_at

    class A(BaseModel):
        kind: Literal["a"] = "a"
        x: int = 0

    class B(BaseModel):
        kind: Literal["b"] = "b"
        y: int = 0

    class Root(BaseModel):
        pair: tuple[A, B]
        items: list[A | B]
        named: dict[str, A] | None = None
        bare: list = []

    assert keys_at(Root, ("pair", 1)) == ["kind", "y"]
    assert keys_at(Root, ("items", 0, "b")) == ["kind", "y"]
    assert keys_at(Root, ("named", "any")) == ["kind", "x"]
    assert keys_at(Root, ("bare", 0)) == [] and keys_at(Root, ("nothing",)) == []
