from kedro.pipeline import Pipeline, node

from pipelines.evaluate.nodes import evaluate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(evaluate, ["study_plan", "study_cells", "prepared_corpora"], "cell_scores",
                          name="score_cells")])
