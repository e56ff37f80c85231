"""Kedro settings: parameters come from the root ``params.yaml`` (the file DVC reads); hooks check it before the plan
stage runs (a bad value is one message, no traceback), find models through its model mirror, and tie each stage
to the `dvc repro` that runs it."""

from kedro.config import OmegaConfigLoader

from pipelines.hooks import ModelMirrorHook, ParamsFileHook, StageProcessHook
from pipelines.param_checks import ParamsCheckHook

HOOKS = (ModelMirrorHook(), StageProcessHook(), ParamsCheckHook(), ParamsFileHook())  # the last runs first

CONFIG_LOADER_CLASS = OmegaConfigLoader
# Paths are relative to conf/<env>/. The root params.yaml is the only parameter file (conf/ holds none); only the
# plan stage reads it, and every later stage reads the plan.
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {"parameters": ["parameters*", "parameters*/**", "**/parameters*", "../../params.yaml"]},
}
