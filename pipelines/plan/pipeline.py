from kedro.pipeline import Pipeline, node

from pipelines.plan.nodes import code_fingerprints, plan_files


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        node(plan_files, "plan", ["download_plan", "study_plans", "prepare_plans", "feature_plans", "train_plans"],
             name="plan_files"),
        node(code_fingerprints, None, "code_fingerprints", name="code_fingerprints"),
    ])
