from kedro.pipeline import Pipeline, node

from pipelines.plan.nodes import code_fingerprints, plan_studies


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(plan_studies, "parameters",
             ["download_plan", "study_plans", "prepare_plans", "feature_plans", "cell_plans"], name="plan_studies"),
        node(code_fingerprints, None, "code_fingerprints", name="code_fingerprints"),
    ])
