"""The Kedro hook of every stage: params.yaml read safely, then models resolved through the model mirror it names."""

from __future__ import annotations

import os
from pathlib import Path

from kedro.framework.hooks import hook_impl

from layertune.model_paths import MODEL_MIRROR_ENV
from layertune.study import ParamsError
from pipelines.param_checks import InvalidParams
from pipelines.params import read_params


class ModelMirrorHook:
    """Sets ``$LAYERTUNE_MODEL_MIRROR``, which the library reads, to params.yaml's ``download.model_mirror`` unless
    the environment set it, as the Kedro context is created (before any check or node loads a model): every stage
    finds the same model files however it was started (`make study`, `dvc repro`, `dvc exp run`, `kedro run`)."""

    def __init__(self) -> None:
        self.mirror: str | None = None  # what this hook set, so that a later run in this process may set it again

    @hook_impl
    def after_context_created(self, context) -> None:
        # read safely first: a file of nested aliases is one error line here, where Kedro's loader would hang
        try:
            read_params(Path(context.project_path))
        except ParamsError as error:
            raise InvalidParams(str(error)) from None
        download = context.config_loader["parameters"].get("download")
        self.apply(download.get("model_mirror") if isinstance(download, dict) else None, context.project_path)

    def apply(self, configured: object, project: str | os.PathLike) -> None:
        """Set the variable to ``configured`` (relative to ``project``) unless the environment set it itself."""
        current = os.environ.get(MODEL_MIRROR_ENV)
        if current and current != self.mirror:  # the environment's own: it wins
            return
        if not isinstance(configured, str) or not configured:  # null, or a bad value the plan's check reports
            if current:
                del os.environ[MODEL_MIRROR_ENV]
            self.mirror = None
            return
        # relative to the project folder, as `dvc repro` and `kedro run` from any folder of it agree
        path = Path(project) / Path(configured).expanduser()  # an absolute path stays as it is
        if not path.is_dir():
            raise InvalidParams(f"download.model_mirror: {configured!r} is not a folder ({path} is missing); "
                                f"point it at a folder of models, set ${MODEL_MIRROR_ENV}, or set it to null")
        self.mirror = os.environ[MODEL_MIRROR_ENV] = str(path.resolve())
