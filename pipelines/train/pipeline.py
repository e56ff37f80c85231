from kedro.pipeline import Pipeline, node

from pipelines.hooks import MLFLOW_TAG
from pipelines.train.nodes import train


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(train, ["cell_plan", "prepared_corpora", "feature_cache"], "trained_cell",
                          name="train_cell", tags=[MLFLOW_TAG])])
