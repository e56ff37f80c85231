from kedro.pipeline import Pipeline, node

from pipelines.train.nodes import train_cells


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(train_cells, ["train_plan", "prepared_corpora", "feature_cache", "study_cells"], None,
                          name="train_cells")])
