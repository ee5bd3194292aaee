"""Two flows writing to one results store at once (two ``privbench run`` processes, SQLite in WAL mode and
PostgreSQL): every run of both lands whole, nothing is lost or left ``running``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from storage.repository import ResultsRepository

BIN = Path(sys.executable).parent
TINY = [
    "train_dp.datasets=[{name: ml-100k}]",
    "train_dp.methods=[transformer, gru]",
    "train_dp.epsilons=[8]",
    "train_dp.nonprivate=true",
    "train_dp.peers=[]",
    "train_dp.epochs=1",
    "train_dp.workers=1",
    "train_dp.max_len=20",
    "train_dp.d_model=32",
]


def test_two_flows_at_once_lose_nothing(store_url: str, home: Path, tmp_path: Path) -> None:
    env = os.environ | {"PRIVBENCH_DB_URL": store_url, "PRIVBENCH_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    cmd = [str(BIN / "privbench"), "run", "train-dp"] + [a for s in TINY for a in ("--set", s)]
    procs = [
        subprocess.Popen(
            cmd + ["--set", f"train_dp.seeds=[{seed}]"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)

    repo = ResultsRepository(store_url)
    _, rows = repo.query(
        "select technique, status, count(*) from runs where stage = 'train-dp' "
        "group by technique, status order by technique"
    )
    # per flow: one parent row and 4 grid points (transformer, gru; DP at eps 8 and non-private)
    assert rows == [("flow", "finished", 2), ("gru", "finished", 4), ("transformer", "finished", 4)]
    _, counts = repo.query(
        "select r.id, count(m.id) from runs r left join metrics m on m.run_id = r.id "
        "where r.stage = 'train-dp' and r.technique != 'flow' group by r.id"
    )
    # the two flows ran the same grid with another seed: their runs recorded the same number of metrics
    per_run = Counter(n for _, n in counts)
    assert len(counts) == 8 and min(per_run) > 0 and all(k % 2 == 0 for k in per_run.values()), per_run
    _, ledgers = repo.query(
        "select count(*) from privacy_ledger p join runs r on r.id = p.run_id where r.stage = 'train-dp'"
    )
    assert ledgers == [(4,)]
