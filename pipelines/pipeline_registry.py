"""One pipeline per DVC stage (`pipelines.STAGES`); those after ``download`` act on one study (``--params
study=<name>``)."""

import importlib

from kedro.pipeline import Pipeline

from pipelines import STAGES


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = {name: importlib.import_module(f"pipelines.{name}").create_pipeline() for name in STAGES}
    pipelines["__default__"] = pipelines["plan"] + pipelines["download"]
    return pipelines
