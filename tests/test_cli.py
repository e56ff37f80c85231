import json

import pandas as pd
import pytest

from layertune.cli import main
from layertune.specs import CellSpec, EncoderSpec
from layertune.training_config import TrainingConfig


def write_split(path, n):
    rows = [{"sentence": f"the movie was {'great' if i % 2 else 'awful'}", "label": i % 2} for i in range(n)]
    pd.DataFrame(rows).to_csv(path, index=False)


def data_folder(tmp_path, train=24, dev=8):
    (tmp_path / "data").mkdir()
    write_split(tmp_path / "data" / "train.csv", train)
    write_split(tmp_path / "data" / "dev.csv", dev)
    return str(tmp_path / "data")


def test_train_cell_writes_a_complete_cell_folder(tiny_bert, tmp_path, capsys):
    code = main(["train-cell", "--path", data_folder(tmp_path), "--model", str(tiny_bert), "--tunable-layers", "1",
                 "--seed", "3", "--epochs", "1", "--batch-size", "8", "--learning-rate", "1e-3",
                 "--output-dir", str(tmp_path / "cell"), "--cache-dir", str(tmp_path / "cache")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    # one epoch of a few short sentences does not repay a cache pass: auto says so, and the folder records why
    cache = json.loads((tmp_path / "cell" / "run_info.json").read_text())["frozen_prefix_cache"]
    assert summary["frozen_prefix_cache_used"] is cache["used"] is False and "eval_accuracy" in summary
    assert cache["reason"].startswith("not cached, by estimate") and cache["estimate"]["epochs"] == 1
    assert {p.name for p in (tmp_path / "cell").iterdir()} == {
        "cell.json", "metrics.json", "history.json", "predictions.json", "run_info.json", "drift.csv", "model",
        ".layertune-output"}
    spec = CellSpec.model_validate_json((tmp_path / "cell" / "cell.json").read_text())
    assert spec.encoders[0].tunable_layers == 1 and spec.training.seed == 3 and spec.training.learning_rate == 1e-3


def test_the_per_epoch_log_line_shows_learning_rates_as_rates(tiny_bert, tmp_path, capsys, caplog):
    """At 5e-5 the line said 'learning_rate': 0.0 at every epoch (every value rounded to 4 decimals); it shows 4
    significant digits, history.json every digit."""
    with caplog.at_level("INFO", logger="layertune.trainer"):
        assert main(["train-cell", "--path", data_folder(tmp_path), "--model", str(tiny_bert), "--tunable-layers", "1",
                     "--seed", "3", "--epochs", "3", "--batch-size", "8", "--learning-rate", "5e-5",
                     "--output-dir", str(tmp_path / "cell"), "--cache-dir", str(tmp_path / "cache")]) == 0
    history = json.loads((tmp_path / "cell" / "history.json").read_text())
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("epoch ")]
    assert len(lines) == 3 and 0 < history[0]["learning_rate"] < 1e-4
    for line, epoch in zip(lines, history):
        rate = float(format(epoch["learning_rate"], ".4g"))
        assert f"'learning_rate': {rate!r}" in line, line
    assert "'learning_rate': 0.0," not in lines[0] and "e-05" in lines[0]


def test_every_library_argument_is_an_option(capsys):
    """The options are generated from the specs: each LanguageModel and training argument has one."""
    with pytest.raises(SystemExit):
        main(["train-cell", "--help"])
    text = capsys.readouterr().out
    for name in [*EncoderSpec.model_fields, *TrainingConfig.model_fields]:
        assert f"--{name.replace('_', '-')}" in text
    assert "--data-seed" in text


def test_every_option_says_what_it_is_and_a_choice_names_its_values(capsys):
    import argparse

    from layertune.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = {a.option_strings[-1]: a for a in commands.choices["train-cell"]._actions if a.option_strings}
    undescribed = [name for name, a in options.items() if not (a.help or "").strip() or a.help.startswith("(")]
    assert undescribed == []
    assert options["--mixed-precision"].metavar == "{auto,no,fp16,bf16}"
    assert options["--pooling"].metavar == "{cls,mean,pooler,null}"
    assert options["--frozen-prefix-cache"].metavar == "{true,false,auto}" and options["--head"].metavar == \
        "{linear,mlp}"
    with pytest.raises(SystemExit):
        main(["train-cell", "--help"])
    assert "--mixed-precision {auto,no,fp16,bf16}" in capsys.readouterr().out


def test_bad_values_are_one_line_errors_without_output(tiny_bert, tmp_path, capsys):
    folder = data_folder(tmp_path, 8, 4)
    common = ["--path", folder, "--model", str(tiny_bert), "--output-dir", str(tmp_path / "cell"),
              "--cache-dir", str(tmp_path / "cache")]
    assert main(["train-cell", *common, "--tunable-layers", "9"]) == 2
    assert "tunable_layers must be 'all' or an int from 0 to 4" in capsys.readouterr().err
    assert main(["train-cell", *common, "--batch-size", "big"]) == 2
    assert "--batch-size: Input should be a valid integer (got 'big')" in capsys.readouterr().err
    assert not (tmp_path / "cell").exists()
    # asked for, the traceback comes before the same line
    assert main(["train-cell", *common, "--tunable-layers", "9", "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith("layertune: error: tunable_layers must")


def test_a_spec_error_names_the_option_the_user_typed(tmp_path, capsys, no_training):
    """The spec's keys (encoders[0].model, corpus.label_column) are not what a user of the command line typed."""
    folder = data_folder(tmp_path, 8, 4)
    common = ["--path", folder, "--output-dir", str(tmp_path / "cell")]
    assert main(["train-cell", *common]) == 2
    assert one_line_error(capsys) == "layertune: error: --model: required key is missing\n"
    assert main(["train-cell", *common, "--model", "m", "--method", "{name: lora, targets: [query]}"]) == 2
    assert one_line_error(capsys) == ("layertune: error: --method: targets: unknown key. Did you mean "
                                      "'target_modules'? Valid choices: name, target_modules, r, alpha, dropout.\n")
    assert main(["train-cell", *common, "--model", "m", "--data-seed", "x"]) == 2
    assert one_line_error(capsys).startswith("layertune: error: --data-seed: Input should be a valid integer")
    assert main(["train-cell", *common, "--model", "m", "--label-names", "good,bad"]) == 2
    assert one_line_error(capsys) == ("layertune: error: --label-names: Input should be a valid list (got 'good,bad') "
                                      "(a list: [a, b])\n")
    # what the data says of a corpus option, under the option (a user who gave no --label never typed 'label')
    (tmp_path / "reviews.csv").write_text("review,sentiment\n" + "".join(f"{w},{i % 2}\n" for i, w in enumerate("ab")))
    assert main(["train-cell", "--path", str(tmp_path / "reviews.csv"), "--model", "m", "--output-dir",
                 str(tmp_path / "cell")]) == 2
    [said] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (datasets' progress too)
    assert said.startswith("layertune: error: --label: column 'label' not in ")
    assert main(["train-cell", "--spec", str(tmp_path / "nope.json"), "--output-dir", str(tmp_path / "cell")]) == 2
    assert one_line_error(capsys).startswith(f"layertune: error: --spec {tmp_path / 'nope.json'}: cannot read it")
    # a --spec file's keys keep their names (the user wrote them there); an option given beside it is renamed
    (tmp_path / "spec.json").write_text(json.dumps({"corpus": {"path": str(tmp_path / "reviews.csv")},
                                                    "encoders": [{"model": "m"}], "training": {"batch_size": "big"}}))
    spec = ["train-cell", "--spec", str(tmp_path / "spec.json"), "--output-dir", str(tmp_path / "cell")]
    assert main([*spec, "--epochs", "x"]) == 2
    assert one_line_error(capsys).startswith("layertune: error: training.batch_size: Input should be a valid "
                                             "integer (got 'big'); --epochs: Input should be a valid integer")
    (tmp_path / "spec.json").write_text(json.dumps({"corpus": {"task": "sst2"}}))  # no encoders: --model makes one
    assert main([*spec, "--model", "m", "--tunable-layers", "x"]) == 2
    assert one_line_error(capsys).startswith("layertune: error: --tunable-layers: ")
    (tmp_path / "spec.json").write_text("[]")
    assert main([*spec, "--model", "m"]) == 2
    assert one_line_error(capsys).startswith("layertune: error: --spec: a CellSpec's JSON is an object")


def test_an_unknown_option_is_one_line_of_the_subcommand_with_the_closest_options(capsys):
    for argv, said in ((["train-cell", "--learnin-rates", "1e-4", "--output-dir", "x"],
                        "layertune train-cell: error: unrecognized arguments: --learnin-rates 1e-4; --learnin-rates: "
                        "did you mean --learning-rate or --head-learning-rate? (layertune train-cell --help lists "
                        "the options)\n"),
                       (["repro", "--jbos=2"], "layertune repro: error: unrecognized arguments: --jbos=2; --jbos: did "
                        "you mean --jobs? (layertune repro --help lists the options)\n"),
                       (["train-cell", "--text-column", "review", "--output-dir", "x"],
                        "layertune train-cell: error: unrecognized arguments: --text-column review; --text-column: did "
                        "you mean --text? (layertune train-cell --help lists the options)\n"),
                       (["--verbose", "train-cell", "--output-dir", "x"],
                        "layertune train-cell: error: unrecognized arguments: --verbose; --verbose goes after "
                        "train-cell (layertune train-cell --help lists the options)\n")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and capsys.readouterr().err == said


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("layertune: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_training(monkeypatch):
    """Training fails the test: what is refused must be refused before it."""
    from layertune.trainer import ModelTrainer

    monkeypatch.setattr(ModelTrainer, "train", lambda *a, **k: pytest.fail("training started"))


def test_a_foreign_folder_is_refused_before_training_and_replaced_only_with_overwrite(tiny_bert, tmp_path, capsys,
                                                                                       monkeypatch):
    thesis = tmp_path / "thesis"
    (thesis / "notes").mkdir(parents=True)
    (thesis / "notes" / "chapter1.tex").write_text("my thesis")
    cell = ["train-cell", "--path", data_folder(tmp_path, 16, 8), "--model", str(tiny_bert), "--tunable-layers", "1",
            "--epochs", "1", "--batch-size", "8", "--output-dir", str(thesis), "--cache-dir", str(tmp_path / "cache")]
    with monkeypatch.context() as patch:
        from layertune.trainer import ModelTrainer

        patch.setattr(ModelTrainer, "train", lambda *a, **k: pytest.fail("training started"))
        assert main(cell) == 2
    err = one_line_error(capsys)
    assert f"Output folder {str(thesis)!r} already exists and holds files layertune did not write" in err
    assert "Choose another folder, or pass overwrite=True (on the command line --overwrite)" in err
    assert (thesis / "notes" / "chapter1.tex").read_text() == "my thesis" and len(list(thesis.iterdir())) == 1

    assert main([*cell, "--overwrite"]) == 0
    assert not (thesis / "notes").exists() and (thesis / "cell.json").is_file()
    assert main([*cell, "--seed", "7"]) == 0  # its own folder now: replaced without --overwrite
    assert json.loads((thesis / "cell.json").read_text())["training"]["seed"] == 7


@pytest.mark.parametrize("where", [".", "~", ".."])
def test_the_current_or_home_folder_is_refused_at_once_even_with_overwrite(tmp_path, capsys, monkeypatch, no_training,
                                                                           where):
    work = tmp_path / "home" / "work"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("keep")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(work)
    assert main(["train-cell", "--task", "sst2", "--model", "m", "--output-dir", where, "--overwrite"]) == 2
    err = one_line_error(capsys)
    assert f"Output folder {where!r} is " in err and "would replace the folder and delete everything in it" in err
    assert [p.name for p in work.iterdir()] == ["mine.txt"] and [p.name for p in work.parent.iterdir()] == ["work"]


def test_the_root_folder_from_another_folder_is_refused_naming_the_current_folder_and_a_new_one(tmp_path, capsys,
                                                                                               monkeypatch,
                                                                                               no_training):
    """It said "a parent of the current folder (/)", which reads as if / were the current folder, and suggested
    '/run', a system folder."""
    work = tmp_path / "work"
    (work / "run").mkdir(parents=True)  # taken: the suggestion is a folder that nothing holds yet
    monkeypatch.chdir(work)
    assert main(["train-cell", "--task", "sst2", "--model", "m", "--output-dir", "/", "--overwrite"]) == 2
    err = one_line_error(capsys)
    assert f"Output folder '/' is a parent of the current folder ({work}): writing an output there would replace the " \
           "folder and delete everything in it. Give a new folder for the output, e.g. 'run-2'." in err, err
    assert "'/run'" not in err and not (work / "run-2").exists()


def test_a_model_with_only_pickled_weights_is_refused_in_one_line_before_any_unpickling(tiny_bert, tmp_path, capsys,
                                                                                          monkeypatch):
    """pytorch_model.bin alone gave train-cell a 42-line traceback; layertune never unpickles: one line, the fix."""
    import shutil

    import safetensors.torch
    import torch

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_bert, pickled)
    torch.save(safetensors.torch.load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    assert main(["train-cell", "--path", data_folder(tmp_path, 8, 4), "--model", str(pickled), "--tunable-layers",
                 "1", "--output-dir", str(tmp_path / "cell"), "--cache-dir", str(tmp_path / "cache")]) == 2
    error = one_line_error(capsys)
    assert (f"'{pickled}' holds its weights only as pickle (pytorch_model.bin), and layertune never unpickles"
            in error and f"AutoModel.from_pretrained('{pickled}').save_pretrained('{pickled}')" in error)
    assert not (tmp_path / "cell").exists()
    from layertune import LanguageModel

    with pytest.raises(ValueError, match="holds its weights only as pickle"):
        LanguageModel(pickled, 1)  # the library's own callers too
    from pipelines.params import validate_params
    from layertune.study import ParamsError

    params = {"download": {"mirror": None}, "studies": {"s": {"report": {"kind": "layers"}, "tasks": ["sst2"],
                                                              "encoders": {"mine": str(pickled)},
                                                              "tunable_layers": [1], "seeds": [1]}}}
    with pytest.raises(ParamsError, match=r"studies.s.encoders.mine: .* holds its weights only as pickle"):
        validate_params(params)  # at plan time, before any cell
