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

Exactness (:func:`float64_exactness`): the transform is exact in real arithmetic, so the check runs the protocol
on a float64 copy of the model and asks for a relative logit error of at most ``rtol`` (1e-9); float32 errors
grow with the computation (depth, width, prompt length) and are reported as measured, not judged.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from core.errors import ConfigError, PrivbenchError
from core.stip.keys import StipKeys, draw_keys
from core.stip.transform import _arch, base_model_of, inverse_permutation, permute_model, permute_vocab
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
    divides by the largest plaintext logit magnitude). ``refused_connections``: connections P2 refused for failing
    authentication; ``holdings``: per party, every tensor its process held at the end (``run_stip(audit=True)``)."""

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

    @property
    def plain_same_work_seconds(self) -> float:
        """The plaintext time of the work P2 does under this design: the block stack alone in ``user_embed`` (P3
        embeds and applies the LM head), the whole step in ``vocab_perm`` (P2 looks up, runs the blocks and the
        head)."""
        return self.plain_blocks_seconds if self.design == "user_embed" else self.plain_seconds

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
def _plain_greedy(model: nn.Module, prompt: torch.Tensor, n_new: int) -> tuple[list[int], float, float]:
    """The same service in plaintext, same work as the protocol: the block stack with a KV cache and the LM head
    on the last position only (``model(...)`` would apply the head to every prompt position). Returns the tokens,
    the whole time and the time of the block stack alone (the part P2 runs in ``user_embed``)."""
    base = base_model_of(model)
    _, head = _embed_and_head(model)
    t0 = time.perf_counter()
    blocks = 0.0
    cache, ids, tokens = None, prompt.view(1, -1), []
    for _ in range(n_new):
        tb = time.perf_counter()
        out = base(input_ids=ids, past_key_values=cache, use_cache=True)
        blocks += time.perf_counter() - tb
        cache = out.past_key_values
        tokens.append(int((out.last_hidden_state[0, -1] @ head.T).argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, time.perf_counter() - t0, blocks


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
    plain_tokens, plain_s, blocks_s = _plain_greedy(model, prompt, n_new)
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
    abs_err, rel_err = _logit_error(model, prompt, tokens, logits)
    return StipResult(
        design=design,
        tokens=tokens,
        plain_tokens=plain_tokens,
        max_abs_logit_error=abs_err,
        max_rel_logit_error=rel_err,
        p2_seconds=cloud.seconds,
        p3_seconds=user.seconds,
        wall_seconds=time.perf_counter() - t_gen,
        plain_seconds=plain_s,
        plain_blocks_seconds=blocks_s,
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
    plain_tokens, plain_s, blocks_s = _plain_greedy(model, prompt, n_new)
    abs_err, rel_err = _logit_error(model, prompt, p3["tokens"], p3["logits"])
    return StipResult(
        design=design,
        tokens=p3["tokens"],
        plain_tokens=plain_tokens,
        max_abs_logit_error=abs_err,
        max_rel_logit_error=rel_err,
        p2_seconds=p2["seconds"],
        p3_seconds=p3["seconds"],
        wall_seconds=p3["wall"],
        plain_seconds=plain_s,
        plain_blocks_seconds=blocks_s,
        bytes_p3_to_p2=p3["up"],
        bytes_p2_to_p3=p3["down"],
        setup_bytes_p1_to_p2=p1["to_p2"],
        setup_bytes_p1_to_p3=p1["to_p3"],
        refused_connections=p2["refused"],
        holdings={p: r["holdings"] for p, r in reports.items()} if audit else None,
    )
