"""Kedro settings: parameters come from the root ``params.yaml``, the file DVC reads."""

from kedro.config import OmegaConfigLoader

from pipelines.hooks import ModelMirrorHook
from pipelines.param_checks import ParamsCheckHook
from pipelines.params import RECORD_FILE

HOOKS = (ModelMirrorHook(), ParamsCheckHook())

CONFIG_LOADER_CLASS = OmegaConfigLoader
# Paths are relative to conf/<env>/: the root params.yaml (conf/ holds none) and the record of rounds beside it.
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {"parameters": ["parameters*", "parameters*/**", "**/parameters*", "../../params.yaml",
                                       f"../../{RECORD_FILE}"]},
}
