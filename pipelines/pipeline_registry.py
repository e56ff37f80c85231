"""One pipeline per DVC stage; ``__default__`` runs the layer-ablation stages in order (``cell`` picks the cell).

The NER and the single-vs-multi-encoder studies are pipelines of their own, outside ``__default__``."""

from kedro.pipeline import Pipeline

from pipelines import aggregate, download, evaluate, multi_encoder, ner, prepare, tokenize, train

STAGES = {"download": download, "prepare": prepare, "tokenize": tokenize, "train": train, "evaluate": evaluate,
          "aggregate": aggregate}


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = {name: module.create_pipeline() for name, module in STAGES.items()}
    pipelines["__default__"] = sum(pipelines.values(), Pipeline([]))
    pipelines["ner"] = ner.create_pipeline()
    pipelines["multi_encoder"] = multi_encoder.create_pipeline()
    return pipelines
