from kedro.pipeline import Pipeline, node

from pipelines.multi_encoder.nodes import multi_encoder_report, run_multi_encoder_study


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(run_multi_encoder_study, ["params:multi_encoder", "params:download", "multi_encoder_cache"],
             "multi_encoder_results", name="multi_encoder_cells"),
        node(multi_encoder_report, "multi_encoder_results", ["multi_encoder_report", "multi_encoder_metrics"],
             name="multi_encoder_report"),
    ])
