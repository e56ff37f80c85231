"""download: each built-in task's official splits (from the data mirror or the Hugging Face hub) and each hub
dataset's splits at its pinned commit, as they come; local files are read where they are, by prepare."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported as the node runs: see pipelines/evaluate/nodes.py
    import datasets

    from pipelines.plans import DownloadPlan


def download_corpora(plan: DownloadPlan) -> dict[str, dict[str, datasets.Dataset]]:
    from layertune.corpora import load_corpus, resolve_data_mirror

    mirror = resolve_data_mirror(plan.mirror)
    downloaded = {task: load_corpus(task, data_mirror=mirror).splits() for task in plan.tasks}
    return downloaded | {folder: dataset.fetch() for folder, dataset in plan.hub.items()}
