"""Micro-benchmarks (``privbench bench NAME``): ratios measured side by side in one run, plus absolutes.

Public API: ``BENCHMARKS`` (name -> :class:`BenchmarkSpec` with ``.description``) and
:func:`run_benchmark` (run one, store it as a run in the results store and MLflow, return its JSON);
the machinery (``interleave``, ``run_in_fresh_process``, ``machine_info``, ``register``) is in
:mod:`privbench.bench.harness`. Benchmarks: :mod:`privbench.bench.dp_clipping` (``dp-clipping``),
:mod:`privbench.bench.tangent` (``tangent``), :mod:`privbench.bench.mpc_generation` (``mpc-generation``),
:mod:`privbench.bench.stip` (``stip``), :mod:`privbench.bench.recbole_sasrec` (``recbole-sasrec``, the peer check).
"""

from __future__ import annotations

from privbench.bench import dp_clipping as _dp_clipping  # noqa: F401  - registers "dp-clipping"
from privbench.bench import mpc_generation as _mpc_generation  # noqa: F401  - registers "mpc-generation"
from privbench.bench import recbole_sasrec as _recbole_sasrec  # noqa: F401  - registers "recbole-sasrec"
from privbench.bench import stip as _stip  # noqa: F401  - registers "stip"
from privbench.bench import tangent as _tangent  # noqa: F401  - registers "tangent"
from privbench.bench.harness import (
    BENCHMARKS,
    BenchmarkError,
    BenchmarkSpec,
    Interleaved,
    interleave,
    machine_info,
    register,
    run_benchmark,
    run_in_fresh_process,
)

__all__ = [
    "BENCHMARKS",
    "BenchmarkError",
    "BenchmarkSpec",
    "Interleaved",
    "interleave",
    "machine_info",
    "register",
    "run_benchmark",
    "run_in_fresh_process",
]
