"""download: check params.yaml, then fetch each task's official splits from the data mirror or the hub."""

from layertune.corpora import load_corpus
from layertune.corpus import Corpus
from layertune.study import data_mirror, validate_params


def download_corpora(parameters: dict) -> dict[str, Corpus]:
    """All of params.yaml is validated here, in the first stage, so a typo fails before any work."""
    params = validate_params(parameters)
    mirror = data_mirror(params.download)
    return {task: load_corpus(task, data_mirror=mirror) for task in params.study.tasks}
