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

Transport (``run_stip``, ``core.stip.processes``): three OS processes started with ``spawn`` (each holds only
what it is handed, never a copy of the launcher's memory), over loopback TCP sockets with a length-prefixed frame
(``core.stip.wire``): 8-byte length, 4-byte header length, JSON header (kind, dtype, shape), raw little-endian
tensor bytes. Every link opens with a mutual HMAC-SHA256 challenge-response on a per-session secret (P1 hands
P3's to P3 and P2). Every wait has ``timeout_s``; a party that dies, disconnects or fails authentication raises
``PartyError`` naming it and all processes are terminated. ``run_stip_inprocess`` runs the same party objects and
frames in one process (for tests and for timing P2 against the plaintext model on the same thread).

Plaintext reference (``_plain_service``, ``_plain_run``): the plaintext model is timed like for like with P2. It is
rebuilt exactly as P2 builds its own (``Cloud``: the same base-model class from the same config, the model's own
attention implementation, which P1 ships in P2's package, the same dtype, the same loading path into a fresh
instance) from the *untransformed* blocks, token table and head, and it runs the same ``Cloud.step`` on the same
thread: token lookup, block stack with a KV cache, LM head on the last position; the greedy pick is outside the
timed region of P2's work (``plain_server_seconds``). ``run_stip_inprocess`` builds every object of a run (the
packages, P2, P3, the plaintext service) before either timed part, then times the plaintext service and the protocol
back to back in the order ``plaintext_first`` asks (``core.stip.evaluate`` alternates it over rounds).

Exactness (:func:`float64_exactness`): the transform is exact in real arithmetic, so the check runs the protocol
on a float64 copy of the model and asks for a relative logit error of at most ``rtol`` (1e-9); float32 errors
grow with the computation (depth, width, prompt length) and are reported as measured, not judged.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from core.errors import ConfigError, PrivbenchError
from core.stip.keys import StipKeys, draw_keys
from core.stip.transform import arch_of, base_model_of, inverse_permutation, permute_model, permute_vocab
from core.stip.wire import decode_body, encode_frame, from_bytes, to_bytes

__all__ = [
    "Cloud",
    "Design",
    "Developer",
    "PartyError",
    "PartyTimeoutError",
    "StipResult",
    "User",
    "float64_exactness",
    "run_stip",
    "run_stip_inprocess",
]

_clock = time.perf_counter  # every timed region of the parties (tests put a fake clock here)

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
    """Outcome of one STIP generation; logits errors are vs the untransformed plaintext model (the relative one
    divides by the largest plaintext logit magnitude). Plaintext times are of the plaintext service
    (``_plain_service``): ``plain_seconds`` the whole greedy generation, ``plain_blocks_seconds`` its block stack,
    ``plain_server_seconds`` its lookup, blocks and head (P2's ``vocab_perm`` step). ``refused_connections``:
    connections P2 refused for failing authentication; ``holdings``: per party, every tensor its process held at the
    end (``run_stip(audit=True)``)."""

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
    max_rel_logit_error: float = float("nan")
    refused_connections: int = 0
    holdings: dict | None = None
    plain_blocks_seconds: float = float("nan")
    plain_server_seconds: float = float("nan")

    @property
    def plain_same_work_seconds(self) -> float:
        """The plaintext time of the work P2 does under this design: the block stack alone in ``user_embed`` (P3
        embeds and applies the LM head), the whole step in ``vocab_perm`` (P2 looks up, runs the blocks and the
        head: ``plain_server_seconds``, without the greedy pick, which is P3's; ``plain_seconds`` where a result
        has no ``plain_server_seconds``)."""
        if self.design == "user_embed":
            return self.plain_blocks_seconds
        return self.plain_seconds if math.isnan(self.plain_server_seconds) else self.plain_server_seconds

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
        self.arch = arch_of(model)

    def packages(self) -> tuple[bytes, bytes]:
        model, cfg = self.model, self.model.config
        embed, head = _embed_and_head(model)
        keys = self.keys if self.keys is not None else draw_keys(model, self.design)
        pi = keys.pi
        base = base_model_of(permute_model(model, pi, rho=keys.rho))
        p2 = _p2_package(self.arch, cfg, base)
        if self.design == "user_embed":
            p2.update(embed=None, head=None)
            p3 = {"pi": pi, "embed": embed.clone(), "head": head.clone(), "sigma": None}
        else:
            sigma = keys.sigma
            e2, h2 = permute_vocab(embed, head, pi, sigma)
            p2.update(embed=e2, head=h2)
            p3 = {"pi": None, "embed": None, "head": None, "sigma": sigma}
        return to_bytes(p2), to_bytes(p3)


def _p2_package(arch: str, cfg, base: nn.Module) -> dict:
    """What every P2-style package holds: the architecture, the config (with the model's attention implementation,
    which ``to_json_string`` leaves out) and the base model's parameters without the token table."""
    emb_key = "wte.weight" if arch == "gpt2" else "embed_tokens.weight"
    state = {k: v for k, v in base.state_dict().items() if k != emb_key}
    attn = getattr(cfg, "_attn_implementation", None)
    return {"arch": arch, "config": cfg.to_json_string(use_diff=False), "attn": attn, "state": state}


def _build_base(arch: str, config_json: str, attn: str | None = None) -> nn.Module:
    """The base model of ``arch`` from its config, with attention implementation ``attn`` (None: the library's
    default, which is what a package without one, built before P1 shipped it, gets)."""
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    cfg_cls, model_cls = (GPT2Config, GPT2Model) if arch == "gpt2" else (LlamaConfig, LlamaModel)
    cfg = cfg_cls.from_dict(json.loads(config_json))
    if attn is not None:
        cfg._attn_implementation = attn
    return model_cls(cfg)


class Cloud:
    """P2: transformed base model (+ substituted embedding/head in ``vocab_perm``) and a KV cache.

    ``seconds``: the time of every ``step``; ``blocks_seconds``: of the block stack within it (the base model's
    forward and the last position's slice). The plaintext service (``_plain_service``) is this class on the
    untransformed model, so both sides run the same code."""

    def __init__(self, package: bytes) -> None:
        pkg = from_bytes(package)
        self.base = _build_base(pkg["arch"], pkg["config"], pkg.get("attn")).eval()
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
        self.blocks_seconds = 0.0

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (1, T, d) permuted embeddings or (1, T) substituted ids -> (1, d) or (1, V)."""
        t0 = _clock()
        if self.embed is not None:
            x = self.embed[x]  # (1, T, d), already permuted by pi
        tb = _clock()
        # transformers 5 names the KV cache `cache` (`past_key_values` is deprecated and warns in every worker)
        out = self.base(inputs_embeds=x, cache=self.cache, use_cache=True)
        self.cache = out.cache
        y = out.last_hidden_state[:, -1]  # (1, d) = h[pi]
        self.blocks_seconds += _clock() - tb
        if self.head is not None:
            y = y @ self.head.T  # (1, V) substituted logits
        self.seconds += _clock() - t0
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
        t0 = _clock()
        x = self.sigma[ids] if self.sigma is not None else self.embed[ids][..., self.pi]
        self.seconds += _clock() - t0
        return x

    @torch.no_grad()
    def decode(self, y: torch.Tensor) -> tuple[int, torch.Tensor]:
        t0 = _clock()
        if self.sigma is not None:
            logits = y[..., self.sigma]  # logits[t] = logits'[sigma[t]]
        else:
            logits = y[..., self.inv_pi] @ self.head.T  # (1, V)
        tok = int(logits.argmax(-1))
        self.seconds += _clock() - t0
        return tok, logits[0]


def user_generate(user: User, exchange: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, n_new: int):
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


def _plain_service(model: nn.Module) -> Cloud:
    """The plaintext model as P2 would run it (see the module docstring): a ``Cloud`` built from the untransformed
    blocks, the model's own token table and its LM head, through the same package, class and loading path as P2's
    (a fresh instance, like P2's)."""
    arch = arch_of(model)
    embed, head = _embed_and_head(model)
    pkg = _p2_package(arch, model.config, base_model_of(model))
    pkg.update(embed=embed, head=head)
    return Cloud(to_bytes(pkg))


@dataclass(frozen=True)
class _PlainRun:
    tokens: list[int]
    seconds: float  # the whole plaintext service: lookup, blocks, head, greedy pick, next input
    blocks_seconds: float  # the block stack alone (P2's work in ``user_embed``)
    server_seconds: float  # lookup, blocks and head on the last position (P2's work in ``vocab_perm``)


@torch.no_grad()
def _plain_run(service: Cloud, prompt: torch.Tensor, n_new: int) -> _PlainRun:
    """Greedy generation in plaintext on ``service`` (``_plain_service``): the same ``Cloud.step`` P2 runs (KV cache,
    LM head on the last position only), then the greedy token."""
    t0 = _clock()
    ids, tokens = prompt.view(1, -1), []
    for _ in range(n_new):
        tokens.append(int(service.step(ids).argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return _PlainRun(tokens, _clock() - t0, service.blocks_seconds, service.seconds)


@torch.no_grad()
def _logit_error(
    model: nn.Module, prompt: torch.Tensor, tokens: list[int], logits: torch.Tensor
) -> tuple[float, float]:
    """Teacher-forced plaintext logits on the STIP tokens vs the STIP per-step logits: ``(max abs, max rel)``."""
    seq = torch.cat([prompt.view(-1), torch.tensor(tokens[:-1], dtype=torch.long)]).view(1, -1)
    plain = model(input_ids=seq).logits[0, prompt.numel() - 1 :].to(logits.dtype)  # (n_new, V)
    err = float((plain - logits).abs().max())
    return err, err / max(float(plain.abs().max()), torch.finfo(plain.dtype).tiny)


def _validate(model: nn.Module, prompt: torch.Tensor, n_new: int, design: str) -> torch.Tensor:
    arch_of(model)
    if design not in get_args(Design):
        raise ConfigError(f"design must be one of {get_args(Design)}, got {design=!r}")
    if not isinstance(n_new, int) or n_new < 1:
        raise ConfigError(f"n_new must be a positive int, got {n_new=!r}")
    prompt = torch.as_tensor(prompt, dtype=torch.long).view(-1)
    if prompt.numel() == 0:
        raise ConfigError("prompt_ids is empty; pass at least one token id")
    return prompt


def run_stip_inprocess(
    model: nn.Module,
    prompt_ids,
    n_new: int,
    *,
    design: Design = "user_embed",
    keys: StipKeys | None = None,
    plaintext_first: bool = True,
) -> StipResult:
    """Algorithm 1 with all three parties in this process (same objects and frames as ``run_stip``), timed against
    the plaintext service on the same thread.

    Every object (P1's packages, P2, P3 and the plaintext service, ``_plain_service``) is built before either timed
    part; then the plaintext generation and the protocol's run back to back, the plaintext one first when
    ``plaintext_first`` (``core.stip.evaluate`` alternates it from round to round so that neither side always goes
    first). ``keys``: None draws fresh secrets (``Developer``); tests may pass their own."""
    prompt = _validate(model, prompt_ids, n_new, design)
    pkg2, pkg3 = Developer(model, design=design, keys=keys).packages()
    plain_service = _plain_service(model)
    cloud, user = Cloud(pkg2), User(pkg3)
    counts = {"up": 0, "down": 0}

    def exchange(x: torch.Tensor) -> torch.Tensor:
        frame = encode_frame("x", x)
        counts["up"] += len(frame)
        y = cloud.step(decode_body(frame[8:])[1])
        frame = encode_frame("y", y)
        counts["down"] += len(frame)
        return decode_body(frame[8:])[1]

    def protocol() -> tuple[list[int], torch.Tensor, float]:
        t_gen = _clock()
        tokens, logits = user_generate(user, exchange, prompt, n_new)
        return tokens, logits, _clock() - t_gen

    gc.collect()  # the packaging's garbage, so that neither timed part collects it
    if plaintext_first:
        plain = _plain_run(plain_service, prompt, n_new)
        tokens, logits, wall = protocol()
    else:
        tokens, logits, wall = protocol()
        plain = _plain_run(plain_service, prompt, n_new)
    abs_err, rel_err = _logit_error(model, prompt, tokens, logits)
    return StipResult(
        design=design,
        tokens=tokens,
        plain_tokens=plain.tokens,
        max_abs_logit_error=abs_err,
        max_rel_logit_error=rel_err,
        p2_seconds=cloud.seconds,
        p3_seconds=user.seconds,
        wall_seconds=wall,
        plain_seconds=plain.seconds,
        plain_blocks_seconds=plain.blocks_seconds,
        plain_server_seconds=plain.server_seconds,
        bytes_p3_to_p2=counts["up"],
        bytes_p2_to_p3=counts["down"],
        setup_bytes_p1_to_p2=len(encode_frame("pkg", pkg2)),
        setup_bytes_p1_to_p3=len(encode_frame("pkg", pkg3)),
    )


@contextlib.contextmanager
def _float64_rms_norms():
    """Hugging Face's ``LlamaRMSNorm`` normalises in float32 whatever its input, which caps a float64 model at ~1e-7
    relative; for the duration, float64 inputs stay in float64. Any other dtype takes the original path (the same
    result), so patching the class is harmless to concurrent users."""
    from transformers.models.llama import modeling_llama as ml

    original = ml.LlamaRMSNorm.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:
            return original(self, x)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    ml.LlamaRMSNorm.forward = forward
    try:
        yield
    finally:
        ml.LlamaRMSNorm.forward = original


def float64_exactness(
    model: nn.Module, prompt_ids, n_new: int, *, design: Design = "user_embed", rtol: float = 1e-9
) -> dict[str, float]:
    """The protocol (in process, fresh secrets) on a float64 copy of ``model`` against the float64 plaintext model.

    Theorem 1 makes the permuted computation equal to the plaintext one in real arithmetic; in float64 the only
    difference left is the order of float sums, ~1e-15 relative (LLaMA's RMSNorm kept in float64 for the check), so
    a wrong transform cannot hide under ``rtol``
    (in float32 a correct one reaches ~1e-4 absolute on a 19-token prompt to SmolLM2-135M). Returns
    ``float64_max_abs_err``, ``float64_max_rel_err``, ``float64_tokens_match`` and ``exact_float64`` (1.0 when the
    relative error is at most ``rtol`` and the tokens match, else 0.0)."""
    if not rtol > 0:
        raise ConfigError(f"rtol must be > 0, got {rtol=}")
    with _float64_rms_norms():
        r = run_stip_inprocess(copy.deepcopy(model).double(), prompt_ids, n_new, design=design)
    ok = r.tokens_match and r.max_rel_logit_error <= rtol
    return {
        "float64_max_abs_err": r.max_abs_logit_error,
        "float64_max_rel_err": r.max_rel_logit_error,
        "float64_tokens_match": float(r.tokens_match),
        "exact_float64": float(ok),
    }


def run_stip(
    model: nn.Module,
    prompt_ids,
    n_new: int,
    *,
    design: Design = "user_embed",
    keys: StipKeys | None = None,
    timeout_s: float = 60.0,
    audit: bool = False,
    _start_method: str = "spawn",
    _crash: Party | None = None,
    _wrong_key: Party | None = None,
) -> StipResult:
    """Algorithm 1 with P1, P2, P3 as three spawned processes over authenticated loopback sockets
    (``core.stip.processes``).

    ``keys``: None makes P1 draw fresh secrets in its own process (``Developer``); tests may pass their own.
    ``timeout_s`` bounds every single wait (accept, receive); the whole run is bounded by
    ``timeout_s * (n_new + 4)``. ``audit``: each party also reports every tensor it holds (``holdings``).
    Tests only: ``_start_method="fork"`` (to show what fork leaks), ``_crash`` makes that party exit abruptly
    mid-protocol, ``_wrong_key`` makes that party present a secret its peer does not hold.
    Raises ``PartyError``/``PartyTimeoutError`` naming the failing party; no process outlives the call.
    ``wall_seconds`` is the generation phase as seen by P3; its first step may include P2 still loading.
    """
    from core.stip.processes import run_processes

    prompt = _validate(model, prompt_ids, n_new, design)
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s=}")
    if _start_method not in ("spawn", "forkserver", "fork"):
        raise ConfigError(f"start method must be spawn, forkserver or (tests) fork, got {_start_method=!r}")
    reports = run_processes(
        model,
        prompt,
        n_new,
        design=design,
        keys=keys,
        timeout_s=timeout_s,
        start_method=_start_method,
        audit=audit,
        crash=_crash,
        wrong_key=_wrong_key,
    )
    p1, p2, p3 = reports["P1"], reports["P2"], reports["P3"]
    plain = _plain_run(_plain_service(model), prompt, n_new)
    abs_err, rel_err = _logit_error(model, prompt, p3["tokens"], p3["logits"])
    return StipResult(
        design=design,
        tokens=p3["tokens"],
        plain_tokens=plain.tokens,
        max_abs_logit_error=abs_err,
        max_rel_logit_error=rel_err,
        p2_seconds=p2["seconds"],
        p3_seconds=p3["seconds"],
        wall_seconds=p3["wall"],
        plain_seconds=plain.seconds,
        plain_blocks_seconds=plain.blocks_seconds,
        plain_server_seconds=plain.server_seconds,
        bytes_p3_to_p2=p3["up"],
        bytes_p2_to_p3=p3["down"],
        setup_bytes_p1_to_p2=p1["to_p2"],
        setup_bytes_p1_to_p3=p1["to_p3"],
        refused_connections=p2["refused"],
        holdings={p: r["holdings"] for p, r in reports.items()} if audit else None,
    )
