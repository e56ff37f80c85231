"""One pipeline per DVC stage. ``plan`` reads params.yaml; ``download`` every task; the others act on one study
(``--params study=<name>``) and ``train`` on one cell of it (``--params study=<name>,cell=<key>``)."""

from kedro.pipeline import Pipeline

from pipelines import aggregate, download, evaluate, plan, prepare, tokenize, train

STAGES = {"plan": plan, "download": download, "prepare": prepare, "tokenize": tokenize, "train": train,
          "evaluate": evaluate, "aggregate": aggregate}


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = {name: module.create_pipeline() for name, module in STAGES.items()}
    pipelines["__default__"] = pipelines["plan"] + pipelines["download"]
    return pipelines
