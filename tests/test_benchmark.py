"""The frozen-prefix benchmark still runs end to end and writes the JSON layout issue #4 asks for (tiny sizes:
its timings are not checked here, the benchmark reports them); the cluster benchmark reads the builds' output."""

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


def test_cluster_benchmark_reads_each_way_of_building_from_its_output():
    spec = importlib.util.spec_from_file_location("cluster_speed", BENCHMARK.parent / "cluster_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    here = [(0.0, "Running stage 'plan':\n"), (20.0, "Running stage 'train@a':\n"),
            (21.0, "12:00:01 INFO pipelines.train.nodes: a: 2 of 2 cell(s) to train, in this process\n"),
            (24.0, "12:00:04 INFO pipelines.train.nodes: [1/2] x-1 trained in 3.0 s; about 3 s left for a\n"),
            (28.0, "12:00:08 INFO pipelines.train.nodes: [2/2] x-2 trained in 4.0 s; none left for a\n"),
            (29.0, "Running stage 'evaluate@a':\n"), (30.0, "done\n")]
    assert module.phases(here) == (20.0, 28.0, 2, [3.0, 4.0])
    ray = [(1.0, "Running stage 'train@a':\n"),
           (30.0, "12:00:30 INFO pipelines.train.nodes: [1/2] x-1 trained; about 29 s left for a\n"),
           (32.0, "12:00:32 INFO pipelines.train.nodes: [2/2] x-2 trained; none left for a\n")]
    assert module.phases(ray) == (1.0, 32.0, 2, [])


def test_benchmark_takes_any_model_folder_and_imdb(data_mirror, tiny_bert, tmp_path):
    """`--model` a folder (as on a GPU machine, a bert-base-sized one that encoder_from_config.py builds; here a tiny
    one that takes IMDb's 512 tokens) and `--task imdb`: every side reports dev accuracy (IMDb's main metric is F1),
    and the report names model, task and device."""
    import torch
    import transformers

    folder = tmp_path / "tiny-512"
    transformers.AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(folder)
    config = transformers.AutoConfig.from_pretrained(tiny_bert)
    config.max_position_embeddings, config.num_hidden_layers = 512, 2
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    benchmark = load_benchmark()
    report = benchmark.main(["--model", str(folder), "--task", "imdb", "--train-size", "16", "--dev-size", "16",
                             "--layers", "0,all", "--seeds", "0", "--epochs", "1", "--no-group-by-length",
                             "--data-mirror", str(data_mirror), "--cache-dir", str(tmp_path / "cache"),
                             "--json", str(tmp_path / "imdb.json")])
    assert (report["model"], report["task"], report["layers"]) == (str(folder), "imdb", 2)
    assert report["device"] == f"CPU, {torch.get_num_threads()} threads"
    # 8 + 8 balanced dev reviews: an accuracy is a positive multiple of 100/16 (an F1 mostly is not, or is 0).
    scores = [row[f"{side}_metric"] for row in report["results"] for side in ("common", "uncached", "cached")]
    assert all(score > 0 and (score * 16 / 100).is_integer() for score in scores), scores


def test_the_longer_budget_doubles_only_the_named_studies_and_keeps_the_others_rounds():
    spec = importlib.util.spec_from_file_location("longer_budget", BENCHMARK.parent / "longer_budget.py")
    longer_budget = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(longer_budget)
    params = {"studies": {
        "ablation": {"seeds": [1, 2], "training": {"epochs": 10}, "decide": {"evaluation_size": 2000},
                     "per_tunable_layers": {0: {"epochs": 100, "head_learning_rate": 1e-2}}},
        "methods": {"seeds": [1, 2], "training": {"epochs": 10}, "decide": {"evaluation_size": 2000},
                    "per_tunable_layers": {0: {"epochs": 100}, 1: {"learning_rate": 2e-4}}}}}
    decided = {"ablation": {"rounds": {"a": 1}}, "methods": {"rounds": {"m": 1}}}
    same, longer = longer_budget.profiles(params, ["methods"], decided).values()
    assert same["decided"] == longer["decided"] == {"ablation": {"rounds": {"a": 1}}}  # the ablation as built
    assert not any(key.startswith("studies.ablation") for key in {**same, **longer})
    assert same["studies.methods.seeds"] == longer["studies.methods.seeds"] == [1]
    assert longer["studies.methods.training.epochs"] == 20
    assert longer["studies.methods.per_tunable_layers"] == {0: {"epochs": 200}, 1: {"learning_rate": 2e-4}}
    assert "studies.methods.training.epochs" not in same
    _, everything = longer_budget.profiles(params, list(params["studies"]), decided).values()
    assert everything["decided"] == {} and everything["studies.ablation.per_tunable_layers"][0]["epochs"] == 200


def test_a_report_s_claims_are_its_verdicts_not_its_scores():
    """What longer_budget.py and swapped_claims.py compare: the committed report's claims (within tolerance, the
    recommendation, the multi-encoder's verdicts), read from its details.json; scores that move change nothing."""
    spec = importlib.util.spec_from_file_location("swapped_claims", BENCHMARK.parent / "swapped_claims.py")
    swapped_claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(swapped_claims)
    root = Path(__file__).parents[1] / "reports"
    ner = json.loads((root / "ner" / "details.json").read_text())
    found = swapped_claims.claims(ner)["conll2003 / all-MiniLM-L6-v2"]
    assert set(found["within_tolerance"]) == {"0", "1", "3", "all"} and "recommended_layers" in found
    assert "mean" not in found and "conll2003 / baselines" not in swapped_claims.claims(ner)
    moved = json.loads(json.dumps(ner))
    moved["conll2003"]["all-MiniLM-L6-v2"]["mean"]["3"] += 0.01
    assert swapped_claims.claims(moved) == swapped_claims.claims(ner)
    moved["conll2003"]["all-MiniLM-L6-v2"]["within_tolerance"]["3"] = "undecided"
    assert swapped_claims.claims(moved) != swapped_claims.claims(ner)
    multi = json.loads((root / "multi_encoder" / "details.json").read_text())
    verdicts = swapped_claims.claims(multi)["sst2 / 2"]["versus_reference"]
    assert set(verdicts) == {"concat", "dme", "paraphrase-MiniLM-L3-v2"}
    assert set(verdicts.values()) <= {"better", "worse", "no difference shown"}
