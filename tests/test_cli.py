import json

import pandas as pd

from layertune.cli import main
from layertune.cell import CellSpec, EncoderSpec
from layertune.training_args import TrainingArguments


def write_split(path, n):
    rows = [{"sentence": f"the movie was {'great' if i % 2 else 'awful'}", "label": i % 2} for i in range(n)]
    pd.DataFrame(rows).to_csv(path, index=False)


def data_folder(tmp_path, train=24, dev=8):
    (tmp_path / "data").mkdir()
    write_split(tmp_path / "data" / "train.csv", train)
    write_split(tmp_path / "data" / "dev.csv", dev)
    return str(tmp_path / "data")


def test_train_cell_writes_a_complete_cell_folder(tiny_bert, tmp_path, capsys):
    code = main(["train-cell", "--task", data_folder(tmp_path), "--model", str(tiny_bert), "--tunable-layers", "1",
                 "--seed", "3", "--epochs", "1", "--batch-size", "8", "--learning-rate", "1e-3",
                 "--output-dir", str(tmp_path / "cell"), "--cache-dir", str(tmp_path / "cache")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["frozen_prefix_cache_used"] is True and "eval_accuracy" in summary
    assert {p.name for p in (tmp_path / "cell").iterdir()} == {
        "cell.json", "metrics.json", "history.json", "predictions.json", "run_info.json", "drift.csv", "model"}
    spec = CellSpec.model_validate_json((tmp_path / "cell" / "cell.json").read_text())
    assert spec.encoders[0].tunable_layers == 1 and spec.training.seed == 3 and spec.training.learning_rate == 1e-3


def test_every_library_argument_is_an_option(capsys):
    """The options are generated from the specs: each LanguageModel and training argument has one."""
    import pytest

    with pytest.raises(SystemExit):
        main(["train-cell", "--help"])
    text = capsys.readouterr().out
    for name in [*EncoderSpec.model_fields, *TrainingArguments.model_fields]:
        assert f"--{name.replace('_', '-')}" in text
    assert "--data-seed" in text


def test_bad_values_are_one_line_errors_without_output(tiny_bert, tmp_path, capsys):
    folder = data_folder(tmp_path, 8, 4)
    common = ["--task", folder, "--model", str(tiny_bert), "--output-dir", str(tmp_path / "cell"),
              "--cache-dir", str(tmp_path / "cache")]
    assert main(["train-cell", *common, "--tunable-layers", "9"]) == 2
    assert "tunable_layers must be 'all' or an int from 0 to 4" in capsys.readouterr().err
    assert main(["train-cell", *common, "--batch-size", "big"]) == 2
    assert "training.batch_size: Input should be a valid integer (got 'big')" in capsys.readouterr().err
    assert not (tmp_path / "cell").exists()
