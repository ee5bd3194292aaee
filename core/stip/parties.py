"""STIP three-party protocol (Yuan et al., Algorithm 1) with greedy autoregressive generation.

Parties
    P1 (model developer): draws ``pi``, the per-layer MLP permutations ``rho`` (and ``sigma``) from the OS
        CSPRNG (``core.stip.keys``; no seed, nothing recorded), runs ``permute_model``, ships the
        transformed blocks to P2 and the secrets to P3, then leaves.
    P2 (cloud): holds only transformed parameters, keeps a KV cache, computes every step.
    P3 (user): holds the prompt, the secrets, and produces the tokens.

Designs (``Design``) and what each party sees
    ``"user_embed"``: P1 -> P2: transformed blocks + final norm (+ GPT-2 ``wpe[:, pi]``), *no*
        token embedding, *no* LM head. P1 -> P3: ``pi``, embedding table ``E`` (V, d), head
        ``H`` (V, d). Per step P3 sends ``X' = E[ids][..., pi]`` (1, T, d) float32; P2 returns the
        permuted final hidden state of the last position ``h' = h[pi]`` (1, d); P3 computes
        ``logits = h'[inv_pi] @ H^T`` and the greedy token. P2 sees permuted embeddings/hidden
        states and permuted weights (never tokens, logits or ``pi``); P3 sees ``E``, ``H`` and ``pi``
        but no block weights.
    ``"vocab_perm"``: P1 -> P2: as above plus ``E' = E[inv_sigma][:, pi]`` and
        ``H' = H[inv_sigma][:, pi]`` (``transform.permute_vocab``). P1 -> P3: ``sigma`` only
        (a secret permutation of the vocabulary). Per step P3 sends ``sigma[ids]`` (1, T) int64; P2
        returns logits in substituted order ``logits'`` (1, V); P3 un-substitutes
        ``logits = logits'[sigma]``. P2 sees substituted token ids and substituted logits (a
        substitution cipher over tokens: frequency analysis applies, see ``core.stip.vocab_attack``);
        P3 holds no weights at all. Bytes down are ``4 V`` per token instead of ``4 d``.

Transport (``run_stip``): three OS processes (``multiprocessing``, fork by default) over loopback
TCP sockets with a length-prefixed frame (``core.stip.wire``): 8-byte length, 4-byte header length, JSON header
(kind, dtype, shape), raw little-endian tensor bytes. Every wait has ``timeout_s``; a party that
dies or disconnects raises ``PartyError`` naming it and all processes are terminated.
``run_stip_inprocess`` runs the same party objects and frames in one process (for tests and for
timing P2 against the plaintext model on the same thread).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from core.errors import ConfigError, PrivbenchError
from core.stip.keys import StipKeys, draw_keys
from core.stip.transform import _arch, base_model_of, inverse_permutation, permute_model, permute_vocab
from core.stip.wire import Link, decode_body, encode_frame, from_bytes, to_bytes

__all__ = [
    "Cloud",
    "Design",
    "Developer",
    "PartyError",
    "PartyTimeoutError",
    "StipResult",
    "User",
    "run_stip",
    "run_stip_inprocess",
]

Design = Literal["user_embed", "vocab_perm"]
Party = Literal["P1", "P2", "P3"]
ROLES = {"P1": "model developer", "P2": "cloud", "P3": "user"}


class PartyError(PrivbenchError):
    """A STIP party failed, died or disconnected; ``.party`` is ``"P1"``, ``"P2"`` or ``"P3"``."""

    def __init__(self, party: str, message: str) -> None:
        self.party = party
        super().__init__(f"STIP party {party} ({ROLES.get(party, '?')}): {message}")


class PartyTimeoutError(PartyError):
    """A party did not answer within ``timeout_s``."""


@dataclass(frozen=True, kw_only=True)
class StipResult:
    """Outcome of one STIP generation; logits error is vs the untransformed plaintext model."""

    design: str
    tokens: list[int]
    plain_tokens: list[int]
    max_abs_logit_error: float
    p2_seconds: float
    p3_seconds: float
    wall_seconds: float
    plain_seconds: float
    bytes_p3_to_p2: int
    bytes_p2_to_p3: int
    setup_bytes_p1_to_p2: int
    setup_bytes_p1_to_p3: int

    @property
    def tokens_match(self) -> bool:
        return self.tokens == self.plain_tokens

    @property
    def bytes_up_per_token(self) -> float:
        return self.bytes_p3_to_p2 / max(len(self.tokens), 1)

    @property
    def bytes_down_per_token(self) -> float:
        return self.bytes_p2_to_p3 / max(len(self.tokens), 1)


# ---------------------------------------------------------------- parties


def _embed_and_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ConfigError(f"{type(model).__name__} has no lm_head; pass a *ForCausalLM/LMHeadModel")
    if head.bias is not None:
        raise ConfigError("lm_head with a bias is not supported by the STIP parties")
    return base_model_of(model).get_input_embeddings().weight.detach(), head.weight.detach()


class Developer:
    """P1: draws the secrets and builds the two packages (bytes) for P2 and P3.

    ``keys``: None (the protocol) draws fresh secrets from the OS CSPRNG (``core.stip.keys.draw_keys``) when the
    packages are built; tests of the algebra may pass their own.
    """

    def __init__(self, model: nn.Module, *, design: Design, keys: StipKeys | None = None) -> None:
        if design not in get_args(Design):
            raise ConfigError(f"design must be one of {get_args(Design)}, got {design=!r}")
        if keys is not None and (keys.sigma is None) != (design == "user_embed"):
            raise ConfigError(f"keys {keys!r} do not fit design {design!r} (sigma exactly for vocab_perm)")
        self.model, self.design, self.keys = model, design, keys
        self.arch = _arch(model)

    def packages(self) -> tuple[bytes, bytes]:
        model, cfg = self.model, self.model.config
        embed, head = _embed_and_head(model)
        keys = self.keys if self.keys is not None else draw_keys(model, self.design)
        pi = keys.pi
        base = base_model_of(permute_model(model, pi, rho=keys.rho))
        emb_key = "wte.weight" if self.arch == "gpt2" else "embed_tokens.weight"
        state = {k: v for k, v in base.state_dict().items() if k != emb_key}
        p2: dict = {"arch": self.arch, "config": cfg.to_json_string(use_diff=False), "state": state}
        if self.design == "user_embed":
            p2.update(embed=None, head=None)
            p3 = {"pi": pi, "embed": embed.clone(), "head": head.clone(), "sigma": None}
        else:
            sigma = keys.sigma
            e2, h2 = permute_vocab(embed, head, pi, sigma)
            p2.update(embed=e2, head=h2)
            p3 = {"pi": None, "embed": None, "head": None, "sigma": sigma}
        return to_bytes(p2), to_bytes(p3)


def _build_base(arch: str, config_json: str) -> nn.Module:
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    cfg_cls, model_cls = (GPT2Config, GPT2Model) if arch == "gpt2" else (LlamaConfig, LlamaModel)
    return model_cls(cfg_cls.from_dict(json.loads(config_json)))


class Cloud:
    """P2: transformed base model (+ substituted embedding/head in ``vocab_perm``) and a KV cache."""

    def __init__(self, package: bytes) -> None:
        pkg = from_bytes(package)
        self.base = _build_base(pkg["arch"], pkg["config"]).eval()
        dtype = next(iter(pkg["state"].values())).dtype
        self.base.to(dtype)
        d = self.base.config.hidden_size
        self.base.set_input_embeddings(nn.Embedding(1, d).to(dtype))  # P2 has no token table
        self.base.get_input_embeddings().weight.data.zero_()
        missing, unexpected = self.base.load_state_dict(pkg["state"], strict=False)
        if unexpected or [k for k in missing if "embed" not in k and "wte" not in k]:
            raise ConfigError(f"P2 package does not match the model: {missing=} {unexpected=}")
        self.embed, self.head = pkg["embed"], pkg["head"]
        self.cache = None
        self.seconds = 0.0

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (1, T, d) permuted embeddings or (1, T) substituted ids -> (1, d) or (1, V)."""
        t0 = time.perf_counter()
        if self.embed is not None:
            x = self.embed[x]  # (1, T, d), already permuted by pi
        out = self.base(inputs_embeds=x, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        y = out.last_hidden_state[:, -1]  # (1, d) = h[pi]
        if self.head is not None:
            y = y @ self.head.T  # (1, V) substituted logits
        self.seconds += time.perf_counter() - t0
        return y


class User:
    """P3: embeds and permutes (or substitutes) tokens, un-permutes and picks the greedy token."""

    def __init__(self, package: bytes) -> None:
        pkg = from_bytes(package)
        self.pi, self.embed, self.head, self.sigma = pkg["pi"], pkg["embed"], pkg["head"], pkg["sigma"]
        self.inv_pi = None if self.pi is None else inverse_permutation(self.pi)
        self.seconds = 0.0

    @torch.no_grad()
    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        x = self.sigma[ids] if self.sigma is not None else self.embed[ids][..., self.pi]
        self.seconds += time.perf_counter() - t0
        return x

    @torch.no_grad()
    def decode(self, y: torch.Tensor) -> tuple[int, torch.Tensor]:
        t0 = time.perf_counter()
        if self.sigma is not None:
            logits = y[..., self.sigma]  # logits[t] = logits'[sigma[t]]
        else:
            logits = y[..., self.inv_pi] @ self.head.T  # (1, V)
        tok = int(logits.argmax(-1))
        self.seconds += time.perf_counter() - t0
        return tok, logits[0]


def _generate(user: User, exchange: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, n_new: int):
    tokens, logits = [], []
    x = user.encode(prompt.view(1, -1))
    for step in range(n_new):
        tok, lg = user.decode(exchange(x))
        tokens.append(tok)
        logits.append(lg)
        if step + 1 < n_new:
            x = user.encode(torch.tensor([[tok]]))
    return tokens, torch.stack(logits)


# ---------------------------------------------------------------- plaintext reference


@torch.no_grad()
def _plain_greedy(model: nn.Module, prompt: torch.Tensor, n_new: int) -> tuple[list[int], float]:
    """The same service in plaintext, same work as the protocol: the block stack with a KV cache and the LM head
    on the last position only (``model(...)`` would apply the head to every prompt position)."""
    base = base_model_of(model)
    _, head = _embed_and_head(model)
    t0 = time.perf_counter()
    cache, ids, tokens = None, prompt.view(1, -1), []
    for _ in range(n_new):
        out = base(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tokens.append(int((out.last_hidden_state[0, -1] @ head.T).argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, time.perf_counter() - t0


@torch.no_grad()
def _logit_error(model: nn.Module, prompt: torch.Tensor, tokens: list[int], logits: torch.Tensor) -> float:
    """Teacher-forced plaintext logits on the STIP tokens vs the STIP per-step logits."""
    seq = torch.cat([prompt.view(-1), torch.tensor(tokens[:-1], dtype=torch.long)]).view(1, -1)
    plain = model(input_ids=seq).logits[0, prompt.numel() - 1 :]  # (n_new, V)
    return float((plain.to(logits.dtype) - logits).abs().max())


def _validate(model: nn.Module, prompt: torch.Tensor, n_new: int, design: str) -> torch.Tensor:
    _arch(model)
    if design not in get_args(Design):
        raise ConfigError(f"design must be one of {get_args(Design)}, got {design=!r}")
    if not isinstance(n_new, int) or n_new < 1:
        raise ConfigError(f"n_new must be a positive int, got {n_new=!r}")
    prompt = torch.as_tensor(prompt, dtype=torch.long).view(-1)
    if prompt.numel() == 0:
        raise ConfigError("prompt_ids is empty; pass at least one token id")
    return prompt


def run_stip_inprocess(
    model: nn.Module, prompt_ids, n_new: int, *, design: Design = "user_embed", keys: StipKeys | None = None
) -> StipResult:
    """Algorithm 1 with all three parties in this process (same objects and frames as ``run_stip``).

    ``keys``: None draws fresh secrets (``Developer``); tests may pass their own."""
    prompt = _validate(model, prompt_ids, n_new, design)
    plain_tokens, plain_s = _plain_greedy(model, prompt, n_new)
    pkg2, pkg3 = Developer(model, design=design, keys=keys).packages()
    cloud, user = Cloud(pkg2), User(pkg3)
    t_gen = time.perf_counter()
    counts = {"up": 0, "down": 0}

    def exchange(x: torch.Tensor) -> torch.Tensor:
        frame = encode_frame("x", x)
        counts["up"] += len(frame)
        y = cloud.step(decode_body(frame[8:])[1])
        frame = encode_frame("y", y)
        counts["down"] += len(frame)
        return decode_body(frame[8:])[1]

    tokens, logits = _generate(user, exchange, prompt, n_new)
    return StipResult(
        design=design,
        tokens=tokens,
        plain_tokens=plain_tokens,
        max_abs_logit_error=_logit_error(model, prompt, tokens, logits),
        p2_seconds=cloud.seconds,
        p3_seconds=user.seconds,
        wall_seconds=time.perf_counter() - t_gen,
        plain_seconds=plain_s,
        bytes_p3_to_p2=counts["up"],
        bytes_p2_to_p3=counts["down"],
        setup_bytes_p1_to_p2=len(encode_frame("pkg", pkg2)),
        setup_bytes_p1_to_p3=len(encode_frame("pkg", pkg3)),
    )


def run_stip(
    model: nn.Module,
    prompt_ids,
    n_new: int,
    *,
    design: Design = "user_embed",
    keys: StipKeys | None = None,
    timeout_s: float = 60.0,
    start_method: str = "fork",
    _crash: Party | None = None,
) -> StipResult:
    """Algorithm 1 with P1, P2, P3 as three processes over loopback sockets.

    ``keys``: None makes P1 draw fresh secrets in its own process (``Developer``); tests may pass their own.
    ``timeout_s`` bounds every single wait (accept, receive); the whole run is bounded by
    ``timeout_s * (n_new + 4)``. ``_crash`` (tests only) makes that party exit abruptly mid-protocol.
    Raises ``PartyError``/``PartyTimeoutError`` naming the failing party; no process outlives the call.
    ``wall_seconds`` is the generation phase as seen by P3; its first step may include P2 still loading.
    """
    prompt = _validate(model, prompt_ids, n_new, design)
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s=}")
    reports = _run_processes(model, prompt, n_new, design, keys, timeout_s, start_method, _crash)
    p1, p2, p3 = reports["P1"], reports["P2"], reports["P3"]
    plain_tokens, plain_s = _plain_greedy(model, prompt, n_new)
    return StipResult(
        design=design,
        tokens=p3["tokens"],
        plain_tokens=plain_tokens,
        max_abs_logit_error=_logit_error(model, prompt, p3["tokens"], p3["logits"]),
        p2_seconds=p2["seconds"],
        p3_seconds=p3["seconds"],
        wall_seconds=p3["wall"],
        plain_seconds=plain_s,
        bytes_p3_to_p2=p3["up"],
        bytes_p2_to_p3=p3["down"],
        setup_bytes_p1_to_p2=p1["to_p2"],
        setup_bytes_p1_to_p3=p1["to_p3"],
    )


# ---------------------------------------------------------------- processes


def _maybe_crash(party: str, crash: str | None) -> None:
    if crash == party:
        os._exit(3)  # simulate a party dying abruptly (tests)


def _party_main(party: str, body: Callable[[], dict], queue) -> None:
    try:
        queue.put((party, "ok", to_bytes(body()), party))  # bytes: no fd-shared tensors
    except (ConnectionError, TimeoutError) as exc:  # blame the peer named in the message
        blame = next((p for p in ROLES if f" {p}" in str(exc)), party)
        queue.put((party, "timeout" if isinstance(exc, TimeoutError) else "error", str(exc), blame))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises PartyError
        queue.put((party, "error", f"{type(exc).__name__}: {exc}", party))


def _accept(server: socket.socket, timeout_s: float, expected: str) -> socket.socket:
    server.settimeout(timeout_s)
    try:
        conn, _ = server.accept()
    except TimeoutError as exc:
        raise TimeoutError(f"no connection from {expected} within {timeout_s} s") from exc
    return conn


def _p1(model, design, keys, port2, port3, timeout_s, crash) -> dict:
    pkg2, pkg3 = Developer(model, design=design, keys=keys).packages()
    to3 = Link(socket.create_connection(("127.0.0.1", port3), timeout=timeout_s), "P3", timeout_s)
    to3.send("package", pkg3)  # the small package first, so P3 is not left waiting
    _maybe_crash("P1", crash)
    to2 = Link(socket.create_connection(("127.0.0.1", port2), timeout=timeout_s), "P2", timeout_s)
    to2.send("hello", b"P1")
    to2.send("package", pkg2)
    return {"to_p2": to2.sent - len(encode_frame("hello", b"P1")), "to_p3": to3.sent}


def _p2(server, timeout_s, crash) -> dict:
    links = {}
    for _ in range(2):
        link = Link(_accept(server, timeout_s, "P1 or P3"), "P1 or P3", timeout_s)
        _, who = link.recv()
        link.peer = who.decode()
        links[link.peer] = link
    kind, pkg = links["P1"].recv()
    cloud = Cloud(pkg)
    links["P1"].sock.close()
    user, steps = links["P3"], 0
    while True:
        kind, x = user.recv()
        if kind == "stop":
            break
        user.send("y", cloud.step(x))
        steps += 1
        if steps == 1:
            _maybe_crash("P2", crash)
    return {"seconds": cloud.seconds}


def _p3(server, port2, prompt, n_new, timeout_s, crash) -> dict:
    from_p1 = Link(_accept(server, timeout_s, "P1"), "P1", timeout_s)
    _, pkg = from_p1.recv()
    user = User(pkg)
    to2 = Link(socket.create_connection(("127.0.0.1", port2), timeout=timeout_s), "P2", timeout_s)
    to2.send("hello", b"P3")
    hello = to2.sent
    t0 = time.perf_counter()

    def exchange(x: torch.Tensor) -> torch.Tensor:
        to2.send("x", x)
        _maybe_crash("P3", crash)
        return to2.recv()[1]

    tokens, logits = _generate(user, exchange, prompt, n_new)
    wall = time.perf_counter() - t0
    to2.send("stop")
    return {
        "tokens": tokens,
        "logits": logits,
        "seconds": user.seconds,
        "wall": wall,
        "up": to2.sent - hello - len(encode_frame("stop")),
        "down": to2.received,
    }


def _listener() -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    return srv


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


def _run_processes(model, prompt, n_new, design, keys, timeout_s, start_method, crash) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    srv2, srv3 = _listener(), _listener()
    port2, port3 = srv2.getsockname()[1], srv3.getsockname()[1]
    bodies = {
        "P1": (_p1, (model, design, keys, port2, port3, timeout_s, crash)),
        "P2": (_p2, (srv2, timeout_s, crash)),
        "P3": (_p3, (srv3, port2, prompt, n_new, timeout_s, crash)),
    }
    procs = {
        p: ctx.Process(target=_party_entry, args=(p, f, a, queue, start_method), daemon=True)
        for p, (f, a) in bodies.items()
    }
    try:
        for pr in procs.values():
            pr.start()
        reports = _collect(procs, queue, time.monotonic() + timeout_s * (n_new + 4))
    except BaseException:
        for pr in procs.values():  # a failed run: stop the survivors at once
            if pr.is_alive():
                pr.terminate()
        raise
    finally:
        for pr in procs.values():
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
    return reports


def _party_entry(party: str, fn: Callable, args: tuple, queue, start_method: str) -> None:
    if start_method == "fork":  # libgomp is not fork-safe: a forked child must not use the parent's pool
        torch.set_num_threads(1)
    _party_main(party, lambda: fn(*args), queue)
