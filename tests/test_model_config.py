"""A model's layer count and longest input come from its own config: a local folder, a packaged model, the model
mirror, or the hub's config.json alone (never weights); a model found nowhere is one message saying what was tried
and how to fix it. The pipeline resolves models through params.yaml's download.model_mirror unless
$LAYERTUNE_MODEL_MIRROR is set."""

import json
import re
import shutil

import pytest
from click import ClickException

from layertune.model_paths import (
    MODEL_MIRROR_ENV,
    ModelConfigError,
    model_config,
    model_fingerprint,
    model_layers,
    model_max_length,
)
from layertune.testing import make_tiny_model
from tests.projects import make_project, run, study


def write_config(folder, **config):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_hub_model_is_read_from_its_config_json_alone(fake_hub, monkeypatch):
    monkeypatch.delenv(MODEL_MIRROR_ENV, raising=False)
    assert model_layers("bert-base-cased") == 12
    assert model_max_length("bert-base-cased") == 512
    assert model_layers("google/electra-base-discriminator") == 12
    assert model_max_length("roberta-base") == 514  # its positions: the hub has no tokenizer_config.json for it
    assert {file for _, file, _ in fake_hub.asked} == {"config.json", "tokenizer_config.json"}  # never weights
    assert [asked for asked in fake_hub.asked if asked[0] == "bert-base-cased"] == [
        ("bert-base-cased", "config.json", None), ("bert-base-cased", "tokenizer_config.json", None)]  # once


def test_a_hub_model_is_read_at_its_revision_with_its_tokenizer_limit(fake_hub, tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_MIRROR_ENV, raising=False)
    fake_hub.root = tmp_path
    folder = write_config(tmp_path / "someone" / "encoder", model_type="bert", num_hidden_layers=7,
                          max_position_embeddings=1024)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    assert model_layers("someone/encoder", revision="abc123") == 7
    assert model_max_length("someone/encoder", revision="abc123") == 256  # the tokenizer's limit is the smaller
    assert fake_hub.asked == [("someone/encoder", "config.json", "abc123"),
                              ("someone/encoder", "tokenizer_config.json", "abc123")]


def test_a_model_found_nowhere_names_where_what_was_tried_and_the_fix(fake_hub, tmp_path, monkeypatch):
    mirror = tmp_path / "models"
    write_config(mirror / "paraphrase-MiniLM-L3-v2", num_hidden_layers=3)
    monkeypatch.setenv(MODEL_MIRROR_ENV, str(mirror))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelConfigError) as raised:
        model_layers("sentence-transformers/paraphrase-MiniLM-L3", where="studies.s.encoders.para")
    message = str(raised.value)
    assert message.startswith("studies.s.encoders.para: unknown model 'sentence-transformers/paraphrase-MiniLM-L3': "
                              "found nowhere. Tried: a local folder")
    assert "sentence-transformers/all-MiniLM-L6-v2" in message  # the packaged models
    assert (f"the model mirror ${MODEL_MIRROR_ENV}='{mirror}' has no sentence-transformers/paraphrase-MiniLM-L3/"
            "config.json or paraphrase-MiniLM-L3/config.json") in message
    assert "the Hugging Face hub (HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it" in message
    assert re.search(r"Did you mean [^?]*'paraphrase-MiniLM-L3-v2'\?", message)  # what the mirror holds
    assert "download.model_mirror in params.yaml, or $LAYERTUNE_MODEL_MIRROR" in message
    assert "local model folder" in message


def test_language_model_and_train_cell_say_the_same_one_line_with_the_mirror_s_models(tmp_path, monkeypatch, capsys):
    """`LanguageModel` (and so `layertune train-cell`) had a message of its own: it ignored the model mirror, whose
    model it did not suggest, and ran on over transformers' lines about the internet connection."""
    from layertune.cli import main
    from layertune.language_model import LanguageModel

    make_tiny_model(tmp_path / "models" / "paraphrase-MiniLM-L3-v2", "bert")
    monkeypatch.setenv(MODEL_MIRROR_ENV, str(tmp_path / "models"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as raised:
        LanguageModel("paraphrase-MiniLM-L3-v3")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("Unknown model 'paraphrase-MiniLM-L3-v3': found nowhere.")
    assert f"the model mirror ${MODEL_MIRROR_ENV}='{tmp_path / 'models'}' has no paraphrase-MiniLM-L3-v3/" in message
    assert re.search(r"Did you mean [^?]*'paraphrase-MiniLM-L3-v2'\?", message)
    assert LanguageModel("paraphrase-MiniLM-L3-v2").model.config.model_type == "bert"  # the suggestion loads

    (tmp_path / "data.csv").write_text("text,label\n" + "".join(f"{w},{i % 2}\n" for i, w in enumerate("abcdefgh")))
    capsys.readouterr()
    assert main(["train-cell", "--path", str(tmp_path / "data.csv"), "--model", "paraphrase-MiniLM-L3-v3",
                 "--output-dir", str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert lines == [f"layertune: error: {message}"], lines


def _gated_answer(url: str) -> None:
    """What `huggingface_hub` raises when the hub answers a download as it does for a gated model the token may not
    read: 403 with the error code GatedRepo."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    hf_raise_for_status(httpx2.Response(403, headers={"X-Error-Code": "GatedRepo"}, request=httpx2.Request("GET", url)))


def test_a_gated_hub_model_is_said_to_be_gated_not_found_nowhere(fake_hub, tmp_path, monkeypatch):
    """The hub has a gated model and refuses it to this machine's token: "unknown model: found nowhere" sent the user
    looking for a typo. The plan and `LanguageModel` (so train-cell too) say it is gated and how to get access."""
    import transformers
    from huggingface_hub.errors import GatedRepoError

    from layertune.language_model import LanguageModel

    name = "meta-llama/Llama-3.2-1B"
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda repo, file, **_: _gated_answer(
        f"https://huggingface.co/{repo}/resolve/main/{file}"))
    with pytest.raises(ModelConfigError) as raised:
        model_layers(name, where="studies.s.encoders.llama")
    assert str(raised.value) == (
        "studies.s.encoders.llama: model 'meta-llama/Llama-3.2-1B' is gated on the Hugging Face hub: it is there, but "
        "the token on this machine has no access to it. To fix it, ask for access on "
        "https://huggingface.co/meta-llama/Llama-3.2-1B, then log in here (hf auth login, or set HF_TOKEN); or give "
        "the path of a local copy of the model.")

    def config_as_transformers_reads_it(repo, **_):  # transformers' cached_file wraps the hub's error so
        try:
            _gated_answer(f"https://huggingface.co/{repo}/resolve/main/config.json")
        except GatedRepoError as error:
            raise OSError(f"You are trying to access a gated repo.\nMake sure to have access to it at "
                          f"https://huggingface.co/{repo}.\n{error}") from error

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config_as_transformers_reads_it)
    with pytest.raises(OSError) as raised:
        LanguageModel(name)
    assert str(raised.value).startswith("Model 'meta-llama/Llama-3.2-1B' is gated on the Hugging Face hub: it is "
                                        "there, but the token on this machine has no access to it.")
    # any other refusal is still a model found nowhere
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda repo, **_: _raise(OSError("no such repo")))
    with pytest.raises(OSError, match=r"^Unknown model 'meta-llama/Llama-3.2-1B': found nowhere\."):
        LanguageModel(name)


def _raise(error: Exception):
    raise error


def test_a_mirrored_model_is_read_from_the_mirror_not_the_hub(fake_hub, tmp_path, monkeypatch):
    make_tiny_model(tmp_path / "mirror" / "tiny-encoder", "distilbert")
    monkeypatch.setenv(MODEL_MIRROR_ENV, str(tmp_path / "mirror"))
    assert model_layers("someone/tiny-encoder") == 4  # by its hub id's last part; DistilBERT counts n_layers
    assert model_config("tiny-encoder")["model_type"] == "distilbert"
    assert model_max_length("tiny-encoder", revision="ignored-here") == 128
    assert fake_hub.asked == []


def test_a_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match=r"^model: model folder '.*empty' has no config\.json"):
        model_layers(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- the pipeline: download.model_mirror


def mirror_project(folder, model_mirror):
    """A project whose study names its model by a bare name, found only in a model mirror."""
    return make_project(folder, {"download": {"mirror": "mirror", "model_mirror": model_mirror},
                                 "studies": {"s": study("layers", ["sst2"], {"tiny": "tiny-a"}, [1], [1])}})


def planned_fingerprint(project):
    return json.loads((project / "data/00_plan/s/tokenize.json").read_text())["fingerprints"]


def test_the_plan_resolves_models_through_download_model_mirror(tmp_path, monkeypatch, fake_hub):
    monkeypatch.delenv(MODEL_MIRROR_ENV, raising=False)
    project = mirror_project(tmp_path / "project", "models")  # relative to the project folder
    run(project, "plan")
    assert planned_fingerprint(project) == [model_fingerprint(str(project / "models" / "tiny-a"))]
    assert fake_hub.asked == []


def test_the_environment_variable_wins_over_download_model_mirror(tmp_path, monkeypatch, fake_hub):
    project = mirror_project(tmp_path / "project", "models")
    other = make_tiny_model(tmp_path / "elsewhere" / "tiny-a", "bert", seed=5)  # same name, other weights
    monkeypatch.setenv(MODEL_MIRROR_ENV, str(other.parent))
    run(project, "plan")
    assert planned_fingerprint(project) == [model_fingerprint(str(other))]
    assert planned_fingerprint(project) != [model_fingerprint(str(project / "models" / "tiny-a"))]


def test_a_model_mirror_that_is_not_a_folder_is_one_message(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_MIRROR_ENV, raising=False)
    project = mirror_project(tmp_path / "project", "../no-such-models")
    shutil.rmtree(project / "models")
    with pytest.raises(ClickException, match=r"^download\.model_mirror: '\.\./no-such-models' is not a folder "):
        run(project, "plan")
    assert not (project / "data" / "00_plan").exists()
