from kedro.pipeline import Pipeline, node

from pipelines.aggregate.nodes import collect_results, draw, tabulate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(collect_results, ["cell_evaluations", "cell_trainings", "params:study"], "results",
             name="collect_results"),
        node(tabulate, ["results", "params:study", "params:aggregate"],
             ["ablation_table", "ablation_markdown", "report_metrics", "timings", "plot_data"], name="tabulate"),
        node(draw, ["results", "cell_trainings", "cell_histories", "cell_drifts"], "figures", name="draw"),
    ])
