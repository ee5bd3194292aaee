"""MERGE's executor on GPT-2 under 2-party CrypTen MPC: embedding resending with the merge module (eq. 10-11) from a
:class:`core.mpc.merge_spec.MergeSpec`, executing exactly :func:`core.mpc.merge_spec.merge_generate_plain` on shares.
Each step processes the one new position against per-layer running sums of the constant attention, so its bytes do
not depend on the prefix length (App. C.1); ``recompute=True`` reruns the whole sequence. :class:`MergeLoop` is the
greedy loop shared with the LLaMA executor (``core.mpc.llama_merge``). The vanilla executors and the plaintext
references are :mod:`core.mpc.gpt2`."""

from __future__ import annotations

from typing import Any

import torch

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.accounting import CostMeter, OpCategory
from core.mpc.crypten_compat import import_crypten
from core.mpc.gpt2 import GenerationResult, StepLog, check_mode, finish_result, prefix_shape, reveal_tokens
from core.mpc.merge_spec import WEIGHT_KEYS, MergeState
from core.mpc.parties import CLIENT, MODEL_OWNER
from core.registry import lookup

CrypTensor = Any


# --- MERGE: embedding resending + merge module (core.mpc.merge_spec) ----------------------------------------
_MERGE_ACT = {"gelu_new": "gelu", "gelu": "gelu", "relu": "relu", "quad": "quad"}


class MergeLoop:
    """The greedy generation loop of a merged model on shares, shared by the GPT-2 (:class:`EncryptedMerge`) and
    LLaMA (``core.mpc.llama_merge.EncryptedLlamaMerge``) executors. The executor provides ``rank``, ``device``,
    ``vocab_size``, ``setup_costs``, ``lm_head_t`` (d, V), ``hidden_step(emb, state)`` (the last output hidden state
    after new input embeddings, one position per step) and, for ``recompute``, ``hidden(emb)`` (the whole sequence);
    its blocks charge ``self.meter``, which the loop sets."""

    def _share(self, x: torch.Tensor) -> CrypTensor:
        """``x`` secret-shared by the model owner (party 0), on this party's device."""
        return ops.share(x, src=MODEL_OWNER, rank=self.rank, device=self.device)

    def merge_loop(
        self,
        prefix_ids: torch.Tensor | None,
        max_new_tokens: int,
        mode: str,
        shape: tuple,
        table: CrypTensor,
        recompute: bool = False,
    ) -> GenerationResult:
        """``merge``: the last hidden state is resent as the next input embedding (eq. 3) and the tokens are decoded
        once at the end; ``mm``: every step selects a token (LM head + argmax) and looks its embedding up in
        ``table`` privately. The prompt's one-hots come from the client; the model owner passes zeros of ``shape``."""
        self.meter = m = CostMeter()
        crypten, log = import_crypten(), StepLog()
        with m.region():
            log.open(m)
            ids = prefix_ids if self.rank == CLIENT and prefix_ids is not None else torch.zeros(shape, dtype=torch.long)
            x = ops.share(ops.onehot(ids, self.vocab_size), src=CLIENT, rank=self.rank, device=self.device)
            emb, state, outs = ops.embed(x, table, m), MergeState(), []  # E_0 (B, N, d)
            for step in range(max_new_tokens):
                with log.step(m):
                    if step:  # the previous step's output is this step's input (every step after the first alike)
                        # mm: the selected token's embedding; merge: the hidden state itself (eq. 3)
                        nxt = ops.embed(outs[-1], table, m) if mode == "mm" else outs[-1]
                        emb = crypten.cat([emb, nxt], dim=1) if recompute else nxt
                    last = self.hidden(emb)[:, -1:] if recompute else self.hidden_step(emb, state)  # (B, 1, d)
                    if mode == "mm":
                        outs.append(ops.argmax_onehot(ops.linear(last, self.lm_head_t, None, m), m))  # (B, 1, V)
                    else:
                        outs.append(last)
            out = crypten.cat(outs, dim=1)  # (B, n_new, V) one-hots or (B, n_new, d) hidden states
            if mode == "merge":
                out = ops.argmax_onehot(ops.linear(out, self.lm_head_t, None, m), m)
            tokens = reveal_tokens(out, self.rank)
            log.close(m)
        return finish_result(self.rank, mode, m, tokens, dict(self.setup_costs), log)


class EncryptedMerge(MergeLoop):
    """A :class:`~core.mpc.merge_spec.MergeSpec` with shared weights (party 0); runs
    :func:`~core.mpc.merge_spec.merge_generate_plain` on shares (``generate(..., mode="merge")``).

    Costs: ``C @ v`` and the block's products (``W_V``, ``W_d``, ``M_u``, ``W_O``) are Linear, the kept
    LayerNorms Norm, the MLP nonlinearity Activation (spec ``gelu`` (erf) runs as the tanh GELU: |diff| <= ~1e-3),
    the prefix lookup and the positions Embed, the LM head + argmax Linear + Generation. No softmax, no lookup
    per step (``merge``). Incremental steps (the default) keep per layer the running sums (B, H, N_max, D) of the
    constant attention (:class:`~core.mpc.merge_spec.MergeState`): a step opens the block's weights and one
    column of ``C`` (H x N_max), whatever the prefix length.
    """

    def __init__(self, spec: Any, *, rank: int, device: str | torch.device = "cpu", norm: str = "exact") -> None:
        self.rank, self.device, self.norm = rank, torch.device(device), ops.check_choice("norm", norm, ops.NORMS)
        self.n_max, self.vocab_size = int(spec.n_max), int(spec.lm_head.shape[0])
        s = self._share
        setup = CostMeter()
        with setup.region():
            self.lm_head = s(spec.lm_head)  # (V, d), also the prefix embedding table
            self.lm_head_t = self.lm_head.t()  # (d, V)
            self.wpe, self.lnf_g, self.lnf_b, self.lnf_eps = (
                s(spec.wpe),
                s(spec.lnf_gamma),
                s(spec.lnf_beta),
                spec.lnf_eps,
            )
            self.layers = [
                (
                    {k: s(getattr(layer, k)) for k in ("C", *WEIGHT_KEYS)},
                    layer.ln_eps,
                    lookup("MERGE activation", _MERGE_ACT, layer.act),
                    layer.n_heads,
                )
                for layer in spec.layers
            ]
        self.setup_costs = setup.totals()
        self.meter = CostMeter()

    def _block(self, layer: tuple, h: CrypTensor, sums: CrypTensor | None, start: int | None) -> tuple:
        """One block on h (B, n, d): the whole sequence (``start`` None) or the new positions ``start..start+n-1``
        given the running sums (merge_spec's ``merged_block`` / ``merged_block_step``). Returns (out, sums)."""
        (p, eps, act, H), m = layer, self.meter
        B, n, d = h.size(0), h.size(1), h.size(2)
        g = ops.layer_norm(h, p["ln_gamma"], p["ln_beta"], m, eps=eps, kind=self.norm)  # (B, n, d)
        v = ops.linear(g, p["W_V"], None, m)  # (B, n, d)
        with m.op(OpCategory.LINEAR):
            v = v.view(B, n, H, d // H).transpose(1, 2)  # (B, H, n, D)
            c = p["C"][:, :n, :n] if start is None else p["C"][:, :, start : start + n]  # (H, n | N_max, n)
            o = c.matmul(v)  # (B, H, n | N_max, D)  head k mixed by C_k
            if start is not None:
                sums = o if sums is None else sums + o
                o = sums[:, :, start : start + n]  # (B, H, n, D)
            o = o.transpose(1, 2).reshape(B, n, d)  # (B, n, d)
        x = h + ops.linear(o, p["W_d"], p["b_a"], m)  # attention + residual
        u = ops.linear(x, p["M_u"], p["b_u"], m)  # (B, n, d_I)  eq. 10
        return x + ops.linear(ops.activation(u, m, kind=act), p["W_O"], p["b_O"], m), sums

    def _positions(self, emb: CrypTensor, start: int) -> CrypTensor:
        n = emb.size(1)
        if start + n > self.n_max:
            raise ConfigError(f"sequence length {start + n} exceeds the constant attention size N_max={self.n_max}")
        with self.meter.op(OpCategory.EMBED):
            return emb + self.wpe[start : start + n]

    def _ln_f(self, h: CrypTensor) -> CrypTensor:
        return ops.layer_norm(h, self.lnf_g, self.lnf_b, self.meter, eps=self.lnf_eps, kind=self.norm)

    def hidden(self, emb: CrypTensor) -> CrypTensor:
        """Eq. 11 stack + ln_f on the whole sequence of (B, N, d) input embeddings (positions from 0)."""
        h = self._positions(emb, 0)
        for layer in self.layers:
            h, _ = self._block(layer, h, None, None)
        return self._ln_f(h)

    def hidden_step(self, emb: CrypTensor, state: MergeState) -> CrypTensor:
        """The last output hidden state (B, 1, d) after n new input embeddings (B, n, d) at positions
        ``state.length`` on; advances ``state`` (merge_spec's ``merged_forward_step``)."""
        start = state.length
        h = self._positions(emb, start)
        sums = state.sums or [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            h, sums[i] = self._block(layer, h, sums[i], start)
        state.sums, state.length = sums, start + emb.size(1)
        return self._ln_f(h[:, -1:])

    def generate(
        self,
        prefix_ids: torch.Tensor | None,
        max_new_tokens: int,
        *,
        mode: str = "merge",
        shape: tuple[int, int] | None = None,
        recompute: bool = False,
    ) -> GenerationResult:
        """Greedy MERGE generation. ``mode="merge"`` (ER + MM, eq. 3): the last hidden state is resent as the
        next input embedding and tokens are decoded once at the end. ``mode="mm"`` (MM only): every step
        selects a token under MPC (LM head + argmax) and looks its embedding up privately, like vanilla.
        Each step processes only the new position (``recompute=True``: the whole sequence, the reference)."""
        check_mode(mode, ("merge", "mm"))
        shape = prefix_shape(prefix_ids, shape, max_new_tokens, self.n_max)
        return self.merge_loop(prefix_ids, max_new_tokens, mode, shape, self.lm_head, recompute)
