"""Offline, telemetry-free defaults for Prefect and MLflow, set when this module is imported (a user's own
environment variables win).

``pbconfig`` imports it, and every package of ours that imports prefect or mlflow (``storage``, ``tasks``,
``flows``, ``privbench``) imports ``pbconfig`` from its ``__init__``, so the defaults are in place before
either library reads its settings.
"""

from __future__ import annotations

import os

OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # the ephemeral Prefect API cold-starts in ~12 s; give slow, shared CI machines room
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "GIT_PYTHON_REFRESH": "quiet",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_offline_defaults() -> None:
    """``os.environ.setdefault`` for each of ``OFFLINE_DEFAULTS``."""
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)


apply_offline_defaults()
