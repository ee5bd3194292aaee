"""The three STIP parties as separate OS processes (``core.stip.parties.run_stip``): isolation, links, audit.

Isolation
    Every party starts with multiprocessing's ``spawn`` method: a fresh interpreter that holds nothing but what
    it is handed through its start pipe. ``fork`` would give each child a copy of the launcher's heap, the
    plaintext model and its embedding table included, in P2. What each party is handed:

    ======  ===========================================================================================
    P1      the plaintext model (pickle bytes), the keys if a test fixes them, its link secrets to P2, P3
    P2      its listening socket and its link secret with P1; from P1: the transformed package, P3's secret
    P3      its listening socket, the prompt, its link secret with P1; from P1: its package, its P2 secret
    ======  ===========================================================================================

Links and secrets
    Three links, each authenticated at its opening by mutual HMAC-SHA256 challenge-response on its own secret
    (``core.stip.wire``): the launcher draws the P1-P2 and P1-P3 secrets (``secrets.token_bytes``) and hands each
    to its two ends at start; P1 draws the P3-P2 session secret and hands it to P3 and to P2 over their
    authenticated links (out of band of the P3-P2 link). P2 refuses any connection that fails the handshake
    (counted in ``refused_connections``) and keeps waiting for the real party; a party refused by its peer fails
    the run with ``PartyError`` naming it. No secret is written anywhere.

Audit (``audit=True``, tests)
    Each party ends by listing every tensor alive in its process (``gc``): shape, dtype and the SHA-256 of its
    bytes (:func:`tensor_inventory`), so a test can check what a party holds against the plaintext model and
    the secrets (``tests/core/stip/test_isolation.py``). The digests never leave the test.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import socket
import time
from collections.abc import Callable

import torch

from core.stip.keys import StipKeys
from core.stip.parties import ROLES, Cloud, Developer, PartyError, PartyTimeoutError, User, user_generate
from core.stip.wire import (
    AuthenticationError,
    Link,
    accept_authenticated,
    client_handshake,
    encode_frame,
    from_bytes,
    new_key,
    read_hello,
    server_handshake,
    to_bytes,
)

__all__ = ["run_processes", "tensor_digest", "tensor_inventory"]


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype and values (row-major bytes); equal tensors of one dtype, equal digests."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(str(flat.dtype).encode())
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensor_inventory() -> list[dict]:
    """Every tensor alive in this process (``gc``), as ``{"shape", "dtype", "sha256"}``."""
    gc.collect()
    out, seen = [], set()
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or id(obj) in seen:  # type(): no __getattr__ of modules
            continue
        seen.add(id(obj))
        try:
            digest = tensor_digest(obj)
        except (RuntimeError, TypeError):  # meta, sparse or other layouts without plain bytes
            digest = None
        out.append({"shape": tuple(obj.shape), "dtype": str(obj.dtype).removeprefix("torch."), "sha256": digest})
    return out


def _report(report: dict, audit: bool) -> dict:
    """``report``, with the party's :func:`tensor_inventory` if ``audit``; call it in the party's own frame, so
    that everything the party holds is still alive."""
    return report | {"holdings": tensor_inventory()} if audit else report


def _maybe_crash(party: str, crash: str | None) -> None:
    if crash == party:
        os._exit(3)  # simulate a party dying abruptly (tests)


def _maybe_wrong(party: str, wrong_key: str | None, key: bytes) -> bytes:
    return new_key() if wrong_key == party else key  # tests: this party presents a secret its peer does not hold


def _connect(port: int, peer: str, role: str, key: bytes, timeout_s: float) -> Link:
    link = Link(socket.create_connection(("127.0.0.1", port), timeout=timeout_s), peer, timeout_s)
    client_handshake(link, role, key)
    return link


def _accept(server: socket.socket, timeout_s: float, expected: str) -> Link:
    server.settimeout(timeout_s)
    try:
        conn, _ = server.accept()
    except TimeoutError as exc:
        raise TimeoutError(f"no connection from {expected} within {timeout_s} s") from exc
    return Link(conn, f"a connection claiming to be {expected}", timeout_s)


def _p1(model_bytes, keys_bytes, design, port2, port3, key2, key3, timeout_s, crash, wrong_key, audit) -> dict:
    model = pickle.loads(model_bytes)  # pickled by the launcher, this process's parent
    if keys_bytes is not None:
        k = from_bytes(keys_bytes)
        keys = StipKeys(pi=k["pi"], rho=tuple(k["rho"]), sigma=k["sigma"])
    else:
        keys = None
    pkg2, pkg3 = Developer(model, design=design, keys=keys).packages()
    session = new_key()  # the P3-P2 secret: P1 hands it to both over their authenticated links
    to3 = _connect(port3, "P3", "P1", key3, timeout_s)
    to3.send("package", pkg3)  # the small package first, so P3 is not left waiting
    to3.send("session", session)
    _maybe_crash("P1", crash)
    to2 = _connect(port2, "P2", "P1", _maybe_wrong("P1", wrong_key, key2), timeout_s)
    opened = to2.sent
    to2.send("package", pkg2)
    to2.send("session", session)
    sent = {"to_p2": to2.sent - opened - len(encode_frame("session", session)), "to_p3": to3.sent}
    return _report(sent, audit)


def _p2(server, key1, timeout_s, crash, audit) -> dict:
    """Accept P1 (its secret from the launcher), load the package, then P3 (the session secret P1 sent); a
    connection that fails the handshake is refused and counted, and P2 keeps waiting."""
    keys, links, parked, refused, cloud = {"P1": key1}, {}, [], 0, None
    while "P3" not in links:
        if parked and "P3" in keys:
            link, role = parked.pop(0), "P3"
        else:
            link, role = _accept(server, timeout_s, "P1 or P3"), None
        try:
            if role is None:
                role = read_hello(link, tuple(r for r in ("P1", "P3") if r not in links))
                if role not in keys:  # P3 before P1's package: its secret is not here yet
                    parked.append(link)
                    continue
            server_handshake(link, role, keys[role])
        except (AuthenticationError, ConnectionError, TimeoutError, OSError):
            refused += 1
            link.close()
            continue
        links[role] = link
        if role == "P1":
            cloud = Cloud(link.recv()[1])
            keys["P3"] = link.recv()[1]
            link.close()
    user, steps = links["P3"], 0
    while True:
        kind, x = user.recv()
        if kind == "stop":
            break
        user.send("y", cloud.step(x))
        steps += 1
        if steps == 1:
            _maybe_crash("P2", crash)
    return _report({"seconds": cloud.seconds, "refused": refused}, audit)


def _p3(server, port2, prompt_ids, n_new, key1, timeout_s, crash, wrong_key, audit) -> dict:
    from_p1 = _accept(server, timeout_s, "P1")
    accept_authenticated(from_p1, {"P1": key1})
    user = User(from_p1.recv()[1])
    session = from_p1.recv()[1]
    from_p1.close()
    to2 = _connect(port2, "P2", "P3", _maybe_wrong("P3", wrong_key, session), timeout_s)
    sent0, received0 = to2.sent, to2.received  # the handshake is not the protocol's traffic
    t0 = time.perf_counter()

    def exchange(x: torch.Tensor) -> torch.Tensor:
        to2.send("x", x)
        _maybe_crash("P3", crash)
        return to2.recv()[1]

    tokens, logits = user_generate(user, exchange, torch.tensor(prompt_ids, dtype=torch.long), n_new)
    wall = time.perf_counter() - t0
    to2.send("stop")
    report = {
        "tokens": tokens,
        "logits": logits,
        "seconds": user.seconds,
        "wall": wall,
        "up": to2.sent - sent0 - len(encode_frame("stop")),
        "down": to2.received - received0,
    }
    return _report(report, audit)


def _listener() -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv


def _party_main(party: str, body: Callable[[], dict], queue) -> None:
    try:
        queue.put((party, "ok", to_bytes(body()), party))  # bytes: no fd-shared tensors
    except (ConnectionError, TimeoutError) as exc:  # blame the peer named in the message
        blame = next((p for p in ROLES if f" {p}" in str(exc)), party)
        queue.put((party, "timeout" if isinstance(exc, TimeoutError) else "error", str(exc), blame))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises PartyError
        queue.put((party, "error", f"{type(exc).__name__}: {exc}", party))


def _party_entry(party: str, fn: Callable, args: tuple, queue, start_method: str, threads: int) -> None:
    # libgomp is not fork-safe: a forked child must not use the parent's pool; a spawned one starts its own
    torch.set_num_threads(1 if start_method == "fork" else threads)
    _party_main(party, lambda: fn(*args), queue)


def _collect(procs: dict, queue, deadline: float) -> dict:
    import queue as queue_mod

    reports: dict = {}
    while len(reports) < 3:
        try:
            party, status, payload, blame = queue.get(timeout=0.1)
        except queue_mod.Empty:
            dead = [p for p, pr in procs.items() if pr.exitcode not in (None, 0) and p not in reports]
            if dead:
                raise PartyError(dead[0], f"process died (exit code {procs[dead[0]].exitcode})")
            if time.monotonic() > deadline:
                raise PartyTimeoutError(next(p for p in ROLES if p not in reports), "run exceeded its deadline")
            continue
        if status == "ok":
            reports[party] = from_bytes(payload)
            continue
        time.sleep(0.5)  # let a dying peer's exit code settle, then prefer it as the culprit
        dead = [p for p, pr in procs.items() if pr.exitcode not in (None, 0) and p not in reports]
        if dead:
            raise PartyError(dead[0], f"process died (exit code {procs[dead[0]].exitcode}); {party}: {payload}")
        cls = PartyTimeoutError if status == "timeout" else PartyError
        raise cls(blame, f"reported by {party}: {payload}")
    return reports


def run_processes(
    model,
    prompt: torch.Tensor,
    n_new: int,
    *,
    design: str,
    keys,
    timeout_s: float,
    start_method: str = "spawn",
    audit: bool = False,
    crash: str | None = None,
    wrong_key: str | None = None,
) -> dict:
    """Start P1, P2, P3 (``start_method``: ``"spawn"``; ``"fork"`` only for the test that shows what it leaks),
    wait for their reports (``{"P1": ..., "P2": ..., "P3": ...}``) and leave no process behind."""
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    srv2, srv3 = _listener(), _listener()
    port2, port3 = srv2.getsockname()[1], srv3.getsockname()[1]
    key12, key13 = new_key(), new_key()  # the launcher's link secrets, handed to each end at start
    model_bytes = pickle.dumps(model)
    keys_bytes = None if keys is None else to_bytes({"pi": keys.pi, "rho": list(keys.rho), "sigma": keys.sigma})
    bodies = {
        "P1": (_p1, (model_bytes, keys_bytes, design, port2, port3, key12, key13, timeout_s, crash, wrong_key, audit)),
        "P2": (_p2, (srv2, key12, timeout_s, crash, audit)),
        "P3": (_p3, (srv3, port2, prompt.tolist(), n_new, key13, timeout_s, crash, wrong_key, audit)),
    }
    del model_bytes
    threads = torch.get_num_threads()
    procs = {
        p: ctx.Process(target=_party_entry, args=(p, f, a, queue, start_method, threads), daemon=True)
        for p, (f, a) in bodies.items()
    }
    try:
        for pr in procs.values():
            pr.start()
        return _collect(procs, queue, time.monotonic() + timeout_s * (n_new + 4))
    except BaseException:
        for pr in procs.values():  # a failed run: stop the survivors at once
            if pr.is_alive():
                pr.terminate()
        raise
    finally:
        for pr in procs.values():
            if pr.pid is None:  # never started (an earlier start failed)
                continue
            pr.join(timeout=2.0)
            if pr.is_alive():
                pr.terminate()
                pr.join(timeout=2.0)
            if pr.is_alive():
                pr.kill()
                pr.join()
        srv2.close()
        srv3.close()
        queue.close()
