from kedro.pipeline import Pipeline, node

from pipelines.prepare.nodes import prepare_corpora


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(prepare_corpora, ["raw_corpora", "prepare_plan"], "prepared_corpora",
                          name="prepare_corpora")])
