from kedro.pipeline import Pipeline, node

from pipelines.aggregate.nodes import report


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([node(report, ["study_plan", "cell_scores", "study_cells", "prepared_corpora",
                                  "evaluation_predictions", "study_references"],
                          ["report_markdown", "report_metrics", "report_details", "report_tables", "report_figures",
                           "plot_scores", "plot_losses"],
                          name="report")])
