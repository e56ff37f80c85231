from kedro.pipeline import Pipeline, node

from pipelines.evaluate.nodes import evaluate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(evaluate, ["cell_model", "prepared_corpora", "params:cell", "params:tokenize", "params:evaluate"],
             ["cell_predictions", "cell_evaluation"], name="evaluate_cell"),
    ])
