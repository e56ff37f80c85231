"""Reports from synthetic results: the recommendation rule (and when the data cannot decide), tables, metrics that
are byte-identical between builds, figures, and evaluate's checks."""

import json
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from layertune.corpus import Corpus
from layertune.reports import build_report
from layertune.reports.common import Setting, StudyResults, settings
from layertune.reports.layers import recommend
from layertune.statistics import Estimate
from layertune.reports.scores import score_cells
from pipelines.plans import plan_studies


def setting(layers, samples, scores=(0.8,)) -> Setting:
    """One seed's full-dev score and its resamples."""
    return Setting("sst2", "m", layers, "accuracy", Estimate(np.asarray(scores, dtype=float), np.asarray([samples])))


def test_recommends_the_fewest_layers_shown_within_tolerance():
    rng = np.random.default_rng(0)
    best = 0.80 + rng.normal(0, 0.002, 1000)
    found = [setting(0, best - 0.10, [0.70]), setting(1, best - 0.002, [0.798]), setting(2, best, [0.80])]
    chosen = recommend(found, tolerance=0.01, confidence=0.95)
    assert chosen.best.tunable_layers == 2 and chosen.recommended == 1 and chosen.candidates == []
    assert {k: c.verdict for k, c in chosen.comparisons.items()} == {"0": "no", "1": "yes", "2": "yes"}


def test_names_no_winner_when_the_data_cannot_decide():
    rng = np.random.default_rng(1)
    best = 0.80 + rng.normal(0, 0.002, 1000)
    shortfall = rng.uniform(0.0, 0.02, 1000)  # straddles the 1-point tolerance
    found = [setting(0, best - shortfall, [0.79]), setting(1, best, [0.80])]
    chosen = recommend(found, tolerance=0.01, confidence=0.95)
    assert chosen.recommended is None and chosen.candidates == [0, 1]


def test_the_best_setting_is_always_good_enough():
    samples = np.full(100, 0.8)
    chosen = recommend([setting("all", samples, [0.8]), setting(2, samples - 0.05, [0.75])], 0.0, 0.95)
    assert chosen.recommended == "all"


@dataclass
class Cell:
    """Stands in for a saved cell folder (`layertune.cell.CellFolder`)."""

    dev: dict
    accuracy: float
    path: str = "data/04_models/s/cell"
    train_time_s: float = 1.0

    def predictions(self):
        return {"dev": self.dev}

    def metrics(self):
        return {"eval_accuracy": self.accuracy, "best_epoch": 1, "train_time_s": self.train_time_s, "samples_per_s": 100.0,
                "trainable_parameters": 770, "total_parameters": 9000, "peak_memory_mb": 1.0}

    def history(self):
        return [{"epoch": 1, "train_loss": 0.6, "eval_loss": 0.5, "eval_accuracy": self.accuracy}]

    def drift(self):
        return pd.DataFrame({"parameter": ["e", "l"], "part": ["embeddings", "layer.0"], "numel": [4, 4],
                             "mean_abs_change": [0.0, 0.1], "relative_l2": [0.0, 0.1], "delta_l2": [0.0, 0.2],
                             "reference_l2": [2.0, 2.0]})


def synthetic_results(study: dict, accuracy: dict, seconds: dict | None = None) -> StudyResults:
    """A study on 400 SST-2-like dev examples whose cells get each example right with the probability ``accuracy``
    gives their setting (tunable layers or method), and train for the ``seconds`` it gives (1 s by default)."""
    plan = plan_studies({"download": {"mirror": None}, "studies": {"s": study}}).studies["s"]
    rng = np.random.default_rng(0)
    references = rng.integers(0, 2, 400).tolist()
    cells = {}
    for cell in plan.cells:
        predictions = [r if rng.random() < accuracy[str(cell.setting[2])] else 1 - r for r in references]
        cells[cell.key] = Cell({"predictions": predictions, "references": references},
                               float(np.mean(np.equal(predictions, references))),
                               train_time_s=(seconds or {}).get(str(cell.setting[2]), 1.0))
    dev = pd.DataFrame({"sentence": ["x"] * 400, "label": references})
    import datasets

    split = datasets.Dataset.from_pandas(dev)
    corpus = Corpus(name="sst2", train=split, dev=split, text_columns=("sentence",), task_type="classification",
                    metrics=("accuracy",), main_metric="accuracy", label_names=("negative", "positive"))
    corpora = {"sst2": lambda: corpus}
    return StudyResults(plan, score_cells(plan, cells, {"sst2": corpus}), cells, corpora)


@pytest.fixture(scope="module")
def results(tiny_model_dirs):
    """A 3-setting, 2-seed layer study on 400 dev examples: K = 0 clearly worse, 1 and 2 nearly the same."""
    return synthetic_results({"report": {"kind": "layers", "resamples": 300}, "tasks": ["sst2"],
                              "encoders": {"m": str(tiny_model_dirs["bert"])}, "tunable_layers": [0, 1, 2],
                              "seeds": [1, 2]}, {"0": 0.6, "1": 0.85, "2": 0.86})


def test_layer_report_tables_rule_and_recommendation(results):
    report = build_report(results)
    assert "| tunable layers | trainable parameters | accuracy (points) | vs best (points) | within tolerance? |" \
        in report.markdown
    assert "one-sided paired test at 95%" in report.markdown
    entry = report.details["sst2"]["m"]
    assert entry["within_tolerance"]["0"] == "no" and entry["seeds"] == 2
    assert entry["ci_low"]["1"] < entry["mean"]["1"] < entry["ci_high"]["1"]
    assert entry["recommended_layers"] in (1, 2, None) and set(entry) >= {"best_layers", "undecided_between"}
    assert entry["best_score"] == entry["mean"][str(entry["best_layers"])] == max(entry["mean"].values())
    assert set(report.figures) >= {"quality_vs_layers", "training_time_vs_layers", "drift_heatmap"}


def test_metrics_hold_the_headline_and_details_the_rest(results):
    """`dvc exp show` shows one column per number of the metrics file: per task and encoder, the answer, the best
    score and each setting's mean; spreads, intervals and tests are in the details."""
    report = build_report(results)
    details = report.details["sst2"]["m"]
    assert report.metrics == {"sst2": {"m": {key: details[key] for key in (
        "recommended_layers", "best_layers", "best_score", "mean")}}}
    assert set(details) - set(report.metrics["sst2"]["m"]) == {
        "metric", "std", "ci_low", "ci_high", "seeds", "undecided_between", "tolerance", "within_tolerance",
        "what_would_settle"}


def settled_as_reported(entry: dict, undecided: list) -> None:
    """What would settle an undecided answer: one entry per undecided candidate, each naming a way to decide it or
    saying that seeds will not help."""
    settle = entry["what_would_settle"]
    assert sorted(settle) == sorted(str(k) for k in undecided if entry["within_tolerance"][str(k)] == "undecided")
    for numbers in settle.values():
        assert numbers["decides"] in ("yes", "no") and numbers["gap"] > 0
        assert numbers["dev_half_width"] ** 2 + numbers["seed_half_width"] ** 2 >= numbers["gap"] ** 2 * 0.99
        assert (numbers["seeds_needed"] or numbers["examples_needed"] or numbers["together"]
                or numbers["seeds_will_not_help"])
        assert numbers["seeds_needed"] is None or numbers["seeds_needed"] > numbers["seeds_now"] == 2
        assert numbers["examples_needed"] is None or numbers["examples_needed"] > numbers["examples_now"] == 400


def test_an_undecided_answer_says_what_would_settle_it(results):
    report = build_report(results)
    entry = report.details["sst2"]["m"]
    assert entry["recommended_layers"] is None  # 1 and 2 are 1 point apart on 400 examples and two seeds
    settled_as_reported(entry, entry["undecided_between"])
    assert "What would settle it, if the observed differences hold" in report.markdown
    assert "| tunable layers | would be within tolerance? | gap (points) |" in report.markdown


def test_a_decided_answer_has_nothing_to_settle(tiny_model_dirs):
    report = build_report(synthetic_results(
        {"report": {"kind": "layers", "resamples": 300, "tolerance": 0.05}, "tasks": ["sst2"],
         "encoders": {"m": str(tiny_model_dirs["bert"])}, "tunable_layers": [0, 2], "seeds": [1, 2]},
        {"0": 0.6, "2": 0.86}))
    assert report.details["sst2"]["m"]["recommended_layers"] == 2
    assert report.details["sst2"]["m"]["what_would_settle"] == {} and "What would settle it" not in report.markdown


def test_the_methods_report_says_what_would_settle_its_answer(tiny_model_dirs):
    report = build_report(synthetic_results(
        {"report": {"kind": "methods", "resamples": 300}, "tasks": ["sst2"],
         "encoders": {"m": str(tiny_model_dirs["bert"])}, "seeds": [1, 2],
         "methods": {"head": {"tunable_layers": 0}, "top1": {"tunable_layers": 1}, "top2": {"tunable_layers": 2}}},
        {"head": 0.6, "top1": 0.85, "top2": 0.86}))
    entry = report.details["sst2"]["m"]
    assert entry["cheapest_by_trainable_parameters"] is None
    settled_as_reported(entry, entry["undecided_by_trainable_parameters"])
    assert "| method | would be within tolerance? | gap (points) |" in report.markdown
    # the table's costs are the cell's own: a CPU process's peak memory carries earlier cells' (JSON only)
    header = next(line for line in report.markdown.splitlines() if line.startswith("| method | what trains |"))
    assert header.endswith("| within tolerance? | training time (s) |") and "memory" not in report.markdown


def test_metrics_are_byte_identical_between_builds(results, tmp_path):
    from pipelines.datasets import FileDataset

    for name in ("a", "b"):
        built = build_report(results)
        FileDataset(str(tmp_path / f"{name}.json")).save(built.metrics)
        FileDataset(str(tmp_path / f"{name}-details.json")).save(built.details)
    for name in ("{}.json", "{}-details.json"):
        assert (tmp_path / name.format("a")).read_bytes() == (tmp_path / name.format("b")).read_bytes()
        assert "train_time" not in (tmp_path / name.format("a")).read_text()  # timings vary between builds


def test_figures_are_written_as_png(results, tmp_path):
    from pipelines.datasets import FileTreeDataset

    FileTreeDataset(str(tmp_path), ".png").save(build_report(results).figures)
    assert (tmp_path / "quality_vs_layers.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluate_names_missing_cells_and_refuses_inconsistent_folders(results):
    cells = dict(results.cells)
    first = results.plan.cells[0]
    del cells[first.key]
    with pytest.raises(ValueError, match=f"have no results: {first.key}"):
        score_cells(results.plan, cells, {"sst2": results.corpora["sst2"]()})
    broken = dict(results.cells)
    broken[first.key] = Cell(results.cells[first.key].dev, accuracy=0.123)
    with pytest.raises(ValueError, match="saved dev predictions score .* but training measured 0.123"):
        score_cells(results.plan, broken, {"sst2": results.corpora["sst2"]()})


def test_metrics_json_is_plain_json(results):
    built = build_report(results)
    json.dumps([built.metrics, built.details])  # no numpy scalars: dvc metrics and git diffs read them


def test_builds_on_two_machines_agree_within_the_tolerance_and_give_the_same_answers():
    from layertune.reports.compare import TOLERANCE, differences

    expected = {"sst2": {"m": {"best_score": 0.6234, "mean": {"0": 0.5, "1": 0.6234}, "recommended_layers": 1}}}
    # One unit of the 4th digit: a score of 0.62345 rounds either way on two CPUs.
    assert differences(expected, {"sst2": {"m": {"best_score": 0.6235, "mean": {"0": 0.5, "1": 0.6235},
                                                "recommended_layers": 1}}}) == []
    moved = {"sst2": {"m": {"best_score": 0.6236, "mean": {"0": 0.5, "1": 0.6234}, "recommended_layers": 0}}}
    assert differences(expected, moved) == [
        f"sst2.m.best_score: 0.6234 expected, 0.6236 built (differs by 0.0002, more than {TOLERANCE:g})",
        "sst2.m.recommended_layers: 1 expected, 0 built"]
    assert differences({"v": "better", "k": [0, 1]}, {"v": "no difference shown", "k": [0, 1], "x": None}) == [
        "v: 'better' expected, 'no difference shown' built", "x: not expected"]
    # what would settle an answer is a projection, not a result: not compared, on either side
    assert differences({"m": {"what_would_settle": {"1": {"seeds_needed": 5}}, "best": 1}},
                       {"m": {"what_would_settle": {"1": {"seeds_needed": 6}}, "best": 1}}) == []
    assert differences({"m": {"best": 1}}, {"m": {"what_would_settle": {}, "best": 1}}) == []


def test_compare_names_each_report_that_is_missing_or_differs(tmp_path, capsys):
    from layertune.reports.compare import main

    for build, score in (("expected", 0.5), ("built", 0.51)):
        (tmp_path / build / "s").mkdir(parents=True)
        (tmp_path / build / "s.json").write_text(json.dumps({"sst2": {"m": {"best_score": score}}}))
    (tmp_path / "expected" / "s" / "details.json").write_text(json.dumps({"sst2": {"m": {"std": {"0": 0.01}}}}))
    assert main([str(tmp_path / "expected"), str(tmp_path / "built")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["s/details.json: expected, not built",
                   "s.json: sst2.m.best_score: 0.5 expected, 0.51 built (differs by 0.01, more than 0.0001)"]
    (tmp_path / "built" / "s" / "details.json").write_text(json.dumps({"sst2": {"m": {"std": {"0": 0.01001}}}}))
    assert main([str(tmp_path / "expected"), str(tmp_path / "built"), "--tolerance", "0.02"]) == 0
    assert "s: equal within 0.02 on every score, every answer the same" in capsys.readouterr().out


def test_the_expected_ci_reports_are_those_of_the_ci_profile():
    """.ci/repro-check.sh compares a ci build with tests/expected/ci/: they must be the ci profile's studies, tasks,
    encoders and settings (a profile changed without refreshing them fails here, not after two builds)."""
    from pathlib import Path

    import yaml

    from pipelines.profiles import apply_overrides, load_profile

    root = Path(__file__).resolve().parents[1]
    params = apply_overrides(yaml.safe_load((root / "params.yaml").read_text()), load_profile("ci", root))
    plan = plan_studies(params)
    expected = root / "tests" / "expected" / "ci"
    assert sorted(p.stem for p in expected.glob("*.json")) == sorted(plan.studies)
    for name, study in plan.studies.items():
        metrics = json.loads((expected / f"{name}.json").read_text())
        assert (expected / name / "details.json").is_file()
        spec = study.spec
        assert sorted(metrics) == sorted(spec.tasks)
        if spec.report.kind == "encoders":
            assert {task: sorted(metrics[task]) for task in metrics} == {
                task: sorted(map(str, spec.tunable_layers)) for task in spec.tasks}
            assert all(sorted(entry["mean"]) == sorted(spec.encoders) for task in metrics
                       for entry in metrics[task].values())
        else:
            assert all(sorted(metrics[task]) == sorted(spec.encoders) for task in metrics)
            settings = spec.methods if spec.methods is not None else map(str, spec.tunable_layers)
            assert all(sorted(entry["mean"]) == sorted(settings) for task in metrics
                       for entry in metrics[task].values())


HOSTILE = "<img src=x onerror=alert(1)>"


def test_user_strings_are_shown_in_reports_never_run(tiny_model_dirs, tmp_path):
    """A label name, a file name or a dev sentence lands in reports/<study>.md as text: escaped for HTML and for
    Markdown, never as markup (an image tag, a link, a broken table)."""
    from layertune.reports.encoders import _short
    from layertune.reports.ner import baselines_text

    folder = tmp_path / "my_data"
    folder.mkdir()
    rows = [(f"film {i}", HOSTILE if i % 2 else "fine|pipe") for i in range(40)]
    pd.DataFrame(rows, columns=["review", "sentiment"]).to_csv(folder / "reviews.csv", index=False)
    params = {"download": {"mirror": None}, "studies": {"s": {
        "report": {"kind": "layers", "resamples": 50}, "tasks": {"reviews": {"path": str(folder / "reviews.csv"),
                                                                          "label": "sentiment"}},
        "encoders": {"m": str(tiny_model_dirs["bert"])}, "tunable_layers": [0, 1], "seeds": [1]}}}
    plan = plan_studies(params).studies["s"]
    corpus = plan.spec.corpus_spec("reviews").load()
    references = corpus.dev["label"]
    cells = {cell.key: Cell({"predictions": references, "references": references}, 1.0) for cell in plan.cells}
    report = build_report(StudyResults(plan, score_cells(plan, cells, {"reviews": corpus}), cells,
                                       {"reviews": lambda: corpus}))
    classes = next(line for line in report.markdown.splitlines() if "classes:" in line)
    assert "2 classes: &lt;img src=x onerror=alert(1)&gt;, fine\\|pipe." in classes
    assert "<img" not in report.markdown
    shown = str(folder / "reviews.csv").replace("_", "\\_")  # as named, not as emphasis
    assert f"local files {shown}." in report.markdown
    assert _short(f"{HOSTILE} a | b") == "&lt;img src=x onerror=alert(1)&gt; a \\| b"
    baselines = {"majority_tag": {"tag": HOSTILE, "f1": 0.0, "accuracy": 0.5},
                 "word_majority_tag": {"f1": 0.1, "precision": 0.1, "recall": 0.1}}
    assert "the majority tag (&lt;img src=x onerror=alert(1)&gt;)" in baselines_text(baselines)


def test_ordinary_names_and_sentences_render_as_before():
    """What the committed reports show (model ids, labels, SST-2 sentences) passes unchanged: they stay
    byte-identical."""
    from pathlib import Path

    from layertune.reports.common import literal

    reports = Path(__file__).resolve().parents[1] / "reports"
    shown = [cell.strip() for line in (reports / "multi_encoder.md").read_text().splitlines()
             if line.endswith(" |") and " | positive | " in line or " | negative | " in line
             for cell in line.strip("|").split(" | ")[:3]]  # the dme attention table: sentence, gold, predicted
    models = ["sentence-transformers/all-MiniLM-L6-v2", "sentence-transformers/paraphrase-MiniLM-L3-v2"]
    assert len(shown) > 10 and all(literal(text) == text for text in [*shown, *models])
    assert literal("O", code=True) == "`O`" and literal("0.1") == "0.1"


def test_the_convergence_table_names_each_encoder_of_an_encoders_study(tiny_model_dirs):
    model = str(tiny_model_dirs["bert"])
    encoders = synthetic_results({"report": {"kind": "encoders", "resamples": 100}, "tasks": ["sst2"],
                                  "encoders": {"a": model, "b": model}, "tunable_layers": [1], "seeds": [1, 2]},
                                 {"1": 0.8})
    markdown = build_report(encoders).markdown
    table = markdown[markdown.index("| encoder | epochs trained (best), per seed |"):]
    assert "| a | 1 (1), 1 (1) | maximum | 3 |" in table and "| b | 1 (1), 1 (1) | maximum | 3 |" in table


def test_cells_the_maximum_stopped_are_named_with_their_best_epoch_and_a_whole_schedule_told_apart():
    """No patience, or one as long as the maximum or longer, cannot run out: the schedule runs to its end by design;
    a shorter patience the maximum beat, or a whole schedule still improving at its last epoch, may have cut the
    cell short. Both kinds are named with their best epoch; patience-stopped and fixed-epoch cells are not."""
    import pandas as pd

    from layertune.reports.references import _capped_text

    def cell(key, stopped_by, patience, max_epochs, best, trained, selects_best=True):
        return {"key": key, "stopped_by": stopped_by, "patience": patience, "max_epochs": max_epochs,
                "best_epoch": best, "epochs_trained": trained, "selects_best": selects_best}

    cells = pd.DataFrame([
        cell("as long", "maximum", 40, 40, 30, 40), cell("longer", "maximum", 50, 40, 28, 40),
        cell("no patience", "maximum", None, 40, 31, 40), cell("still improving", "maximum", None, 40, 40, 40),
        cell("cut", "maximum", 2, 15, 15, 15), cell("done", "patience", 2, 10, 4, 6),
        cell("fixed epochs", "maximum", None, 3, 3, 3, selects_best=False)])
    text = _capped_text(cells)
    assert "Ran their whole schedule by design (no patience, or one as long as the maximum; the rate decays to zero " \
        "and the best epoch is kept): as long (best 30 of 40), longer (best 28 of 40), no patience (best 31 of 40)." \
        in text
    assert "or still improving at their last epoch (they may not have converged): still improving (best 40 of 40), " \
        "cut (best 15 of 15)." in text
    assert "done" not in text and "fixed epochs" not in text
    assert _capped_text(cells[cells["key"] == "done"]) == ""


def test_references_stand_beside_the_settings_and_the_head_alone_is_held_to_its_probe(results):
    """The probe is the head alone's optimum: a head-only setting below it by more than a point is named as not
    converged, and every setting that tunes layers below it is listed."""
    import dataclasses

    def record(name, score, chosen):
        return {"name": name, "metrics": {"eval_accuracy": score}, "main_metric": "accuracy", "chosen": chosen,
                "predictions": {}}

    means = {k: s.mean for k, s in ((s.tunable_layers, s) for s in settings(results))}
    probe = means[1] + 0.001  # above 1 and 0, below 2
    references = {"sst2": {"no_model": record("majority class", 0.5, {"class": "<b>positive</b>"}),
                           "encoders": {"m": {"linear_probe": record("linear probe (logistic_regression)", probe,
                                                                     {"C": 0.1, "validation_scores": {}})}}}}
    report = build_report(dataclasses.replace(results, references=references))
    assert "| majority class | – | 50.0 | class &lt;b&gt;positive&lt;/b&gt; |" in report.markdown  # data, escaped
    assert f"the head alone (0) scores {100 * means[0]:.1f} against its linear probe's {100 * probe:.1f}" \
        in report.markdown and "points short of it: the probe fits its penalty" in report.markdown
    assert (f"m: settings that tune layers and score below its probe ({100 * probe:.1f}): 1 ({100 * means[1]:.1f})."
            in report.markdown)
    assert set(report.tables["references"]["kind"]) == {"no_model", "linear_probe"}


@pytest.mark.parametrize("probe_accuracy", [0.7, 0.45, None])
def test_the_head_alones_gap_to_its_probe_is_paired_over_dev_examples_with_the_heads_seeds(results, probe_accuracy):
    """The probe scored on the settings' own bootstrap draws of the same dev examples: head − probe with an interval
    whose dev part is paired and whose seed part is the head's alone (the probe is one fixed fit). A probe right far
    more (less) often is shown above (below) the head; one that predicts as a head cell is shown neither."""
    import dataclasses

    from layertune.metrics import metric_for
    from layertune.statistics import Resamples, interval, shrunk_spread

    head = [c for c in results.plan.cells if c.tunable_layers == 0]
    references_ = results.cells[head[0].key].predictions()["dev"]["references"]
    if probe_accuracy is None:
        predicted = results.cells[head[0].key].predictions()["dev"]["predictions"]
    else:
        rng = np.random.default_rng(5)
        predicted = [r if rng.random() < probe_accuracy else 1 - r for r in references_]
    score = float(np.mean(np.equal(predicted, references_)))
    probe = {"name": "linear probe (logistic_regression)", "metrics": {"eval_accuracy": score},
             "main_metric": "accuracy", "chosen": {"C": 0.1},
             "predictions": {"predictions": predicted, "references": references_}}
    report = build_report(dataclasses.replace(results, references={"sst2": {"encoders": {"m": {"linear_probe": probe}}}}))
    setting = next(s for s in settings(results) if s.tunable_layers == 0)
    found = re.search(r"head − probe ([+-][\d.]+) \[([+-][\d.]+), ([+-][\d.]+)\] points \(dev examples paired, and "
                      r"the head's seeds\): (shown below it|shown above it|not shown above or below it)", report.markdown)
    assert found, report.markdown
    # The interval computed apart: the probe on the settings' draws, the head's seeds shrunk toward the pooled spread.
    draws = Resamples.draw(len(references_), results.options.resamples)
    fixed = draws.estimate(metric_for("accuracy", ("accuracy",)), "accuracy", [predicted] * setting.estimate.seeds,
                           references_, [score] * setting.estimate.seeds)
    difference = setting.estimate.minus(fixed)
    low, high = interval(difference, setting.confidence, shrunk_spread(difference, setting.spread, sides=1))
    assert [float(found.group(i)) for i in (1, 2, 3)] == [round(100 * x, 1) for x in (difference.mean, low, high)]
    assert found.group(4) == {None: "not shown above or below it", 0.7: "shown below it",
                              0.45: "shown above it"}[probe_accuracy]
    table = report.tables["references"].set_index("kind").loc["linear_probe"]
    assert (table["head_minus_probe_low"], table["head_minus_probe_high"]) == pytest.approx((low, high))
    other = dataclasses.replace(results, references={"sst2": {"encoders": {"m": {"linear_probe": {
        **probe, "predictions": {"predictions": predicted[:-1], "references": references_[:-1]}}}}}})
    assert "head − probe" not in build_report(other).markdown  # other examples: no pairing claimed


@dataclass
class ValidatedCell(Cell):
    """A cell that kept its epoch on the validation slice, where it scored ``validation``."""

    validation: float = 0.0

    def history(self):
        return [{**super().history()[0], "validation_accuracy": self.validation}]


@pytest.mark.parametrize("head_validation, why", [
    (0.795, "level with it (within a point): the two fits, chosen on that slice, differ in their regulariser"),
    (0.75, "short there too, but level with or above the same fit with no penalty (74.0): the head has trained as "
           "far as an unpenalised fit goes, and what it lacks is the probe's penalty"),
    (0.70, "short there too, and short of the same fit with no penalty (74.0): its optimiser has not reached the "
           "fit in the epochs it trained"),
])
def test_a_head_alone_short_of_its_probe_is_told_why_from_the_validation_slice(results, head_validation, why):
    """Short on dev, the head alone is set beside the probe on the validation slice, where both chose: level there,
    the fits differ in their regulariser; short there too, the probe's fit with no penalty tells whether the head
    lacks the penalty (it reaches that fit) or training (it does not)."""
    import dataclasses

    layers = {cell.key: cell.tunable_layers for cell in results.plan.cells}
    cells = {key: ValidatedCell(cell.dev, cell.accuracy, validation=head_validation if layers[key] == 0 else 0.9)
             for key, cell in results.cells.items()}
    means = {s.tunable_layers: s.mean for s in settings(results)}
    probe = {"name": "linear probe (logistic_regression)", "metrics": {"eval_accuracy": means[1] + 0.001},
             "main_metric": "accuracy", "predictions": {},
             "chosen": {"C": 0.1, "validation_scores": {"0.01": 0.78, "0.1": 0.80},
                        "unpenalised_validation_score": 0.74}}
    references = {"sst2": {"no_model": None, "encoders": {"m": {"linear_probe": probe}}}}
    scores = score_cells(results.plan, cells, {"sst2": results.corpora["sst2"]()})
    # cells.csv ships each cell's score on the slice at the epoch it kept: what the sentences below average
    assert sorted(set(scores["validation_score"])) == sorted({head_validation, 0.9})
    report = build_report(dataclasses.replace(results, cells=cells, scores=scores, references=references))
    gap = 100 * (means[1] + 0.001 - means[0])
    assert (f"is {gap:.1f} points short of it; on the validation slice it scores {100 * head_validation:.1f} "
            f"against the probe's 80.0, {why}") in report.markdown
    assert report.tables["references"]["validation_score"].tolist() == [0.80]
    assert report.tables["references"]["unpenalised_validation_score"].tolist() == [0.74]
    assert "| C 0.1 |" in report.markdown  # what the probe chose; its scores on the slice are in the table's columns
    # K = 1 scores 0.9 on the slice: above the probe there, below it on dev
    assert (f"below its probe ({100 * (means[1] + 0.001):.1f}): 1 ({100 * means[1]:.1f}); on the validation slice "
            "they score 1 90.0 against the probe's 80.0, all above it there: they beat the frozen features on data "
            "drawn as their training data is, not on dev") in report.markdown


def test_each_setting_costs_its_training_time_in_full_fine_tunings(tiny_model_dirs):
    """Convergence has a price, counted in the unit of one full fine-tuning of the same seed: per setting, and for
    one seed of the whole grid; a grid without full fine-tuning has no such column."""
    model = str(tiny_model_dirs["bert"])
    study = {"report": {"kind": "layers", "resamples": 100}, "tasks": ["sst2"], "encoders": {"m": model},
             "tunable_layers": [0, 1, "all"], "seeds": [1, 2]}
    markdown = build_report(synthetic_results(study, {"0": 0.6, "1": 0.8, "all": 0.85},
                                              {"0": 1.0, "1": 2.0, "all": 5.0})).markdown
    assert "| at most | training time (× full fine-tuning) |" in markdown
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[-1].strip(" |")
            for line in markdown.splitlines() if line.startswith("| ") and line.count(" | ") == 4}
    assert (rows["0"], rows["1"], rows["all"]) == ("0.20", "0.40", "1.00")
    assert "One seed of this grid trains in 1.6 full fine-tunings' time" in markdown
    without = build_report(synthetic_results({**study, "tunable_layers": [0, 1]}, {"0": 0.6, "1": 0.8})).markdown
    assert "full fine-tuning)" not in without and "full fine-tunings' time" not in without


def test_a_grid_whose_settings_trained_different_seeds_costs_each_setting_once():
    """A study decided in rounds trains seeds 3 and 4 of the settings still in question only: summed per seed, those
    seeds' totals left out the others (2.8 full fine-tunings where the settings cost 2.9)."""
    from layertune.reports.references import _convergence_text

    rows = [("0", seed, 1.0) for seed in (1, 2)] + [("1", seed, 2.0) for seed in (1, 2, 3, 4)] + \
        [("all", seed, 5.0) for seed in (1, 2, 3, 4)]
    cells = pd.DataFrame([{"encoder": "m", "setting": setting, "seed": seed, "train_time_s": time,
                           "full_fine_tuning": setting == "all", "epochs_trained": 3, "best_epoch": 2,
                           "stopped_by": "early_stopping", "max_epochs": 10, "selects_best": True, "patience": 2, "key": "c"}
                          for setting, seed, time in rows])
    assert "One seed of this grid trains in 1.6 full fine-tunings' time" in _convergence_text(cells, "tunable layers")
