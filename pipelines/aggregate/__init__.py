from pipelines.aggregate.pipeline import create_pipeline

__all__ = ["create_pipeline"]
