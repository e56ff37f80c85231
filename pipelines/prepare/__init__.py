from pipelines.prepare.pipeline import create_pipeline

__all__ = ["create_pipeline"]
