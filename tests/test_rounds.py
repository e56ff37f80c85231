"""A study decided in rounds (layertune.rounds): the next round's seeds and settings, when it stops, and a rebuild
that replays the recorded rounds reaching the same claims as the study that ran them."""

import itertools

import numpy as np
import pytest

from layertune.rounds import RULE, Allocation, Round, allocate, answer, next_round, replay, seeds_by_setting
from layertune.statistics import Estimate, Looks, Resamples

ORDER = ("0", "1", "2", "all")  # cheapest first
DECIDED_WITH = {"tolerance": 0.01, "confidence": 0.95, "looks": 3, "spending": "obrien-fleming", "seeds_per_round": 2,
                "evaluation_size": None, "rule": RULE}
ACCURACY = {"0": 0.70, "1": 0.795, "2": 0.80, "all": 0.80}
EXAMPLES, DEV = 2000, 500  # the first DEV examples are the dev set; the rest, the evaluation examples
WEIGHTS = {n: np.stack([np.bincount(row, minlength=n) for row in Resamples.draw(n, 200).examples]) for n in
           (DEV, EXAMPLES)}
DIFFICULTY = np.random.default_rng(0).random(EXAMPLES)


def cell(setting: str, seed: int) -> np.ndarray:
    """A trained cell's per-example correctness: the same cell every time it is asked for (a saved cell folder)."""
    rng = np.random.default_rng([ORDER.index(setting), seed])
    p = ACCURACY[setting] + rng.normal(0, 0.003)
    return np.where(rng.random(EXAMPLES) < 0.95, DIFFICULTY < p, rng.random(EXAMPLES) < p).astype(float)


def estimate(setting: str, seeds, extended: bool = True) -> Estimate:
    """On all the examples (the tests of seeds alone), or on the dev ones until a round adds the rest."""
    n = EXAMPLES if extended else DEV
    cells = [cell(setting, seed)[:n] for seed in seeds]
    return Estimate(np.array([c.mean() for c in cells]), np.stack([WEIGHTS[n] @ c / n for c in cells]), n)


def on_all(setting: str, seeds, extended: bool) -> Estimate:
    """A study whose dev set is all the examples (no evaluation examples to add)."""
    return estimate(setting, seeds)


def rule_next(rounds, claims, estimate_of, looks, seeds_per_round=2, evaluation_size=None, dev_dominates=False):
    """The round the rule chooses after ``rounds`` (as a report does, `layertune.reports.decided`)."""
    seen = {setting: estimate_of(setting, used, any(done.examples for done in rounds))
            for setting, used in seeds_by_setting(rounds).items()}
    allocation = allocate(seen, claims, ORDER, 0.01, looks, len(rounds), seeds_per_round, rounds[-1].settings)
    return next_round(rounds, claims, ORDER, looks, seeds_per_round, allocation, evaluation_size, dev_dominates)


def test_a_rebuild_replaying_the_recorded_rounds_reaches_the_claims_the_study_made():
    looks = Looks(4)
    rounds, live = [Round((1, 2), ORDER)], []
    while True:
        live = replay(rounds, on_all, 0.01, looks)  # what the study sees after its latest round
        following = rule_next(rounds, live[-1], on_all, looks)
        if following is None:
            break
        rounds.append(following)
    # K = 0, 10 points below, stopped after round 2 (two seeds, the first look's tiny error, decide nothing)
    assert live[0]["0"] == "undecided" and live[1]["0"] == "no" and "0" not in rounds[2].settings
    assert seeds_by_setting(rounds)["0"] == [1, 2, 3, 4]
    for earlier, later in itertools.pairwise(rounds):  # a setting left out of a round stays out: seeds pair in order
        assert set(later.settings) <= set(earlier.settings)
    assert replay(rounds, on_all, 0.01, looks) == live  # the same cells, the same rounds: the same claims
    assert "yes" in live[-1].values() and answer(live[-1], ORDER) in ("1", "2", None) and len(rounds) <= 4


def test_where_the_dev_sample_dominates_the_next_round_adds_the_evaluation_examples_once():
    """Cheaper than seeds (nothing trains) and what helps when the dev sample is the noise; a rebuild replays it."""
    looks = Looks(4)
    rounds = [Round((1, 2), ORDER)]
    live = replay(rounds, estimate, 0.01, looks)
    assert live[0]["1"] == "undecided"  # on 500 dev examples, 1 and 2 cannot be told apart
    following = rule_next(rounds, live[-1], estimate, looks, evaluation_size=EXAMPLES - DEV, dev_dominates=True)
    contenders = tuple(setting for setting in ORDER if live[-1][setting] != "no")
    assert following == Round((), contenders, EXAMPLES - DEV)
    rounds.append(following)
    live = replay(rounds, estimate, 0.01, looks)
    widths = [estimate("2", (1, 2), extended).minus(estimate("1", (1, 2), extended)).samples.mean(axis=0).std()
              for extended in (False, True)]
    assert widths[1] < 0.7 * widths[0]  # 4 times the examples: about half the dev part
    # Once added, the next round gives seeds again (or none, where none could settle anything)
    again = rule_next(rounds, live[-1], estimate, looks, evaluation_size=EXAMPLES - DEV, dev_dominates=True)
    assert again is None or (again.seeds == (3, 4) and not again.examples)
    assert replay(rounds, estimate, 0.01, looks) == live
    assert rule_next(rounds[:1], live[0], estimate, looks, dev_dominates=True).seeds == (3, 4)  # none to add
    assert rule_next(rounds[:1], live[0], estimate, looks, evaluation_size=1500).seeds == (3, 4)  # seeds dominate


def test_seeds_go_where_they_can_settle_something_and_to_the_rival_they_are_settled_against():
    """After two rounds: K = 1 is 0.5 points below the best, inside the 1-point tolerance, but its comparison would
    need more seeds than the two rounds left give: it gets none (stalled, with the seeds that would settle it).
    Settings shown worse, or decided and no one's rival, get none either."""
    accuracy = {"0": 0.70, "1": 0.795, "2": 0.80, "all": 0.80}
    looks = Looks(4)
    rounds = [Round((1, 2), ORDER), Round((3, 4), ORDER)]
    claims = replay(rounds, on_all, 0.01, looks)[-1]
    seen = {setting: on_all(setting, used, False) for setting, used in seeds_by_setting(rounds).items()}
    allocation = allocate(seen, claims, ORDER, 0.01, looks, 2, 2, ORDER)
    assert accuracy and claims["0"] == "no" and "0" not in allocation.settings
    for name, needed in allocation.stalled.items():
        assert claims[name] == "undecided" and (needed is None or needed > 4 + 2 * 2)
    chosen = [name for name in ORDER if claims[name] == "undecided" and name not in allocation.stalled]
    assert set(chosen) <= set(allocation.settings)
    if not chosen:  # nothing left that seeds could settle: no next round, though looks are left
        assert next_round(rounds, claims, ORDER, looks, 2, allocation) is None
    # A setting left out of a round cannot come back, even as a rival: its seeds would not pair in order
    assert not allocate(seen, claims, ORDER, 0.01, looks, 2, 2, eligible=("0",)).settings


def test_it_stops_when_the_answer_is_decided_or_the_looks_are_spent():
    rounds = [Round((1, 2), ORDER)]
    anything = Allocation(ORDER, {})
    assert answer({"0": "no", "1": "yes", "2": "undecided", "all": "yes"}, ORDER) == "1"
    assert next_round(rounds, {"0": "no", "1": "yes"}, ORDER, Looks(4), 2, anything) is None
    assert answer({"0": "undecided", "1": "yes"}, ORDER) is None  # a cheaper one is still open
    assert next_round(rounds * 4, {}, ORDER, Looks(4), 2, anything) is None
    assert next_round(rounds, {}, ORDER, Looks(4), 2, Allocation((), {"0": None})) is None  # nothing could settle
    with pytest.raises(ValueError, match="5 rounds recorded, more than the 4 looks the rule allows"):
        replay(rounds * 5, on_all, 0.01, Looks(4))
    with pytest.raises(ValueError, match="seeds per round must be at least 1; got 0"):
        next_round(rounds, {}, ORDER, Looks(4), 0, anything)


# ------------------------------------------------------------------------------------ a decided study's record


def decided_study(model: str, rounds: dict, **decide) -> dict:
    """A decided study of three settings whose record (``rounds``) today's rule made, with today's values."""
    decide = {"looks": 3, "rounds": rounds, **decide}
    decide.setdefault("decided_with", {**DECIDED_WITH, "looks": decide["looks"],
                                       "evaluation_size": decide.get("evaluation_size")})
    return {"report": {"kind": "layers", "resamples": 300}, "tasks": ["sst2"], "encoders": {"m": model},
            "tunable_layers": [0, 1, 2], "seeds": [1, 2], "decide": decide}


def round_cell(k, seed, number) -> tuple[str, dict]:
    return f"sst2-m-{k}-{seed}", {"task": "sst2", "encoder": "m", "tunable_layers": k, "seed": seed, "round": number}


def test_a_recorded_round_adds_its_cells_to_the_plan(tiny_model_dirs):
    from pipelines.plans import plan_studies

    rounds = dict(round_cell(k, seed, 2) for k in (1, 2) for seed in (3, 4))
    plan = plan_studies({"download": {"mirror": None},
                         "studies": {"s": decided_study(str(tiny_model_dirs["bert"]), rounds)}}).studies["s"]
    assert [cell.key for cell in plan.cells][6:] == ["sst2-m-1-3", "sst2-m-2-3", "sst2-m-1-4", "sst2-m-2-4"]
    # A grid cell's plan is as before the rounds existed (its saved form has no round).
    assert "round" not in plan.cells[0].model_dump() and plan.cells[6].model_dump()["round"] == 2


@pytest.mark.parametrize("rounds, message", [
    (dict([round_cell(1, 2, 2)]), "seed 2 is one of the grid's seeds"),
    (dict([round_cell(3, 3, 2)]), "tunable layer 3 is not on the study's grid"),
    (dict([round_cell(1, 3, 3)]), r"rounds \[3\] are recorded; they are numbered 2, 3"),
    (dict([round_cell(1, 3, 2), round_cell(2, 4, 2)]), "the settings of round 2 have different seeds"),
    (dict([round_cell(1, 3, 2), round_cell(1, 5, 3), round_cell(2, 5, 3)]),
     r"round 3 trains 2, which an earlier round left out: a setting left out of a round stays out"),
    ({"sst2-m-1-9": round_cell(1, 3, 2)[1]}, "decide.rounds.sst2-m-1-9: this cell's key is sst2-m-1-3"),
])
def test_a_record_the_rule_could_not_have_written_is_refused_naming_it(tiny_model_dirs, rounds, message):
    from layertune.study import ParamsError
    from pipelines.plans import plan_studies

    with pytest.raises(ParamsError, match=message):
        plan_studies({"download": {"mirror": None},
                      "studies": {"s": decided_study(str(tiny_model_dirs["bert"]), rounds)}})




@pytest.mark.parametrize(("section", "change", "key", "then"), [
    ("report", {"tolerance": 0.2}, "report.tolerance", "0.01"),
    ("report", {"confidence": 0.9}, "report.confidence", "0.95"),
    ("decide", {"looks": 4}, "decide.looks", "3"),
    ("decide", {"looks": 2}, "decide.looks", "3"),  # named as changed, before the record outgrows the looks
    ("decide", {"spending": "pocock"}, "decide.spending", "obrien-fleming"),
    ("decide", {"seeds_per_round": 1}, "decide.seeds_per_round", "2"),
    ("decide", {"evaluation_size": 50}, "decide.evaluation_size", "None"),
])
def test_a_value_the_recorded_rounds_were_decided_with_cannot_change_at_plan_time(tiny_model_dirs, section, change,
                                                                                   key, then):
    """Their claims replay under today's values: a change is refused in one line naming the key, the value the rounds
    were decided with, and the two ways out."""
    from layertune.study import ParamsError
    from pipelines.plans import plan_studies

    rounds = dict(round_cell(k, seed, 2) for k in (1, 2) for seed in (3, 4)) | dict([round_cell(1, 5, 3)])
    study = decided_study(str(tiny_model_dirs["bert"]), rounds, decided_with=DECIDED_WITH)
    plan_studies({"download": {"mirror": None}, "studies": {"s": study}})  # as decided: accepted
    study[section] = {**study[section], **change}
    with pytest.raises(ParamsError) as refused:
        plan_studies({"download": {"mirror": None}, "studies": {"s": study}})
    line = str(refused.value).splitlines()[-1].strip()
    now = str(next(iter(change.values())))
    assert line == (f"studies.s: {key}: {now}, but the recorded rounds were decided with {then} "
                    f"(decide.decided_with.{key.split('.')[1]}), and their claims hold for that value only; restore "
                    f"{key}: {then}, or clear decide.rounds and decide.evaluation_rounds to decide the study again "
                    "from its grid"), line
    # Cleared, the study is decided again from its grid: the values it was decided with before no longer bind it.
    study["decide"] = {**study["decide"], "rounds": {}}
    plan_studies({"download": {"mirror": None}, "studies": {"s": study}})


@pytest.mark.parametrize("recorded", [{**DECIDED_WITH, "rule": "1"}, None], ids=["rule 1", "no decided_with"])
def test_a_record_another_rule_made_is_refused_at_plan_time_in_one_line(tiny_model_dirs, recorded):
    """Its rounds are not those today's rule would choose, nor its claims those it would make: replaying them as if
    they were would report what neither rule says. A record from before rules were named is rule 1's."""
    from layertune.study import ParamsError
    from pipelines.plans import plan_studies

    study = decided_study(str(tiny_model_dirs["bert"]), dict([round_cell(1, 3, 2), round_cell(2, 3, 2)]),
                          decided_with=recorded)
    with pytest.raises(ParamsError) as refused:
        plan_studies({"download": {"mirror": None}, "studies": {"s": study}})
    line = str(refused.value).splitlines()[-1].strip()
    assert line == ("studies.s: decide.decided_with.rule: the recorded rounds were chosen by rule '1', and today's is "
                    f"{RULE!r}, which chooses its rounds and makes its claims differently: clear decide.rounds, "
                    "decide.evaluation_rounds and decide.decided_with to decide the study again from its grid "
                    "(layertune repro --decide), or use the layertune release that recorded them"), line
    study["decide"] = {**study["decide"], "rounds": {}, "decided_with": None}  # cleared: decided again from the grid
    plan_studies({"download": {"mirror": None}, "studies": {"s": study}})


def test_a_record_from_before_the_evaluation_size_was_kept_checks_the_other_values(tiny_model_dirs):
    """Such a record says nothing of the evaluation size: a change of it is not refused (nothing to compare with),
    a change of the values it holds still is."""
    from layertune.study import ParamsError
    from pipelines.plans import plan_studies

    older = {key: value for key, value in DECIDED_WITH.items() if key != "evaluation_size"}
    study = decided_study(str(tiny_model_dirs["bert"]), dict([round_cell(1, 3, 2), round_cell(2, 3, 2)]),
                          decided_with=older, evaluation_size=50)
    plan = plan_studies({"download": {"mirror": None}, "studies": {"s": study}})
    assert plan.studies["s"].spec.decide.decided_with.evaluation_size == 50  # taken as decided with today's
    study["decide"]["looks"] = 4
    with pytest.raises(ParamsError, match=r"decide.looks: 4, but the recorded rounds were decided with 3"):
        plan_studies({"download": {"mirror": None}, "studies": {"s": study}})


def test_a_study_of_one_setting_has_nothing_to_decide_in_rounds(tiny_model_dirs):
    from layertune.study import ParamsError
    from pipelines.plans import plan_studies

    study = {**decided_study(str(tiny_model_dirs["bert"]), {}), "tunable_layers": [2]}
    with pytest.raises(ParamsError, match=r"the study has one setting \(2\), so no question to decide in rounds; "
                                          "give tunable_layers two settings or more, or remove the decide section"):
        plan_studies({"download": {"mirror": None}, "studies": {"s": study}})


@pytest.mark.parametrize("decide, message", [
    ({"evaluation_rounds": {"sst2": {"m": 2}}}, "evaluation_rounds: recorded, but decide.evaluation_size is not set"),
    ({"evaluation_size": 50, "evaluation_rounds": {"sst2": {"m": 2}}}, "round 2 trained cells of this question"),
    ({"evaluation_size": 50, "evaluation_rounds": {"mrpc": {"m": 3}}}, "task 'mrpc' is not on the study's grid"),
    ({"evaluation_size": 50, "evaluation_rounds": {"sst2": {"m": 4}}}, r"rounds \[2, 4\] are recorded"),
])
def test_a_record_of_the_evaluation_round_the_rule_could_not_have_written_is_refused(tiny_model_dirs, decide, message):
    from layertune.study import ParamsError
    from pipelines.plans import plan_studies

    rounds = dict(round_cell(k, seed, 2) for k in (1, 2) for seed in (3, 4))
    with pytest.raises(ParamsError, match=message):
        plan_studies({"download": {"mirror": None},
                      "studies": {"s": decided_study(str(tiny_model_dirs["bert"]), rounds, **decide)}})


def test_the_evaluation_round_sits_between_rounds_of_seeds(tiny_model_dirs):
    """Round 2 gave seeds, round 3 the evaluation examples, round 4 seeds again to settings round 2 had."""
    from pipelines.plans import plan_studies

    rounds = dict([*(round_cell(k, seed, 2) for k in (1, 2) for seed in (3, 4)), round_cell(1, 5, 4),
                   round_cell(1, 6, 4)])
    study = decided_study(str(tiny_model_dirs["bert"]), rounds, evaluation_size=50,
                          evaluation_rounds={"sst2": {"m": 3}}, looks=4)
    plan = plan_studies({"download": {"mirror": None}, "studies": {"s": study}}).studies["s"]
    assert plan.spec.decide.evaluation_rounds == {"sst2": {"m": 3}}


def test_a_decided_report_shows_each_round_its_claims_and_what_comes_next(tiny_model_dirs):
    from layertune.reports import build_report
    from tests.test_reports import synthetic_results

    rounds = dict(round_cell(k, seed, 2) for k in (0, 1, 2) for seed in (3, 4))
    report = build_report(synthetic_results(decided_study(str(tiny_model_dirs["bert"]), rounds),
                                            {"0": 0.6, "1": 0.85, "2": 0.86}))
    decided = report.details["sst2"]["m"]["decided"]
    assert [r["seeds"] for r in decided["rounds"]] == [[1, 2], [3, 4]]
    assert [r["settings"] for r in decided["rounds"]] == [["0", "1", "2"], ["0", "1", "2"]]
    # Two seeds at a look's small error leave even 25 points undecided (Student t on 2 degrees of freedom); with
    # four, K = 0 is shown worse and stops and 2, the best, within the tolerance, while 1 (1 point below it) stays
    # in question: the cheaper setting open, no answer yet.
    assert decided["rounds"][0]["claims"] == {"0": "undecided", "1": "undecided", "2": "undecided"}
    assert decided["rounds"][1]["claims"] == {"0": "no", "1": "undecided", "2": "yes"}
    assert decided["order"] == ["0", "1", "2"] and decided["looks"] == 3 and decided["answer"] is None
    assert decided["next_round"] == {"seeds": [5, 6], "settings": ["1", "2"]} and decided["stalled"] == {}
    assert decided["rule"] == RULE and decided["rounds"][1]["follows_rule"] is True  # what the rule chose after 1
    # The table's verdicts are the last look's claims, and the answer is read from them.
    assert report.details["sst2"]["m"]["within_tolerance"] == decided["rounds"][-1]["claims"]
    assert report.details["sst2"]["m"]["recommended_layers"] is None
    assert "### Rounds" in report.markdown and "| 2 | 3, 4 | 0, 1, 2 | 6 |" in report.markdown
    assert "the next round would train seed(s) 5, 6 of 1, 2" in report.markdown
    assert "Decided in rounds (at most 3" in report.markdown
    # What would settle it names the settings in question against the best, never the best against itself, under
    # the rounds' test at their next look (third of three): at the fixed 95% test, a comparison it already decides
    # read as needing one more seed.
    assert sorted(report.details["sst2"]["m"]["what_would_settle"]) == ["1"]
    from layertune.statistics import Looks

    level = Looks(3).level(3)
    assert (f"What would settle it, if the observed differences hold (the rounds' test at their next look, against "
            f"the best, at one-sided error {level:.2%} for within tolerance and {level / 2:.2%} for worse, and 1-point "
            "tolerance;") in report.markdown
    # Half a point below the best, K = 1 has a 5% chance of a claim with the two seeds the last look gives: it is
    # stalled, and gets seeds only as the setting 2, still in question too, is compared with.
    closer = build_report(synthetic_results(decided_study(str(tiny_model_dirs["bert"]), rounds),
                                            {"0": 0.6, "1": 0.855, "2": 0.86}))
    found = closer.details["sst2"]["m"]["decided"]
    assert found["next_round"] == {"seeds": [5, 6], "settings": ["1", "2"]} and found["stalled"] == {"1": 0.053}
    assert ("the next round would train seed(s) 5, 6 of 1, 2 (`layertune repro --decide s`); 1 only as what the "
            "others are compared with, since the seeds the rounds left give could hardly settle their own claims (the "
            "chance of a claim: 1: 5%).") in closer.markdown
    assert "none for settings" not in closer.markdown  # it is trained: the report must not say it gets none


def test_where_no_seeds_could_settle_anything_the_rounds_stop_early_and_say_so(tiny_model_dirs, monkeypatch):
    """With the futility bound at 100% every comparison is futile: no round 3, though a look is left."""
    from layertune import rounds as rule
    from layertune.reports import build_report
    from tests.test_reports import synthetic_results

    monkeypatch.setattr(rule, "FUTILE", 1.0)
    rounds = dict(round_cell(k, seed, 2) for k in (0, 1, 2) for seed in (3, 4))
    report = build_report(synthetic_results(decided_study(str(tiny_model_dirs["bert"]), rounds),
                                            {"0": 0.6, "1": 0.85, "2": 0.86}))
    decided = report.details["sst2"]["m"]["decided"]
    assert decided["next_round"] is None and set(decided["stalled"]) == {"1"}
    assert ("Not decided after round 2 of at most 3, and the seeds the rounds left give have less than a 100% chance "
            "of settling any comparison in question") in report.markdown


def test_a_recorded_round_the_rule_would_not_choose_is_named_in_the_report(tiny_model_dirs):
    """Round 2 gave seeds 3, 4 to K = 1 and 2 only, where the rule, after round 1, gives them to every setting (two
    seeds measure nothing yet): its details say so, and the report names the round."""
    from layertune.reports import build_report
    from tests.test_reports import synthetic_results

    rounds = dict(round_cell(k, seed, 2) for k in (1, 2) for seed in (3, 4))
    report = build_report(synthetic_results(decided_study(str(tiny_model_dirs["bert"]), rounds),
                                            {"0": 0.6, "1": 0.85, "2": 0.86}))
    decided = report.details["sst2"]["m"]["decided"]
    assert [r.get("follows_rule") for r in decided["rounds"]] == [None, False]
    assert f"Round(s) 2 are not what today's rule ({RULE}) chooses from the rounds before" in report.markdown


@pytest.mark.parametrize("kind", ["layers", "methods"])
def test_a_round_of_evaluation_examples_is_replayed_on_the_dev_and_evaluation_examples_together(tiny_model_dirs,
                                                                                                kind):
    """Round 3 added 1,600 evaluation examples (the evaluate stage scored every cell of the question on them): the
    report lists it as a round that trained nothing, and looks 3 and after pair the settings on all 2,000."""
    import dataclasses

    from layertune.reports import build_report
    from layertune.reports.decided import evaluation_estimates
    from tests.test_reports import synthetic_results

    rounds = dict(round_cell(k, seed, 2) for k in (0, 1, 2) for seed in (3, 4))
    study = decided_study(str(tiny_model_dirs["bert"]), rounds, evaluation_size=1600,
                          evaluation_rounds={"sst2": {"m": 3}}, looks=4)
    name = str if kind == "layers" else "top{}".format  # a setting's name: its tunable layers, or a method's
    accuracy = {name(0): 0.6, name(1): 0.85, name(2): 0.86}
    if kind == "methods":  # the same question, its settings named as methods
        study = {**{k: v for k, v in study.items() if k != "tunable_layers"}, "report": {"kind": "methods",
                 "resamples": 300}, "methods": {name(k): {"tunable_layers": k} for k in (0, 1, 2)}}
        study["decide"]["rounds"] = {f"sst2-m-{name(cell['tunable_layers'])}-{cell['seed']}": {
            **{k: v for k, v in cell.items() if k != "tunable_layers"}, "method": name(cell["tunable_layers"])}
            for cell in rounds.values()}
    results = synthetic_results(study, accuracy)
    rng = np.random.default_rng(1)
    references = rng.integers(0, 2, 1600).tolist()
    results = dataclasses.replace(results, evaluation={"sst2": {"references": references, "predictions": {
        cell.key: [r if rng.random() < accuracy[str(cell.setting[2])] else 1 - r for r in references]
        for cell in results.plan.cells}}})
    assert {estimate.examples for estimate in evaluation_estimates(results, "sst2", "m").values()} == {2000}

    report = build_report(results)
    decided = report.details["sst2"]["m"]["decided"]
    assert [(r["seeds"], r.get("examples")) for r in decided["rounds"]] == [([1, 2], None), ([3, 4], None),
                                                                          ([], 1600)]
    assert decided["rounds"][2]["settings"] == decided["rounds"][1]["settings"]
    assert decided["rounds"][1]["claims"][name(0)] == decided["rounds"][2]["claims"][name(0)] == "no"
    assert "| 3 | +1,600 evaluation examples | – | 0 | 0.0 |" in report.markdown
    assert "1,600 more labelled examples the study does not train on" in report.markdown
    # The table's intervals, like the claims, are on the dev and evaluation examples together.
    from layertune.reports.common import signed_points
    from layertune.statistics import SeedSpread, difference_spread, within_tolerance

    extended, options = evaluation_estimates(results, "sst2", "m"), results.options
    reference = max(extended, key=lambda k: extended[k].mean)
    pooled = SeedSpread.pooled(list(extended.values()))
    assert f"vs {reference}, the best on dev and 1,600 evaluation examples (points)" in report.markdown
    for k in (k for k in extended if k != reference):
        shown = within_tolerance(extended[k], extended[reference], options.tolerance, options.confidence,
                                 difference_spread(extended[k], extended[reference], pooled))
        assert (f"| {signed_points(shown.difference)} [{signed_points(shown.low)}, {signed_points(shown.high)}] |"
                in report.markdown), k
    if decided["next_round"] is not None:  # once added, never again: the next round gives seeds
        assert decided["next_round"]["seeds"] == [5, 6] and "examples" not in decided["next_round"]


def test_every_committed_decided_report_follows_todays_rule():
    """The default studies' records replay under today's rule: each committed report of a decided study names the
    rule, and each of its rounds after the first is the round that rule chose from the looks before it (the report
    recomputes the choice from the cells when it is built: `layertune.reports.decided`)."""
    import json
    from pathlib import Path

    from pipelines.params import read_params

    root = Path(__file__).resolve().parents[1]
    decided = [name for name, study in read_params(root)["studies"].items() if study.get("decide")]
    assert decided, "params.yaml has no decided study"
    for study in decided:
        details = json.loads((root / "reports" / study / "details.json").read_text())
        for task, encoders in details.items():
            for encoder, entry in encoders.items():
                record = entry["decided"]
                assert record["rule"] == RULE, (study, task, encoder)
                assert all(done["follows_rule"] for done in record["rounds"][1:]), (study, task, encoder)
