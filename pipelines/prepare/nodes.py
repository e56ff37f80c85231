"""prepare: the seeded subsample of each task that the study trains and evaluates on."""

from collections.abc import Callable

from layertune.corpus import Corpus
from layertune.study import prepare_corpus, section


def prepare_corpora(raw: dict[str, Callable[..., Corpus]], study: dict, prepare: dict) -> dict[str, Corpus]:
    tasks, options = section("study", study).tasks, section("prepare", prepare)
    missing = [task for task in tasks if task not in raw]
    if missing:
        raise ValueError(f"No raw splits for {', '.join(missing)}: run the download stage first.")
    return {task: prepare_corpus(raw[task], options) for task in tasks}
