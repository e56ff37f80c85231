"""One pipeline per DVC stage; ``__default__`` runs them all in order (the ``cell`` section picks the cell)."""

from kedro.pipeline import Pipeline

from pipelines import aggregate, download, evaluate, prepare, tokenize, train

STAGES = {"download": download, "prepare": prepare, "tokenize": tokenize, "train": train, "evaluate": evaluate,
          "aggregate": aggregate}


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = {name: module.create_pipeline() for name, module in STAGES.items()}
    pipelines["__default__"] = sum(pipelines.values(), Pipeline([]))
    return pipelines
