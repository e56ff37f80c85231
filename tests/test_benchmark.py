"""The frozen-prefix benchmark still runs end to end and writes the JSON layout issue #4 asks for (tiny sizes:
its timings are not checked here, the benchmark reports them)."""

import importlib.util
import json
from pathlib import Path

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "frozen_prefix_speed.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("frozen_prefix_speed", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_writes_the_issue_json_layout(data_mirror, tmp_path):
    benchmark = load_benchmark()
    out = tmp_path / "speed.json"
    benchmark.main(["--train-size", "24", "--dev-size", "16", "--layers", "0,1,all", "--seeds", "0", "--epochs", "1",
                    "--data-mirror", str(data_mirror), "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["model"] == benchmark.MODEL and report["layers"] == 6 and report["train_size"] == 24
    assert [r["tunable_layers"] for r in report["results"]] == [0, 1, "all"]
    for row in report["results"]:
        assert {"common_epoch_s", "uncached_epoch_s", "cached_epoch_s", "cache_pass_s", "ideal_ratio",
                "common_metric", "uncached_metric", "cached_metric"} <= set(row)
        assert 0 <= row["cached_metric"] <= 100
    assert [row["ideal_ratio"] for row in report["results"]] == [0.0, 0.375, 1.0]  # 3K / (L + 2K)
    k1 = report["results"][1]
    assert k1["cached_metric"] == k1["uncached_metric"]  # the cache changes no result
    assert {"common_s", "cached_s", "cached_grouped_s", "cache_mb"} <= set(report["study"])
    assert report["study"]["cache_mb"] > 0
