"""The recipe of one cell, typed and checked: which data, which encoder(s), which head, how it trains.

A `CellSpec` is the whole recipe: a `CorpusSpec`, one `EncoderSpec` per language model (several are combined by a
`CombineSpec`), a `HeadSpec` (the model's parts: `layertune.model_specs`) and the `TrainingConfig` (seed included).
Each spec has exactly the arguments of the library object it builds (`LanguageModel`, `MultiEncoder`, the heads,
`ModelTrainer.train`), so anything the library can do, a cell can do; each is also the saved form (a cell's
``cell.json``, a study's params). Running a cell is `layertune.cell.train_cell`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from layertune.corpus import TaskType
from layertune.model_specs import (  # noqa: F401  (EncoderSettings, TunableLayers: a cell's vocabulary, named here too)
    CombineSpec,
    EncoderSettings,
    EncoderSpec,
    HeadSpec,
    Spec,
    TunableLayers,
)
from layertune.training_config import TrainingConfig, encoder_rates

if TYPE_CHECKING:
    import datasets

    from layertune.corpus import Corpus
    from layertune.heads import TaskModel

# What numpy and torch take as a seed.
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class SampleSpec(Spec):
    """Which examples of a corpus a cell sees: a seeded subsample (a study's ``data`` section: the same for each of
    its tasks)."""

    train_size: PositiveInt | None = Field(None, description="at most this many training examples; null: all")
    dev_size: PositiveInt | None = Field(None, description="at most this many dev examples; null: all")
    validation_size: PositiveInt | None = Field(
        None, description="examples carved from the training data (before train_size is drawn) as the validation "
                          "slice that picks the best epoch and stops training early; never dev; null: none")
    seed: Seed = Field(42, description="seed of the subsample (and of a dev split carved from train)")
    balanced: bool | None = Field(None, description="equal classes; null: the task's default (IMDb: balanced)")
    test: bool = Field(True, description="keep a labelled test split (its predictions are scored with the best "
                                         "weights); false leaves it out")


class DatasetSpec(Spec):
    """Where a task's examples are and how to read them: a built-in task, local files or a Hugging Face dataset,
    with `load_corpus`'s options (its arguments less the subsample). Exactly one of ``task``, ``path`` and ``hub``.

    In a study's ``tasks`` (``params.yaml``): ``reviews: {path: data/reviews.csv, label: sentiment}``."""

    task: str | None = Field(None, description="a built-in task (`layertune.corpora.TASKS`): cola, sst2, mrpc, rte, "
                                               "stsb, imdb, conll2003")
    path: str | None = Field(None, description="a local file, or a folder of train/dev/test files (csv, tsv, json, "
                                               "jsonl, parquet, CoNLL)")
    hub: str | None = Field(None, description="a Hugging Face dataset id (owner/name)")
    config: str | None = Field(None, description="the hub dataset's configuration")
    revision: str | None = Field(None, description="the hub dataset's commit, branch or tag (a study pins a commit)")
    text: list[str] | None = Field(None, min_length=1, max_length=2, description="the text column (text: review "
                                                                                 "or [review]), or two for sentence "
                                                                                 "pairs; null: inferred")
    label: str | None = Field(None, description="the label column; null: label (or labels, score, target, class)")
    task_type: TaskType | None = Field(None, description="classification, regression or token_classification; null:"
                                                         " inferred from the labels")
    metric: str | None = Field(None, description="the metric that picks the best epoch and ranks settings; null: "
                                                 "the task type's default")
    label_names: list[str] | None = Field(None, min_length=2, description="the classes in order (integer labels: the "
                                                                          "name of each id); null: sorted")
    splits: dict[Literal["train", "dev", "test"], str] | None = Field(
        None, description="which file under path (or hub split) is train, dev and test; null: by name")
    dev_fraction: float | None = Field(None, gt=0, lt=1, description="share of train carved off as dev when there is "
                                                                     "no dev split; null: 0.1")

    @field_validator("text", mode="before")
    @classmethod
    def _one_column(cls, text: object) -> object:
        """``text: review`` is the one column ``[review]`` (as `load_corpus`'s ``text_columns`` takes a string)."""
        return [text] if isinstance(text, str) else text

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        from layertune.corpora import TASKS
        from layertune.corpora.sources import is_registry_name
        from layertune.errors import choices_hint

        given = [key for key in ("task", "path", "hub") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of task (a built-in task), path (local files) or hub (a Hugging Face "
                             f"dataset); got {', '.join(given) or 'none'}")
        if self.task is not None:
            if not is_registry_name(self.task, hub=False):
                raise ValueError(f"unknown task {self.task!r}.{choices_hint(self.task, TASKS)} Local files are "
                                 "path: <file or folder>, a Hugging Face dataset is hub: <owner/name>")
            if own := [k for k in ("text", "label", "task_type", "label_names", "splits", "revision")
                       if getattr(self, k) is not None]:
                raise ValueError(f"{', '.join(own)}: a built-in task has its own columns, labels, splits and source; "
                                 f"these keys are for path: or hub: datasets")
        if self.path is not None and (self.config is not None or self.revision is not None):
            raise ValueError("config and revision are for hub datasets; local files (path:) have neither")
        if self.metric is not None:
            from layertune.corpora import METRICS_BY_TASK_TYPE

            valid = sorted({m for metrics in METRICS_BY_TASK_TYPE.values() for m in metrics})
            if self.metric not in valid:
                raise ValueError(f"unknown metric {self.metric!r}.{choices_hint(self.metric, valid)}")
        return self

    @property
    def source(self) -> str:
        """The registry task, local path or hub dataset, as a name (``hub:owner/name@revision``)."""
        if self.hub is not None:
            config = f":{self.config}" if self.config else ""
            return f"hub:{self.hub}{config}" + (f"@{self.revision}" if self.revision else "")
        return self.task or str(self.path)

    def load(self, data_mirror: str | os.PathLike | None = None, *, files: Mapping[str, str] | None = None,
             **sample) -> Corpus:
        """The corpus (`load_corpus` with these options and ``sample``: train_size, dev_size, seed, balanced).
        ``files``: local copies of the splits (``{split: path}``, the pipeline's download) read instead of the
        source. An option that does not fit the data raises `CorpusArgumentError` whose ``argument`` is the key
        of this spec to blame (``label``, ``text``, ``path``, ...)."""
        from layertune.corpora import load_corpus
        from layertune.errors import CorpusArgumentError

        reading = {"text_columns": self.text, "label_column": self.label or "label", "task_type": self.task_type,
                   "label_names": self.label_names, "metric": self.metric, "dev_fraction": self.dev_fraction}
        if self.task is not None:
            arguments = {"name": self.task, "config": self.config, "data_files": files, "metric": self.metric,
                         "data_mirror": data_mirror}
        elif self.path is not None or files is not None:
            # A hub dataset's downloaded files: its revision keeps a registry task's hub id from naming the task.
            arguments = {"name": self.hub or self.path, "data_files": files or self._local_files(),
                         "revision": self.revision, **reading}
        else:
            arguments = {"name": self.hub, "config": self.config, "revision": self.revision, "splits": self.splits,
                         **reading}
        try:
            corpus = load_corpus(**arguments, **sample)
        except CorpusArgumentError as error:
            field = {"text_columns": "text", "label_column": "label", "data_files": "path"}.get(error.argument,
                                                                                                error.argument)
            raise CorpusArgumentError(field, str(error)) from None
        except FileNotFoundError as error:
            raise CorpusArgumentError("splits" if self.splits else "path", str(error)) from None
        if files is not None:  # where the copies lie differs between machines; what they are copies of does not
            corpus.notes = [f"Read from a download of {self.source}.",
                            *(note for note in corpus.notes if not note.startswith("Loaded from"))]
        return corpus

    def fetch(self) -> dict[str, datasets.Dataset]:
        """A hub dataset's splits as the hub has them (columns unchanged), under our split names (train, dev,
        test): what the pipeline downloads, to `load` later with ``files=``."""
        from layertune.corpora import sources

        if self.hub is None:
            raise ValueError(f"fetch() downloads hub datasets; {self.source!r} is not one")
        what = f"hub dataset {self.hub!r}"
        hub = sources.fetch_dataset(self.hub, self.config, self.revision)
        found, _ = sources.chosen_splits(hub, self.splits, what) if self.splits else sources.canonical_splits(hub, what)
        return found

    def _local_files(self) -> str | dict[str, str]:
        """``path``, or ``{split: path/file}`` when ``splits`` name the files of the folder ``path``."""
        from layertune.errors import CorpusArgumentError

        if self.splits is None:
            return self.path
        folder = Path(self.path).expanduser()
        if not folder.is_dir():
            raise CorpusArgumentError("splits", f"splits name files of a folder, but path {self.path!r} is not a "
                                      "folder")
        return {split: str(folder / name) for split, name in self.splits.items()}

    def data_files(self) -> list[Path]:
        """The local files this dataset reads (empty for built-in tasks and hub datasets): what a study
        fingerprints, so that an edited file re-prepares its task."""
        from layertune.corpora.sources import split_files

        if self.path is None:
            return []
        return sorted(split_files(self._local_files()).values())


class CorpusSpec(DatasetSpec, SampleSpec):
    """A dataset (`DatasetSpec`) and the seeded subsample of it a cell sees (`SampleSpec`)."""

    def load(self, data_mirror: str | os.PathLike | None = None, *, files: Mapping[str, str] | None = None,
             ) -> Corpus:
        """The subsample: at most ``train_size`` / ``dev_size`` examples (a smaller split is kept whole), stratified
        or balanced, dev carved from train when the data has none; the test split unless ``test`` is false."""
        import dataclasses

        sample = {"seed": self.seed}
        full = DatasetSpec.load(self, data_mirror, files=files, **sample)
        left = {"train": len(full.train) - (self.validation_size or 0), "dev": len(full.dev)}
        sizes = {f"{split}_size": size for split, size in (("train", self.train_size), ("dev", self.dev_size))
                 if size is not None and size < left[split]}
        if self.validation_size is not None:
            sizes["validation_size"] = self.validation_size
        corpus = DatasetSpec.load(self, data_mirror, files=files, **sample, **sizes, balanced=self.balanced) \
            if sizes or self.balanced is not None else full
        return corpus if self.test else dataclasses.replace(corpus, test=None)

    def evaluation_sample(self, size: int, data_mirror: str | os.PathLike | None = None, *,
                          files: Mapping[str, str] | None = None) -> datasets.Dataset:
        """At most ``size`` labelled examples of the task's training data that this subsample neither trains nor
        evaluates on (their text in neither its train nor its dev split), stratified by class and seeded by
        ``seed``: a larger evaluation sample, the same rows every time (`layertune.corpora.sampling.unused_sample`)."""
        from layertune.corpora.sampling import unused_sample

        full = DatasetSpec.load(self, data_mirror, files=files, seed=self.seed)
        used = self.load(data_mirror, files=files)
        used_splits = [split for split in (used.train, used.validation, used.dev) if split is not None]
        return unused_sample(full.train, used_splits, size, seed=self.seed, text_columns=full.text_columns,
                             label_names=full.label_names if full.task_type == "classification" else ())


class CellSpec(Spec):
    """Everything one cell trains with. Two or more encoders need ``combine``; one must not have it."""

    corpus: CorpusSpec
    encoders: list[EncoderSpec] = Field(min_length=1)
    combine: CombineSpec | None = None
    head: HeadSpec = HeadSpec()
    training: TrainingConfig = TrainingConfig()

    @model_validator(mode="before")
    @classmethod
    def _own_rates_of_older_folders(cls, data: Any) -> Any:
        # Cells saved before one-home-per-rate gave an encoder its own learning_rate in its EncoderSpec: read back,
        # it is the cell's training rate, as they trained with it.
        encoders = data.get("encoders") if isinstance(data, dict) else None
        if not isinstance(encoders, list) or not any(isinstance(e, dict) and "learning_rate" in e for e in encoders):
            return data
        own = [e.get("learning_rate") if isinstance(e, dict) else None for e in encoders]
        training = dict(data.get("training") or {})
        shared = training.get("learning_rate", TrainingConfig.model_fields["learning_rate"].default)
        if any(rate is not None for rate in own):
            training["learning_rate"] = encoder_rates([shared if rate is None else rate for rate in own])
        return {**data, "training": training, "encoders": [
            {k: v for k, v in e.items() if k != "learning_rate"} if isinstance(e, dict) else e for e in encoders]}

    @model_validator(mode="after")
    def _consistent(self) -> CellSpec:
        if (len(self.encoders) > 1) != (self.combine is not None):
            raise ValueError(f"{len(self.encoders)} encoder(s) with combine={self.combine}: several language "
                             "models need a combine method (concat or dme), a single one has none")
        self.training.learning_rates([encoder.model for encoder in self.encoders])  # one per encoder, or one for all
        return self

    def build_model(self, corpus: Corpus) -> TaskModel:
        """The encoder(s) and the head that fits ``corpus``. Their new parts are drawn from ``training.seed`` when
        training begins (`TaskModel.begin_training`)."""
        from layertune.heads import build_model
        from layertune.multi_encoder import MultiEncoder

        language_models = [spec.build() for spec in self.encoders]
        encoder = language_models[0] if self.combine is None else MultiEncoder(
            language_models, self.combine.method, self.combine.dropout, self.combine.projection_size)
        return build_model(encoder, corpus, **self.head.model_dump())
