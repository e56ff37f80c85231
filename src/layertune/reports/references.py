"""What every report sets beside its cells: references no one here trained, and how each cell's training ended.

- References (`layertune.probes`): a no-model baseline, a linear probe on each frozen encoder, an untrained model's
  cosine similarity. The head alone (0 tunable layers) trains a linear head on the probe's very features, so a
  converged head-only cell reaches its probe (within `PROBE_TOLERANCE`; the gap with its interval, `GapToProbe`,
  says whether dev examples and seeds show it above or below); a setting that tunes layers and stays below the
  probe has learned less than its frozen features already hold.
- Convergence: per cell, the epochs it trained, its best validation epoch, and what stopped it (the patience, or
  the maximum number of epochs). The maximum's cells are named: those that ran their whole schedule by design (no
  patience, or one as long as the maximum), and those it may have cut short (it beat the patience, or the cell was
  still improving at its last epoch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from layertune.reports.common import StudyResults, display, literal, markdown_table, points, signed_points
from layertune.statistics import Estimate, Resamples, SeedSpread, interval, shrunk_spread

PROBE_TOLERANCE = 0.01  # a converged head-only cell is within a point of its linear probe
STOPPED = {"early_stopping": "patience", "max_epochs": "maximum"}


def references_table(results: StudyResults) -> pd.DataFrame:
    """One row per task, encoder (empty for a no-model baseline) and reference (``kind``: no_model, linear_probe,
    untrained_cosine): its dev score, its score on the validation slice where it chose something there (the probe's
    best, and its fit with no penalty; else NaN), and what it chose."""
    rows = []
    for task, found in results.references.items():
        if found.get("no_model"):
            rows.append(_row(task, "", "no_model", found["no_model"]))
        for encoder, mine in found.get("encoders", {}).items():
            rows += [_row(task, encoder, kind, mine[kind]) for kind in ("linear_probe", "untrained_cosine")
                     if kind in mine]
    return pd.DataFrame(rows, columns=["task", "encoder", "kind", "reference", "metric", "score", "validation_score",
                                       "unpenalised_validation_score", "chosen"])


def _row(task: str, encoder: str, kind: str, record: dict) -> dict:
    found = record.get("chosen", {})
    chosen = {k: v for k, v in found.items() if k not in ("validation_scores", "unpenalised_validation_score")}
    tried = found.get("validation_scores") or {}
    return {"task": task, "encoder": encoder, "kind": kind, "reference": record["name"],
            "metric": record["main_metric"], "score": record["metrics"][f"eval_{record['main_metric']}"],
            "validation_score": max(tried.values()) if tried else float("nan"),
            "unpenalised_validation_score": found.get("unpenalised_validation_score", float("nan")),
            "chosen": ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in chosen.items())}


def convergence_table(results: StudyResults) -> pd.DataFrame:
    """One row per cell: its setting, seed, epochs trained, best epoch, what stopped it and the maximum it had."""
    scores = results.scores.set_index("key")
    rows = [{"key": cell.key, "task": cell.task, "encoder": cell.encoder, "setting": str(cell.setting[2]),
             "tunable_layers": str(cell.tunable_layers), "seed": cell.seed,
             "epochs_trained": int(scores.loc[cell.key, "epochs_trained"]),
             "best_epoch": int(scores.loc[cell.key, "best_epoch"]),
             "stopped_by": STOPPED.get(scores.loc[cell.key, "stopped_by"], scores.loc[cell.key, "stopped_by"]),
             "max_epochs": cell.spec.training.epochs,
             "patience": cell.spec.training.early_stopping_patience,
             "selects_best": cell.spec.training.selects_best,
             "train_time_s": float(scores.loc[cell.key, "train_time_s"]),
             "full_fine_tuning": _full_fine_tuning(cell.spec)}
            for cell in results.plan.cells]
    return pd.DataFrame(rows)


def _full_fine_tuning(spec) -> bool:
    """One language model, every layer trained whole (no adapter): the unit a setting's training time is counted in."""
    return len(spec.encoders) == 1 and spec.encoders[0].tunable_layers == "all" and \
        spec.encoders[0].method.name == "top_k"


def section(results: StudyResults, setting_header: str, settings: Sequence, gaps: dict[tuple, GapToProbe]) -> str:
    """Per task: the references beside the settings' means (``settings``: the report's `Setting` objects), the
    head-only check against each probe (``gaps``: `gaps_to_probe`'s), then how the cells' training ended."""
    references, convergence = references_table(results), convergence_table(results)
    layers = {cell.setting: cell.tunable_layers for cell in results.plan.cells}
    validation = _validation_at_best_epoch(results)
    lines = []
    for task in results.plan.spec.tasks:
        mine = references[references["task"] == task]
        lines.append(f"### {display(task)}: references and convergence\n")
        if len(mine):
            rows = [[r.reference, r.encoder or "–", points(r.score), literal(r.chosen) or "–"]  # a class name: data
                    for r in mine.itertuples()]
            lines.append(markdown_table(["reference (no fine-tuning)", "encoder", f"{mine['metric'].iloc[0]} "
                                         "(points)", "chosen on the validation slice"], rows, "llrl"))
            if results.plan.spec.head_for(0, task).head == "linear":  # the probe is the optimum of a linear head only
                lines.append(_probe_check(task, mine, settings, layers, validation, gaps))
        lines.append(_convergence_text(convergence[convergence["task"] == task], setting_header))
    return "\n".join(lines)


def _validation_at_best_epoch(results: StudyResults) -> dict[tuple, float]:
    """Per setting (task, encoder, setting): the mean over its cells of the validation-slice score of the epoch each
    kept, where every cell chose on the slice (a cell without one chose on dev: then the setting has none)."""
    scores = results.scores.set_index("key")["validation_score"]
    found: dict[tuple, list[float]] = {}
    for cell in results.plan.cells:
        found.setdefault(cell.setting, []).append(scores[cell.key])
    return {setting: sum(values) / len(values) for setting, values in found.items()
            if not any(math.isnan(value) for value in values)}


@dataclass(frozen=True)
class GapToProbe:
    """The head alone's dev score minus its probe's, and that difference's interval: the dev part paired (the
    settings' bootstrap draws, the probe scored on each), the seed part the head's own (the probe is one fixed fit),
    None where one seed measured none."""

    difference: float
    low: float
    high: float
    seed_spread: SeedSpread | None

    @property
    def shown(self) -> str:
        return "below it" if self.high < 0 else "above it" if self.low > 0 else "neither"

    def text(self) -> str:
        over = "dev examples paired, and the head's seeds" if self.seed_spread else "dev examples paired (one seed)"
        shown = "not shown above or below it" if self.shown == "neither" else f"shown {self.shown}"
        return (f"head − probe {signed_points(self.difference)} [{signed_points(self.low)}, "
                f"{signed_points(self.high)}] points ({over}): {shown}")


def gaps_to_probe(results: StudyResults, settings: Sequence) -> dict[tuple, GapToProbe]:
    """Per head-alone setting (keyed as `Setting`s are: task, encoder, tunable layers, or the method setting's
    name) whose encoder has a linear probe scored on the same dev examples: its `GapToProbe`."""
    from layertune.metrics import metric_for

    layers = {cell.setting: cell.tunable_layers for cell in results.plan.cells}
    found = {}
    for setting in settings:
        key = (setting.task, setting.encoder, setting.tunable_layers)
        probe = results.references.get(setting.task, {}).get("encoders", {}).get(setting.encoder, {}) \
            .get("linear_probe") or {}
        predicted = probe.get("predictions") or {}
        if layers.get(key) != 0 or predicted.get("references") is None:
            continue
        cell = next(c for c in results.plan.cells if c.setting == key)
        if predicted["references"] != results.cells[cell.key].predictions()["dev"]["references"]:
            continue  # scored on other examples: nothing to pair
        corpus = results.corpora[setting.task]()
        metric = corpus.main_metric
        # The draws `settings` scored every setting on: Resamples.draw is a function of the count and resamples alone.
        draws = Resamples.draw(len(predicted["references"]), results.options.resamples)
        once = draws.estimate(metric_for(metric, corpus.metrics), metric, [predicted["predictions"]],
                              predicted["references"], [probe["metrics"][f"eval_{metric}"]])
        seeds = setting.estimate.seeds
        fixed = Estimate(np.repeat(once.scores, seeds), np.repeat(once.samples, seeds, axis=0), once.examples)
        difference = setting.estimate.minus(fixed)
        spread = shrunk_spread(difference, setting.spread, sides=1)
        found[key] = GapToProbe(difference.mean, *interval(difference, setting.confidence, spread), spread)
    return found


def _probe_check(task: str, references: pd.DataFrame, settings: Sequence, layers: dict,
                 validation: dict[tuple, float], gaps: dict[tuple, GapToProbe] | None = None) -> str:
    """The head alone against its probe (within a point, above or short of it; whether the dev examples and seeds
    show it above or below; whether it is short on the validation slice too, where both were chosen), and the
    settings that tune layers and stay below it."""
    sentences = []
    gaps = gaps or {}
    for probe in references[references["kind"] == "linear_probe"].itertuples():
        own = [s for s in settings if (s.task, s.encoder) == (task, probe.encoder)]
        head = [s for s in own if layers.get((s.task, s.encoder, s.tunable_layers)) == 0]
        for setting in head:
            gap = setting.mean - probe.score
            found = gaps.get((setting.task, setting.encoder, setting.tunable_layers))
            paired = f"; {found.text()}" if found else ""
            verdict = (f"reaches it (within a point){paired}" if abs(gap) <= PROBE_TOLERANCE else
                       f"is {points(gap)} points above it{paired}" if gap > 0 else
                       f"is {points(-gap)} points short of it{paired}{_short_why(setting, probe, validation)}")
            sentences.append(f"{probe.encoder}: the head alone ({setting.tunable_layers}) scores "
                             f"{points(setting.mean)} against its linear probe's {points(probe.score)}, and {verdict}.")
        below = [s for s in own if layers.get((s.task, s.encoder, s.tunable_layers)) != 0 and s.mean < probe.score]
        named = ", ".join(f"{s.tunable_layers} ({points(s.mean)})" for s in below)
        # Named by encoder: a multi-encoder report has one probe per language model.
        sentences.append(f"{probe.encoder}: settings that tune layers and score below its probe "
                         f"({points(probe.score)}): {named}{_below_why(below, probe, validation)}." if below else
                         f"{probe.encoder}: every setting that tunes layers scores at or above its probe.")
    return " ".join(sentences) + "\n" if sentences else ""


def _below_why(below: Sequence, probe, validation: dict[tuple, float]) -> str:
    """The settings below the probe on dev, set beside it on the validation slice, drawn as their training data is:
    above it there and below on dev, they beat the frozen features on data like their training data, not on dev."""
    there = [(s, validation.get((s.task, s.encoder, s.tunable_layers))) for s in below]
    if math.isnan(probe.validation_score) or any(score is None for _, score in there):
        return ""
    scores = ", ".join(f"{s.tunable_layers} {points(score)}" for s, score in there)
    above = [str(s.tunable_layers) for s, score in there if score >= probe.validation_score]
    under = [str(s.tunable_layers) for s, score in there if score < probe.validation_score]
    verdict = ("all above it there: they beat the frozen features on data drawn as their training data is, not on dev"
               if not under else "below it there too" if not above else
               f"{', '.join(above)} above it there, {', '.join(under)} below it there too")
    return (f"; on the validation slice they score {scores} against the probe's {points(probe.validation_score)}, "
            f"{verdict}")


def _short_why(setting, probe, validation: dict[tuple, float]) -> str:
    """Why a head alone is short of its probe on dev, as the validation slice (where the probe chose its penalty and
    the head its epoch) tells: level with the probe there, the two fits differ in their regulariser (L2 on
    standardised features against early stopping), which dev, not the data they were chosen on, tells apart. Short
    there too: at or above the probe's fit with no penalty, the head has trained as far as that fit goes and lacks
    only the penalty; below it, its optimiser has not reached the fit."""
    head = validation.get((setting.task, setting.encoder, setting.tunable_layers))
    if head is None or math.isnan(probe.validation_score):  # the probe recorded no validation scores
        return (": the probe fits its penalty (L2 on standardised features, chosen on the validation slice), which "
                "the early-stopped head does not have, or the head stopped too soon (its epochs are below)")
    there = f"on the validation slice it scores {points(head)} against the probe's {points(probe.validation_score)}"
    if probe.validation_score - head <= PROBE_TOLERANCE:
        return (f"; {there}, level with it (within a point): the two fits, chosen on that slice, differ in their "
                "regulariser (the probe's L2 on standardised features, the head's early stopping), and only dev tells "
                "them apart")
    unpenalised = probe.unpenalised_validation_score
    if math.isnan(unpenalised):  # a probe recorded before the unpenalised fit was
        return f"; {there}, short there too"
    if unpenalised - head <= PROBE_TOLERANCE:
        return (f"; {there}, short there too, but level with or above the same fit with no penalty "
                f"({points(unpenalised)}): the head has trained as far as an unpenalised fit goes, and what it lacks "
                "is the probe's penalty (L2 on standardised features), not epochs")
    return (f"; {there}, short there too, and short of the same fit with no penalty ({points(unpenalised)}): its "
            "optimiser has not reached the fit in the epochs it trained (below)")


def _convergence_text(cells: pd.DataFrame, setting_header: str) -> str:
    """Per encoder and setting: each seed's epochs trained (best epoch), and the cells the maximum stopped, named."""
    rows = []
    several = cells["encoder"].nunique() > 1
    # The cost of a setting in the unit the issue of convergence asks for: its training time over that of full
    # fine-tuning, the same encoder and seed (where the grid has full fine-tuning).
    full = cells[cells["full_fine_tuning"]].set_index(["encoder", "seed"])["train_time_s"]
    costs = cells["train_time_s"] / [full.get((r.encoder, r.seed), float("nan")) for r in cells.itertuples()]
    for (encoder, setting), group in cells.groupby(["encoder", "setting"], sort=False):
        per_seed = ", ".join(f"{r.epochs_trained} ({r.best_epoch})" for r in group.itertuples())
        stopped = ", ".join(sorted(set(group["stopped_by"])))
        # an encoders study's settings are its encoders (at one K): the setting's name alone would merge them
        name = encoder if setting_header == "encoder" else f"{encoder}, {setting}" if several else setting
        row = [name, per_seed, stopped, str(group["max_epochs"].max())]
        rows.append(row + [f"{costs[group.index].mean():.2f}"] if len(full) else row)
    header = [setting_header, "epochs trained (best), per seed", "stopped by", "at most"]
    text = markdown_table(header + ["training time (× full fine-tuning)"] * bool(len(full)), rows,
                          "llll" + "r" * bool(len(full)))
    if len(full):
        # Per setting over the seeds it trained, then summed: a study decided in rounds trains later seeds of some
        # settings only, and a sum per seed would leave the others out of those seeds' totals.
        per_setting = costs.groupby([cells["encoder"], cells["setting"]], sort=False).mean().dropna()
        text += (f"\nOne seed of this grid trains in {per_setting.sum():.1f} full fine-tunings' time (each setting's "
                 "training time over full fine-tuning's, same seed, as a mean over the seeds it trained; summed over "
                 "the settings); the frozen-prefix pass, computed once per study before any cell trains, is not in "
                 "it.\n")
    return text + _capped_text(cells)


def _capped_text(cells: pd.DataFrame) -> str:
    """The cells the maximum stopped, each with its best epoch. A cell that keeps its best epoch with no patience, or
    one as long as the maximum, runs its whole schedule by design (its rate decaying to zero); it may still have
    been cut short if its best epoch was its last. A shorter patience the maximum beat may have cut a cell short."""
    capped = cells[cells["stopped_by"] == "maximum"]
    whole = capped["selects_best"] & (capped["patience"].isna() | (capped["patience"] >= capped["max_epochs"]))
    improving = capped["best_epoch"] >= capped["epochs_trained"]
    short = capped[~whole & capped["patience"].notna() | whole & improving]

    def named(group: pd.DataFrame) -> str:
        return ", ".join(f"{r.key} (best {r.best_epoch} of {r.epochs_trained})" for r in group.itertuples())

    text = ""
    if len(done := capped[whole & ~improving]):
        text += ("\nRan their whole schedule by design (no patience, or one as long as the maximum; the rate decays to "
                 f"zero and the best epoch is kept): {named(done)}.\n")
    if len(short):
        text += ("\nStopped by the maximum number of epochs before their patience ran out, or still improving at "
                 f"their last epoch (they may not have converged): {named(short)}.\n")
    return text


def tables(results: StudyResults, gaps: dict[tuple, GapToProbe]) -> dict[str, pd.DataFrame]:
    """The report's tables of this module: ``references.csv`` (empty where none were computed; a probe's row with
    its head alone's paired gap, from ``gaps``, where there is one) and ``convergence.csv``."""
    references = references_table(results)
    gaps = {(task, encoder): gap for (task, encoder, _), gap in gaps.items()}
    mine = [gaps.get((r.task, r.encoder)) if r.kind == "linear_probe" else None for r in references.itertuples()]
    for column, part in (("head_minus_probe", "difference"), ("head_minus_probe_low", "low"),
                         ("head_minus_probe_high", "high")):
        references[column] = [getattr(gap, part) if gap else float("nan") for gap in mine]
    return {"references": references, "convergence": convergence_table(results)}
