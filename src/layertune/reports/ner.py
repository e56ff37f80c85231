"""The NER layer report: the layer-ablation report on a tagging task, plus what tagging adds: entity F1 per type
(dev and test), two baselines that need no model, and how far the classifier, the top layer and the embeddings
moved."""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import pandas as pd

from layertune.corpus import Corpus
from layertune.drift import layer_drift
from layertune.metrics import compute_metrics
from layertune.reports import references
from layertune.reports.common import (
    Report,
    StudyResults,
    display,
    in_layers_order,
    literal,
    markdown_table,
    points,
    round_metric,
    settings,
    settings_table,
    setup_text,
)
from layertune.reports.layers import (
    headline,
    layer_figures,
    recommendations,
    report_details,
    rule_text,
    task_section,
)

ENTITY_TYPES = ("PER", "ORG", "LOC", "MISC")


def majority_baselines(corpus: Corpus) -> dict[str, dict]:
    """Dev scores of the majority tag everywhere, and of each word's most frequent training tag (``O`` if unseen)."""
    names = corpus.label_names
    train_tags = [[names[t] for t in tags] for tags in corpus.train["tags"]]
    references = [[names[t] for t in tags] for tags in corpus.dev["tags"]]
    majority = Counter(tag for tags in train_tags for tag in tags).most_common(1)[0][0]
    by_word: dict[str, Counter] = defaultdict(Counter)
    for words, tags in zip(corpus.train["tokens"], train_tags):
        for word, tag in zip(words, tags):
            by_word[word][tag] += 1
    word_tag = {word: counts.most_common(1)[0][0] for word, counts in by_word.items()}
    with warnings.catch_warnings():  # the all-majority baseline predicts no entity at all
        warnings.simplefilter("ignore")
        everywhere = compute_metrics(["seqeval"], [[majority] * len(r) for r in references], references)
        lexical = compute_metrics(["seqeval"], [[word_tag.get(w, "O") for w in words]
                                                for words in corpus.dev["tokens"]], references)
    return {"majority_tag": {"tag": majority, **everywhere}, "word_majority_tag": lexical}


def entity_table(results: StudyResults, task: str, encoder: str) -> tuple[list[str], list[list]]:
    """Per tunable-layers value, mean over seeds: dev F1 per entity type, dev precision and recall, test F1."""
    scores = in_layers_order(results.scores[(results.scores["task"] == task)
                                            & (results.scores["encoder"] == encoder)])
    types = [t for t in ENTITY_TYPES if f"dev_{t}_f1" in scores.columns]
    columns = ["dev_precision", "dev_recall", *[f"dev_{t}_f1" for t in types],
               *(["test_f1"] if "test_f1" in scores.columns else [])]
    means = scores.groupby("tunable_layers", sort=False)[columns].mean()
    header = ["tunable layers", "precision", "recall", *[f"{t} F1" for t in types],
              *(["test F1"] if "test_f1" in columns else [])]
    return header, [[k, *[points(row[c]) for c in columns]] for k, row in means.iterrows()]


def selected_drift(results: StudyResults, task: str, encoder: str) -> pd.DataFrame:
    """Mean absolute change (mean over seeds) of the classifier weight, the top layer and the embeddings."""
    rows = []
    for cell in results.plan.cells:
        if (cell.task, cell.encoder) != (task, encoder):
            continue
        drift = results.cells[cell.key].drift()
        parts = layer_drift(drift).set_index("part")
        top = max((p for p in parts.index if p.startswith("layer.")), key=lambda p: int(p.split(".")[1]))
        classifier = drift[drift["parameter"].str.startswith("head.") & drift["parameter"].str.endswith(".weight")]
        for tensor, value in (("classifier weight", classifier.iloc[-1]["mean_abs_change"]),
                              (f"top layer ({top})", parts.loc[top, "mean_abs_change"]),
                              ("embeddings", parts.loc["embeddings", "mean_abs_change"])):
            rows.append({"tunable_layers": str(cell.tunable_layers), "tensor": tensor, "mean_abs_change": value})
    return pd.DataFrame(rows).groupby(["tunable_layers", "tensor"], sort=False)["mean_abs_change"].mean().unstack()


def baselines_text(baselines: dict) -> str:
    majority, lexical = baselines["majority_tag"], baselines["word_majority_tag"]
    return (f"Baselines without a model: the majority tag ({literal(majority['tag'], code=True)}) everywhere scores F1 "
            f"**{points(majority['f1'])}** (it finds no entity; token accuracy {points(majority['accuracy'])}); each "
            f"word's most frequent training tag scores F1 **{points(lexical['f1'])}** (precision "
            f"{points(lexical['precision'])}, recall {points(lexical['recall'])}).\n")


def ner_report(results: StudyResults) -> Report:
    """``reports/<study>.md`` for a tagging study: the layer report's tables and rule, entity scores, baselines,
    selected drift, figures."""
    options = results.options
    found = settings(results)
    chosen = recommendations(found, options.tolerance, options.confidence)
    sections = [f"# NER: how many layers to fine-tune ({results.plan.name})\n", setup_text(results),
                "- F1, precision and recall are entity-level micro averages on dev (conlleval's rules); losses are "
                "cross-entropy per labelled word piece (each word's first piece).\n",
                rule_text(options.tolerance, options.confidence), task_section(results, found, chosen)]
    details = report_details(found, chosen, options.tolerance)
    for task in results.plan.spec.tasks:
        baselines = majority_baselines(results.corpora[task]())
        details[task]["baselines"] = {name: round_metric(b["f1"]) for name, b in baselines.items()}
        sections.append(f"## {display(task)}: entities and baselines\n")
        sections.append(baselines_text(baselines))
        for encoder in results.plan.spec.encoders:
            sections.append(markdown_table(*entity_table(results, task, encoder)))
            drift = selected_drift(results, task, encoder)
            sections += [f"Mean absolute change from the starting weights ({encoder}; frozen tensors stay at 0):\n",
                         markdown_table(["tunable layers", *drift.columns],
                                        [[k, *[f"{v:.2e}" for v in row]] for k, row in drift.iterrows()])]
    gaps = references.gaps_to_probe(results, found)
    sections += ["## References and convergence\n", references.section(results, "tunable layers", found, gaps)]
    figures = layer_figures(results, settings_table(found))
    sections += ["## Figures\n", *[f"![{name}]({results.plan.name}/figures/{name}.png)\n" for name in figures]]
    metrics = headline({task: {e: entry for e, entry in encoders.items() if e != "baselines"}
                        for task, encoders in details.items()})
    return Report("\n".join(sections), metrics, details, {"settings": settings_table(found), "cells": results.scores,
                                                         **references.tables(results, gaps)}, figures)
