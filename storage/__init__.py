"""The results store (SQLAlchemy + Alembic) and the MLflow adapter; the one recording API every task uses."""

import pbconfig  # noqa: F401  - sets offline Prefect/MLflow defaults before mlflow is imported
