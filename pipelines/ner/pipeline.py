from kedro.pipeline import Pipeline, node

from pipelines.ner.nodes import ner_baselines, ner_report, train_ner_cells


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(train_ner_cells, ["params:ner", "params:download", "ner_feature_cache"],
             ["ner_history", "ner_summary", "ner_drift"], name="ner_train_cells"),
        node(ner_baselines, ["params:ner", "params:download"], "ner_baselines", name="ner_baselines"),
        node(ner_report, ["ner_summary", "ner_history", "ner_drift", "ner_baselines", "params:ner"],
             ["ner_report", "ner_figures"], name="ner_report"),
    ])
