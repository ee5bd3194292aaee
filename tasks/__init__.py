"""Prefect tasks: thin wrappers, one logical step or side effect each. Pure logic lives in ``core``;
the store and MLflow in ``storage``. Each task's logic is a plain function callable through ``task.fn``."""

import pbconfig  # noqa: F401  - sets offline Prefect/MLflow defaults before prefect is imported
