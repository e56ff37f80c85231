"""Where a corpus's data lives: registry names, the local data mirror, the Hugging Face hub, and local files or
folders (which file is which split, and that it is a kind of file we read).

`datasets` is imported only to fetch from the hub, so that `layertune.corpora` (which exports names from here)
stays as cheap to import as `layertune.corpora.registry`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from layertune.corpora.conll import CONLL_SUFFIXES, is_conll_file
from layertune.corpora.registry import GLUE_CONFIGS, TASKS, TaskSpec
from layertune.errors import CorpusArgumentError, choices_hint, unknown_choice

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

MIRROR_ENV = "LAYERTUNE_DATA_MIRROR"
MIRROR_LAYOUT = ("glue/{CoLA,SST-2,MRPC,RTE,STS-B}/{train,dev}.tsv, imdb/{train,test}.parquet and "
                 "ner/conll2003/{train,dev,test}.txt")
SPLIT_ALIASES = {"train": "train", "dev": "dev", "validation": "dev", "valid": "dev", "val": "dev", "test": "test"}
FILE_TYPES = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataUnavailableError(ConnectionError):
    """The data is neither in the mirror nor reachable on the Hugging Face hub."""


# ------------------------------------------------------------------------------------------- resolving the name


def is_local_path(name: str | os.PathLike) -> bool:
    return isinstance(name, os.PathLike) or Path(name).expanduser().exists()


def names_a_file(name: str | os.PathLike) -> bool:
    """A local path, or a name ending as a data file does (``reviews.csv``) in a folder that exists: missing, it is
    a file that does not exist, not a dataset for the hub to look up (``owner/data.json``, whose owner is no local
    folder, is still the hub's)."""
    path = Path(name).expanduser()
    return is_local_path(name) or (path.suffix.lower() in (*FILE_TYPES, *CONLL_SUFFIXES, ".txt")
                                   and path.parent.is_dir())


def _task_key(name: str) -> str:
    # "SST-2", "STS-B", "CoLA" (the GLUE folder names) resolve to the registry keys.
    return str(name).lower().replace("-", "").replace("_", "")


def is_registry_name(name: object, hub: bool = True) -> bool:
    """True for a registry task, ``glue`` (with a config) or (``hub``) a registry task's hub id."""
    if not isinstance(name, str):
        return False
    return _task_key(name) in (*TASKS, "glue") or hub and name in {spec.hub_path for spec in TASKS.values()}


def resolve_task(name: str, config: str | None) -> TaskSpec | None:
    """The registry spec for ``name`` (+ ``config``), None for a hub id outside the registry."""
    key = _task_key(name)
    if key in TASKS:
        spec = TASKS[key]
        if config is not None and config not in (spec.hub_config, spec.name):
            raise unknown_choice(f"{spec.name} config", config, [spec.hub_config])
        return spec
    if key == "glue" or name == "nyu-mll/glue":
        if config is None:
            hint = choices_hint("", GLUE_CONFIGS)
            raise ValueError(f"{name!r} needs a config, e.g. load_corpus('glue', 'mrpc').{hint}")
        if _task_key(config) not in GLUE_CONFIGS:
            raise unknown_choice("GLUE config", config, GLUE_CONFIGS)
        return TASKS[_task_key(config)]
    for spec in TASKS.values():
        if name == spec.hub_path:
            return resolve_task(spec.name, config)
    if "/" in name:
        return None
    error = unknown_choice("task", name, TASKS)
    raise ValueError(f"{error} Any other Hugging Face dataset needs its full id ('owner/name'); "
                     f"local files need a path that exists or data_files=.")


# ---------------------------------------------------------------------------------------------- the data mirror


def mirror_root(data_mirror: str | os.PathLike | None) -> Path | None:
    origin = "data_mirror" if data_mirror is not None else MIRROR_ENV
    root = data_mirror if data_mirror is not None else os.environ.get(MIRROR_ENV)
    if not root:
        return None
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{origin}={str(root)!r} is not a folder; it should hold {MIRROR_LAYOUT}.")
    return root


def resolve_data_mirror(configured: str | os.PathLike | None) -> str | os.PathLike | None:
    """The data mirror to use: ``$LAYERTUNE_DATA_MIRROR`` when set (then None, which `load_corpus` resolves to it),
    else ``configured`` (None: the Hugging Face hub)."""
    return None if os.environ.get(MIRROR_ENV) else configured


def mirror_files(spec: TaskSpec, mirror: Path | None) -> dict[str, Path] | None:
    """``{split: path}`` of the task's files in the mirror, None unless the mirror holds every one of them."""
    files = {split: mirror / rel for split, rel in spec.mirror_files.items()} if mirror else {}
    return files if files and all(path.is_file() for path in files.values()) else None


def _mirror_hint(spec: TaskSpec, mirror: Path | None, err: Exception) -> str:
    wanted = ", ".join(spec.mirror_files.values())
    where = f"The data mirror {mirror} has no {wanted}. " if mirror else "No data mirror is set. "
    return (f"Could not load task {spec.name!r} from the Hugging Face hub ({spec.hub_path}, {spec.hub_config}): "
            f"{type(err).__name__}: {err}. {where}To work offline, point at a local copy: set "
            f"{MIRROR_ENV}=/path/to/data (or pass data_mirror=) to a folder holding {wanted} "
            f"(full layout: {MIRROR_LAYOUT}).")


# ------------------------------------------------------------------------------------------------------ the hub


def fetch_task(spec: TaskSpec, mirror: Path | None) -> dict[str, datasets.Dataset]:
    """A registry task's splits from the hub, by our split names, hub columns renamed to ours (not yet conformed).

    ``mirror``: the data mirror that lacks the task, named in the error when the hub cannot be reached."""
    import datasets

    if mirror:
        logger.info("%s is not in the data mirror %s; trying the Hugging Face hub", spec.name, mirror)
    try:
        hub = datasets.load_dataset(spec.hub_path, spec.hub_config, revision=spec.hub_revision)
    except OSError as err:  # ConnectionError (offline) and DatasetNotFoundError are both OSErrors
        raise DataUnavailableError(_mirror_hint(spec, mirror, err)) from err
    hub = {split: ds.rename_columns({k: v for k, v in spec.hub_columns.items() if k in ds.column_names})
           for split, ds in hub.items()}
    return {split: hub[hub_split] for split, hub_split in spec.hub_splits.items()}


def fetch_dataset(name: str, config: str | None, revision: str | None = None) -> dict[str, datasets.Dataset]:
    """Every split of hub dataset ``name`` (``config``, at ``revision``), under the hub's split names."""
    import datasets

    try:
        if config is not None:
            configs = datasets.get_dataset_config_names(name, revision=revision)
            if config not in configs:
                raise CorpusArgumentError("config", str(unknown_choice(f"{name} config", config, configs)))
        hub = datasets.load_dataset(name, config, revision=revision)
    except OSError as err:
        raise DataUnavailableError(
            f"Could not load {name!r} from the Hugging Face hub: {type(err).__name__}: {err}. Offline, download "
            f"it elsewhere and pass the files: load_corpus({name!r}, data_files={{'train': ..., 'dev': ...}})."
        ) from err
    return dict(hub)


def chosen_splits(splits: Mapping[str, datasets.Dataset], chosen: Mapping[str, str], what: str) -> tuple[dict,
                                                                                                      list[str]]:
    """``{ours: splits[theirs]}`` for ``chosen`` = ``{ours: theirs}`` (ours: train, dev, test)."""
    for ours, theirs in chosen.items():
        if ours not in ("train", "dev", "test"):
            raise CorpusArgumentError("splits", str(unknown_choice("split", ours, ("train", "dev", "test"))))
        if theirs not in splits:
            raise CorpusArgumentError("splits", f"{what} has no split {theirs!r} (given for {ours}); its splits are "
                                      f"{', '.join(splits)}.")
    if "train" not in chosen:
        raise CorpusArgumentError("splits", f"splits must name the train split of {what}; its splits are "
                                  f"{', '.join(splits)}.")
    unused = [f"Split {name!r} of {what} is not used." for name in splits if name not in chosen.values()]
    return {ours: splits[theirs] for ours, theirs in chosen.items()}, unused


def canonical_splits(splits: Mapping[str, datasets.Dataset], what: str) -> tuple[dict, list[str]]:
    """Rename validation/valid/val to dev and drop splits we do not use (noted)."""
    out, notes = {}, []
    for split, ds in splits.items():
        ours = SPLIT_ALIASES.get(split.lower())
        if ours is None or ours in out:
            notes.append(f"Split {split!r} of {what} is not used.")
        else:
            out[ours] = ds
    if "train" not in out:
        raise ValueError(f"{what} has no train split; its splits are {', '.join(splits)}.")
    return out, notes


# ------------------------------------------------------------------------------------------------- local files


def split_files(source) -> dict[str, Path]:
    """``{split: path}`` from a file (train only), a folder (``train.csv``, ``dev.tsv``, ...), or a mapping."""
    if isinstance(source, Mapping):
        files = {}
        for split, path in source.items():
            if str(split).lower() not in SPLIT_ALIASES:
                raise unknown_choice("split", split, SPLIT_ALIASES)
            files[SPLIT_ALIASES[str(split).lower()]] = Path(path).expanduser()
    elif Path(source).expanduser().is_dir():
        folder = Path(source).expanduser()
        files = {SPLIT_ALIASES[p.stem.lower()]: p for p in sorted(folder.iterdir())
                 if p.stem.lower() in SPLIT_ALIASES and p.suffix.lower() in (*FILE_TYPES, *CONLL_SUFFIXES, ".txt")}
        if "train" not in files:
            found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
            raise FileNotFoundError(f"No train file (train.csv/.tsv/.json/.jsonl/.parquet) in {folder}; found {found}.")
    else:
        files = {"train": Path(source).expanduser()}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"Data file {path} does not exist.")
        if path.suffix.lower() not in FILE_TYPES and not is_conll_file(path):
            error = unknown_choice("file type", path.suffix or path.name, (*FILE_TYPES, *CONLL_SUFFIXES))
            if path.suffix.lower() == ".txt":
                error = ValueError(f"{error} A .txt file is read as CoNLL columns (word ... tag), but the first line "
                                   f"of {path} has fewer than 2 columns.")
            raise error
    if "train" not in files:
        raise ValueError(f"data_files needs a 'train' file; got {', '.join(files)}.")
    return files
