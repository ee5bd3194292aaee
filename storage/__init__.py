"""The results store (SQLAlchemy + Alembic) and the MLflow adapter; the one recording API every task uses."""
