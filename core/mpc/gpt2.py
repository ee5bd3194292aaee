"""Encrypted GPT-2 forward and greedy generation under 2-party CrypTen MPC (the MERGE baselines and ER).

Party 0 (model owner) shares the weights, party 1 (client) shares the one-hot prefix; every op runs on
secret shares and is charged to a :class:`~core.mpc.accounting.CostMeter` category. Only the final tokens are
revealed, to the client.

Shapes: B batch, N sequence length, T keys (cached + new), V vocabulary, d hidden, H heads, D = d / H.

Generation modes (greedy; each step: forward -> last-position logits -> encrypted argmax one-hot -> private
embedding of the new token):

* ``vanilla``: the baseline of MERGE Table 1: every step embeds and recomputes the whole prefix + generated
  sequence (one-hot (B, N, V) @ wte, full causal attention).
* ``vanilla_kv``: encrypted K/V caches; each step embeds and computes only the new position.
* ``vanilla_er``: embedding resending only (MERGE eq. 3) on the unmodified GPT-2: the next input embedding is
  the last position's final hidden state (after ``ln_f``); no argmax or lookup during generation; the stored
  hidden states are decoded at the end by the LM head and one batched argmax.
* ``merge``: ER + merge module (eq. 10-11): :class:`core.mpc.gpt2_merge.EncryptedMerge`, which uses this
  module's results and step logs.

Every :class:`GenerationResult` records each step's bytes and rounds (``step_bytes``, ``step_rounds``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.accounting import CostMeter, NullMeter, OpCategory
from core.mpc.crypten_compat import import_crypten
from core.mpc.parties import CLIENT, MODEL_OWNER

GENERATION_MODES: tuple[str, ...] = ("vanilla", "vanilla_kv", "vanilla_er")
CrypTensor = Any


@dataclass(frozen=True, kw_only=True)
class MPCVariant:
    """Which nonlinearities run under MPC: ``softmax`` exact|2relu|2quad, ``activation`` gelu|quad|relu
    (``gelu`` is GPT-2's tanh GELU), ``norm`` exact|approx (approx = ``x * gamma + beta``, approx.py's
    ``affine``); ``softmax_c`` the 2relu/2quad offset (default 0 / 5, as :mod:`core.mpc.approx`)."""

    softmax: str = "exact"
    activation: str = "gelu"
    norm: str = "exact"
    softmax_c: float | None = None

    def __post_init__(self) -> None:
        ops.check_choice("softmax", self.softmax, ops.SOFTMAXES)
        ops.check_choice("activation", self.activation, ops.ACTIVATIONS)
        ops.check_choice("norm", self.norm, ops.NORMS)


@dataclass(frozen=True)
class GPT2Layer:
    """One block's plaintext weights, Conv1D layout (in, out)."""

    ln1_g: torch.Tensor
    ln1_b: torch.Tensor
    attn_w: torch.Tensor  # (d, 3d)
    attn_b: torch.Tensor  # (3d,)
    proj_w: torch.Tensor  # (d, d)
    proj_b: torch.Tensor
    ln2_g: torch.Tensor
    ln2_b: torch.Tensor
    fc_w: torch.Tensor  # (d, d_I)
    fc_b: torch.Tensor
    out_w: torch.Tensor  # (d_I, d)
    out_b: torch.Tensor


@dataclass(frozen=True)
class GPT2Weights:
    """Plaintext GPT-2 weights (float32, CPU), picklable to the parties. The LM head is tied to ``wte``."""

    wte: torch.Tensor  # (V, d)
    wpe: torch.Tensor  # (P, d)
    layers: tuple[GPT2Layer, ...]
    lnf_g: torch.Tensor
    lnf_b: torch.Tensor
    n_head: int
    eps: float

    @property
    def vocab_size(self) -> int:
        return int(self.wte.shape[0])

    @property
    def n_positions(self) -> int:
        return int(self.wpe.shape[0])


def weights_from_hf(model: Any) -> GPT2Weights:
    """Extract a Hugging Face ``GPT2LMHeadModel``'s weights (tied LM head assumed, as GPT-2)."""
    t = model.transformer
    f = lambda p: p.detach().float().cpu().clone()
    layers = tuple(
        GPT2Layer(
            ln1_g=f(b.ln_1.weight),
            ln1_b=f(b.ln_1.bias),
            attn_w=f(b.attn.c_attn.weight),
            attn_b=f(b.attn.c_attn.bias),
            proj_w=f(b.attn.c_proj.weight),
            proj_b=f(b.attn.c_proj.bias),
            ln2_g=f(b.ln_2.weight),
            ln2_b=f(b.ln_2.bias),
            fc_w=f(b.mlp.c_fc.weight),
            fc_b=f(b.mlp.c_fc.bias),
            out_w=f(b.mlp.c_proj.weight),
            out_b=f(b.mlp.c_proj.bias),
        )
        for b in t.h
    )
    cfg = model.config
    if getattr(cfg, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ConfigError(f"unsupported activation_function={cfg.activation_function!r} for an MPCVariant")
    return GPT2Weights(
        wte=f(t.wte.weight),
        wpe=f(t.wpe.weight),
        layers=layers,
        lnf_g=f(t.ln_f.weight),
        lnf_b=f(t.ln_f.bias),
        n_head=int(cfg.n_head),
        eps=float(cfg.layer_norm_epsilon),
    )


def check_lengths(prefix_len: int, max_new_tokens: int, n_positions: int) -> None:
    """ConfigError naming the numbers when the prefix (or prefix + new tokens) exceeds ``n_positions``."""
    if prefix_len < 1:
        raise ConfigError(f"the prefix must hold at least one token, got length {prefix_len}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens=}")
    if prefix_len > n_positions:
        raise ConfigError(f"prefix length {prefix_len} exceeds the model's n_positions={n_positions}")
    if prefix_len + max_new_tokens - 1 > n_positions:
        raise ConfigError(
            f"prefix length {prefix_len} + max_new_tokens {max_new_tokens} - 1 exceeds the model's "
            f"n_positions={n_positions}; shorten the prefix or generate fewer tokens"
        )


def check_mode(mode: str, known: tuple[str, ...] = GENERATION_MODES + ("merge",)) -> str:
    return ops.check_choice("generation mode", mode, known)


def prefix_shape(
    prefix_ids: torch.Tensor | None, shape: tuple[int, int] | None, max_new_tokens: int, n_positions: int
) -> tuple[int, int]:
    """The (B, N) of a generation's prefix: ``prefix_ids``' on the client, ``shape`` on a party that holds no ids;
    the prefix and the new tokens checked against ``n_positions`` (:func:`check_lengths`)."""
    shape = tuple(prefix_ids.shape) if prefix_ids is not None else shape
    if shape is None:
        raise ConfigError("pass prefix_ids (client) or shape=(B, N) (model owner)")
    check_lengths(int(shape[1]), max_new_tokens, n_positions)
    return shape


@dataclass
class StepLog:
    """Wall seconds, bytes and rounds of each generation step, read from the meter around the step, and of the
    two phases outside the steps: ``prefix`` (from :meth:`open` to the first step: sharing the prompt, its first
    embedding) and ``decode`` (from the last step to :meth:`close`: the final LM head and argmax where a
    method decodes at the end, and the reveal)."""

    bytes: list[int] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    _open: tuple[float, int, int] | None = None
    _first: tuple[float, int, int] | None = None
    _last: tuple[float, int, int] | None = None
    _close: tuple[float, int, int] | None = None

    def open(self, meter: CostMeter) -> None:
        self._open = meter.snapshot()

    def close(self, meter: CostMeter) -> None:
        self._close = meter.snapshot()

    @contextmanager
    def step(self, meter: CostMeter) -> Iterator[None]:
        t0, b0, r0 = start = meter.snapshot()
        if self._first is None:
            self._first = start
        yield
        t1, b1, r1 = self._last = meter.snapshot()
        self.seconds.append(t1 - t0)
        self.bytes.append(b1 - b0)
        self.rounds.append(r1 - r0)

    def phases(self) -> dict[str, dict[str, float]]:
        """``{"prefix": {s, bytes, rounds}, "decode": {...}}``; empty when :meth:`open`/:meth:`close` were not
        called around the steps."""
        if None in (self._open, self._first, self._last, self._close):
            return {}
        spans = {"prefix": (self._open, self._first), "decode": (self._last, self._close)}
        return {
            name: {"s": b[0] - a[0], "bytes": float(b[1] - a[1]), "rounds": float(b[2] - a[2])}
            for name, (a, b) in spans.items()
        }


@dataclass
class GenerationResult:
    """One party's result: tokens (B, n_new) on the client (None on the model owner), costs per category
    ({category: {s, bytes, rounds, calls}}), totals of the generation region, and the weight-sharing setup.

    ``step_bytes[i]``, ``step_rounds[i]``, ``step_s[i]``: this party's communication and wall seconds during
    generation step i (step 0 processes the prefix); sharing the prefix before the steps and the final decoding
    and reveal are not in any step: they are ``phases["prefix"]`` and ``phases["decode"]`` ({s, bytes, rounds}),
    so that prefix + steps + decode is the whole generation region (``total_s``, ``comm_bytes``, ``rounds``)."""

    rank: int
    mode: str
    tokens: torch.Tensor | None
    costs: dict[str, dict[str, float | int]]
    total_s: float
    comm_bytes: int
    rounds: int
    setup: dict[str, float | int] = field(default_factory=dict)
    step_bytes: list[int] = field(default_factory=list)
    step_rounds: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)


def reveal_tokens(onehots: CrypTensor, rank: int) -> torch.Tensor | None:
    """Decrypt (B, n, V) one-hots to the client only; its token ids (B, n), None on other parties."""
    plain = onehots.get_plain_text(dst=CLIENT)
    return plain.argmax(dim=-1).cpu() if rank == CLIENT else None


def finish_result(
    rank: int, mode: str, meter: CostMeter, tokens: torch.Tensor | None, setup: dict, steps: StepLog
) -> GenerationResult:
    """Package one party's result after the metered region closed."""
    tot = meter.totals()
    return GenerationResult(
        rank=rank,
        mode=mode,
        tokens=tokens,
        costs=meter.as_dict(),
        total_s=float(tot["total_s"]),
        comm_bytes=int(tot["comm_bytes"]),
        rounds=int(tot["rounds"]),
        setup=setup,
        step_bytes=list(steps.bytes),
        step_rounds=list(steps.rounds),
        step_s=list(steps.seconds),
        phases=steps.phases(),
    )


class EncryptedGPT2:
    """GPT-2 with secret-shared weights (shared by party 0 on construction); all calls are collective."""

    def __init__(
        self,
        weights: GPT2Weights,
        variant: MPCVariant,
        *,
        rank: int,
        device: str | torch.device = "cpu",
        meter: CostMeter | None = None,
    ) -> None:
        self.variant, self.rank, self.device = variant, rank, torch.device(device)
        self.meter = meter if meter is not None else CostMeter()
        self.vocab_size, self.n_positions, self.n_head = weights.vocab_size, weights.n_positions, weights.n_head
        self.d = int(weights.wte.shape[1])
        self.eps = weights.eps
        setup = CostMeter()
        with setup.region():
            s = self._share
            self.wte = s(weights.wte)
            self.wte_t = self.wte.t()  # (d, V) tied LM head
            self.wpe = s(weights.wpe)
            self.layers = [
                {k: s(getattr(layer, k)) for k in GPT2Layer.__dataclass_fields__} for layer in weights.layers
            ]
            self.lnf_g, self.lnf_b = s(weights.lnf_g), s(weights.lnf_b)
        self.setup_costs = setup.totals()

    def _share(self, x: torch.Tensor) -> CrypTensor:
        return ops.share(x, src=MODEL_OWNER, rank=self.rank, device=self.device)

    def share_prefix(self, prefix_ids: torch.Tensor | None, shape: tuple[int, int]) -> CrypTensor:
        """The client's (B, N) ids as an encrypted (B, N, V) one-hot (other parties pass ``None``)."""
        ids = prefix_ids if self.rank == CLIENT and prefix_ids is not None else torch.zeros(shape, dtype=torch.long)
        return ops.share(ops.onehot(ids, self.vocab_size), src=CLIENT, rank=self.rank, device=self.device)

    # --- the network -------------------------------------------------------------------------------------
    def _block(self, p: dict, h: CrypTensor, past: tuple | None) -> tuple[CrypTensor, tuple]:
        m, v = self.meter, self.variant
        B, N, d, H = h.size(0), h.size(1), self.d, self.n_head
        D = d // H
        a = ops.layer_norm(h, p["ln1_g"], p["ln1_b"], m, eps=self.eps, kind=v.norm)
        qkv = ops.linear(a, p["attn_w"], p["attn_b"], m)  # (B, N, 3d)
        with m.op(OpCategory.LINEAR):
            q = qkv[:, :, :d].view(B, N, H, D).transpose(1, 2) * (1.0 / math.sqrt(D))  # (B, H, N, D)
            k = qkv[:, :, d : 2 * d].view(B, N, H, D).transpose(1, 2)  # (B, H, N, D)
            val = qkv[:, :, 2 * d :].view(B, N, H, D).transpose(1, 2)  # (B, H, N, D)
            if past is not None:
                crypten = import_crypten()
                k = crypten.cat([past[0], k], dim=2)  # (B, H, T, D)
                val = crypten.cat([past[1], val], dim=2)
        T = k.size(2)
        scores = ops.matmul(q, k.transpose(2, 3), m)  # (B, H, N, T)
        mask = None if N == 1 else ops.causal_mask(N, T, device=self.device)
        probs = ops.softmax(scores, m, kind=v.softmax, mask=mask, c=v.softmax_c)
        att = ops.matmul(probs, val, m)  # (B, H, N, D)
        with m.op(OpCategory.LINEAR):
            att = att.transpose(1, 2).reshape(B, N, d)  # (B, N, d)
        h = h + ops.linear(att, p["proj_w"], p["proj_b"], m)
        x = ops.layer_norm(h, p["ln2_g"], p["ln2_b"], m, eps=self.eps, kind=v.norm)
        x = ops.activation(ops.linear(x, p["fc_w"], p["fc_b"], m), m, kind=v.activation)
        return h + ops.linear(x, p["out_w"], p["out_b"], m), (k, val)

    def hidden(self, emb: CrypTensor, *, start: int = 0, past: list | None = None) -> tuple[CrypTensor, list]:
        """Final hidden states (after ln_f) of (B, N, d) token embeddings at positions start..start+N-1."""
        n = emb.size(1)
        if start + n > self.n_positions:
            raise ConfigError(f"sequence length {start + n} exceeds the model's n_positions={self.n_positions}")
        with self.meter.op(OpCategory.EMBED):
            h = emb + self.wpe[start : start + n]
        caches = []
        for i, p in enumerate(self.layers):
            h, kv = self._block(p, h, None if past is None else past[i])
            caches.append(kv)
        h = ops.layer_norm(h, self.lnf_g, self.lnf_b, self.meter, eps=self.eps, kind=self.variant.norm)
        return h, caches

    def logits(self, h: CrypTensor) -> CrypTensor:
        """Tied LM head: (B, N, d) -> (B, N, V)."""
        return ops.linear(h, self.wte_t, None, self.meter)

    def forward(self, onehot_ids: CrypTensor) -> CrypTensor:
        """Encrypted (B, N, V) one-hot ids -> encrypted (B, N, V) logits."""
        return self.logits(self.hidden(ops.embed(onehot_ids, self.wte, self.meter))[0])

    # --- generation --------------------------------------------------------------------------------------
    def generate(
        self,
        prefix_ids: torch.Tensor | None,
        max_new_tokens: int,
        *,
        mode: str = "vanilla",
        shape: tuple[int, int] | None = None,
    ) -> GenerationResult:
        """Greedy generation; ``prefix_ids`` (B, N) on the client (others may pass None with ``shape``)."""
        check_mode(mode, GENERATION_MODES)
        shape = prefix_shape(prefix_ids, shape, max_new_tokens, self.n_positions)
        self.meter = m = CostMeter()
        crypten, log = import_crypten(), StepLog()
        with m.region():
            log.open(m)
            x = self.share_prefix(prefix_ids, shape)  # (B, N, V)
            if mode == "vanilla_er":
                out = self._generate_er(x, max_new_tokens, log)
            else:
                outs = []
                past, pos = None, 0
                emb = ops.embed(x, self.wte, m)
                for step in range(max_new_tokens):
                    with log.step(m):
                        if mode == "vanilla":
                            seq = x if step == 0 else crypten.cat([x] + outs, dim=1)
                            h, _ = self.hidden(ops.embed(seq, self.wte, m) if step else emb)
                        else:
                            if step:  # the previous token looked up at the start of the step, so every step
                                emb = ops.embed(outs[-1], self.wte, m)  # after the first has the same work
                            h, past = self.hidden(emb, start=pos, past=past)
                            pos += emb.size(1)
                        outs.append(ops.argmax_onehot(self.logits(h[:, -1:]), m))  # (B, 1, V)
                out = crypten.cat(outs, dim=1)
            tokens = reveal_tokens(out, self.rank)
            log.close(m)
        return finish_result(self.rank, mode, m, tokens, dict(self.setup_costs), log)

    def _generate_er(self, x: CrypTensor, n_new: int, log: StepLog) -> CrypTensor:
        crypten, m = import_crypten(), self.meter
        emb = ops.embed(x, self.wte, m)  # E_0 (B, N, d)
        last = []
        for step in range(n_new):
            with log.step(m):
                h, _ = self.hidden(emb)
                last.append(h[:, -1:])  # (B, 1, d)
                if step + 1 < n_new:
                    emb = crypten.cat([emb, last[-1]], dim=1)  # eq. 3
        hid = crypten.cat(last, dim=1)  # (B, n_new, d)
        return ops.argmax_onehot(self.logits(hid), m)


# --- plaintext references (same approximations) -------------------------------------------------------------
def _plain_block(layer: GPT2Layer, h: torch.Tensor, n_head: int, eps: float, v: MPCVariant) -> torch.Tensor:
    B, N, d = h.shape
    D = d // n_head
    a = ops.plain_layer_norm(h, layer.ln1_g, layer.ln1_b, eps=eps, kind=v.norm)
    q, k, val = (a @ layer.attn_w + layer.attn_b).split(d, dim=-1)
    q, k, val = (t.view(B, N, n_head, D).transpose(1, 2) for t in (q, k, val))  # (B, H, N, D)
    probs = ops.plain_softmax(
        q @ k.transpose(2, 3) / math.sqrt(D), kind=v.softmax, mask=ops.causal_mask(N, N), c=v.softmax_c
    )
    att = (probs @ val).transpose(1, 2).reshape(B, N, d)
    h = h + att @ layer.proj_w + layer.proj_b
    x = ops.plain_layer_norm(h, layer.ln2_g, layer.ln2_b, eps=eps, kind=v.norm)
    return h + ops.plain_activation(x @ layer.fc_w + layer.fc_b, kind=v.activation) @ layer.out_w + layer.out_b


def plaintext_hidden(w: GPT2Weights, variant: MPCVariant, emb: torch.Tensor) -> torch.Tensor:
    """Plaintext twin of :meth:`EncryptedGPT2.hidden` (positions from 0)."""
    h = emb + w.wpe[: emb.shape[1]]
    for layer in w.layers:
        h = _plain_block(layer, h, w.n_head, w.eps, variant)
    return ops.plain_layer_norm(h, w.lnf_g, w.lnf_b, eps=w.eps, kind=variant.norm)


def plaintext_logits(w: GPT2Weights, variant: MPCVariant, ids: torch.Tensor) -> torch.Tensor:
    """(B, N) ids -> (B, N, V) logits with the variant's approximations."""
    return plaintext_hidden(w, variant, w.wte[ids]) @ w.wte.T


def plaintext_reference(
    w: GPT2Weights, variant: MPCVariant, prefix_ids: torch.Tensor, max_new_tokens: int, *, mode: str = "vanilla"
) -> torch.Tensor:
    """Greedy tokens (B, max_new_tokens) computed in plaintext exactly as :meth:`EncryptedGPT2.generate`."""
    check_mode(mode, GENERATION_MODES)
    check_lengths(prefix_ids.shape[1], max_new_tokens, w.n_positions)
    emb, ids, out = w.wte[prefix_ids], prefix_ids, []
    for _ in range(max_new_tokens):
        if mode == "vanilla_er":
            last = plaintext_hidden(w, variant, emb)[:, -1:]
            out.append((last @ w.wte.T).argmax(-1))
            emb = torch.cat([emb, last], dim=1)
        else:
            nxt = plaintext_logits(w, variant, ids)[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
    return torch.cat(out, dim=1)


def null_meter() -> CostMeter:
    """A meter that records nothing (for one-off encrypted calls)."""
    return NullMeter()
