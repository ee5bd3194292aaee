"""Where privbench keeps its state, resolved from the environment at call time.

| variable              | default                                   |
|-----------------------|-------------------------------------------|
| ``PRIVBENCH_HOME``    | ``./.privbench``                           |
| ``PRIVBENCH_DB_URL``  | ``sqlite:///<home>/results.db``           |
| ``MLFLOW_TRACKING_URI`` | ``sqlite:///<home>/mlflow.db``          |
| artifacts             | ``<home>/mlartifacts``                    |
| prepared data         | ``<home>/data``                           |
| ``PREFECT_API_URL``   | unset: Prefect's ephemeral in-process API |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Settings:
    home: Path
    db_url: str
    tracking_uri: str
    artifact_root: Path
    data_dir: Path
    prefect_api_url: str | None

    @property
    def tracking_is_default(self) -> bool:
        return "MLFLOW_TRACKING_URI" not in os.environ


def get_settings() -> Settings:
    """Read the environment now (not at import), so tests and users can redirect everything."""
    home = Path(os.environ.get("PRIVBENCH_HOME", ".privbench")).expanduser().absolute()
    return Settings(
        home=home,
        db_url=os.environ.get("PRIVBENCH_DB_URL") or f"sqlite:///{home / 'results.db'}",
        tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow.db'}",
        artifact_root=home / "mlartifacts",
        data_dir=home / "data",
        prefect_api_url=os.environ.get("PREFECT_API_URL") or None,
    )
