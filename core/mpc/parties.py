"""Run one function as the parties of a CrypTen computation, with clean shutdown on failure.

Roles (see :mod:`core.mpc.ops`): party 0 is the model owner (server), party 1 the client (data owner).

``run_local(fn, args)`` starts one process per party on this machine (``fork`` start method where available,
so ``fn`` may be any callable; ``spawn`` needs a module-level function), rendezvous over TCP on a free loopback
port with the gloo backend, calls ``fn(ctx, *args)`` in every party after ``crypten.init()`` and returns the
list of return values ordered by rank. If a party raises or dies (e.g. ``os._exit``) or the run passes
``timeout_s``, the remaining parties are terminated (SIGTERM, then SIGKILL) and :class:`PartyError` names the
party and its error; no process is left behind.

``run_party_from_env(fn, args)`` is for one process per host: it reads ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (rendezvous ``tcp://MASTER_ADDR:MASTER_PORT``, party 0 listens there),
optionally ``DISTRIBUTED_BACKEND`` (default gloo), and returns this party's value. Start it on every host,
e.g. ``RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m my_job``.

Share randomness: every party calls ``crypten.init()``, which seeds CrypTen's share generators (``prev``/``next``:
the pairwise seeds of the zero sharings, ``local``: the trusted-first-party triples and the binary shares,
``global``) from ``os.urandom(8)`` each (CrypTen 0.4.1, ``crypten._setup_prng``), fresh per run and per process.
Nothing here reseeds them and no share is drawn from torch's global generator, so ``torch.manual_seed(cfg.seed)``
(model initialisation, prompts) never reaches a share: the recorded seed does not regenerate the masks. Runs record
:data:`SHARE_RANDOMNESS` (tag ``privbench.secret_source``), never a seed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch

from core.errors import ConfigError, PrivbenchError
from core.mpc.crypten_compat import import_crypten, stage_cuda_communication

MODEL_OWNER = 0
CLIENT = 1
SHARE_RANDOMNESS = "crypten.init: share generators seeded from os.urandom per run and party, never recorded"
_ENV_KEYS = ("DISTRIBUTED_BACKEND", "RENDEZVOUS", "WORLD_SIZE", "RANK")


class PartyError(PrivbenchError, RuntimeError):
    """A party of an MPC run raised, died or timed out; ``rank`` names it (None: several timed out)."""

    def __init__(self, message: str, *, rank: int | None, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail


@dataclass(frozen=True)
class PartyContext:
    """What a party function receives first: its rank, the world size and the torch device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_model_owner(self) -> bool:
        return self.rank == MODEL_OWNER

    @property
    def is_client(self) -> bool:
        return self.rank == CLIENT


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"`` or ``"cuda"``/``"cuda:N"``; CUDA only when available (ConfigError otherwise)."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda', got {device=}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={str(device)!r} requested but CUDA is not available; use device='cpu'")
    return dev


def free_port() -> int:
    """A currently free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_initialized(fn: Callable[..., Any], ctx: PartyContext, args: Sequence[Any], kwargs: dict) -> Any:
    crypten = import_crypten()
    if ctx.device.type == "cuda":  # gloo moves CUDA tensors for two of CrypTen's eight operations only
        stage_cuda_communication(crypten)
    crypten.init(device=ctx.device if ctx.device.type == "cuda" else None)
    crypten.cfg.communicator.verbose = True
    try:
        return fn(ctx, *args, **kwargs)
    finally:
        crypten.uninit()


def _child(fn, rank, world_size, rendezvous, device, threads, conn, args, kwargs) -> None:
    status, payload = "ok", b""
    try:
        os.environ.update(
            {"DISTRIBUTED_BACKEND": "gloo", "RENDEZVOUS": rendezvous, "WORLD_SIZE": str(world_size), "RANK": str(rank)}
        )
        if threads:
            torch.set_num_threads(threads)
        ctx = PartyContext(rank=rank, world_size=world_size, device=torch.device(device))
        payload = pickle.dumps(_run_initialized(fn, ctx, args, kwargs))
    except BaseException as exc:  # noqa: BLE001  - report everything (SystemExit too); the parent decides
        status = "err"
        payload = pickle.dumps(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send_bytes(pickle.dumps((status, payload)))
    finally:
        conn.close()
        os._exit(0 if status == "ok" else 1)  # skip inherited atexit handlers (pytest, torch) of the parent


def _stop(procs: Sequence[mp.process.BaseProcess], grace_s: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_local(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    kwargs: dict | None = None,
    world_size: int = 2,
    timeout_s: float = 300.0,
    device: str | torch.device = "cpu",
    threads_per_party: int | None = 1,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` as ``world_size`` local parties; return their values by rank.

    Raises :class:`PartyError` naming the first party that failed (raised, or exited without a result) or,
    after ``timeout_s`` seconds, the parties still running; the other parties are killed either way.
    """
    if world_size < 2:
        raise ConfigError(f"world_size must be >= 2 for an MPC run, got {world_size=}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s=}")
    dev = resolve_device(device)
    import_crypten()  # fail early, in the parent, when CrypTen is missing
    if start_method is None:
        # a forked child of a process that has initialised CUDA cannot use it (nor can CrypTen's init, which
        # touches CUDA whenever it is available): spawn then, and for CUDA parties
        cuda_here = dev.type == "cuda" or torch.cuda.is_initialized()
        start_method = "spawn" if cuda_here or "fork" not in mp.get_all_start_methods() else "fork"
    mpctx = mp.get_context(start_method)
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs, conns = [], {}
    for rank in range(world_size):
        recv, send = mpctx.Pipe(duplex=False)
        p = mpctx.Process(
            target=_child,
            args=(fn, rank, world_size, rendezvous, str(dev), threads_per_party, send, tuple(args), kwargs or {}),
            name=f"privbench-party-{rank}",
            daemon=True,
        )
        p.start()
        send.close()
        procs.append(p)
        conns[rank] = recv
    try:
        return _collect(procs, conns, timeout_s)
    finally:
        _stop(procs)
        for c in conns.values():
            c.close()


def _collect(procs: list, conns: dict, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = sorted(pending)
            raise PartyError(
                f"MPC run timed out after {timeout_s:g} s; parties {ranks} still running (killed)",
                rank=ranks[0] if len(ranks) == 1 else None,
            )
        by_obj = {c: r for r, c in pending.items()} | {procs[r].sentinel: r for r in pending}
        for obj in wait(list(by_obj), timeout=left):
            rank = by_obj[obj]
            if rank not in pending:
                continue
            conn = pending[rank]
            if conn.poll():
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "dead", None
            elif procs[rank].is_alive():
                continue
            else:
                status, payload = "dead", None
            del pending[rank]
            if status == "ok":
                results[rank] = pickle.loads(payload)
                continue
            if status == "err":
                detail = pickle.loads(payload)
                first = detail.splitlines()[0] if detail else "unknown error"
                raise PartyError(f"party {rank} raised {first}\n{detail}", rank=rank, detail=detail)
            procs[rank].join(1.0)
            code = procs[rank].exitcode
            raise PartyError(f"party {rank} died without a result (exit code {code})", rank=rank)
    return [results[r] for r in range(len(procs))]


def run_party_from_env(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    kwargs: dict | None = None,
    device: str | torch.device = "cpu",
    env: dict[str, str] | None = None,
) -> Any:
    """Run this host's party of ``fn(ctx, *args)`` from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

    Errors in ``fn`` are re-raised as :class:`PartyError` naming this rank. (Cross-host failures of the peer
    surface as gloo errors/timeouts in this process; a supervisor must restart or stop the job.)
    """
    env = dict(os.environ if env is None else env)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(f"run_party_from_env needs environment variables {missing}; set them on every host")
    try:
        rank, world_size, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError as exc:
        raise ConfigError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers: {exc}") from exc
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK must be in [0, WORLD_SIZE), got RANK={rank}, WORLD_SIZE={world_size}")
    dev = resolve_device(device)
    os.environ.update(
        {
            "DISTRIBUTED_BACKEND": env.get("DISTRIBUTED_BACKEND", "gloo"),
            "RENDEZVOUS": f"tcp://{env['MASTER_ADDR']}:{port}",
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
        }
    )
    ctx = PartyContext(rank=rank, world_size=world_size, device=dev)
    try:
        return _run_initialized(fn, ctx, args, kwargs or {})
    except PrivbenchError:
        raise
    except Exception as exc:
        raise PartyError(f"party {rank} raised {type(exc).__name__}: {exc}", rank=rank) from exc
