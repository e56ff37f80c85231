"""params.yaml's schema and its one check (`validate_params`), which names every bad key by its dotted path and reads
each model's config files only, never its weights (docs/pipeline.md, "Parameters")."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from layertune.specs import EncoderSpec, Spec
from layertune.errors import describe_validation_error
from layertune.model_paths import model_config, model_layers, model_max_length, require_safe_weights
from layertune.study import ParamsError, StudySpec

# Study, encoder, task and method names name folders and DVC stages, and reach Kedro as `--params study=<name>`, read
# as YAML: so a letter first (`01` would arrive as 1), no dots (DVC reads `${studies.<name>.tasks}` as a path), no
# YAML word for true, false or null (`yes` would arrive as True). Encoder names may name their model (upper case).
NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
ENCODER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
# A cell's folder is named <task>-<encoder>-<setting>-<seed> and its MLflow experiment layertune-<study>: four names
# of this length still fit a file name (255 bytes) and MLflow's limits.
MAX_NAME = 48


def name_problem(name: object, pattern: re.Pattern = NAME) -> str | None:
    """Why ``name`` cannot name a study, encoder, task or method (see `NAME`), or None."""
    letters = "lower-case letters" if pattern is NAME else "letters"
    rule = f"{letters}, digits, '_' and '-', starting with a letter (it names folders, DVC stages and `kedro run " \
           "--params` values)"
    if not isinstance(name, str):
        kind = {bool: "a boolean", int: "a number", float: "a number", type(None): "null"}.get(type(name), "a date")
        return f"{name!r} is not a valid name: YAML read it as {kind}, not as text; a name is {rule}"
    if not pattern.match(name):
        return f"{name!r} is not a valid name: a name is {rule}"
    if len(name) > MAX_NAME:
        return f"{name[:20]!r}… is not a valid name: {len(name)} characters, at most {MAX_NAME} (it names folders)"
    if name.lower() in YAML_WORDS:
        return f"{name!r} is not a valid name: YAML reads it as a boolean or null, not as text"
    return None


# Values of params.yaml with its aliases (``*name``) expanded (the default studies: about 1,100). Nested aliases can
# stand for billions, on which DVC, Kedro's loader and the plan would hang: such a file is refused first.
MAX_EXPANDED_VALUES = 100_000
# Bytes of a parameter file (the default params.yaml: 5 KB). DVC, Kedro's loader and every stage's check read it at each
# build, in pure-Python YAML parsers (0.6 s a megabyte here, for this reader alone): a 50 MB file of comments made a
# build that trains nothing take 219 s instead of 5, with no word. Refused first, as nested aliases are.
MAX_FILE_BYTES = 2**20


def read_yaml(path: Path) -> Any:
    """The YAML file at ``path`` as plain data (`yaml.safe_load`); `ParamsError` if it is larger than
    `MAX_FILE_BYTES`, not YAML, or expands past `MAX_EXPANDED_VALUES`."""
    import yaml

    from layertune.io import in_bytes

    if (size := path.stat().st_size) > MAX_FILE_BYTES:
        raise ParamsError(f"{path}: {in_bytes(size)}, more than the {in_bytes(MAX_FILE_BYTES)} a parameter file may "
                          "hold: DVC, Kedro and every stage read it at each build, which at this size takes minutes "
                          "without a word; move long comments or data to a file of their own")
    text = path.read_text()
    try:
        size = _expanded_size(yaml.compose(text, Loader=_loader()), {})
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    except RecursionError:
        size = math.inf
    if size > MAX_EXPANDED_VALUES:
        raise ParamsError(f"{path}: its aliases (*name) expand it to more than {MAX_EXPANDED_VALUES:,} values, which "
                          "DVC and Kedro would take minutes or hours to read; write the values out, or use fewer, "
                          "unnested aliases")
    return yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader, one more float spelling)


@functools.cache  # one class for every read (compose and load both use it)
def _loader() -> type:
    """PyYAML's SafeLoader, which reads ``3e-05`` as a float as YAML 1.2 does (1.1 wants a dot: ``3.0e-05``): DVC
    (ruamel, YAML 1.2) writes floats so after ``dvc exp run -S``, and the rate would otherwise be read as text."""
    import yaml

    class ParamsLoader(yaml.SafeLoader):
        pass

    ParamsLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                                       list("-+0123456789"))
    return ParamsLoader


def _expanded_size(node, sizes: dict) -> float:
    """How many values the composed ``node`` stands for, aliases expanded (an alias is the node it names: ``sizes``
    counts each node once)."""
    import yaml

    if node is None:  # an empty file
        return 0
    if id(node) not in sizes:
        children = [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


# The record of the decided studies' rounds, written by `pipelines.decide.record` and read as parameters by DVC and
# Kedro: a file of its own, so that no code ever rewrites the params.yaml a person wrote.
RECORD_FILE, RECORD_KEY = "rounds.yaml", "decided"
RECORDED = ("rounds", "evaluation_rounds", "decided_with")  # what a study's entry there holds: its decide fields


def read_params(project: Path = Path()) -> dict:
    """params.yaml and the record of rounds as one mapping, as the stages see them: ``{download, studies, decided:
    {study: {rounds, evaluation_rounds, decided_with}}}``; `ParamsError` as `read_yaml`, and for a record that is
    missing (DVC would stop at dvc.yaml's plan stage, which names it, without saying what the file is) or not one."""
    params = read_yaml(project / "params.yaml") or {}
    record = project / RECORD_FILE
    if not record.is_file():
        raise ParamsError(f"{RECORD_FILE} is missing: it is the record of the decided studies' rounds (layertune repro "
                          "--decide writes it, dvc.yaml's plan stage reads it). Restore it (git checkout "
                          f"{RECORD_FILE}), or write an empty record, '{RECORD_KEY}: {{}}', to decide every study "
                          "again from its grid")
    recorded = read_yaml(record) or {}
    if not isinstance(recorded, Mapping):
        raise ParamsError(f"{RECORD_FILE}: a record of rounds is a mapping with one key, {RECORD_KEY} "
                          f"('{RECORD_KEY}: {{}}' when no study has rounds); got {type(recorded).__name__}")
    return {**params, RECORD_KEY: recorded.get(RECORD_KEY) or {}}


def write_params(project: Path, params: Mapping[str, Any]) -> None:
    """``params`` (as `read_params` reads them) written as params.yaml and the record of rounds, into a benchmark's
    or a test's own project: the tools never write a person's params.yaml."""
    import yaml

    (project / "params.yaml").write_text(yaml.safe_dump({k: v for k, v in params.items() if k != RECORD_KEY},
                                                        sort_keys=False))
    (project / RECORD_FILE).write_text(yaml.safe_dump({RECORD_KEY: params.get(RECORD_KEY) or {}}, sort_keys=False))


def merge_record(params: Mapping[str, Any]) -> dict:
    """``params`` with each study's recorded rounds moved into its ``decide`` section (`layertune.study.DecideSpec`);
    `ParamsError` for rounds written in params.yaml too, or recorded for no study with a decide section."""
    params = dict(params)
    if RECORD_KEY not in params:  # params without a record file (the library's own use): as they are
        return params
    decided = params.pop(RECORD_KEY) or {}
    studies = dict(params.get("studies") or {})
    for name, study in studies.items():
        decide = study.get("decide") if isinstance(study, Mapping) else None
        if isinstance(decide, Mapping) and (written := [key for key in RECORDED if decide.get(key)]):
            raise ParamsError(f"studies.{name}.decide.{written[0]}: rounds are recorded in {RECORD_FILE} ("
                              f"{RECORD_KEY}.{name}), which layertune repro --decide writes; remove "
                              f"{', '.join(written)} from params.yaml")
    for name, entry in decided.items():
        if name not in studies or not isinstance(studies[name].get("decide"), Mapping):
            raise ParamsError(f"{RECORD_KEY}.{name}: a record of rounds, but params.yaml has no study "
                              f"{name!r} with a decide section; remove the entry (or restore the study)")
        unknown = sorted(set(entry or {}) - set(RECORDED))
        if unknown:
            raise ParamsError(f"{RECORD_KEY}.{name}.{unknown[0]}: not part of a record of rounds "
                              f"({', '.join(RECORDED)})")
        studies[name] = {**studies[name], "decide": {**studies[name]["decide"], **(entry or {})}}
    return {**params, "studies": studies}


def check_names(params: Any) -> None:
    """A `ParamsError` naming each study, encoder, task and method name of ``params`` (as read) that `name_problem`
    refuses."""
    studies = params.get("studies") if isinstance(params, Mapping) else None
    if not isinstance(studies, Mapping):
        return
    problems = [f"studies.{name}: {problem}" for name in studies if (problem := name_problem(name))]
    for name, study in studies.items():
        for section, pattern in (("encoders", ENCODER_NAME), ("tasks", NAME), ("methods", NAME)):
            entries = study.get(section) if isinstance(study, Mapping) else None
            problems += [f"studies.{name}.{section}.{entry}: {problem}" for entry in (entries or {})
                         if isinstance(entries, Mapping) and (problem := name_problem(entry, pattern))]
    if problems:
        raise ParamsError("\n  ".join(problems))


class DownloadSection(Spec):
    mirror: str | None = Field(None, description="folder with glue/, imdb/, ner/; $LAYERTUNE_DATA_MIRROR wins; null "
                                                 "and no variable: the Hugging Face hub")
    model_mirror: str | None = Field(None, description="folder of models named as their hub id or its last part, "
                                                       "relative to the project root; every stage resolves models "
                                                       "through it (pipelines.hooks.ModelMirrorHook); "
                                                       "$LAYERTUNE_MODEL_MIRROR wins; a model not there, or null "
                                                       "and no variable: a local folder, a packaged model, the hub")


class StudyParams(Spec):
    """All of ``params.yaml``."""

    download: DownloadSection
    studies: dict[str, StudySpec] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _names(cls, params: Any) -> Any:
        """Study, encoder, task and method names, checked before anything else: an error names the key, not the
        whole mapping."""
        check_names(params)
        return params

    @model_validator(mode="after")
    def _models_fit(self) -> StudyParams:
        """Each study's tunable layers and max_length, against every model it tunes (from the models' configs)."""
        for study_name, study in self.studies.items():
            for encoder in study.encoders:
                for member, single in study.members(encoder):
                    where = f"studies.{study_name}.encoders.{member}"
                    revision = (single if "revision" in single.model_fields_set else study.encoder).revision
                    limit = model_layers(single.model, where=where, revision=revision)
                    require_safe_weights(single.model, where)
                    for index, (name, k) in enumerate(study.grid_settings):
                        key = f"tunable_layers[{index}]" if name is None else f"methods.{name}.tunable_layers"
                        if k != "all" and k > limit:
                            raise ParamsError(
                                f"studies.{study_name}.{key}: {k} is out of range: encoder "
                                f"{member!r} ({single.model}) has {limit} layers, so tunable layers go from 0 to "
                                f"{limit} (or 'all').")
                    longest = model_max_length(single.model, where=where, revision=revision)
                    if study.training.max_length and longest and study.training.max_length > longest:
                        raise ParamsError(
                            f"studies.{study_name}.training.max_length: {study.training.max_length} is longer than "
                            f"encoder {member!r} ({single.model}) takes: at most {longest} tokens (its config's "
                            "max_position_embeddings and its tokenizer's model_max_length).")
            _check_methods(study_name, study)
        return self


def _check_methods(study_name: str, study: StudySpec) -> None:
    """Each tuning method's settings against every model it tunes, on the structure its config builds (no weights):
    a bad one fails here, not in the train stage after other cells trained."""
    checked = set()
    for encoder in study.encoders:
        for method_name, k in study.grid_settings:
            for (member, single), spec in zip(study.members(encoder), study.encoder_specs(encoder, k, method_name)):
                key = _method_key(study, member, method_name)
                if (key, member) in checked:
                    continue
                checked.add((key, member))
                config = model_config(spec.model, where=f"studies.{study_name}.encoders.{member}",
                                      revision=spec.revision)
                try:
                    spec.method.check_model(config, spec.layers, f"encoder {member!r} ({spec.model})")
                except ValueError as error:
                    message = str(error)
                    where = f"{key}.{message.removeprefix('method.')}" if message.startswith("method.") \
                        else f"encoders.{member}: {message}"  # the model itself (its `layers` path, say)
                    raise ParamsError(f"studies.{study_name}.{where}") from None


def _method_key(study: StudySpec, member: str, method_name: str | None) -> str:
    """Where the method of ``member``'s cells is set: the methods axis, the encoder's entry, or the study's
    encoder settings."""
    if method_name is not None:
        return f"methods.{method_name}.method"
    entry = study.encoders[member]
    return f"encoders.{member}.method" if isinstance(entry, EncoderSpec) and "method" in entry.model_fields_set \
        else "encoder.method"


def validate_params(params: Mapping[str, Any], source: str = "params.yaml") -> StudyParams:
    """The whole parameter file (and the record of rounds beside it: `merge_record`), checked; raises `ParamsError`
    naming each bad key by its dotted path."""
    recorded = params.get(RECORD_KEY) if isinstance(params.get(RECORD_KEY), Mapping) else {}
    try:
        params = merge_record(params)
        for name, study in (params.get("studies") or {}).items():
            if isinstance(study, Mapping) and "seed" in (study.get("training") or {}):
                raise ParamsError(f"studies.{name}.training.seed: each cell's seed comes from studies.{name}.seeds; "
                                  "remove this key")
        return StudyParams.model_validate(params)
    except ValidationError as error:  # pydantic's: each error by its dotted path (a validator's ParamsError too)
        lines = describe_validation_error(error, schema=StudyParams)
    except ParamsError as error:
        lines = str(error).split("\n  ")
    termed = [_in_record_terms(line, recorded) for line in lines]
    # Each file a line is about: params.yaml's keys start with studies or download, the record's with decided; a line
    # that weighs one against the other (a tolerance changed since the rounds were decided) is about both.
    files = [name for name, named in (
        (source, any(not line.startswith(f"{RECORD_KEY}.") for line in termed)),
        (RECORD_FILE, any(line.startswith(f"{RECORD_KEY}.") or line != before for line, before in zip(termed, lines))),
    ) if named]
    lines = termed
    raise ParamsError(f"{' and '.join(files)} {'is' if len(files) == 1 else 'are'} invalid:\n  " + "\n  ".join(lines))


def _in_record_terms(line: str, recorded: Collection[str]) -> str:
    """A line of the check in the record of rounds' own terms where it speaks of a study's recorded rounds: the
    check sees them in the study's ``decide`` section (`merge_record` put them there), the person wrote none there,
    and finds them in rounds.yaml as ``decided.<study>.rounds`` (and ``evaluation_rounds``, ``decided_with``)."""
    study = next((name for name in recorded if re.match(rf"studies\.{re.escape(str(name))}(\.|: )", line)), None)
    if study is None:
        return line
    fields = "|".join(RECORDED)
    line = re.sub(rf"^studies\.{re.escape(str(study))}(?:\.|: )decide\.({fields})\b", rf"{RECORD_KEY}.{study}.\1",
                  line)
    line = re.sub(r"clear decide\.rounds(?:, decide\.evaluation_rounds and decide\.decided_with| and "
                  r"decide\.evaluation_rounds)", f"remove {RECORD_KEY}.{study} from {RECORD_FILE}", line)
    return re.sub(rf"\bdecide\.({fields})\b", rf"{RECORD_FILE}'s {RECORD_KEY}.{study}.\1", line)


