"""The one factory of the Prefect task runners the parallel stages (train-dp, tangent, attacks) run on."""

from __future__ import annotations

from typing import Any

from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from core.errors import ConfigError
from pbconfig.tangent import TaskRunner


def task_runner(
    workers: int,
    kind: TaskRunner = "process",
    *,
    dask_address: str | None = None,
    threads_per_worker: int = 1,
) -> Any:
    """The task runner of ``workers`` parallel tasks.

    ``process``: a process pool (true parallelism on one machine, per-process RNG seeding); ``thread``: a thread
    pool; ``dask``: the Dask cluster at ``dask_address`` (several machines), or a local cluster of ``workers``
    processes with ``threads_per_worker`` threads each when there is none.

    ``PRIVBENCH_DASK_ADDRESS`` applies where the caller does not say otherwise: ``process`` and ``dask`` without
    a ``dask_address`` run on that cluster; ``thread`` and an explicit ``dask_address`` win over it.
    """
    from pbconfig.settings import get_settings

    if kind == "thread":
        return ThreadPoolTaskRunner(max_workers=workers)
    env_address = get_settings().dask_address
    if kind == "process" and not env_address:
        return ProcessPoolTaskRunner(max_workers=workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as exc:  # pragma: no cover - prefect-dask is a dependency
        raise ConfigError("the Dask task runner needs prefect-dask; pip install prefect-dask") from exc
    address = dask_address or env_address
    if address:
        return DaskTaskRunner(address=address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": workers,
            "threads_per_worker": threads_per_worker,
            "processes": True,
            "dashboard_address": None,
        }
    )
