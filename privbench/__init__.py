"""privbench: a benchmark platform for privacy-preserving Transformers.

Importing the package sets offline, telemetry-free defaults for Prefect and MLflow before either is
imported (a user's own environment variables win).
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

_OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # the ephemeral Prefect API cold-starts in ~12 s; give slow, shared CI machines room
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "GIT_PYTHON_REFRESH": "quiet",
    "TOKENIZERS_PARALLELISM": "false",
}
for _key, _value in _OFFLINE_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
