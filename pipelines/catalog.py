"""The catalog's paths where no Kedro session runs (`layertune repro`, ``python -m pipelines.tracking sync``), read
as a stage reads them, so that every path is written in the catalog alone."""

from __future__ import annotations

from pathlib import Path


def catalog_entries(study: str | None = None, project: Path = Path()) -> dict[str, dict]:
    """The catalog's datasets as configured (``{name: {type, path, …}}``), its ``${_study}`` filled with ``study``."""
    from kedro.config import OmegaConfigLoader

    from pipelines.settings import CONFIG_LOADER_ARGS

    loader = OmegaConfigLoader(conf_source=str(project / "conf"), **CONFIG_LOADER_ARGS,
                               runtime_params={"study": study} if study is not None else {})
    return {name: entry for name, entry in loader["catalog"].items() if not name.startswith("_")}


def catalog_path(entry: str, study: str | None = None, project: Path = Path(), key: str | None = None) -> Path:
    """Where the catalog's dataset ``entry`` lies for ``study``, under ``project``: its ``path`` or ``filepath``, or
    its ``key`` (the ``retired`` folder of ``study_cells``)."""
    dataset = catalog_entries(study, project)[entry]
    return project / dataset[key or ("path" if "path" in dataset else "filepath")]
