"""Where privbench keeps its state, resolved from the environment at call time.

| variable                   | default                                                              |
|----------------------------|----------------------------------------------------------------------|
| ``PRIVBENCH_HOME``         | ``./.privbench``                                                     |
| ``PRIVBENCH_DB_URL``       | ``sqlite:///<home>/results.db``                                      |
| ``MLFLOW_TRACKING_URI``    | ``sqlite:///<home>/mlflow.db``                                       |
| artifacts                  | ``<home>/mlartifacts``                                               |
| prepared data              | ``<home>/data``                                                      |
| ``PREFECT_API_URL``        | unset: Prefect's ephemeral in-process API                            |
| ``PRIVBENCH_DASK_ADDRESS`` | unset: local process pools; ``tcp://host:8786``: that Dask scheduler |

``PRIVBENCH_DASK_ADDRESS`` switches the task runners of the train-dp, tangent and attacks flows to
``prefect_dask.DaskTaskRunner(address=...)``. Tasks then run in the Dask workers' processes and record
through *their* environment: give every Dask worker the same ``PRIVBENCH_DB_URL``, ``MLFLOW_TRACKING_URI``
and ``PRIVBENCH_HOME`` (on storage shared at the same path) as the process that starts the flow.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from core.errors import ConfigError

DASK_ENV = "PRIVBENCH_DASK_ADDRESS"
# the comm protocols of dask.distributed; an address without a scheme means tcp
DASK_SCHEMES = ("tcp", "tls", "ucx", "inproc", "ws", "wss")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


@dataclass(frozen=True, kw_only=True)
class Settings:
    home: Path
    db_url: str
    tracking_uri: str
    artifact_root: Path
    data_dir: Path
    prefect_api_url: str | None
    dask_address: str | None = None

    @property
    def tracking_is_default(self) -> bool:
        return "MLFLOW_TRACKING_URI" not in os.environ


def parse_dask_address(value: str | None) -> str | None:
    """``None`` for an unset or blank value, else the stripped scheduler address.

    Raises ``ConfigError`` naming the value when it cannot be a Dask scheduler address."""
    if value is None or not value.strip():
        return None
    address = value.strip()
    fix = f"set {DASK_ENV} to the scheduler's address, e.g. tcp://scheduler-host:8786, or unset it"
    if any(c.isspace() for c in address):
        raise ConfigError(f"{DASK_ENV}={value!r} contains whitespace; {fix}")
    match = _SCHEME.match(address)
    if match:
        scheme, rest = match.group(1).lower(), match.group(2)
        if scheme not in DASK_SCHEMES:
            raise ConfigError(
                f"{DASK_ENV}={value!r} uses the scheme {scheme!r}, which Dask does not speak "
                f"(one of {', '.join(DASK_SCHEMES)}); {fix}"
            )
        if not rest or rest.startswith(":"):
            raise ConfigError(f"{DASK_ENV}={value!r} names no host; {fix}")
    elif address.startswith(":") or "/" in address:
        raise ConfigError(f"{DASK_ENV}={value!r} is not a host:port address; {fix}")
    return address


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
        dask_address=parse_dask_address(os.environ.get(DASK_ENV)),
    )
