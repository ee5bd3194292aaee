"""Prefect flows: they only sequence tasks. One flow per stage plus ``benchmark``, the whole chain."""

import pbconfig  # noqa: F401  - sets offline Prefect/MLflow defaults before prefect is imported
