from pipelines.multi_encoder.pipeline import create_pipeline

__all__ = ["create_pipeline"]
