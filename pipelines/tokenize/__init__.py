from pipelines.tokenize.pipeline import create_pipeline

__all__ = ["create_pipeline"]
