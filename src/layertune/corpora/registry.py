"""The built-in tasks (`TASKS`): where each lives (data mirror and hub), how its files are laid out, and how it is
scored.

Free of `datasets` (imported only to build a task's column types), so that checking a study's tasks is cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from layertune.corpora.conll import iob2_label_names
from layertune.corpus import TaskType

if TYPE_CHECKING:
    import datasets

TOKEN_COLUMN = "tokens"  # the words of a sentence, in token-classification splits


@dataclass(frozen=True)
class TsvLayout:
    """Where an official GLUE TSV keeps text and label: header names, or positions when it has no header."""

    header: tuple[str, ...] | None
    text: tuple[str | int, ...]
    label: str | int
    num_fields: int


@dataclass(frozen=True)
class TaskSpec:
    """A registry entry: where a task lives (mirror and hub) and how it is scored."""

    name: str
    hub_path: str
    hub_config: str | None
    text_columns: tuple[str, ...]
    task_type: TaskType
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    main_metric: str
    max_length: int
    mirror_files: Mapping[str, str]  # our split name -> file path relative to the mirror root
    hub_splits: Mapping[str, str] = field(default_factory=lambda: {"train": "train", "dev": "validation"})
    tsv_layout: TsvLayout | None = None
    balanced: bool = False
    notes: tuple[str, ...] = ()
    hub_revision: str | None = None
    hub_columns: Mapping[str, str] = field(default_factory=dict)  # hub column -> ours, e.g. ner_tags -> tags
    conll_columns: int | None = None  # columns per line of the task's CoNLL files

    def features(self) -> datasets.Features:
        import datasets

        from layertune.corpora.conll import token_features

        if self.task_type == "token_classification":
            return token_features(self.label_names)
        label = (datasets.Value("float32") if self.task_type == "regression"
                 else datasets.ClassLabel(names=list(self.label_names)))
        return datasets.Features({**{c: datasets.Value("string") for c in self.text_columns}, "label": label})


def _glue(name: str, folder: str, layout: TsvLayout, text_columns: tuple[str, ...], label_names: tuple[str, ...],
          metrics: tuple[str, ...], task_type: TaskType = "classification") -> TaskSpec:
    # GLUE test labels are hidden, so a GLUE corpus has train and dev only.
    return TaskSpec(name=name, hub_path="nyu-mll/glue", hub_config=name, text_columns=text_columns,
                    task_type=task_type, label_names=label_names, metrics=metrics, main_metric=metrics[0],
                    max_length=128, mirror_files={s: f"glue/{folder}/{s}.tsv" for s in ("train", "dev")},
                    tsv_layout=layout)


_STSB_HEADER = ("index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
                "score")
_PAIR = ("sentence1", "sentence2")

TASKS: dict[str, TaskSpec] = {
    "cola": _glue("cola", "CoLA", TsvLayout(None, (3,), 1, 4), ("sentence",),
                  ("unacceptable", "acceptable"), ("matthews_correlation",)),
    "sst2": _glue("sst2", "SST-2", TsvLayout(("sentence", "label"), ("sentence",), "label", 2), ("sentence",),
                  ("negative", "positive"), ("accuracy",)),
    "mrpc": _glue("mrpc", "MRPC", TsvLayout(("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
                                            ("#1 String", "#2 String"), "Quality", 5), _PAIR,
                  ("not_equivalent", "equivalent"), ("accuracy", "f1")),
    "rte": _glue("rte", "RTE", TsvLayout(("index", *_PAIR, "label"), _PAIR, "label", 4), _PAIR,
                 ("entailment", "not_entailment"), ("accuracy",)),
    "stsb": _glue("stsb", "STS-B", TsvLayout(_STSB_HEADER, _PAIR, "score", 10), _PAIR, (),
                  ("spearmanr", "pearsonr"), task_type="regression"),
    "imdb": TaskSpec(
        name="imdb", hub_path="stanfordnlp/imdb", hub_config="plain_text", text_columns=("text",),
        task_type="classification", label_names=("neg", "pos"), metrics=("accuracy", "f1"), main_metric="f1",
        max_length=512, mirror_files={"train": "imdb/train.parquet", "dev": "imdb/test.parquet"},
        hub_splits={"train": "train", "dev": "test"}, balanced=True,
        notes=("IMDb has no validation split: dev is drawn from the official test reviews (no separate test set).",),
    ),
}
TASKS["conll2003"] = TaskSpec(
    name="conll2003", hub_path="eriktks/conll2003", hub_config=None, text_columns=(TOKEN_COLUMN,),
    task_type="token_classification",
    # The Hugging Face order of the tags, so hub ids and ours agree.
    label_names=iob2_label_names(("PER", "ORG", "LOC", "MISC")), metrics=("seqeval",), main_metric="f1",
    max_length=256, mirror_files={s: f"ner/conll2003/{s}.txt" for s in ("train", "dev", "test")},
    hub_splits={"train": "train", "dev": "validation", "test": "test"},
    # The hub repository's main branch is a loading script, which datasets>=4 no longer runs; the hub's own
    # parquet conversion of it loads.
    hub_revision="refs/convert/parquet", hub_columns={"ner_tags": "tags"}, conll_columns=4,
    notes=("Tags are read as IOB1 (the original files) and converted to IOB2; entity spans are unchanged.",),
)
GLUE_CONFIGS = tuple(k for k, spec in TASKS.items() if spec.hub_path == "nyu-mll/glue")
