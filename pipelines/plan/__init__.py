from pipelines.plan.pipeline import create_pipeline

__all__ = ["create_pipeline"]
