"""MERGE's merge module on T5 (encoder-decoder): constant attention in every attention, the FFN's norm folded
into its first matrix (eq. 9-11), embedding resending on the decoder (eq. 3), plaintext and on shares.

What the paper does with cross-attention: its T5 rows (Tables 1-2) report zero softmax cost for MERGE and for
MM alone, so no attention of the model keeps a softmax; the authors' released encoder-decoder benchmark applies
a constant (H x N x N) matrix to the encoder's states in every encoder block, in every decoder self-attention and
in every cross-attention. We do the same:

* encoder block: ``h + C_enc[:, :P, :P] (RMS(h) W_V) W_d``, then ``+ act(x M_u) W_O`` with ``M_u = diag(g_ff) W_I``
  (the FFN's RMS norm replaced by ``f'_ln(x) = x * g``, eq. 9, and folded, eq. 10);
* decoder block: the same with a causal ``C_self`` (running sums, one new position per step, as
  :mod:`core.mpc.merge_spec`), plus the cross-attention ``C_cross[:, t, :P] (enc W_Vc) W_dc``: with constant
  attention its output does not depend on the decoder's state at all, so each block's ``enc W_Vc`` is computed
  once per prompt and a step reads one row of ``C_cross`` (H x P) whatever the decoder's length;
* the stacks' final RMS norms and each block's first norm are kept (eq. 11 keeps ``f_ln``); T5 has no biases,
  so eq. 10's merged biases are zero and left out. A gated FFN folds the norm into both its matrices.

``C`` is initialised as the average attention map over a set of inputs (eq. 8, :func:`average_attentions`); a
prompt shorter than the encoder's ``P_max`` uses the top-left corner of ``C_enc`` and the first columns of
``C_cross``, as the released code slices them. :func:`constant_attention_reference` is the unmerged model (T5's
own blocks with the attention probabilities replaced by ``C`` and the FFN norm by ``f'_ln``), the reference the
merged forward is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.accounting import CostMeter, OpCategory
from core.mpc.crypten_compat import import_crypten
from core.mpc.gpt2 import GenerationResult, StepLog, check_mode, finish_result, reveal_tokens
from core.mpc.merge_spec import MergeState
from core.mpc.parties import CLIENT, MODEL_OWNER
from core.mpc.t5 import T5Weights, check_generation

CrypTensor = Any
MERGE_MODES: tuple[str, ...] = ("merge", "mm")


@dataclass(frozen=True, kw_only=True)
class T5MergedLayer:
    """One merged T5 block. ``C`` (H, N_max, N_max) its self-attention's constant attention (causal in the
    decoder); ``ln`` (d,) the kept RMS norm at its input; ``W_V`` (d, I), ``W_d`` (I, d) the value and output
    projections; decoder blocks also ``C_cross`` (H, N_max, P_max), ``W_Vc`` (d, I), ``W_dc`` (I, d); ``M_u``
    one (d, F) matrix or two (gated), ``diag(g_ff) W_I``; ``W_O`` (F, d); ``act`` the FFN nonlinearity."""

    C: torch.Tensor
    ln: torch.Tensor
    W_V: torch.Tensor
    W_d: torch.Tensor
    M_u: tuple[torch.Tensor, ...]
    W_O: torch.Tensor
    act: str
    C_cross: torch.Tensor | None = None
    W_Vc: torch.Tensor | None = None
    W_dc: torch.Tensor | None = None

    @property
    def n_heads(self) -> int:
        return int(self.C.shape[0])


@dataclass(frozen=True, kw_only=True)
class T5MergeSpec:
    """A merged T5: ``shared`` (V, d) the token table (prompt lookups; MM's token lookups), ``lm_head`` (V, d),
    the merged ``encoder`` and ``decoder`` blocks, the kept final norms ``enc_ln``, ``dec_ln`` (d,), ``eps``,
    the decoder's ``start_id``."""

    shared: torch.Tensor
    lm_head: torch.Tensor
    encoder: tuple[T5MergedLayer, ...]
    enc_ln: torch.Tensor
    decoder: tuple[T5MergedLayer, ...]
    dec_ln: torch.Tensor
    eps: float
    start_id: int

    @property
    def p_max(self) -> int:
        """The longest prompt the encoder's constant attention covers."""
        return int(self.encoder[0].C.shape[1])

    @property
    def n_max(self) -> int:
        """The longest decoder sequence (start token + generated tokens) the decoder's constant attention covers."""
        return int(self.decoder[0].C.shape[1])

    def check(self, prompt_len: int, n_new: int) -> None:
        check_generation(prompt_len, n_new)
        if prompt_len > self.p_max:
            raise ConfigError(f"prompt length {prompt_len} exceeds the encoder's constant attention P_max={self.p_max}")
        if n_new > self.n_max:
            raise ConfigError(
                f"{n_new} new tokens need a decoder of {n_new} positions, more than the constant attention's "
                f"N_max={self.n_max}; export the spec with a larger n_max or generate fewer tokens"
            )


# --- eq. 8 and the fold ---------------------------------------------------------------------------------
def average_attentions(model: Any, enc_ids: torch.Tensor, dec_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Eq. 8 on a Hugging Face T5: the average attention maps over the (S, P) prompts and (S, N) decoder inputs,
    ``enc`` (L, H, P, P), ``self`` (L, H, N, N) (causal, row-stochastic), ``cross`` (L, H, N, P)."""
    with torch.no_grad():
        out = model(input_ids=enc_ids, decoder_input_ids=dec_ids, output_attentions=True)
    if not out.encoder_attentions:
        raise ConfigError("the T5 returned no attention maps: build it with attn_implementation='eager'")
    mean = lambda maps: torch.stack([a.mean(0) for a in maps]).detach()
    return {
        "enc": mean(out.encoder_attentions),
        "self": mean(out.decoder_attentions),
        "cross": mean(out.cross_attentions),
    }


def merge_spec_from_t5(w: T5Weights, c: dict[str, torch.Tensor]) -> T5MergeSpec:
    """The merged model of ``w`` under the constant attentions ``c`` (:func:`average_attentions`'s keys)."""
    if c["enc"].shape[0] != len(w.encoder) or c["self"].shape[0] != len(w.decoder):
        raise ConfigError(
            f"constant attention for {c['enc'].shape[0]} encoder and {c['self'].shape[0]} decoder blocks, the model "
            f"has {len(w.encoder)} and {len(w.decoder)}"
        )
    fold = lambda g, ff: tuple(g[:, None] * wi for wi in ff.wi)  # diag(g) W_I
    enc = tuple(
        T5MergedLayer(
            C=c["enc"][i], ln=b.ln1, W_V=b.attn.v, W_d=b.attn.o, M_u=fold(b.ln2, b.ff), W_O=b.ff.wo, act=w.act
        )
        for i, b in enumerate(w.encoder)
    )
    dec = tuple(
        T5MergedLayer(
            C=c["self"][i], ln=b.ln1, W_V=b.attn.v, W_d=b.attn.o, M_u=fold(b.ln3, b.ff), W_O=b.ff.wo, act=w.act,
            C_cross=c["cross"][i], W_Vc=b.cross.v, W_dc=b.cross.o,
        )
        for i, b in enumerate(w.decoder)
    )  # fmt: skip
    return T5MergeSpec(
        shared=w.shared, lm_head=w.lm_head, encoder=enc, enc_ln=w.enc_ln, decoder=dec, dec_ln=w.dec_ln,
        eps=w.eps, start_id=w.start_id,
    )  # fmt: skip


# --- the unmerged reference -----------------------------------------------------------------------------
def constant_attention_reference(
    w: T5Weights, c: dict[str, torch.Tensor], prompt_emb: torch.Tensor, dec_emb: torch.Tensor
) -> torch.Tensor:
    """T5's own blocks with every attention's probabilities replaced by ``c`` and each FFN's RMS norm by
    ``x * g``, whole sequences: the decoder's final hidden states (B, N, d). Slow and obviously what eq. 9
    describes; the merged forward must equal it."""
    B, P, _ = prompt_emb.shape
    N, H, D = dec_emb.shape[1], w.n_head, w.d_kv

    def mix(probs: torch.Tensor, a: Any, x: torch.Tensor) -> torch.Tensor:  # probs (H, n, T), x (B, T, d)
        v = (x @ a.v).view(B, x.shape[1], H, D).transpose(1, 2)  # (B, H, T, D)
        return (probs @ v).transpose(1, 2).reshape(B, probs.shape[1], H * D) @ a.o

    def ffn(ff: Any, x: torch.Tensor) -> torch.Tensor:
        u = ops.plain_activation(x @ ff.wi[0], kind=w.act)
        return (u * (x @ ff.wi[1]) if len(ff.wi) == 2 else u) @ ff.wo

    h = prompt_emb
    for i, b in enumerate(w.encoder):
        h = h + mix(c["enc"][i][:, :P, :P], b.attn, ops.plain_rms_norm(h, b.ln1, eps=w.eps))
        h = h + ffn(b.ff, h * b.ln2)
    enc = ops.plain_rms_norm(h, w.enc_ln, eps=w.eps)
    h = dec_emb
    for i, b in enumerate(w.decoder):
        h = h + mix(c["self"][i][:, :N, :N], b.attn, ops.plain_rms_norm(h, b.ln1, eps=w.eps))
        h = h + mix(c["cross"][i][:, :N, :P], b.cross, enc)
        h = h + ffn(b.ff, h * b.ln3)
    return ops.plain_rms_norm(h, w.dec_ln, eps=w.eps)


# --- the merged forward, plaintext ------------------------------------------------------------------------
def _split(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, n, inner = x.shape
    return x.view(B, n, heads, inner // heads).transpose(1, 2)  # (B, H, n, D)


def _join(o: torch.Tensor) -> torch.Tensor:
    B, H, n, D = o.shape
    return o.transpose(1, 2).reshape(B, n, H * D)


def _merged_ffn(layer: T5MergedLayer, x: torch.Tensor) -> torch.Tensor:
    u = ops.plain_activation(x @ layer.M_u[0], kind=layer.act)
    return (u * (x @ layer.M_u[1]) if len(layer.M_u) == 2 else u) @ layer.W_O


def merged_encode(spec: T5MergeSpec, emb: torch.Tensor) -> torch.Tensor:
    """The merged encoder's output (B, P, d) of prompt embeddings (B, P, d)."""
    P, h = emb.shape[1], emb
    for layer in spec.encoder:
        v = _split(ops.plain_rms_norm(h, layer.ln, eps=spec.eps) @ layer.W_V, layer.n_heads)
        x = h + _join(layer.C[:, :P, :P] @ v) @ layer.W_d
        h = x + _merged_ffn(layer, x)
    return ops.plain_rms_norm(h, spec.enc_ln, eps=spec.eps)


def cross_values(spec: T5MergeSpec, enc: torch.Tensor) -> list[torch.Tensor]:
    """Each decoder block's cross-attention values of the encoder output, (B, H, P, D), once per prompt."""
    return [_split(enc @ layer.W_Vc, layer.n_heads) for layer in spec.decoder]


def merged_decode_step(
    spec: T5MergeSpec, emb: torch.Tensor, cross: list[torch.Tensor], state: MergeState
) -> torch.Tensor:
    """Final decoder hidden states (B, n, d) of n new decoder input embeddings at positions ``state.length`` on;
    advances ``state``. With ``state`` fresh and the whole sequence it is the merged decoder on that sequence."""
    s, n = state.length, emb.shape[1]
    if s + n > spec.n_max:
        raise ConfigError(f"decoder length {s + n} exceeds the constant attention size N_max={spec.n_max}")
    h, sums = emb, state.sums or [None] * len(spec.decoder)
    for i, layer in enumerate(spec.decoder):
        v = _split(ops.plain_rms_norm(h, layer.ln, eps=spec.eps) @ layer.W_V, layer.n_heads)
        new = layer.C[:, :, s : s + n] @ v  # (B, H, N_max, D) pushed to every later position
        sums[i] = new if sums[i] is None else sums[i] + new
        x = h + _join(sums[i][:, :, s : s + n]) @ layer.W_d
        P = cross[i].shape[2]
        x = x + _join(layer.C_cross[:, s : s + n, :P] @ cross[i]) @ layer.W_dc
        h = x + _merged_ffn(layer, x)
    state.sums, state.length = sums, s + n
    return ops.plain_rms_norm(h, spec.dec_ln, eps=spec.eps)


def merge_generate_plain(
    spec: T5MergeSpec, prompt_ids: torch.Tensor, n_new: int, *, mode: str = "merge"
) -> torch.Tensor:
    """Greedy tokens (B, n_new) of the merged T5, one decoder position per step: ``merge`` resends the last
    hidden state as the next decoder input (eq. 3) and decodes every token at the end; ``mm`` selects a token
    every step and looks its embedding up, like vanilla."""
    check_mode(mode, MERGE_MODES)
    spec.check(prompt_ids.shape[1], n_new)
    B = prompt_ids.shape[0]
    cross = cross_values(spec, merged_encode(spec, spec.shared[prompt_ids]))
    emb, state, outs = spec.shared[torch.full((B, 1), spec.start_id)], MergeState(), []
    for _ in range(n_new):
        last = merged_decode_step(spec, emb, cross, state)  # (B, 1, d)
        if mode == "mm":
            outs.append((last @ spec.lm_head.T).argmax(-1))  # (B, 1)
            emb = spec.shared[outs[-1]]
        else:
            outs.append(last)
            emb = last
    if mode == "mm":
        return torch.cat(outs, dim=1)
    return (torch.cat(outs, dim=1) @ spec.lm_head.T).argmax(-1)


# --- on shares -------------------------------------------------------------------------------------------
class EncryptedT5Merge:
    """A :class:`T5MergeSpec` with shared weights (party 0); runs :func:`merge_generate_plain` on shares.
    No softmax anywhere; a decoder step processes one position, opens one column of each block's ``C_self``
    (H x N_max) and one row of its ``C_cross`` (H x P), whatever the decoder's length."""

    def __init__(self, spec: T5MergeSpec, *, rank: int, device: str | torch.device = "cpu") -> None:
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        self.vocab_size = int(spec.shared.shape[0])
        setup = CostMeter()
        with setup.region():
            s = self._share
            self.shared = s(spec.shared)
            self.lm_head_t = s(spec.lm_head).t()
            self.enc_ln, self.dec_ln = s(spec.enc_ln), s(spec.dec_ln)
            self.encoder = [self._share_layer(layer) for layer in spec.encoder]
            self.decoder = [self._share_layer(layer) for layer in spec.decoder]
        self.setup_costs = setup.totals()
        self.meter = CostMeter()

    def _share(self, x: torch.Tensor) -> CrypTensor:
        return ops.share(x, src=MODEL_OWNER, rank=self.rank, device=self.device)

    def _share_layer(self, layer: T5MergedLayer) -> dict[str, Any]:
        out = {k: self._share(getattr(layer, k)) for k in ("C", "ln", "W_V", "W_d", "W_O")}
        out["M_u"] = [self._share(m) for m in layer.M_u]
        if layer.C_cross is not None:
            out.update({k: self._share(getattr(layer, k)) for k in ("C_cross", "W_Vc", "W_dc")})
        out["act"], out["H"] = layer.act, layer.n_heads
        return out

    def _norm(self, x: CrypTensor, g: CrypTensor) -> CrypTensor:
        return ops.rms_norm(x, g, self.meter, eps=self.spec.eps)

    def _split(self, x: CrypTensor, heads: int) -> CrypTensor:
        with self.meter.op(OpCategory.LINEAR):
            B, n, inner = x.size(0), x.size(1), x.size(2)
            return x.view(B, n, heads, inner // heads).transpose(1, 2)

    def _mix(self, c: CrypTensor, v: CrypTensor, w_out: CrypTensor) -> CrypTensor:
        """``join(c @ v) @ w_out``: c (H, n, T) constant attention, v (B, H, T, D) values."""
        m = self.meter
        with m.op(OpCategory.LINEAR):
            o = c.matmul(v)
            B, H, n, D = o.size(0), o.size(1), o.size(2), o.size(3)
            o = o.transpose(1, 2).reshape(B, n, H * D)
        return ops.linear(o, w_out, None, m)

    def _ffn(self, p: dict, x: CrypTensor) -> CrypTensor:
        m = self.meter
        u = ops.activation(ops.linear(x, p["M_u"][0], None, m), m, kind=p["act"])
        if len(p["M_u"]) == 2:
            gate = ops.linear(x, p["M_u"][1], None, m)
            with m.op(OpCategory.ACTIVATION):
                u = u * gate
        return ops.linear(u, p["W_O"], None, m)

    def encode(self, emb: CrypTensor) -> CrypTensor:
        P, h = emb.size(1), emb
        for p in self.encoder:
            v = self._split(ops.linear(self._norm(h, p["ln"]), p["W_V"], None, self.meter), p["H"])
            x = h + self._mix(p["C"][:, :P, :P], v, p["W_d"])
            h = x + self._ffn(p, x)
        return self._norm(h, self.enc_ln)

    def cross_values(self, enc: CrypTensor) -> list[CrypTensor]:
        return [self._split(ops.linear(enc, p["W_Vc"], None, self.meter), p["H"]) for p in self.decoder]

    def decode_step(self, emb: CrypTensor, cross: list[CrypTensor], state: MergeState) -> CrypTensor:
        s, n, m = state.length, emb.size(1), self.meter
        if s + n > self.spec.n_max:
            raise ConfigError(f"decoder length {s + n} exceeds the constant attention size N_max={self.spec.n_max}")
        h, sums = emb, state.sums or [None] * len(self.decoder)
        for i, p in enumerate(self.decoder):
            v = self._split(ops.linear(self._norm(h, p["ln"]), p["W_V"], None, m), p["H"])
            with m.op(OpCategory.LINEAR):
                new = p["C"][:, :, s : s + n].matmul(v)  # (B, H, N_max, D)
                sums[i] = new if sums[i] is None else sums[i] + new
                o = sums[i][:, :, s : s + n]
                B, H, _, D = o.size(0), o.size(1), o.size(2), o.size(3)
                o = o.transpose(1, 2).reshape(B, n, H * D)
            x = h + ops.linear(o, p["W_d"], None, m)
            P = cross[i].size(2)
            x = x + self._mix(p["C_cross"][:, s : s + n, :P], cross[i], p["W_dc"])
            h = x + self._ffn(p, x)
        state.sums, state.length = sums, s + n
        return self._norm(h, self.dec_ln)

    def generate(
        self,
        prompt_ids: torch.Tensor | None,
        max_new_tokens: int,
        *,
        mode: str = "merge",
        shape: tuple[int, int] | None = None,
    ) -> GenerationResult:
        """Greedy generation as :func:`merge_generate_plain`; ``prompt_ids`` (B, P) on the client."""
        check_mode(mode, MERGE_MODES)
        shape = tuple(prompt_ids.shape) if prompt_ids is not None else shape
        if shape is None:
            raise ConfigError("pass prompt_ids (client) or shape=(B, P) (model owner)")
        self.spec.check(int(shape[1]), max_new_tokens)
        self.meter = m = CostMeter()
        crypten, log, B = import_crypten(), StepLog(), int(shape[0])
        with m.region():
            log.open(m)
            ids = prompt_ids if self.rank == CLIENT and prompt_ids is not None else torch.zeros(shape, dtype=torch.long)
            x = ops.share(ops.onehot(ids, self.vocab_size), src=CLIENT, rank=self.rank, device=self.device)
            state, outs, cross, emb = MergeState(), [], None, None
            for step in range(max_new_tokens):
                with log.step(m):
                    if step == 0:
                        cross = self.cross_values(self.encode(ops.embed(x, self.shared, m)))
                        with m.op(OpCategory.EMBED):
                            emb = self.shared[torch.full((B, 1), self.spec.start_id, dtype=torch.long)]
                    elif mode == "mm":
                        emb = ops.embed(outs[-1], self.shared, m)
                    else:
                        emb = outs[-1]  # eq. 3
                    last = self.decode_step(emb, cross, state)  # (B, 1, d)
                    outs.append(
                        ops.argmax_onehot(ops.linear(last, self.lm_head_t, None, m), m) if mode == "mm" else last
                    )
            out = crypten.cat(outs, dim=1)
            if mode == "merge":
                out = ops.argmax_onehot(ops.linear(out, self.lm_head_t, None, m), m)
            tokens = reveal_tokens(out, self.rank)
            log.close(m)
        return finish_result(self.rank, mode, m, tokens, dict(self.setup_costs), log)
