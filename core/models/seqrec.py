"""Sequential recommenders of DPFormer (App. E.2): a SASRec-style Transformer and GRU/LSTM baselines.

All models map left-padded item ids (B, L) -- 0 is padding, items are 1..num_items -- to next-item
scores over all ``num_items + 1`` rows of the item embedding, (B, L, num_items + 1). Column 0 (the
padding row) is scored like any item but is never a target (see :func:`core.models.loss.sequence_loss`).

Design choices (documented because the privacy machinery depends on them):

* **Tied embedding.** ``logits = h E^T`` through an ``nn.Linear(d, M + 1, bias=False)`` whose
  ``weight`` *is* the item-embedding Parameter ``E`` (M + 1, d): the parameter sharing of Sec. 4.1.
  Phantom Clipping (Claim 4.1) and Opacus' GradSampleModule both see the two uses through plain
  modules. ``tied=False`` gives the output layer its own weight (the "no sharing" setting; the
  paper's footnote 5 halves ``d_model`` there for a similar parameter count).
* **Padding.** Item embeddings (plus positions) are multiplied by the non-padding mask and real
  queries never attend to padding keys: real positions do not depend on padding ones (outputs are
  invariant to the padding length), and the input side of ``E`` gets exactly zero gradient in row
  0, whatever the targets; the output side does get one (row 0 is a candidate that the softmax
  pushes down). ``nn.Embedding.padding_idx`` is therefore not needed and not set.
* **Positions** are learned and right-aligned: the most recent item always sits at position
  ``max_len - 1``, so a batch shorter than ``max_len`` sees the same positions as a full one.
* **Block layout** (``norm_first``). Pre-LN (``True``, the default here): ``x + Drop(Attn(LN(x)))``,
  ``x + Drop(FFN(LN(x)))`` with a final LayerNorm (Xiong et al., 2020), which trains without
  learning-rate warm-up. Post-LN (``False``): the encoder of Vaswani et al. (2017) that DPFormer
  uses (App. E.2), ``LN(x + Drop(Attn(x)))``, ``LN(x + Drop(FFN(x)))`` and *no* final LayerNorm
  (the last block already ends in one; ``final_norm`` is ``nn.Identity``). The layout matters for
  Re-Attention (Sec. 5): in post-LN the first attention layer's keys are ``W_K (E[x] + P) + b``,
  so a rare item's embedding error reaches them un-normalised; in pre-LN a LayerNorm sits in
  between and bounds it (see :func:`core.dp.methods.build_reattention`). Both layouts use the same
  sub-modules (``ln_attn``/``ln_ff`` are the attention / feed-forward sub-layers' LayerNorms), so
  parameter names and counts are identical apart from ``final_norm``.
* **RNN baselines** are GRU / LSTM layers written out from ``nn.Linear`` modules (:class:`LinearGRU`,
  :class:`LinearLSTM`, the equations and gate order of ``torch.nn.GRU`` / ``torch.nn.LSTM``, checked against them in
  the tests) so that Phantom Clipping and Opacus can compute their per-sample norms. They run the
  recurrence in Python, hence are slower than cuDNN/ATen RNNs even without DP. Under left padding their
  state evolves through the (zeroed) padding inputs, so their outputs depend on the padding length;
  gradients remain exact.
* **Windows.** Every model also takes rows of ``T = K * max_len`` ids: K consecutive windows of ``max_len``
  positions, each encoded on its own (attention within the window, positions 0..max_len-1 in each, an RNN
  state that starts at zero in each), as if the K windows were K rows. The row is still one sample for the
  per-sample gradient machinery: every parameterised module sees the whole row, so a user's windows form one
  clipped unit (the trainer's ``train_targets="every"``, user-level DP over every training target).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.models.attention import CausalSelfAttention, ScoreCorrection

Arch = Literal["transformer", "gru", "lstm"]
Corrections = ScoreCorrection | Sequence[ScoreCorrection | None] | None
Activation = Literal["relu", "gelu"]
PADDING_ID = 0


@dataclass(frozen=True)
class SeqRecConfig:
    """Hyper-parameters of a sequential recommender (defaults: App. E.2, MovieLens dropout).

    Attributes:
        num_items: M, number of real items; ids are 1..M and 0 is padding.
        max_len: L_max, longest input sequence (number of learned positions).
        d_model: model / embedding dimension d.
        n_heads: attention heads (transformer only).
        n_layers: transformer blocks or stacked RNN layers.
        dropout: 0.2 for MovieLens, 0.5 for Amazon (App. E.3).
        tied: share the item embedding with the output layer (Sec. 4.1).
        arch: "transformer", "gru" or "lstm".
        d_ff: feed-forward width (transformer); None means 4 * d_model (Vaswani et al., 2017).
        activation: feed-forward non-linearity, "relu" (Vaswani et al.) or "gelu".
        norm_first: transformer block layout: True = pre-LN (default), False = post-LN, the encoder
            of Vaswani et al. that DPFormer uses (App. E.2). Only meaningful for arch="transformer";
            False with an RNN raises ConfigError.
    """

    num_items: int
    max_len: int
    d_model: int = 64
    n_heads: int = 1
    n_layers: int = 2
    dropout: float = 0.2
    tied: bool = True
    arch: Arch = "transformer"
    d_ff: int | None = None
    activation: Activation = "relu"
    norm_first: bool = True

    def __post_init__(self) -> None:
        for name in ("num_items", "max_len", "d_model", "n_heads", "n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {name}={value!r}")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise ConfigError(f"d_ff must be a positive int or None (= 4 * d_model), got d_ff={self.d_ff!r}")
        if self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"d_model must be divisible by n_heads, got d_model={self.d_model}, n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got dropout={self.dropout!r}")
        if self.arch not in get_args(Arch):
            raise ConfigError(f"unknown arch={self.arch!r}; known: {', '.join(get_args(Arch))}")
        if self.activation not in get_args(Activation):
            raise ConfigError(f"unknown activation={self.activation!r}; known: {', '.join(get_args(Activation))}")
        if not isinstance(self.tied, bool):
            raise ConfigError(f"tied must be a bool, got tied={self.tied!r}")
        if not isinstance(self.norm_first, bool):
            raise ConfigError(f"norm_first must be a bool, got norm_first={self.norm_first!r}")
        if not self.norm_first and self.arch != "transformer":
            raise ConfigError(
                f"norm_first=False (post-LN blocks) needs arch='transformer', got arch={self.arch!r}; "
                "RNNs have no LayerNorm blocks, leave norm_first=True"
            )

    @property
    def vocab_size(self) -> int:
        """Rows of the item embedding: num_items + 1 (row 0 = padding)."""
        return self.num_items + 1


class FeedForward(nn.Module):
    """Position-wise ``W_2 act(W_1 x)``: (B, L, d) -> (B, L, d)."""

    def __init__(self, d_model: int, d_ff: int, activation: Activation, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.act = nn.ReLU() if activation == "relu" else nn.GELU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class TransformerBlock(nn.Module):
    """Causal self-attention encoder block, pre-LN or post-LN (``cfg.norm_first``): (B, L, d) -> (B, L, d).

    Pre-LN: ``x + Drop(Attn(LN_a(x)))`` then ``x + Drop(FFN(LN_f(x)))``. Post-LN (Vaswani et al.):
    ``LN_a(x + Drop(Attn(x)))`` then ``LN_f(x + Drop(FFN(x)))``. ``LN_a``/``LN_f`` = ``ln_attn``/``ln_ff``.
    """

    def __init__(self, cfg: SeqRecConfig) -> None:
        super().__init__()
        self.norm_first = cfg.norm_first
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ln_ff = nn.LayerNorm(cfg.d_model)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff or 4 * cfg.d_model, cfg.activation, cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: Tensor, key_valid: Tensor, score_correction: ScoreCorrection | None = None, window: int | None = None
    ) -> Tensor:
        if self.norm_first:
            x = x + self.dropout(self.attn(self.ln_attn(x), key_valid, score_correction, window))
            return x + self.dropout(self.ff(self.ln_ff(x)))
        x = self.ln_attn(x + self.dropout(self.attn(x, key_valid, score_correction, window)))
        return self.ln_ff(x + self.dropout(self.ff(x)))


class SeqRecModel(nn.Module):
    """Shared parts: item embedding (M + 1, d), final LayerNorm, (tied) output layer.

    Subclasses implement :meth:`encode` (B, L) ids -> (B, L, d) hidden states before the final norm
    (``nn.Identity`` for post-LN transformers, whose last block ends in a LayerNorm).
    ``score_correction`` (forward argument): one Re-Attention correction for every attention layer
    or a sequence with one per layer (see :mod:`core.models.attention`); transformer only.
    """

    def __init__(self, cfg: SeqRecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.item_emb.weight, std=cfg.d_model**-0.5)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        post_ln = cfg.arch == "transformer" and not cfg.norm_first
        self.final_norm = nn.Identity() if post_ln else nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.output.weight = self.item_emb.weight  # the same Parameter: logits = h E^T

    def encode(self, input_ids: Tensor, valid: Tensor, score_correction: Corrections = None) -> Tensor:
        raise NotImplementedError

    def check_input(self, input_ids: Tensor) -> None:
        """Raise DataError unless ``input_ids`` is an integer (B, L) tensor of ids in [0, M], L <= L_max."""
        if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.dim() != 2:
            raise DataError(
                f"input_ids must be an int64 (B, L) tensor, got dtype={input_ids.dtype}, shape={tuple(input_ids.shape)}"
            )
        L, L_max = input_ids.shape[1], self.cfg.max_len
        if not (1 <= L <= L_max or L % L_max == 0):
            raise DataError(
                f"sequence length must be in [1, max_len={L_max}] or a multiple of max_len (windows), got {L=}"
            )
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() > self.cfg.num_items):
            raise DataError(
                f"item ids must be in [0, num_items={self.cfg.num_items}] (0 = padding), got range "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )

    def hidden(self, input_ids: Tensor, score_correction: Corrections = None) -> Tensor:
        """Final-normed hidden states (B, L, d) of left-padded ids (B, L); L > max_len: windows (module docstring)."""
        self.check_input(input_ids)
        input_ids = input_ids.contiguous()  # Opacus' embedding norm sampler calls .view on the ids
        valid = input_ids != PADDING_ID  # (B, L)
        return self.final_norm(self.encode(input_ids, valid, score_correction))

    def forward(self, input_ids: Tensor, score_correction: Corrections = None) -> Tensor:
        """Next-item scores (B, L, M + 1) = hidden (B, L, d) @ E^T (tied) or @ W_out^T (untied)."""
        return self.output(self.hidden(input_ids, score_correction))


class TransformerSeqRec(SeqRecModel):
    """SASRec-style causal Transformer (App. E.2) with learned positions and pre- or post-LN blocks."""

    def __init__(self, cfg: SeqRecConfig) -> None:
        super().__init__(cfg)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        nn.init.normal_(self.pos_emb.weight, std=cfg.d_model**-0.5)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))

    @property
    def attention_layers(self) -> list[CausalSelfAttention]:
        """The attention modules, first block first (where Re-Attention plugs its correction)."""
        return [block.attn for block in self.blocks]

    def set_score_correction(self, correction: Corrections) -> None:
        """Install one correction for every block, one per block (a sequence), or None to remove."""
        for layer, fn in zip(self.attention_layers, self._per_layer(correction), strict=True):
            layer.score_correction = fn

    def _per_layer(self, correction: Corrections) -> list[ScoreCorrection | None]:
        n = len(self.blocks)
        if correction is None or callable(correction):
            return [correction] * n
        per_layer = list(correction)
        if len(per_layer) != n:
            raise ConfigError(f"need one score correction per block ({n}), got {len(per_layer)}")
        return per_layer

    def encode(self, input_ids: Tensor, valid: Tensor, score_correction: Corrections = None) -> Tensor:
        B, T = input_ids.shape
        L_max = self.cfg.max_len
        window = L_max if T > L_max else None
        if window is None:  # one window, right-aligned: the last item at position max_len - 1
            positions = torch.arange(L_max - T, L_max, device=input_ids.device)
        else:  # K windows of max_len, each with positions 0..max_len-1
            positions = torch.arange(L_max, device=input_ids.device).repeat(T // L_max)
        positions = positions.repeat(B, 1)  # (B, T); contiguous (Opacus views the ids)
        x = (self.item_emb(input_ids) + self.pos_emb(positions)) * valid.unsqueeze(-1)  # (B, T, d)
        x = self.emb_dropout(x)
        for block, correction in zip(self.blocks, self._per_layer(score_correction), strict=True):
            x = block(x, valid, correction, window)
        return x


class LinearGRU(nn.Module):
    """Multi-layer GRU (``torch.nn.GRU``'s equations, gate order r, z, n, batch first) from ``nn.Linear`` modules.

    ``ih[l]`` (input to hidden, 3 d) is applied to the whole sequence at once, ``hh[l]`` (hidden to hidden) once
    per time step; both see the sample as their batch dimension, so per-sample gradient norms are exact.
    Input (B, K, L, d): K independent windows per sample, each starting from a zero state.
    """

    gates = 3
    recurrent = True  # hh[l] runs once per time step (opacus_ghost refuses such layers, core.dp.clipping)

    def __init__(self, d_model: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        self.ih = nn.ModuleList(nn.Linear(d_model, self.gates * d_model) for _ in range(num_layers))
        self.hh = nn.ModuleList(nn.Linear(d_model, self.gates * d_model) for _ in range(num_layers))
        self.dropout = nn.Dropout(dropout)  # between layers, as torch.nn.GRU's ``dropout``

    def _cell(self, gi: Tensor, h: Tensor, c: Tensor | None, hh: nn.Linear) -> tuple[Tensor, Tensor | None]:
        gh = hh(h)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None

    def forward(self, x: Tensor) -> Tensor:
        B, K, L, d = x.shape
        for layer, (ih, hh) in enumerate(zip(self.ih, self.hh, strict=True)):
            if layer:
                x = self.dropout(x)
            gi = ih(x.reshape(B, K * L, d)).view(B, K, L, -1)  # (B, K, L, gates * d)
            h = x.new_zeros(B, K, d)
            c = x.new_zeros(B, K, d) if self.gates == 4 else None
            outs = []
            for t in range(L):
                h, c = self._cell(gi[:, :, t], h, c, hh)
                outs.append(h)
            x = torch.stack(outs, dim=2)  # (B, K, L, d)
        return x


class LinearLSTM(LinearGRU):
    """Multi-layer LSTM (``torch.nn.LSTM``'s equations, gate order i, f, g, o), built like :class:`LinearGRU`."""

    gates = 4

    def _cell(self, gi: Tensor, h: Tensor, c: Tensor | None, hh: nn.Linear) -> tuple[Tensor, Tensor | None]:
        i, f, g, o = (gi + hh(h)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class RNNSeqRec(SeqRecModel):
    """GRU4Rec-style baseline (:class:`LinearGRU` / :class:`LinearLSTM`), same tied embedding."""

    def __init__(self, cfg: SeqRecConfig) -> None:
        super().__init__(cfg)
        rnn_cls = LinearGRU if cfg.arch == "gru" else LinearLSTM
        self.rnn = rnn_cls(cfg.d_model, cfg.n_layers, cfg.dropout if cfg.n_layers > 1 else 0.0)
        self.out_dropout = nn.Dropout(cfg.dropout)

    def encode(self, input_ids: Tensor, valid: Tensor, score_correction: Corrections = None) -> Tensor:
        if score_correction is not None:
            raise ConfigError(f"score_correction needs attention, but arch={self.cfg.arch!r} has none")
        B, T = input_ids.shape
        L = min(T, self.cfg.max_len)  # T > max_len: T / max_len windows, each from a zero state
        x = self.item_emb(input_ids) * valid.unsqueeze(-1)  # (B, T, d)
        out = self.rnn(self.emb_dropout(x).view(B, T // L, L, -1))  # (B, K, L, d)
        return self.out_dropout(out.reshape(B, T, -1))


def build_seqrec(cfg: SeqRecConfig) -> SeqRecModel:
    """Build the model named by ``cfg.arch`` (raises ConfigError listing known architectures)."""
    if not isinstance(cfg, SeqRecConfig):
        raise ConfigError(f"build_seqrec needs a SeqRecConfig, got {type(cfg).__name__}")
    if cfg.arch == "transformer":
        return TransformerSeqRec(cfg)
    return RNNSeqRec(cfg)


__all__ = [
    "PADDING_ID",
    "FeedForward",
    "LinearGRU",
    "LinearLSTM",
    "RNNSeqRec",
    "SeqRecConfig",
    "SeqRecModel",
    "TransformerBlock",
    "TransformerSeqRec",
    "build_seqrec",
]
