"""Kedro settings: parameters come from the root ``params.yaml`` (the file DVC reads), hooks validate them and
track train cells in MLflow."""

from kedro.config import OmegaConfigLoader

from pipelines.hooks import MlflowCellHook, ValidateParamsHook

HOOKS = (ValidateParamsHook(), MlflowCellHook())

CONFIG_LOADER_CLASS = OmegaConfigLoader
# Paths are relative to conf/<env>/. The root params.yaml is the only parameter file (conf/ holds none), and is
# also read as globals so that catalog paths can default to its `cell` section.
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {
        "parameters": ["parameters*", "parameters*/**", "**/parameters*", "../../params.yaml"],
        "globals": ["globals.yml", "../../params.yaml"],
    },
}
