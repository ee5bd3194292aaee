"""Two-party launcher: results by rank, clean failure (PartyError naming the rank), no leftover processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError, PrivbenchError
from core.mpc.crypten_compat import import_crypten
from core.mpc.parties import PartyError, free_port, resolve_device, run_local, run_party_from_env

from .conftest import require_crypten

require_crypten()


def _mul(ctx, x):
    crypten = import_crypten()
    a, b = crypten.cryptensor(x, src=0), crypten.cryptensor(x, src=1)
    return ctx.rank, (a * b).get_plain_text()


def _fail(ctx, pid_dir, how):
    Path(pid_dir, f"{ctx.rank}.pid").write_text(str(os.getpid()))
    crypten = import_crypten()
    bad = 1 if how == "raise" else 0
    if ctx.rank == bad:
        time.sleep(0.3)
        if how == "raise":
            raise ValueError("boom in the client")
        os._exit(3)
    x = crypten.cryptensor(torch.ones(4), src=bad)  # blocks on the dead/failed peer
    return (x * x).get_plain_text()


def _shares(ctx, seed):
    torch.manual_seed(seed)  # what a party's model code does with the recorded config seed
    crypten = import_crypten()
    x = crypten.cryptensor(torch.arange(8.0), src=0)
    y = crypten.cryptensor(torch.ones(8), src=1)
    z = x * y  # a Beaver triple from the trusted-first-party provider
    return x.share.clone(), z.share.clone(), z.get_plain_text()


def _sleep(ctx):
    Path(os.environ["PB_PID_DIR"], f"{ctx.rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_local_returns_values_by_rank() -> None:
    out = run_local(_mul, (torch.arange(4.0),), timeout_s=60)
    assert [r for r, _ in out] == [0, 1]
    assert all(torch.allclose(v, torch.arange(4.0) ** 2) for _, v in out)


@pytest.mark.parametrize(
    ("how", "rank", "match"),
    [("raise", 1, "party 1 raised ValueError: boom"), ("exit", 0, r"party 0 died .*exit code 3")],
)
def test_failing_party_raises_party_error_and_kills_the_other(tmp_path, how, rank, match) -> None:
    t0 = time.monotonic()
    with pytest.raises(PartyError, match=match) as err:
        run_local(_fail, (str(tmp_path), how), timeout_s=60)
    assert err.value.rank == rank and isinstance(err.value, PrivbenchError)
    assert time.monotonic() - t0 < 30
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    assert not mp.active_children()


def test_timeout_kills_all_parties(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PB_PID_DIR", str(tmp_path))
    with pytest.raises(PartyError, match=r"timed out after 2 s; parties \[0, 1\]"):
        run_local(_sleep, timeout_s=2)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_share_randomness_is_fresh_under_the_same_torch_seed() -> None:
    """The recorded seed does not regenerate the masks: two runs seeded alike share the same values differently."""
    torch.manual_seed(0)
    first = run_local(_shares, (0,), timeout_s=60)
    torch.manual_seed(0)
    second = run_local(_shares, (0,), timeout_s=60)
    for rank in (0, 1):
        (x1, z1, p1), (x2, z2, p2) = first[rank], second[rank]
        assert not torch.equal(x1, x2) and not torch.equal(z1, z2)
        assert torch.allclose(p1, torch.arange(8.0)) and torch.allclose(p2, torch.arange(8.0))
    assert not torch.equal(first[0][0], first[1][0])  # and the two parties' shares differ from each other


def _env_party(rank, port, q):
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r, v = run_party_from_env(_mul, (torch.ones(3) * 2,), env=env)
    q.put((r, v.tolist()))  # plain values: a shared-memory tensor would die with this process


def test_run_party_from_env_two_processes() -> None:
    ctx, port = mp.get_context("fork"), free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_env_party, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted([q.get(timeout=60), q.get(timeout=60)], key=lambda v: v[0])
    for p in procs:
        p.join(10)
    assert [r for r, _ in got] == [0, 1] and got[0][1] == pytest.approx([4.0] * 3)


def test_env_and_device_errors() -> None:
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        run_party_from_env(_mul, env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x"})
    with pytest.raises(ConfigError, match="world_size"):
        run_local(_mul, world_size=1)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")
