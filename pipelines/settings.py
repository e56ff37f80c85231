"""Kedro settings: parameters come from the root ``params.yaml`` (the file DVC reads); hooks check it before the plan
stage runs (a bad value is one message, no traceback) and find models through its model mirror."""

from kedro.config import OmegaConfigLoader

from pipelines.hooks import ModelMirrorHook
from pipelines.param_checks import ParamsCheckHook
from pipelines.params import RECORD_FILE

HOOKS = (ModelMirrorHook(), ParamsCheckHook())

CONFIG_LOADER_CLASS = OmegaConfigLoader
# Paths are relative to conf/<env>/. The root params.yaml is the parameter file (conf/ holds none), with the record of
# the decided studies' rounds beside it; only the plan stage reads them, and every later stage reads the plan.
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {"parameters": ["parameters*", "parameters*/**", "**/parameters*", "../../params.yaml",
                                       f"../../{RECORD_FILE}"]},
}
