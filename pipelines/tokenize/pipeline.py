from kedro.pipeline import Pipeline, node

from pipelines.tokenize.nodes import build_feature_caches


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(build_feature_caches, ["prepared_corpora", "feature_plan", "feature_cache"],
                          "feature_manifests", name="build_feature_caches")])
