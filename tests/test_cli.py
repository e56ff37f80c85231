import json

import pandas as pd

from layertune.cli import main


def write_split(path, n):
    rows = [{"sentence": f"the movie was {'great' if i % 2 else 'awful'}", "label": i % 2} for i in range(n)]
    pd.DataFrame(rows).to_csv(path, index=False)


def test_train_cell_writes_a_complete_cell_folder(tiny_bert, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    write_split(tmp_path / "data" / "train.csv", 24)
    write_split(tmp_path / "data" / "dev.csv", 8)
    code = main(["train-cell", "--task", str(tmp_path / "data"), "--model", str(tiny_bert), "--tunable-layers", "1",
                 "--seed", "3", "--epochs", "1", "--batch-size", "8", "--output-dir", str(tmp_path / "cell"),
                 "--cache-dir", str(tmp_path / "cache")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["frozen_prefix_cache_used"] is True and "eval_accuracy" in summary
    assert {p.name for p in (tmp_path / "cell").iterdir()} >= {"metrics.json", "history.json", "drift.csv",
                                                                 "best-model"}


def test_train_cell_reports_bad_layers_without_a_traceback(tiny_bert, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    write_split(tmp_path / "data" / "train.csv", 8)
    write_split(tmp_path / "data" / "dev.csv", 4)
    code = main(["train-cell", "--task", str(tmp_path / "data"), "--model", str(tiny_bert), "--tunable-layers", "9",
                 "--output-dir", str(tmp_path / "cell"), "--cache-dir", str(tmp_path / "cache")])
    assert code == 2
    assert "tunable_layers must be 'all' or an int from 0 to 4" in capsys.readouterr().err
    assert not (tmp_path / "cell").exists()
