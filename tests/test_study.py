"""params.yaml: its schema, errors that name the key, profiles, and agreement between DVC, Kedro and the code."""

import copy
from pathlib import Path

import pytest
import yaml

from layertune.study import (
    Cell,
    ParamsError,
    apply_overrides,
    feature_cache_dir,
    load_profile,
    prepare_corpus,
    profile_overrides,
    section,
    validate_params,
)

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


@pytest.fixture(scope="module")
def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


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
    assert checked.study.seeds and len(checked.study.seeds) >= 2
    assert checked.study.tunable_layers == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_overrides_existing_keys_and_validates(params, profile):
    overrides = load_profile(profile, root=ROOT)
    validate_params(apply_overrides(params, overrides))
    arguments = profile_overrides(overrides)
    assert arguments[::2] == ["-S"] * len(overrides)


def test_ci_profile_is_small(params):
    ci = validate_params(apply_overrides(params, load_profile("ci", root=ROOT)))
    assert len(ci.study.cells()) == 2 and ci.train.epochs == 1 and ci.prepare.train_size <= 500


def test_unknown_key_is_named_with_a_suggestion(params):
    message = error_of(edited(params, "train.learnin_rate", 3e-5))
    assert "train.learnin_rate: unknown key" in message and "'learning_rate'" in message


def test_wrong_type_is_named(params):
    assert "train.epochs" in error_of(edited(params, "train.epochs", "3"))
    assert "train.learning_rate" in error_of(edited(params, "train.learning_rate", "5e-5"))  # YAML 1.1 string


def test_unknown_task_is_named_by_position(params):
    message = error_of(edited(params, "study.tasks", ["sst2", "sst"]))
    assert "study.tasks[1]: unknown task 'sst'" in message and "'sst2'" in message


def test_unknown_model_is_named(params):
    assert "study.models[0]: unknown model 'no-such-model-xyz'" in error_of(
        edited(params, "study.models", ["no-such-model-xyz"]))


def test_model_that_cannot_name_a_folder(params):
    assert "study.models[0]" in error_of(edited(params, "study.models", ["/abs/model"]))


def test_layers_out_of_range_name_the_key_and_the_model(params):
    message = error_of(edited(params, "study.tunable_layers", [0, 7, "all"]))
    assert "study.tunable_layers[1]: 7 is out of range" in message and "6 layers" in message


def test_bad_layer_value_and_missing_section(params):
    assert "study.tunable_layers[0]" in error_of(edited(params, "study.tunable_layers", ["al"]))
    without = {k: v for k, v in params.items() if k != "aggregate"}
    assert "aggregate: required key is missing" in error_of(without)


def test_section_errors_are_prefixed(params):
    with pytest.raises(ParamsError, match=r"prepare\.train_size"):
        section("prepare", {**params["prepare"], "train_size": -1})


def test_profile_key_must_exist(params):
    with pytest.raises(ParamsError, match="train.epoch"):
        apply_overrides(params, {"train.epoch": 1})


def test_cells_are_the_grid_and_named_like_dvc(params):
    study = validate_params(params).study
    cells = study.cells()
    assert len(cells) == len(study.tasks) * len(study.models) * len(study.tunable_layers) * len(study.seeds)
    assert Cell("sst2", "m/x", "all", 1).dvc_stage == "train@sst2-m/x-all-1"


def test_dvc_stages_and_catalog_paths_agree_with_the_code(params):
    """The cell layout is written in dvc.yaml (outs) and conf/base/catalog.yml: they must name the same folders."""
    from dvc.repo import Repo
    from kedro.config import OmegaConfigLoader

    from pipelines.settings import CONFIG_LOADER_ARGS

    cells = validate_params(params).study.cells()
    with Repo(str(ROOT)) as repo:
        stages = {stage.addressing: stage for stage in repo.index.stages}
    cell = cells[-1]
    stage = stages[cell.dvc_stage]
    out = str(stage.outs[0].fs_path).removeprefix(str(ROOT) + "/")
    runtime = {"cell": cell.as_dict()}
    loader = OmegaConfigLoader(str(ROOT / "conf"), runtime_params=runtime, **CONFIG_LOADER_ARGS)
    catalog = loader["catalog"]
    assert catalog["cell_metrics"]["filepath"] == f"{out}/metrics.json"
    evaluate = stages[f"evaluate@{cell.task}-{cell.model}"]
    assert catalog["task_evaluations"]["path"] == str(evaluate.outs[0].fs_path).removeprefix(str(ROOT) + "/")
    assert out.startswith(catalog["task_models"]["path"] + "/")
    features = [d for d in stage.deps if "03_features" in str(d.fs_path)][0]
    assert str(features.fs_path).removeprefix(str(ROOT) + "/") == str(
        feature_cache_dir(catalog["feature_cache"]["path"], cell.task, cell.model) / "tokenized")


def test_kedro_parameters_are_params_yaml_only(params):
    from kedro.config import OmegaConfigLoader

    from pipelines.settings import CONFIG_LOADER_ARGS

    assert not list((ROOT / "conf").rglob("parameters*"))
    loaded = OmegaConfigLoader(str(ROOT / "conf"), **CONFIG_LOADER_ARGS)["parameters"]
    assert loaded == params


def test_prepare_caps_sizes_at_the_split(toy_corpus):
    calls = []

    def load(**options):
        calls.append(options)
        return toy_corpus

    prepare_corpus(load, section("prepare", {"train_size": 10, "dev_size": 10_000}))
    assert calls[-1] == {"train_size": 10, "dev_size": None, "seed": 42, "balanced": None}
    calls.clear()
    prepare_corpus(load, section("prepare", {"train_size": None, "dev_size": None}))
    assert calls == [{}]
