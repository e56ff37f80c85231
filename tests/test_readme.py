"""The README a newcomer reads: short, its quick starts run as written (with tiny sizes where the real ones are
long), and the figures it and the docs quote are those of the committed reports and benchmark."""

import json
import os
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PIPELINE_DOC = (ROOT / "docs" / "pipeline.md").read_text()


def quickstart(name: str) -> str:
    """The code block after ``<!-- quickstart: <name> -->`` in the README."""
    found = re.search(rf"<!-- quickstart: {name} -->\n```\w+\n(.*?)```", README, re.S)
    assert found, f"README.md has no quick start {name!r}"
    return found.group(1)


def test_the_readme_is_read_in_five_minutes():
    assert len(README.split()) <= 1500
    for heading in ("## Install", "## Three quick starts", "## Concepts", "## Your data, your model, your GPU",
                    "## What the default studies say"):
        assert heading in README
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):  # every local link and the figure exist
        assert link.startswith("http") or (ROOT / link).exists(), link
    assert "![" in README  # one figure


def test_the_default_studies_quick_start_is_layertune_repro():
    """`make study` is `layertune repro` once set up: `dvc repro` study by study (tests/test_scale.py checks it gives
    a plain `dvc repro`'s build; CI's repro-check builds the studies with `dvc exp run`, at the ci profile's sizes);
    `make test` the fast tier, which says how to run the rest."""
    assert README.splitlines()[7:9] == [
        "make study   # set up (.venv), then build the four default studies, study by study → reports/",
        "make test    # set up, then run the tests (the fast tier, ~5 min; make test-slow: the rest)"]
    makefile = (ROOT / "Makefile").read_text()
    study = re.search(r"^study: setup\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert study.strip() == "layertune repro --jobs $(JOBS)"
    test = re.search(r"^test: setup\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert '-m "not slow"' in test and "make test-slow" in test


def clone(tmp_path: Path) -> Path:
    copy = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(copy)], check=True)
    return copy


def run(folder: Path, command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(command, shell=True, cwd=folder, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(folder / "src"), **(env or {})})
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.integration  # the real all-MiniLM-L6-v2 on 64 of the CSV's reviews: ~1 min
def test_one_cell_on_your_csv_runs_as_written(data_mirror, tmp_path):
    folder = clone(tmp_path)
    commands = quickstart("cell").replace("\\\n", " ").strip().splitlines()
    assert commands[0] == "python examples/make_your_data.py"
    run(folder, commands[0])
    done = run(folder, commands[1] + " --train-size 64 --dev-size 32")  # tiny sizes: the same command otherwise
    metrics = json.loads(done.stdout[done.stdout.index("{"):])
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["trainable_parameters"] < metrics["total_parameters"]
    written = {p.name for p in (folder / "runs" / "reviews-k2").iterdir()}
    assert {"model", "metrics.json", "history.json", "predictions.json", "drift.csv"} <= written
    cell = json.loads((folder / "runs" / "reviews-k2" / "cell.json").read_text())
    assert '"tunable_layers": 2' in json.dumps(cell)  # the spec as the command line gave it


@pytest.mark.slow
@pytest.mark.integration  # the study of quick start 2 through `layertune repro`, at tiny sizes: ~3 min
def test_your_own_study_is_built_alone_as_written(data_mirror, minilm_l3, tmp_path):
    folder = clone(tmp_path)
    block = yaml.safe_load(quickstart("study"))
    (name, study), = block.items()
    study["data"] = {"train_size": 64, "dev_size": 32, "seed": 42}  # tiny sizes
    study["training"]["epochs"] = 1
    params = yaml.safe_load((folder / "params.yaml").read_text())
    params["studies"][name] = study
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(folder, "python examples/make_your_data.py")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}", "LAYERTUNE_MODEL_MIRROR": str(minilm_l3.parent)}
    run(folder, f"layertune repro {name}", env)
    report = (folder / "reports" / f"{name}.md").read_text()
    assert "Recommended number of tunable layers" in report and (folder / "reports" / f"{name}.json").is_file()
    assert sorted(p.name for p in (folder / "data" / "04_models").iterdir() if not p.name.startswith(".")) == [name]


def test_your_model_study_block_is_a_valid_study(fake_hub, tmp_path, monkeypatch):
    """The roberta-base study of "Your data, your model, your GPU" passes the plan's checks (roberta-base's config
    from tests/hub; the CSV from the examples)."""
    from examples.make_your_data import write_examples
    from pipelines.plans import plan_studies

    block = re.search(r"## Your data, your model, your GPU.*?```yaml\n(.*?)```", README, re.S).group(1)
    (name, study), = yaml.safe_load(block).items()
    monkeypatch.chdir(tmp_path)
    reviews = tmp_path / "data" / "user" / "reviews.csv"
    reviews.parent.mkdir(parents=True)
    reviews.write_text("review,sentiment\n" + "".join(f"film {i} was {'great bad'.split()[i % 2]},"
                                                      f"{'positive negative'.split()[i % 2]}\n" for i in range(40)))
    planned = plan_studies({"download": {"mirror": None}, "studies": {name: study}}).studies[name]
    assert {cell.tunable_layers for cell in planned.cells} == {0, 2, 4, "all"} and len(planned.cells) == 12
    assert write_examples  # the example writer the quick starts use exists


# ------------------------------------------------------------------ figures quoted against their sources


def quoted(row: str, label: str) -> float:
    """The number the README writes after ``label`` in ``row`` (its − as -)."""
    found = re.search(re.escape(label) + r"\s*([−+-]?\d+\.\d)", row)
    assert found, (label, row)
    return float(found.group(1).replace("−", "-"))


def agrees(shown: float, value: float) -> bool:
    """``shown`` is ``value`` (metric units, in details.json's 4 digits) in points, to the README's one digit."""
    return abs(shown - 100 * value) <= 0.051


def row(start: str) -> str:
    return next(line for line in README.splitlines() if line.startswith(start))


def scores_named(text: str) -> dict[str, float]:
    """The ``<setting>: <points>`` pairs a README cell writes (``4: 83.3``, ``ia3: 82.1``)."""
    return {name: float(value) for name, value in re.findall(r"([\w-]+): (\d+\.\d)", text)}


def settings_listed(text: str, before: str) -> list[str]:
    """The settings a README cell lists before ``before`` (``2, 3, 4 and all shown worse`` → ['2', '3', '4', 'all'])."""
    found = re.search(r"([\w-]+(?:, [\w-]+)*(?: and [\w-]+)?) " + re.escape(before), text)
    return re.split(r", | and ", found.group(1)) if found else []


def answer_agrees(line: str, details: dict) -> None:
    """A layers or methods row: each score it names is the report's mean; the settings it calls undecided and worse
    are the report's."""
    answer = line.split(" | ")[1]
    named = scores_named(answer)
    assert named and all(agrees(shown, details["mean"][name]) for name, shown in named.items()), (answer, named)
    worse = sorted(str(k) for k, claim in details["within_tolerance"].items() if claim == "no")
    assert sorted(settings_listed(answer, "shown worse")) == worse, answer
    undecided = [str(k) for k in (details.get("undecided_between") or details.get("undecided_by_trainable_parameters")
                                  or [])]
    if "cannot decide" in answer:
        listed = settings_listed(answer.split("cannot decide")[1].removeprefix(" among").strip(), "(")
        assert sorted(listed) == sorted(undecided), answer
    else:
        assert undecided == [], answer


def test_the_answers_table_is_the_reports():
    """Every figure and claim of "What the default studies say" is the committed reports' (and its references the
    references' and the learning curve's)."""
    ablation = json.loads((ROOT / "reports" / "ablation" / "details.json").read_text())
    answer_agrees(row("| SST-2: how many of 6 layers?"), ablation["sst2"]["all-MiniLM-L6-v2"])
    answer_agrees(row("| STS-B: how many of 6 layers?"), ablation["stsb"]["all-MiniLM-L6-v2"])
    methods = json.loads((ROOT / "reports" / "methods" / "details.json").read_text())["sst2"]["all-MiniLM-L6-v2"]
    answer_agrees(row("| SST-2: top-K, LoRA"), methods)
    ner = json.loads((ROOT / "reports" / "ner" / "details.json").read_text())
    mine, line = ner["conll2003"]["all-MiniLM-L6-v2"], row("| CoNLL-2003 NER")
    assert f"**{mine['recommended_layers']}**" in line and agrees(quoted(line, "F1"), mine["best_score"])
    answer_agrees(line.replace(f"**{mine['recommended_layers']}** (F1", "(all:"), mine)
    assert agrees(quoted(line, "most frequent tag"), ner["conll2003"]["baselines"]["word_majority_tag"])
    encoders = json.loads((ROOT / "reports" / "multi_encoder" / "details.json").read_text())["sst2"]["2"]
    line = row("| two MiniLMs together")
    # each combination, and the smaller model alone, as the report judges it against the better one alone
    verdicts = {"no difference shown": "no difference shown", "worse": "**shown worse**", "better": "**shown better**"}
    for name, shown in (("concat", "concat"), ("dme", "dme"), ("paraphrase-MiniLM-L3-v2", "MiniLM-L3 alone")):
        versus = encoders["versus_reference"][name]
        assert agrees(quoted(line, f"{shown}: {verdicts[versus['verdict']]} ("), versus["difference"]), (name, line)
        bounds = re.search(re.escape(shown) + r": [^\[]*\[([^,]+), ([^\]]+)\]", line).groups()
        assert all(agrees(float(b.replace("−", "-")), v) for b, v in zip(bounds, (versus["low"], versus["high"])))
    assert agrees(quoted(line, "MiniLM-L6 alone"), encoders["encoders"]["all-MiniLM-L6-v2"]["mean"])
    import pandas as pd

    probes = pd.read_csv(ROOT / "reports" / "multi_encoder" / "references.csv").query("kind == 'linear_probe'")
    probe = dict(zip(probes.encoder, probes.score))
    assert agrees(quoted(line, "probes"), probe["all-MiniLM-L6-v2"])
    assert agrees(quoted(line, "(L6),"), probe["paraphrase-MiniLM-L3-v2"])
    references = pd.read_csv(ROOT / "reports" / "ablation" / "references.csv")
    score = {(r.task, r.kind): r.score for r in references.itertuples()}
    line = row("| SST-2: how many of 6 layers?")
    assert agrees(quoted(line, "majority class"), score["sst2", "no_model"])
    assert agrees(quoted(line, "linear probe"), score["sst2", "linear_probe"])
    line = row("| STS-B: how many of 6 layers?")
    assert agrees(quoted(line, "cosine **"), score["stsb", "untrained_cosine"])
    assert agrees(quoted(line, "ridge probe"), score["stsb", "linear_probe"])
    curve = json.loads((ROOT / "reports" / "benchmarks" / "learning_curve.json").read_text())["points"]
    top = {task: max(p["dev_score"] for p in curve if p["task"] == task) for task in ("stsb", "conll2003")}
    sst2 = [p for p in curve if p["task"] == "sst2"]

    def sst2_mean(size: int) -> float:  # over the seeds measured at that size
        return statistics.mean(p["dev_score"] for p in sst2 if p["train_size"] == size)

    largest = max(p["train_size"] for p in sst2)
    assert agrees(quoted(row("| SST-2: how many"), f"full fine-tuning at {largest:,} examples"), sst2_mean(largest))
    assert agrees(quoted(row("| SST-2: how many"), "(2,000:"), sst2_mean(2000))
    assert agrees(quoted(row("| STS-B: how many"), "full fine-tuning at 4,000 pairs"), top["stsb"])
    assert agrees(quoted(row("| CoNLL-2003 NER"), "full fine-tuning at 8,000 sentences"), top["conll2003"])


def test_build_times_quoted_are_the_benchmarks():
    """The README's build time and first report are those of the last whole build timed in one run
    (reports/benchmarks/default_build.json, with the machine's reference figure: machines of one kind differ by 2x);
    docs/pipeline.md's figures are pipeline_speed.py's."""
    build = json.loads((ROOT / "reports" / "benchmarks" / "default_build.json").read_text())
    assert build["total_s"] == sum(build["study_s"].values())
    flat = " ".join(README.split())
    assert f"{build['total_s'] / 60:.0f} minutes of `layertune repro`" in flat
    assert f"the first report lands after {build['first']['s'] / 60:.0f} minutes" in flat
    assert f"{build['machine']['matmul_gflops']:.0f} GFLOPS" in flat
    benchmarks = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    assert f"about {build['total_s'] / 60:.0f} minutes of `layertune repro`" in benchmarks
    measured = json.loads((ROOT / "reports" / "benchmarks" / "pipeline.json").read_text())
    default = measured["default"]
    compute = default["compute_s"]
    quoted = (f"in {default['wall_s']:,.0f} s: {sum(compute.values()):,.0f} s of it computing (training "
              f"{compute['training']:.0f} s, scoring {compute['scoring']:.0f} s, the frozen-prefix pass "
              f"{compute['caching']:.0f} s,")
    assert quoted in " ".join(PIPELINE_DOC.split())
    thousand = measured["synthetic"]["after"]["1000"]
    assert f"1,000 head-only cells builds in {thousand['wall_s']:.0f} s" in " ".join(PIPELINE_DOC.split())
    assert f"{measured['synthetic']['after']['added_per_cell_s']['100->1000']:.2f} s of bookkeeping per cell" in \
        " ".join(PIPELINE_DOC.split())
