"""Streamlit dashboard over the results store (reads through ``storage``). Not built yet: see the
operations issue (deployments, dashboard, MLflow comparison views)."""
