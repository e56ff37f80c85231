"""What every report sets beside its cells: references no one here trained, and how each cell's training ended.

- References (`layertune.probes`): a no-model baseline, a linear probe on each frozen encoder, an untrained model's
  cosine similarity. The head alone (0 tunable layers) trains a linear head on the probe's very features, so a
  converged head-only cell reaches its probe (within `PROBE_TOLERANCE`); a setting that tunes layers and stays below
  the probe has learned less than its frozen features already hold.
- Convergence: per cell, the epochs it trained, its best validation epoch, and what stopped it (the patience, or
  the maximum number of epochs: then it may not have converged, and the report names it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from layertune.reports.common import StudyResults, display, literal, markdown_table, points, signed_points
from layertune.statistics import Resamples, interval

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
             "train_time_s": float(scores.loc[cell.key, "train_time_s"]),
             "full_fine_tuning": _full_fine_tuning(cell.spec)}
            for cell in results.plan.cells]
    return pd.DataFrame(rows)


def _full_fine_tuning(spec) -> bool:
    """One language model, every layer trained whole (no adapter): the unit a setting's training time is counted in."""
    return len(spec.encoders) == 1 and spec.encoders[0].tunable_layers == "all" and \
        spec.encoders[0].method.name == "top_k"


def section(results: StudyResults, setting_header: str, settings: Sequence) -> str:
    """Per task: the references beside the settings' means (``settings``: the report's `Setting` objects), the
    head-only check against each probe, then how the cells' training ended."""
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
                gaps = _gaps_to_probe(results, task, settings, layers)
                lines.append(_probe_check(task, mine, settings, layers, validation, gaps))
        lines.append(_convergence_text(convergence[convergence["task"] == task], setting_header))
    return "\n".join(lines)


def _validation_at_best_epoch(results: StudyResults) -> dict[tuple, float]:
    """Per setting (task, encoder, setting): the mean over its cells of the validation-slice score of the epoch each
    kept, where every cell chose on the slice (a cell without one chose on dev: then the setting has none)."""
    scores = results.scores.set_index("key")
    found: dict[tuple, list[float]] = {}
    for cell in results.plan.cells:
        key = f"validation_{scores.loc[cell.key, 'metric']}"
        best = int(scores.loc[cell.key, "best_epoch"])
        kept = [record[key] for record in results.cells[cell.key].history()
                if record.get("epoch") == best and key in record]
        found.setdefault(cell.setting, []).append(kept[0] if kept else float("nan"))
    return {setting: sum(values) / len(values) for setting, values in found.items()
            if not any(math.isnan(value) for value in values)}


def _gaps_to_probe(results: StudyResults, task: str, settings: Sequence, layers: dict) -> dict[tuple, tuple]:
    """Per head-alone setting of ``task`` (keyed as `Setting`s are: task, encoder, tunable layers): the interval of
    head − probe, paired on the dev examples (the settings' own bootstrap draws, the probe scored on each) and over the
    head's seeds (the probe is one deterministic fit: the seed part is the head's spread, pooled as its interval's).
    None where the probe kept no dev predictions, or scored other examples."""
    from layertune.metrics import metric_for

    corpus = results.corpora[task]()
    metrics = metric_for(corpus.main_metric, corpus.metrics)
    found = {}
    for encoder, mine in results.references.get(task, {}).get("encoders", {}).items():
        probe = mine.get("linear_probe") or {}
        predicted = probe.get("predictions") or {}
        for setting in settings:
            key = (setting.task, setting.encoder, setting.tunable_layers)
            if (setting.task, setting.encoder) != (task, encoder) or layers.get(key) != 0:
                continue
            cell = next(c for c in results.plan.cells if c.setting == key)
            if predicted.get("references") is None or \
                    predicted["references"] != results.cells[cell.key].predictions()["dev"]["references"]:
                found[key] = None
                continue
            seeds = setting.estimate.seeds
            draws = Resamples.draw(len(predicted["references"]), results.options.resamples)  # the settings' draws
            fixed = draws.estimate(metrics, corpus.main_metric, [predicted["predictions"]] * seeds,
                                   predicted["references"], [probe["metrics"][f"eval_{corpus.main_metric}"]] * seeds)
            found[key] = interval(setting.estimate.minus(fixed), setting.confidence, setting.spread)
    return found


def _probe_check(task: str, references: pd.DataFrame, settings: Sequence, layers: dict,
                 validation: dict[tuple, float], gaps: dict[tuple, tuple] | None = None) -> str:
    """The head alone against its probe (within a point, or how far short, whether the dev examples and seeds show
    it short, and whether it is short on the validation slice too, where both were chosen), and the settings that
    tune layers and stay below it."""
    sentences = []
    gaps = gaps or {}
    for probe in references[references["kind"] == "linear_probe"].itertuples():
        own = [s for s in settings if (s.task, s.encoder) == (task, probe.encoder)]
        head = [s for s in own if layers.get((s.task, s.encoder, s.tunable_layers)) == 0]
        for setting in head:
            gap = probe.score - setting.mean
            paired = _paired_text(setting.mean - probe.score, gaps.get((setting.task, setting.encoder,
                                                                        setting.tunable_layers)))
            verdict = (f"reaches it (within a point{paired})" if gap <= PROBE_TOLERANCE
                       else f"is {points(gap)} points short of it{paired}{_short_why(setting, probe, validation)}")
            sentences.append(f"{probe.encoder}: the head alone ({setting.tunable_layers}) scores "
                             f"{points(setting.mean)} against its linear probe's {points(probe.score)}, and {verdict}.")
        below = [s for s in own if layers.get((s.task, s.encoder, s.tunable_layers)) != 0 and s.mean < probe.score]
        named = ", ".join(f"{s.tunable_layers} ({points(s.mean)})" for s in below)
        # Named by encoder: a multi-encoder report has one probe per language model.
        sentences.append(f"{probe.encoder}: settings that tune layers and score below its probe "
                         f"({points(probe.score)}): {named}{_below_why(below, probe, validation)}." if below else
                         f"{probe.encoder}: every setting that tunes layers scores at or above its probe.")
    return " ".join(sentences) + "\n" if sentences else ""


def _paired_text(difference: float, bounds: tuple | None) -> str:
    """Head − probe with its interval, and whether the dev examples and seeds show the head below the probe."""
    if bounds is None:
        return ""
    low, high = bounds
    shown = "shown below it" if high < 0 else "not shown below it"
    return (f"; head − probe {signed_points(difference)} [{signed_points(low)}, {signed_points(high)}] points, paired "
            f"over dev examples and seeds: {shown}")


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
        per_seed = costs.groupby(cells["seed"]).sum(min_count=1).dropna()
        text += (f"\nOne seed of this grid trains in {per_seed.mean():.1f} full fine-tunings' time (every setting's "
                 f"training time over full fine-tuning's, same seed, summed; mean over {len(per_seed)} seed(s)); the "
                 "frozen-prefix pass, computed once per study before any cell trains, is not in it.\n")
    return text + _capped_text(cells)


def _capped_text(cells: pd.DataFrame) -> str:
    """The cells the maximum stopped, each with its best epoch. A patience as long as the maximum can never run out:
    such a cell runs its whole schedule by design (its rate decaying to zero, the best epoch kept); any other the
    maximum stopped may have been cut short."""
    capped = cells[(cells["stopped_by"] == "maximum") & cells["patience"].notna()]
    whole = capped["patience"] >= capped["max_epochs"]

    def named(group: pd.DataFrame) -> str:
        return ", ".join(f"{r.key} (best {r.best_epoch} of {r.epochs_trained})" for r in group.itertuples())

    text = ""
    if whole.any():
        text += ("\nRan their whole schedule by design (a patience as long as the maximum; the rate decays to zero "
                 f"and the best epoch is kept): {named(capped[whole])}.\n")
    if (~whole).any():
        text += ("\nStopped by the maximum number of epochs before their patience ran out (they may not have "
                 f"converged): {named(capped[~whole])}.\n")
    return text


def tables(results: StudyResults) -> dict[str, pd.DataFrame]:
    """The report's tables of this module: ``references.csv`` (empty where none were computed) and
    ``convergence.csv``."""
    return {"references": references_table(results), "convergence": convergence_table(results)}
