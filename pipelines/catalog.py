"""The catalog's paths where no Kedro session runs (`layertune repro`, its ``--decide`` rounds, ``python -m
pipelines.tracking sync``): conf/base/catalog.yml read by Kedro's own config loader with the project's settings, as
a stage reads it, so that every path is written in the catalog alone."""

from __future__ import annotations

from pathlib import Path


def catalog_path(entry: str, study: str | None = None, project: Path = Path(), key: str | None = None) -> Path:
    """Where the catalog's dataset ``entry`` lies for ``study`` (its ``${_study}``), under ``project``: its
    ``path`` or ``filepath``, or another of its paths (``key``: the ``retired`` folder of ``study_cells``)."""
    from kedro.config import OmegaConfigLoader

    from pipelines.settings import CONFIG_LOADER_ARGS

    loader = OmegaConfigLoader(conf_source=str(project / "conf"), **CONFIG_LOADER_ARGS,
                               runtime_params={"study": study} if study is not None else {})
    dataset = loader["catalog"][entry]
    return project / dataset[key or ("path" if "path" in dataset else "filepath")]
