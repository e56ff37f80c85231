"""prepare: the seeded subsample of each task that one study trains and evaluates on."""

from layertune.corpus import Corpus
from pipelines.plans import PreparePlan


def prepare_corpora(downloaded: dict[str, dict[str, str]], plan: PreparePlan) -> dict[str, Corpus]:
    """Each task's `CorpusSpec` loaded from its downloaded files (built-in tasks, hub datasets) or from the user's
    own files."""
    missing = [folder for folder in plan.downloaded.values() if folder is not None and folder not in downloaded]
    if missing:
        raise ValueError(f"No downloaded data for {', '.join(missing)}: run the download stage first.")
    return {task: corpus.load(files=downloaded[plan.downloaded[task]] if plan.downloaded[task] else None)
            for task, corpus in plan.corpora.items()}
