from kedro.pipeline import Pipeline, node

from pipelines.download.nodes import download_corpora


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(download_corpora, "download_plan", "raw_corpora", name="download_corpora")])
