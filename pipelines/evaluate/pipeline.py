from kedro.pipeline import Pipeline, node

from pipelines.evaluate.nodes import evaluate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(evaluate, ["task_models", "task_trainings", "prepared_corpora", "params:cell", "params:study",
                        "params:tokenize", "params:evaluate"],
             ["task_predictions", "task_evaluations"], name="evaluate_cells"),
    ])
