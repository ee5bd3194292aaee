"""The Dask fan-out: ``PRIVBENCH_DASK_ADDRESS`` switches the runner factories of train-dp, tangent and attacks
to ``DaskTaskRunner(address=...)``, and a train-dp grid really executes on the workers of a running Dask
cluster (two worker processes started here) while every grid point's run row ends ``finished``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from core.errors import ConfigError
from flows.attacks import attacks_runner
from flows.tangent import tangent_runner
from flows.train_dp import train_dp_flow, train_dp_runner
from pbconfig.benchmark import BenchmarkConfig, load_config, validate
from pbconfig.settings import DASK_ENV, get_settings
from pbconfig.tangent import TangentConfig
from storage.repository import ResultsRepository
from tests.flows.test_train_dp_flow import TINY  # the tiny grid: four grid points

ADDRESS = "tcp://scheduler.example:8786"


@pytest.fixture(scope="module")
def quick() -> BenchmarkConfig:
    cfg = load_config("quick")
    assert cfg.train_dp is not None and cfg.tangent is not None and cfg.attacks is not None
    return cfg


def _tangent(quick: BenchmarkConfig, **changes: object) -> TangentConfig:
    assert quick.tangent is not None
    return validate(TangentConfig, quick.tangent.model_dump(mode="json") | changes, origin="test")


def test_without_the_env_var_the_factories_keep_their_local_runners(
    quick: BenchmarkConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DASK_ENV, raising=False)
    assert quick.train_dp is not None and quick.attacks is not None
    assert get_settings().dask_address is None
    for runner, workers in (
        (train_dp_runner(quick.train_dp), quick.train_dp.workers),
        (attacks_runner(quick.attacks), quick.attacks.workers),
        (tangent_runner(_tangent(quick, task_runner="process")), quick.tangent.workers),
    ):
        assert type(runner) is ProcessPoolTaskRunner
        assert runner._max_workers == workers
    assert type(tangent_runner(_tangent(quick, task_runner="thread"))) is ThreadPoolTaskRunner
    local = tangent_runner(_tangent(quick, task_runner="dask"))
    assert isinstance(local, DaskTaskRunner) and local.address is None  # a local cluster, as before


def test_with_the_env_var_every_factory_returns_a_dask_runner_at_that_address(
    quick: BenchmarkConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DASK_ENV, f"  {ADDRESS} ")
    assert quick.train_dp is not None and quick.attacks is not None
    assert get_settings().dask_address == ADDRESS
    runners = {
        "train-dp": train_dp_runner(quick.train_dp),
        "attacks": attacks_runner(quick.attacks),
        "tangent (process, the default)": tangent_runner(_tangent(quick, task_runner="process")),
        "tangent (dask, no address)": tangent_runner(_tangent(quick, task_runner="dask")),
    }
    for name, runner in runners.items():
        assert isinstance(runner, DaskTaskRunner), name
        assert runner.address == ADDRESS, name


def test_the_tangent_config_wins_over_the_env_var(quick: BenchmarkConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DASK_ENV, ADDRESS)
    own = tangent_runner(_tangent(quick, task_runner="dask", dask_address="tcp://own-cluster:8786"))
    assert isinstance(own, DaskTaskRunner) and own.address == "tcp://own-cluster:8786"
    assert type(tangent_runner(_tangent(quick, task_runner="thread"))) is ThreadPoolTaskRunner


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_env_var_means_unset(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DASK_ENV, value)
    assert get_settings().dask_address is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("http://scheduler:8786", "scheme 'http'"),
        ("tcp://", "names no host"),
        ("tcp://a b:8786", "whitespace"),
        (":8786", "not a host:port"),
    ],
)
def test_a_bad_env_var_is_refused_naming_the_value_and_the_fix(
    value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DASK_ENV, value)
    with pytest.raises(ConfigError, match=message) as err:
        get_settings()
    assert repr(value) in str(err.value) and "tcp://scheduler-host:8786" in str(err.value)


@pytest.fixture
def dask_cluster(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A real two-process Dask cluster, started after ``home`` so its workers inherit the test's store and
    tracking URLs (as remote workers must be given them), exported as PRIVBENCH_DASK_ADDRESS."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    client = Client(cluster)
    monkeypatch.setenv(DASK_ENV, cluster.scheduler_address)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


@pytest.mark.system
@pytest.mark.usefixtures("prefect_harness")
def test_train_dp_grid_runs_on_the_dask_workers_and_records_every_point(dask_cluster: object) -> None:
    from distributed import Client

    client = dask_cluster
    assert isinstance(client, Client) and TINY.train_dp is not None

    def executed() -> dict[str, int]:
        return client.run(lambda dask_worker: dask_worker.state.executed_count)

    before = executed()
    assert len(before) == 2, f"expected the two workers of the local cluster, got {sorted(before)}"
    runner = train_dp_runner(TINY.train_dp)
    assert isinstance(runner, DaskTaskRunner) and runner.address == client.scheduler.address
    summary = train_dp_flow.with_options(task_runner=runner)(TINY.train_dp, TINY.prepare, profile="tiny")
    after = executed()

    assert len(summary["runs"]) == 4
    ran = {w: after[w] - before.get(w, 0) for w in after}
    assert sum(ran.values()) >= 4, f"the four grid points did not execute on the Dask workers: {ran}"
    repo = ResultsRepository()
    for point in summary["runs"]:
        row = repo.get_run(point["run_id"])
        assert row["status"] == "finished", row
        assert row["mlflow_run_id"]
        assert any(m["name"] == "test_ndcg_at_10" for m in row["metrics"])
    _, rows = repo.query("select technique, status from runs where stage = 'train-dp' and parent_id is not null")
    assert len(rows) == 4 and {status for _, status in rows} == {"finished"}
