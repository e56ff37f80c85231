"""download: each task's official splits, from the data mirror or the Hugging Face hub."""

from layertune.corpora import load_corpus, resolve_data_mirror
from layertune.corpus import Corpus
from pipelines.plans import DownloadPlan


def download_corpora(plan: DownloadPlan) -> dict[str, Corpus]:
    mirror = resolve_data_mirror(plan.mirror)
    return {task: load_corpus(task, data_mirror=mirror) for task in plan.tasks}
