"""The one tag under which a run records where its secrets came from (permutations, shares, secure-mode DP noise).

A run records *how* its secrets were drawn (e.g. ``secrets.SystemRandom (OS CSPRNG), fresh per run, never
recorded``), under :data:`SECRET_SOURCE_TAG`, and never a secret itself; every stage that draws secrets tags its runs
with this one name, so a reader (or a test) finds them all with one query.
"""

from __future__ import annotations

SECRET_SOURCE_TAG = "privbench.secret_source"

__all__ = ["SECRET_SOURCE_TAG"]
