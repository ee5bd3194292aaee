"""privbench's science: pure PyTorch (and NumPy) math.

Nothing here imports prefect, mlflow, sqlalchemy or another privbench package; a test enforces it.
"""
