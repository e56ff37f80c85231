"""A study: a grid of cells and what they share, declared as data (the ``studies`` of ``params.yaml``).

Every study has the same shape::

    <name>:
      report: {kind: layers, tolerance: 0.01}     # which report function, and its options (`layertune.reports`)
      tasks: [sst2, stsb]                          # ┐ (or a mapping: name → task or dataset, see below)
      encoders: {<encoder name>: <model>, ...}     # │ the grid: one cell per
      tunable_layers: [0, 1, 2, all]               # │ task × encoder × tunable layers × seed
      seeds: [1, 2]                                # ┘
      data: {train_size: 300, dev_size: null}      # SampleSpec: the subsample of every task
      encoder: {pooling: mean}                     # EncoderSettings of every language model
      head: {head: linear}                         # HeadSpec
      training: {learning_rate: 2.0e-4, ...}       # TrainingConfig (the seed comes from seeds)
      per_tunable_layers: {0: {head_learning_rate: 3.0e-3}}   # training (and head) overrides for one K
      per_task: {sst2: {2: {learning_rate: 5.0e-5}}}          # one task's own, over per_tunable_layers'

A study of *what* to tune has ``methods`` in place of ``tunable_layers``: named settings, each a tuning method
(`layertune.tuning_methods`) and the layers it applies to, since not every method fits every K (LoRA on no layer is
nothing) and DVC's matrix is a full product::

      methods:
        top_k-0: {tunable_layers: 0}                       # the head alone
        top_k-all: {tunable_layers: all}                   # full fine-tuning
        lora-top2: {method: {name: lora, r: 8}, tunable_layers: 2, learning_rate: 3.0e-3}
        bitfit: {method: bitfit, tunable_layers: all}

Its cells are task × encoder × method × seed, keyed ``<task>-<encoder>-<method>-<seed>``.

A task is a built-in task (``tasks: [sst2, stsb]``), or any dataset described in place, in a mapping from the name
its cells, stages and report sections get to a `DatasetSpec` (``null``: the built-in task of that name)::

      tasks:
        sst2:                                                     # the built-in task
        reviews: {path: data/reviews.csv, label: sentiment}       # local files (a file, or a folder of splits)
        news: {path: data/news.parquet, label: category, dev_fraction: 0.1, label_names: [world, sports, ...]}
        mrpc_hub: {hub: nyu-mll/glue, config: mrpc, revision: <commit>}   # a Hugging Face dataset

An encoder is a model (``minilm: sentence-transformers/all-MiniLM-L6-v2``), a `SingleEncoder` with settings and a
learning rate of its own (``roberta: {model: roberta-base, hidden_dropout_prob: 0.4, learning_rate: 1.0e-5}``), or
several of the study's encoders combined (``dme: {members: [minilm, roberta], combine: dme}``, a `CombineSpec`).

A learning rate has one spelling per level, and the most specific wins: a setting of the grid
(``methods.<m>.learning_rate``, ``per_task.<task>.<K>.learning_rate``, ``per_tunable_layers.<K>.learning_rate``),
then an encoder
(``encoders.<e>.learning_rate``), then the study (``training.learning_rate``, one rate). `StudySpec.training_for`
resolves it once into the cell's `TrainingConfig`: one rate per language model of a combination.
Each section is the library's own spec (`layertune.specs`), nested, never a copy. Names name folders, so each cell
has a readable key, ``<task>-<encoder>-<tunable_layers>-<seed>``.

`study_cells` turns a `StudySpec` into one `StudyCell` per cell, each holding the `CellSpec` that `train_cell`
trains; `StudyPlan` is a study with its cells, what reports read. How a study is planned into pipeline stages,
checked as a parameter file and run lives with the pipeline (``pipelines/``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Tag,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from layertune.specs import (
    CellSpec,
    CombineSpec,
    CorpusSpec,
    DatasetSpec,
    EncoderSettings,
    EncoderSpec,
    HeadSpec,
    SampleSpec,
    Seed,
    Spec,
    TunableLayers,
)
from layertune.errors import choices_hint, describe_validation_error
from layertune.model_paths import model_fingerprint
from layertune.rounds import RULE
from layertune.training_config import TrainingConfig, encoder_rates
from layertune.tuning_methods import TopK, TuningMethod

# Training keys that decide what the tokenize stage caches for every cell (mixed_precision: the autocast its pass
# computes in), and the seed (the seeds axis).
STUDY_WIDE_TRAINING = {"max_length", "cache_dtype", "frozen_prefix_cache", "mixed_precision", "seed"}
# Keys of a per-K override that set the head (HeadSpec) rather than training: the head alone, a linear model on
# frozen features, may be best without the dropout that helps a head over tuned layers.
HEAD_KEYS = tuple(HeadSpec.model_fields)  # in its order: error messages list them so
PER_K_TRAINING = tuple(key for key in TrainingConfig.model_fields if key not in STUDY_WIDE_TRAINING)


class ParamsError(ValueError):
    """``params.yaml`` is invalid; the message names every bad key by its dotted path."""


def _unique(values: list, what: str) -> list:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} must not repeat; {', '.join(repeated)} appear more than once")
    return values


def cell_key(*values: object) -> str:
    """A cell's key (task, encoder, tunable layers or method, seed) or a setting's (less the seed): the values
    joined by '-', as DVC's matrix names a stage. `StudySpec` refuses a grid where two cells would share one."""
    return "-".join(str(v) for v in values)


def layers_key(value: TunableLayers) -> tuple[bool, int]:
    """Where a number of tunable layers sorts: 0, 1, 2, … then 'all'."""
    return value == "all", value if value != "all" else 0


def layers_order(values: Iterable[TunableLayers]) -> list[TunableLayers]:
    """0, 1, 2, … then 'all': the row order of an ablation table."""
    return sorted(set(values), key=layers_key)


# ------------------------------------------------------------------------------------------------------- schema


# The report functions of `layertune.reports.REPORTS` (named here too: checking params.yaml imports no reports).
ReportKind = Literal["layers", "ner", "encoders", "methods"]


class ReportSpec(Spec):
    """Which report function builds the study's report (`layertune.reports.REPORTS`), and its options."""

    kind: ReportKind
    tolerance: NonNegativeFloat = Field(0.01, description="a setting within this of the best (metric units: 0.01 = "
                                                          "1 point) counts as good enough")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="of the intervals and tests")
    resamples: PositiveInt = Field(1000, description="bootstrap resamples of dev examples and seeds")
    examples: int = Field(5, ge=0, description="dev examples shown one by one (dme attention, tagged sentences)")


class RoundCell(Spec):
    """A cell a later round of a decided study trained (`DecideSpec.rounds`): where it sits in the grid and its
    round. The record names each cell, not only the round's seeds and settings: what each round trained reads off it
    (rounds.yaml), and a cell's key and round are all the plan needs to add it to the study. A `StudyCell` is the
    planned cell, with its resolved `CellSpec`: a recorded `RoundCell` becomes one."""

    task: str
    encoder: str
    tunable_layers: TunableLayers | None = Field(None, description="a layers study's setting")
    method: str | None = Field(None, description="a methods study's setting")
    seed: Seed
    round: int = Field(ge=2, description="round 1 is the study's grid")


class DecidedWith(Spec):
    """The values a decided study's recorded rounds were decided with, written by `layertune repro --decide` with
    the first round it records: the claims hold at the error the rule spent for these values only (docs/pipeline.md,
    "Deciding in rounds"), so while rounds are recorded `StudySpec` refuses a change of any of them."""

    tolerance: NonNegativeFloat = Field(description="report.tolerance")
    confidence: float = Field(gt=0.5, lt=1, description="report.confidence (the error spent: 1 - confidence)")
    looks: int = Field(ge=2, le=20, description="decide.looks")
    spending: Literal["obrien-fleming", "pocock", "bonferroni"] = Field(description="decide.spending")
    seeds_per_round: PositiveInt = Field(description="decide.seeds_per_round")
    evaluation_size: PositiveInt | None = Field(description="decide.evaluation_size (which examples a round may "
                                                            "add)")
    rule: str = Field("1", description="the rule that chose the rounds and made the claims (`layertune.rounds.RULE`); "
                                       "1: a record from before rules were named")

    @classmethod
    def of(cls, report: ReportSpec, decide: DecideSpec) -> DecidedWith:
        """The values a study with ``report`` and ``decide`` decides its rounds with, as it stands (today's rule)."""
        return cls(tolerance=report.tolerance, confidence=report.confidence, looks=decide.looks,
                   spending=decide.spending, seeds_per_round=decide.seeds_per_round,
                   evaluation_size=decide.evaluation_size, rule=RULE)


# Each value of `DecidedWith`: where the study sets it.
DECIDED_WITH_KEYS = {"tolerance": "report.tolerance", "confidence": "report.confidence", "looks": "decide.looks",
                     "spending": "decide.spending", "seeds_per_round": "decide.seeds_per_round",
                     "evaluation_size": "decide.evaluation_size"}


class DecideSpec(Spec):
    """A study decided in rounds (`layertune.rounds`; `layertune repro --decide`): after each round, the settings
    shown worse than the best by more than the tolerance stop, and the next seeds go where they can settle
    something, until each question (task and encoder) is answered, ``looks`` rounds are done, no seeds could settle
    more, or the build's budget is spent. ``rounds`` is the record `layertune repro --decide` writes: a rebuild
    trains and reports the same rounds."""

    looks: int = Field(4, ge=2, le=20, description="rounds at most, the grid's included: the error rate is spent "
                                                  "over them")
    seeds_per_round: PositiveInt = Field(2, description="seeds each setting still in question gets per round")
    spending: Literal["obrien-fleming", "pocock", "bonferroni"] = Field(
        "obrien-fleming", description="how the one-sided error (1 - report.confidence) is spread over the looks "
                          "(`layertune.statistics.Looks`)")
    budget_minutes: PositiveFloat | None = Field(None, description="`layertune repro --decide` starts no round "
                                                                   "that would end past it (--budget wins)")
    rounds: dict[str, RoundCell] = Field({}, description="cell key → the cell a later round trained (written by "
                                                         "`layertune repro --decide`)")
    evaluation_size: PositiveInt | None = Field(
        None, description="labelled examples of each task that the study neither trains nor evaluates on, carved "
                          "once (data.seed) from its training data: once the dev sample is most of an open "
                          "comparison's uncertainty, a round adds them to the dev examples, scored from the saved "
                          "cells (no training); null: only seeds")
    evaluation_rounds: dict[str, dict[str, int]] = Field(
        {}, description="task → encoder → the round that added the evaluation examples to that question (written "
                        "by `layertune repro --decide`)")
    decided_with: DecidedWith | None = Field(
        None, description="the values the recorded rounds were decided with (written by `layertune repro --decide` "
                          "with the first round; none in a record from before it wrote them: not checked)")

    @model_validator(mode="before")
    @classmethod
    def _older_record(cls, data: Any) -> Any:
        """A ``decided_with`` written before the evaluation size was kept says nothing of it: taken as today's
        (not checked), as a record with no ``decided_with`` at all is."""
        if isinstance(data, Mapping) and isinstance(data.get("decided_with"), Mapping) \
                and "evaluation_size" not in data["decided_with"]:
            data = {**data, "decided_with": {**data["decided_with"], "evaluation_size": data.get("evaluation_size")}}
        return data

    @property
    def recorded(self) -> bool:
        """Whether any round after the grid is recorded."""
        return bool(self.rounds or self.evaluation_rounds)


class MethodSetting(Spec):
    """One setting of a study's ``methods`` axis: a tuning method and the layers it applies to."""

    method: TuningMethod = TopK()
    tunable_layers: TunableLayers
    learning_rate: PositiveFloat | None = Field(None, description="the encoders' rate with this method (adapters "
                                                                  "and biases learn at larger rates than whole "
                                                                  "layers): wins over an encoder's own and the "
                                                                  "study's; null: theirs")

    @model_validator(mode="after")
    def _fits(self) -> MethodSetting:
        self.method.check_tunable_layers(self.tunable_layers)
        return self


class CombinedEncoder(Spec):
    """Several of the study's single encoders, combined by a `MultiEncoder` as ``combine`` says. ``combine: dme``
    is short for ``combine: {method: dme}``."""

    members: list[str] = Field(min_length=2)
    combine: CombineSpec

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, entry: Any) -> Any:
        if isinstance(entry, Mapping) and isinstance(entry.get("combine"), str):
            return {**entry, "combine": {"method": entry["combine"]}}
        return entry


def _encoder_kind(entry: Any) -> str:
    if isinstance(entry, str):
        return "model"
    return "combined" if isinstance(entry, Mapping) and "combine" in entry or isinstance(entry, CombinedEncoder) \
        else "single"


class SingleEncoder(EncoderSpec):
    """One of the study's single encoders: a model with settings, and optionally its own learning rate (a
    `MultiEncoder` tunes each of its language models at its own rate)."""

    learning_rate: PositiveFloat | None = Field(None, description="this encoder's own rate: wins over "
                                                                  "training.learning_rate, loses to a setting's "
                                                                  "(methods.<m>, per_tunable_layers.<K>)")


# A model id, a model with settings, or a combination; tagged so that an error names only the form that was meant.
EncoderEntry = Annotated[Annotated[str, Tag("model")] | Annotated[SingleEncoder, Tag("single")]
                         | Annotated[CombinedEncoder, Tag("combined")], Discriminator(_encoder_kind)]


class StudySpec(Spec):
    """One study of ``params.yaml``: its grid, the shared settings of its cells, and its report."""

    report: ReportSpec
    tasks: dict[str, DatasetSpec] = Field(min_length=1, description="name → DatasetSpec; a list names built-in "
                                                                    "tasks")
    encoders: dict[str, EncoderEntry] = Field(min_length=1)
    tunable_layers: list[TunableLayers] | None = Field(None, min_length=1)
    methods: dict[str, MethodSetting] | None = Field(None, min_length=1, description="in place of tunable_layers: "
                                                     "named (method, tunable layers) settings")
    seeds: list[Seed] = Field(min_length=1)
    data: SampleSpec = SampleSpec()
    encoder: EncoderSettings = EncoderSettings()
    head: HeadSpec = HeadSpec()
    training: TrainingConfig = TrainingConfig()
    per_tunable_layers: dict[TunableLayers, dict[str, Any]] = Field(
        {}, description="training arguments, and the head's (HeadSpec: head_dropout, ...), for one tunable-layers "
                        "value, e.g. {0: {head_learning_rate: 3.0e-3, head_dropout: 0.0}} (a value the grid lacks is "
                        "kept for when it has it)")
    per_task: dict[str, dict[TunableLayers, dict[str, Any]]] = Field(
        {}, description="one task's own overrides for a tunable-layers value, over per_tunable_layers', e.g. "
                        "{sst2: {2: {learning_rate: 5.0e-5}}}: a rate chosen on each task's validation slice")
    decide: DecideSpec | None = Field(None, description="decide in rounds (layers and methods reports): more seeds "
                                                        "for the settings still in question")

    @field_validator("tasks", mode="before")
    @classmethod
    def _task_entries(cls, tasks: Any) -> Any:
        """``[sst2, stsb]`` is ``{sst2: {task: sst2}, stsb: {task: stsb}}``; in a mapping, ``null`` is the built-in
        task of the key's name and a string a built-in task."""
        if isinstance(tasks, list):
            for position, task in enumerate(tasks):
                if not isinstance(task, str):
                    raise ValueError(f"tasks[{position}]: a list of tasks holds built-in task names; write a dataset "
                                     "described in place in a mapping, tasks: {sst2: null, reviews: {path: ...}} (DVC "
                                     "names each train stage after a task's key, and a list item has none)")
            tasks = {task: None for task in _unique(tasks, "tasks")}
        if isinstance(tasks, Mapping):
            return {name: {"task": name} if entry is None else {"task": entry} if isinstance(entry, str) else entry
                    for name, entry in tasks.items()}
        return tasks

    @field_validator("encoders", mode="before")
    @classmethod
    def _grid_sets_tunable_layers(cls, encoders: Any) -> Any:
        # Checked on the written entries only: a planned study read back from JSON holds each EncoderSpec whole.
        for name, entry in (encoders.items() if isinstance(encoders, Mapping) else ()):
            if isinstance(entry, Mapping) and "tunable_layers" in entry:
                raise ValueError(f"encoders.{name}.tunable_layers: an encoder's tunable layers come from the study's "
                                 "tunable_layers (the grid); remove this key")
        return encoders

    @field_serializer("encoders")
    def _entries_without_tunable_layers(self, encoders: dict) -> dict:
        # An entry's tunable layers come from the grid: written back without them, so the entry reads back as given.
        # Only the keys given: a default written back would read as set (a methods study refuses an entry's method).
        return {name: entry.model_dump(include=entry.model_fields_set - {"tunable_layers"})
                if isinstance(entry, EncoderSpec)
                else entry if isinstance(entry, str) else entry.model_dump() for name, entry in encoders.items()}

    @field_validator("tunable_layers")
    @classmethod
    def _layers(cls, values: list | None) -> list | None:
        return values if values is None else _unique(values, "tunable_layers")

    @field_validator("training")
    @classmethod
    def _one_study_rate(cls, training: TrainingConfig) -> TrainingConfig:
        if isinstance(training.learning_rate, list):
            raise ValueError(f"learning_rate: the study's is one rate, got {training.learning_rate}; give an encoder "
                             "a rate of its own as encoders.<name>.learning_rate")
        return training

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        return _unique(seeds, "seeds")

    @field_validator("per_tunable_layers", mode="before")
    @classmethod
    def _numeric_keys(cls, overrides: Any) -> Any:
        # Mapping keys pass through JSON and some YAML writers as text: "0" is the tunable-layers value 0.
        if isinstance(overrides, Mapping):
            return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in overrides.items()}
        return overrides

    @field_validator("per_task", mode="before")
    @classmethod
    def _numeric_keys_per_task(cls, overrides: Any) -> Any:
        if isinstance(overrides, Mapping):
            return {task: cls._numeric_keys(per_k) for task, per_k in overrides.items()}
        return overrides

    @property
    def grid_axis(self) -> Literal["tunable_layers", "methods"]:
        """The grid's third axis: numbers of tunable layers, or named methods."""
        return "tunable_layers" if self.methods is None else "methods"

    @property
    def grid_settings(self) -> list[tuple[str | None, TunableLayers]]:
        """The third axis as (method setting name or None, tunable layers), in order."""
        if self.methods is None:
            return [(None, k) for k in self.tunable_layers]
        return [(name, setting.tunable_layers) for name, setting in self.methods.items()]

    @property
    def layer_values(self) -> list[TunableLayers]:
        """Every number of tunable layers a cell of the study trains."""
        return list(dict.fromkeys(k for _, k in self.grid_settings))

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        if (self.tunable_layers is None) == (self.methods is None):
            raise ValueError("give tunable_layers (how many top layers to tune) or methods (named tuning methods, "
                             "each with its tunable layers), not both" + (" and not neither" if self.methods is None
                                                                          else ""))
        if self.methods is not None:
            if own := [name for name, entry in self.encoders.items()
                       if isinstance(entry, EncoderSpec) and "method" in entry.model_fields_set]:
                raise ValueError(f"encoders.{own[0]}.method: the study's methods axis sets each cell's method; "
                                 "remove this key")
        for name, entry in self.encoders.items():
            if isinstance(entry, CombinedEncoder):
                for member in entry.members:
                    if not isinstance(self.encoders.get(member), (str, EncoderSpec)):
                        single = [n for n, e in self.encoders.items() if not isinstance(e, CombinedEncoder)]
                        raise ValueError(f"encoders.{name}.members: {member!r} is not a single encoder of this "
                                         f"study.{choices_hint(member, single)}")
        # An override of a K the grid lacks is kept for when it has it: a profile or `dvc exp run -S` that shrinks the
        # grid need not touch the per-K settings (each is still checked below).
        if unknown := [task for task in self.per_task if task not in self.tasks]:
            raise ValueError(f"per_task.{unknown[0]}: not a task of this study."
                             f"{choices_hint(unknown[0], list(self.tasks))}")
        per_k = [(f"per_tunable_layers.{k}", overrides) for k, overrides in self.per_tunable_layers.items()]
        per_k += [(f"per_task.{task}.{k}", overrides) for task, mine in self.per_task.items()
                  for k, overrides in mine.items()]
        for where, overrides in per_k:
            if isinstance(rate := overrides.get("learning_rate"), list):
                raise ValueError(f"{where}.learning_rate: a setting's rate is one rate, got {rate}; "
                                 "give an encoder a rate of its own as encoders.<name>.learning_rate")
            if unknown := [key for key in overrides if key not in TrainingConfig.model_fields and key not in HEAD_KEYS]:
                raise ValueError(f"{where}.{unknown[0]}: not a training or head argument."
                                 f"{choices_hint(unknown[0], [*PER_K_TRAINING, *HEAD_KEYS])}")
            if shared := sorted(set(overrides) & STUDY_WIDE_TRAINING):
                raise ValueError(f"{where}: {', '.join(shared)} can only be set for the whole study "
                                 "(in training): the tokenized features and cached states are shared by its cells")
        # Each override is checked where it is written (a bad one fails naming its key): per_tunable_layers' alone
        # first (task None), so that an error with a task's own overrides on top is theirs.
        for task in (None, *self.tasks):
            for k in dict.fromkeys([*self.layer_values, *self.per_tunable_layers, *self.per_task.get(task, {})]):
                training = self.training_for(next(iter(self.encoders)), k, seed=0, task=task)
                self.head_for(k, task)
                if task is None or training.early_stopping_patience is None or k not in self.layer_values \
                        or self.data.validation_size is not None:
                    continue
                where = next((f for f, o in (
                    (f"per_task.{task}.{k}", self.per_task.get(task, {}).get(k, {})),
                    (f"per_tunable_layers.{k}", self.per_tunable_layers.get(k, {})))
                    if "early_stopping_patience" in o), "training")
                raise ValueError(f"{where}.early_stopping_patience: {training.early_stopping_patience}, but "
                                 "data.validation_size is not set: early stopping needs a validation slice carved "
                                 "from the training data (dev is never used to stop); set data.validation_size, or "
                                 "remove early_stopping_patience")
        self._check_distinct_keys()
        if self.decide is not None:
            self._check_rounds(self.decide)
        return self

    def setting_name(self, tunable_layers: TunableLayers, method: str | None) -> TunableLayers | str:
        """A setting's name on the grid's third axis: its tunable layers, or (a methods study) its method."""
        return tunable_layers if self.methods is None else method

    def _check_rounds(self, decide: DecideSpec) -> None:
        """The record of the rounds is one the rule could have written: per question (task and encoder), rounds 2,
        3, … without a gap, each either new seeds (none of the grid's, the same for each of its settings) for some
        of the settings of the round before (a setting left out gets none after), or the evaluation examples, once;
        chosen by today's rule (``decided_with.rule``), with the values of today's study."""
        if self.report.kind not in ("layers", "methods"):
            raise ValueError(f"decide: a {self.report.kind!r} report has no question to decide in rounds; "
                             "decide works with the layers and methods reports")
        self._check_decided_with(decide)
        axis, settings = self.grid_axis, [self.setting_name(k, m) for m, k in self.grid_settings]
        if len(settings) < 2:  # the rule stops settings shown worse than the best: with one, nothing is asked
            raise ValueError(f"decide: the study has one setting ({settings[0]}), so no question to decide in rounds; "
                             f"give {axis} two settings or more, or remove the decide section")
        questions: dict[tuple[str, str], dict[int, dict[str, set[int]]]] = {}
        for key, cell in decide.rounds.items():
            where = f"decide.rounds.{key}"
            setting = cell.tunable_layers if axis == "tunable_layers" else cell.method
            if (cell.tunable_layers if axis == "methods" else cell.method) is not None or setting is None:
                raise ValueError(f"{where}: a cell of this study names its {axis.replace('_', ' ')} "
                                 f"({'tunable_layers' if axis == 'tunable_layers' else 'method'}) and nothing else")
            self._check_on_grid(where, cell.task, cell.encoder, (setting, settings, axis.replace("_", " ").rstrip("s")))
            if key != (own := cell_key(cell.task, cell.encoder, setting, cell.seed)):
                raise ValueError(f"{where}: this cell's key is {own}")
            if cell.seed in self.seeds:
                raise ValueError(f"{where}: seed {cell.seed} is one of the grid's seeds {self.seeds}")
            rounds = questions.setdefault((cell.task, cell.encoder), {})
            rounds.setdefault(cell.round, {}).setdefault(str(setting), set()).add(cell.seed)
        if decide.evaluation_rounds and decide.evaluation_size is None:
            raise ValueError("decide.evaluation_rounds: recorded, but decide.evaluation_size is not set")
        for task, encoders in decide.evaluation_rounds.items():
            for encoder, number in encoders.items():
                where = f"decide.evaluation_rounds.{task}.{encoder}"
                self._check_on_grid(where, task, encoder)
                rounds = questions.setdefault((task, encoder), {})
                if number in rounds:
                    raise ValueError(f"{where}: round {number} trained cells of this question; the round that adds "
                                     "the evaluation examples trains none")
                rounds[number] = {}
        for (task, encoder), rounds in questions.items():
            numbers, where = sorted(rounds), f"decide (task {task}, encoder {encoder})"
            if numbers != list(range(2, numbers[-1] + 1)):
                raise ValueError(f"{where}: rounds {numbers} are recorded; they are numbered 2, 3, … without a gap")
            if len(numbers) + 1 > decide.looks:
                raise ValueError(f"{where}: {len(numbers) + 1} rounds with the grid's, more than decide.looks "
                                 f"({decide.looks})")
            trained = set(map(str, settings))
            for number in numbers:
                if not rounds[number]:  # the evaluation examples' round
                    continue
                if len({frozenset(seeds) for seeds in rounds[number].values()}) != 1:
                    raise ValueError(f"{where}: the settings of round {number} have different seeds; a round gives "
                                     "each of its settings the same seeds")
                if stopped := sorted(set(rounds[number]) - trained):
                    raise ValueError(f"{where}: round {number} trains {', '.join(stopped)}, which an earlier round "
                                     "left out: a setting left out of a round stays out (its seeds pair with the "
                                     "others' by their order)")
                trained = set(rounds[number])

    def _check_decided_with(self, decide: DecideSpec) -> None:
        """Recorded rounds replay their claims under today's values: each must be the one they were decided with."""
        if not decide.recorded:
            return
        then_rule = decide.decided_with.rule if decide.decided_with is not None else "1"
        if then_rule != RULE:
            raise ValueError(f"decide.decided_with.rule: the recorded rounds were chosen by rule {then_rule!r}, and "
                             f"today's is {RULE!r}, which chooses its rounds and makes its claims differently: clear "
                             "decide.rounds, decide.evaluation_rounds and decide.decided_with to decide the study "
                             "again from its grid (layertune repro --decide), or use the layertune release that "
                             "recorded them")
        if decide.decided_with is None:
            return
        now = DecidedWith.of(self.report, decide)
        for field, key in DECIDED_WITH_KEYS.items():
            then, value = getattr(decide.decided_with, field), getattr(now, field)
            if then != value:
                raise ValueError(f"{key}: {value}, but the recorded rounds were decided with {then} "
                                 f"(decide.decided_with.{field}), and their claims hold for that value only; restore "
                                 f"{key}: {then}, or clear decide.rounds and decide.evaluation_rounds to decide the "
                                 "study again from its grid")

    def _check_on_grid(self, where: str, task: str, encoder: str, *more: tuple) -> None:
        for value, known, what in ((task, list(self.tasks), "task"), (encoder, list(self.encoders), "encoder"), *more):
            if value not in known:
                raise ValueError(f"{where}: {what} {value!r} is not on the study's grid.{choices_hint(value, known)} "
                                 "(a profile or -S that changes the grid sets decide.rounds: {} too: the record is of "
                                 "another grid)")

    def _check_distinct_keys(self) -> None:
        """Names may hold '-', the keys' separator: tasks a and a-b with encoders b-c and c would both name a cell
        a-b-c-0-1, and one cell's folder, stage and run would silently be the other's."""
        settings: dict[str, str] = {}
        third = "tunable layers" if self.methods is None else "method"
        for task, encoder, (method, k) in itertools.product(self.tasks, self.encoders, self.grid_settings):
            key = cell_key(task, encoder, k if method is None else method)
            described = f"(task {task}, encoder {encoder}, {third} {k if method is None else method})"
            if key in settings:
                raise ValueError(f"cells {settings[key]} and {described} would both be named {key}-{self.seeds[0]} "
                                 f"(a cell's key joins its task, encoder, {third} and seed with '-'); rename one of "
                                 "them")
            settings[key] = described

    # -------------------------------------------------------------------------------------------------- cells

    def members(self, encoder: str) -> list[tuple[str, EncoderSpec]]:
        """The single encoders behind ``encoder`` (itself, or a combination's members), with their settings."""
        entry = self.encoders[encoder]
        names = entry.members if isinstance(entry, CombinedEncoder) else [encoder]
        return [(name, self._single(self.encoders[name])) for name in names]

    @staticmethod
    def _single(entry: str | SingleEncoder) -> SingleEncoder:
        return SingleEncoder(model=entry) if isinstance(entry, str) else entry

    def encoder_specs(self, encoder: str, tunable_layers: TunableLayers, method: str | None = None
                      ) -> list[EncoderSpec]:
        """Each language model of ``encoder`` as the cell builds it: the study's ``encoder`` settings, the entry's
        own, the grid's tunable layers and (a methods study) the tuning method of setting ``method``."""
        chosen = {} if method is None else {"method": self.methods[method].method}
        return [EncoderSpec(**{**self.encoder.model_dump(), **single.model_dump(
                    include=single.model_fields_set - {"learning_rate"}), "tunable_layers": tunable_layers, **chosen})
                for _, single in self.members(encoder)]

    def training_for(self, encoder: str, tunable_layers: TunableLayers, seed: int, method: str | None = None,
                     task: str | None = None) -> TrainingConfig:
        """A cell's training arguments: the study's, with ``per_tunable_layers[K]``'s overrides, then those of
        ``per_task[task][K]``, and the cell's seed.

        Its learning rate is resolved here, once, most specific first: the setting's (``methods.<m>.learning_rate``,
        else ``per_tunable_layers.<K>.learning_rate``), else the encoder's own (``encoders.<e>.learning_rate``),
        else the study's (``training.learning_rate``); one rate per language model of a combination, a single rate
        where they agree."""
        overrides = {key: value for key, value in self._overrides(tunable_layers, task).items()
                     if key not in HEAD_KEYS}
        setting = next((rate for rate in (method and self.methods[method].learning_rate,
                                          overrides.get("learning_rate")) if rate is not None), None)
        rates = [next(rate for rate in (setting, single.learning_rate, self.training.learning_rate)
                      if rate is not None) for _, single in self.members(encoder)]
        values = {**self.training.model_dump(), **overrides, "seed": seed,
                  "learning_rate": encoder_rates(rates)}
        try:
            return TrainingConfig.model_validate(values)
        except ValidationError as error:
            raise _nested(error, self._where(tunable_layers, task)) from None

    def head_for(self, tunable_layers: TunableLayers, task: str | None = None) -> HeadSpec:
        """A cell's head: the study's ``head``, with the head keys of ``per_tunable_layers[K]`` and then of
        ``per_task[task][K]`` (``head_dropout: 0.0`` for the head alone, say)."""
        overrides = {key: value for key, value in self._overrides(tunable_layers, task).items() if key in HEAD_KEYS}
        if not overrides:
            return self.head  # the study's own object, as every cell without an override has always had
        try:
            return HeadSpec.model_validate({**self.head.model_dump(exclude_unset=True), **overrides})
        except ValidationError as error:
            raise _nested(error, self._where(tunable_layers, task)) from None

    def _overrides(self, tunable_layers: TunableLayers, task: str | None) -> dict[str, Any]:
        return {**self.per_tunable_layers.get(tunable_layers, {}), **self.per_task.get(task, {}).get(tunable_layers, {})}

    def _where(self, tunable_layers: TunableLayers, task: str | None) -> tuple:
        return ("per_task", task, tunable_layers) if tunable_layers in self.per_task.get(task, {}) else \
            ("per_tunable_layers", tunable_layers)

    def corpus_spec(self, task: str) -> CorpusSpec:
        """Task ``task``'s dataset and the study's subsample of it: what each of its cells trains on."""
        return CorpusSpec(**self.tasks[task].model_dump(), **self.data.model_dump())

    def cell_spec(self, task: str, encoder: str, tunable_layers: TunableLayers, seed: int,
                  method: str | None = None) -> CellSpec:
        entry = self.encoders[encoder]
        return CellSpec(corpus=self.corpus_spec(task),
                        encoders=self.encoder_specs(encoder, tunable_layers, method),
                        combine=entry.combine if isinstance(entry, CombinedEncoder) else None,
                        head=self.head_for(tunable_layers, task),
                        training=self.training_for(encoder, tunable_layers, seed, method, task))


def _nested(error: ValidationError, prefix: tuple) -> ParamsError:
    return ParamsError("; ".join(describe_validation_error(error, prefix)))


# --------------------------------------------------------------------------------------------------------- plan


class StudyCell(Spec):
    """One cell of a study: where it sits in the grid, and the `CellSpec` it trains."""

    study: str
    task: str
    encoder: str
    tunable_layers: TunableLayers
    seed: int
    spec: CellSpec
    method: str | None = Field(None, description="the setting of the study's methods axis (None: a layers grid)")
    model_fingerprints: list[str | None] = Field(
        [], description="per language model of spec.encoders, `model_fingerprint` of the files it starts from")
    # Left out of the saved form in round 1 (every cell of a study not decided in rounds): a cell's plan file is a
    # dependency of its train stage, and a new field would retrain every cell.
    round: int = Field(1, ge=1, exclude_if=lambda number: number == 1,
                       description="the round of a decided study that trained it (1: the grid)")

    @property
    def key(self) -> str:
        """The name DVC's matrix gives this cell (its values joined by '-', in the matrix's order)."""
        return cell_key(*self.setting, self.seed)

    @property
    def path(self) -> str:
        """``<study>/<key>``: the cell's folder below data/04_models, and the ``--params cell=`` value."""
        return f"{self.study}/{self.key}"

    @property
    def setting_key(self) -> str:
        """``<task>-<encoder>-<tunable_layers>``: the key less the seed, shared by the cells of one setting."""
        return cell_key(*self.setting)

    @property
    def setting(self) -> tuple[str, str, TunableLayers | str]:
        """What the cell measures, seeds aside: task, encoder, and its tunable layers or (a methods study) its
        method setting's name."""
        return self.task, self.encoder, self.tunable_layers if self.method is None else self.method


class StudyPlan(Spec):
    """A validated study and its cells: what the evaluate and aggregate stages read."""

    name: str
    spec: StudySpec
    cells: list[StudyCell]

    def cell(self, key: str) -> StudyCell:
        for cell in self.cells:
            if cell.key == key:
                return cell
        raise KeyError(f"{self.name} has no cell {key!r}.{choices_hint(key, [c.key for c in self.cells])}")


def study_cells(name: str, study: StudySpec) -> list[StudyCell]:
    """Every task × encoder × tunable layers (or method) × seed, in the order of DVC's matrix, then the cells of
    the later rounds of a decided study, as recorded."""
    fingerprints = {encoder: [model_fingerprint(single.model) for _, single in study.members(encoder)]
                    for encoder in study.encoders}
    grid = [(task, encoder, method, k, seed) for task, encoder, (method, k), seed
            in itertools.product(study.tasks, study.encoders, study.grid_settings, study.seeds)]
    layers = dict((method, k) for method, k in study.grid_settings)
    rounds = [(cell.task, cell.encoder, cell.method, layers[cell.method] if cell.method else cell.tunable_layers,
               cell.seed, cell.round) for cell in sorted(study.decide.rounds.values() if study.decide else (),
                                                         key=lambda cell: (cell.round, cell.seed))]  # seeds in order
    return [StudyCell(study=name, task=task, encoder=encoder, tunable_layers=k, seed=seed, method=method,
                      spec=study.cell_spec(task, encoder, k, seed, method), model_fingerprints=fingerprints[encoder],
                      round=number)
            for task, encoder, method, k, seed, number in [(*cell, 1) for cell in grid] + rounds]


