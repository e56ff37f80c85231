from kedro.pipeline import Pipeline, node

from pipelines.hooks import MLFLOW_TAG
from pipelines.train.nodes import train


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(train, ["prepared_corpora", "feature_cache", "params:cell", "params:train", "params:tokenize"],
             ["cell_model", "cell_metrics", "cell_history", "cell_drift"], name="train_cell", tags=[MLFLOW_TAG]),
    ])
