"""prepare: the seeded subsample of each task that one study trains and evaluates on."""

from collections.abc import Callable

from layertune.corpus import Corpus
from layertune.stages import prepare_corpus
from layertune.study import PreparePlan


def prepare_corpora(raw: dict[str, Callable[..., Corpus]], plan: PreparePlan) -> dict[str, Corpus]:
    missing = [task for task in plan.tasks if task not in raw]
    if missing:
        raise ValueError(f"No raw splits for {', '.join(missing)}: run the download stage first.")
    return {task: prepare_corpus(raw[task], plan.data) for task in plan.tasks}
