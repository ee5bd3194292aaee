"""Streamlit dashboard over the results store: ``app.py`` (the page, reads through ``storage.views``) and
``plots.py`` (Plotly figure builders). Start it with ``privbench dashboard``."""
