from kedro.pipeline import Pipeline, node

from pipelines.evaluate.nodes import evaluate, reference_scores, score_evaluation_examples


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(evaluate, ["study_plan", "study_cells", "prepared_corpora"], "cell_scores", name="score_cells"),
        node(reference_scores, ["study_plan", "prepared_corpora", "feature_cache"], "study_references",
             name="score_references"),
        node(score_evaluation_examples, ["study_plan", "study_cells", "prepared_corpora", "raw_corpora",
                                         "prepare_plan", "feature_cache"], "evaluation_predictions",
             name="score_evaluation_examples"),
    ])
