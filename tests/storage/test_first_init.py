"""Several processes starting at once on a fresh MLflow tracking store: MLflow's own schema migration and
default experiment must be created once, by one of them, and every process must get its run."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest

PROCESSES = 4


def _first_use(uri: str, artifact_root: str, barrier, index: int) -> str:
    """Create a Tracker on ``uri`` after every process reached ``barrier``; returns "" or the error."""
    from storage.tracking import Tracker

    try:
        barrier.wait(timeout=120)
        tracker = Tracker(uri, Path(artifact_root))
        _exp_id, run_id = tracker.start_run(
            stage="prepare", run_name=f"race-{index}", params={"i": str(index)}, tags={"privbench.race": "1"}
        )
        tracker.end_run(run_id, "FINISHED")
        return ""
    except BaseException:  # noqa: BLE001 -- report every failure of the child to the test
        return traceback.format_exc()


def _run_all(uri: str, artifact_root: Path) -> list[str]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(PROCESSES) as pool:
        barrier = manager.Barrier(PROCESSES)
        args = [(uri, str(artifact_root), barrier, i) for i in range(PROCESSES)]
        return pool.starmap(_first_use, args, chunksize=1)


@pytest.mark.timeout(600)
def test_concurrent_first_use_of_a_fresh_tracking_store(tmp_path: Path) -> None:
    """Every process gets its experiment and run, and they all land in the one experiment."""
    from mlflow.tracking import MlflowClient

    from storage.tracking import experiment_name

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    errors = [e for e in _run_all(uri, tmp_path / "mlartifacts") if e]
    assert not errors, f"{len(errors)} of {PROCESSES} failed on a fresh store:\n" + "\n".join(errors)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name("prepare"))
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    assert sorted(r.data.params["i"] for r in runs) == [str(i) for i in range(PROCESSES)]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_initialised_store_is_opened_without_the_lock(mlflow_uri: str) -> None:
    """The usual case, and a read-only home: an initialised store needs no lock and no lock file."""
    from storage.tracking import Tracker

    Tracker(mlflow_uri)  # initialises the session's store if no test did yet
    lock = Path(mlflow_uri.split(":///", 1)[1] + ".init.lock")
    lock.unlink(missing_ok=True)
    Tracker(mlflow_uri).experiment_id("prepare")
    assert not lock.exists()


def test_lock_is_skipped_where_it_cannot_be_created() -> None:
    """Where not even the lock file can be created nobody can create a store either: nothing to serialise."""
    from storage.tracking import _first_init_lock

    entered = []
    with _first_init_lock(Path("/proc/no-such-dir/mlflow.db")):
        entered.append(True)
    assert entered == [True]
