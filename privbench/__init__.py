"""privbench: a benchmark platform for privacy-preserving Transformers (the top layer: command line, flow
runner and supervisor, micro-benchmarks, deployments).

Importing the package imports ``pbconfig``, which sets offline, telemetry-free defaults for Prefect and MLflow
before either is imported (a user's own environment variables win).
"""

from __future__ import annotations

from pbconfig import __version__

__all__ = ["__version__"]
