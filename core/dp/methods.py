"""Training configuration of DPFormer's experiments (Sec. 6, App. E.2-E.3) and the method registry.

:class:`DPTrainConfig` holds every knob of one training run of :func:`core.dp.trainer.train_seqrec`;
its defaults are the paper's (``d_model = 64``, 1 head, 2 blocks, dropout 0.2 for MovieLens,
normalised gradients with ``C = 1``, Adam with weight decay ``1e-5``, 20% warm-up then linear
decay). :data:`METHODS` names the compared methods as partial configs and :func:`method_config`
completes one; a method is trained non-privately with ``clipping="nonprivate", epsilon=None``.

Methods (Tables 1-2 and Sec. 4.3):

* ``gru``, ``lstm``: recurrent baselines with the tied embedding ("embedding sharing is applied for
  all evaluated methods if not explicitly stated", Sec. 6).
* ``transformer_untied``: "Transformer w/o PS", separate input and output embeddings.
* ``transformer``: the vanilla Transformer (tied, no Re-Attention).
* ``dpformer``: tied embedding (Phantom Clipping) + Re-Attention (Sec. 5), built for a model by
  :func:`build_reattention`.
* ``transformer_opacus_hooks``: the vanilla Transformer clipped by Opacus' per-sample-gradient hooks.
* ``transformer_opacus_ghost_untied``: Ghost Clipping (Opacus' fast gradient clipping) cannot tie
  parameters, so the model is untied with ``d_model`` halved to 32 (footnote 5: a similar number of
  parameters as the tied model). An explicit ``d_model`` override is taken literally: pass half of
  the other methods' ``d_model`` to keep footnote 5's comparison.

**Block layout.** App. E.2: "We use the standard Transformer encoder described in [36]" (Vaswani et
al., 2017), i.e. *post-LN* blocks ``LN(x + Attn(x))``. Every transformer method above therefore sets
``norm_first=False``; pass ``norm_first=True`` to get the pre-LN model (``x + Attn(LN(x))``, the
default of :class:`~core.models.SeqRecConfig` and of a bare :class:`DPTrainConfig`). The layout
changes what Re-Attention corrects (:func:`build_reattention`, every block): in post-LN the first
attention sees the raw embedding sum ``E[x] + P``, so a rare item's effective error (Claim 5.4)
reaches its key through ``W_K`` alone (eq. 5.5) and is not bounded, but the logit variance also
scales with the raw input's small norm (embeddings initialised with std ``d^-1/2``), so the first
post-LN block's correction is tiny except for the rarest items; every later post-LN block, and every
pre-LN block, reads LayerNorm-ed tokens whose noise is bounded by the LayerNorm but whose norm is not
small, and gets corrections orders of magnitude larger (docs/stages/train-dp.md has the measured sizes).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from core.dp.accounting import Accountant
from core.dp.clipping import CLIPPERS, ClippingMethod
from core.dp.propagation import BlockReAttention, EffectiveErrors
from core.dp.reattention import (
    block_error_variance,
    embedding_error_variance,
    token_presence_frequency,
)
from core.errors import ConfigError, DataError
from core.models import PADDING_ID, TransformerSeqRec

__all__ = ["METHODS", "WIDTH_FACTOR", "DPTrainConfig", "build_reattention", "method_config", "method_d_model"]

Arch = Literal["transformer", "gru", "lstm"]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class DPTrainConfig:
    """One training run: model (App. E.2), privacy (Sec. 3, eq. 3.1) and optimisation (Sec. 6, E.3).

    Model: ``arch``, ``tied`` (share the item embedding with the output layer, Sec. 4.1),
    ``d_model``, ``n_heads``, ``n_layers``, ``dropout``, ``max_len`` (longest input sequence),
    ``reattention`` (Sec. 5; transformer only; a no-op without noise, so ignored when non-private),
    ``norm_first`` (transformer block layout: True = pre-LN, False = post-LN as in App. E.2, which
    the transformer methods of :data:`METHODS` use; must be True for the RNNs).

    Privacy: ``clipping`` (a clipping method registered in :data:`~core.dp.clipping.CLIPPERS`;
    ``"nonprivate"`` disables DP), ``epsilon`` (target budget, required > 0 for private runs and forbidden for
    non-private ones), ``delta`` (None: ``default_delta(N) = 1 / (10 N)``; an explicit delta must be
    below ``1 / N``, checked against the data by the trainer), ``clip_norm`` ``C``, ``normalize``
    (automatic clipping ``C g / (||g|| + 0.01)``, the paper's normalised gradients with ``C = 1``),
    ``accountant`` (``"rdp"`` or ``"prv"``), ``secure_mode`` (private runs only: draw the DP noise and the
    Poisson batches from generators seeded by the OS CSPRNG and never recorded, instead of from ``seed``, which
    is recorded and regenerates them; :mod:`core.dp.noise`).

    Optimisation: ``epochs``; ``batch_size`` (the *expected* batch size ``q N`` of Poisson sampling,
    ``q = batch_size / N``; the fixed batch size of non-private runs); Adam ``lr`` and
    ``weight_decay``; ``train_targets``: ``"every"`` trains on every next-item target of a user's training
    prefix, in windows of ``max_len`` that together form the user's one clipped unit
    (:meth:`~core.data.sequential.SequentialDataset.train_windows`; RecBole's SASRec also trains on every target),
    ``"last_window"`` on the last ``max_len`` only (the earlier items are context, never targets);
    ``warmup_frac`` of the steps warms the learning rate up linearly, the rest
    decays it linearly to 0; ``eval_every`` (epochs); ``seed``; ``device``; ``max_steps`` caps the
    number of steps (tests, quick profiles) -- the privacy calibration and the learning-rate
    schedule then use the capped number, so the target epsilon is spent by the last step run.
    ``patience``: stop once this many evaluations in a row bring no better validation NDCG@10 under
    either protocol (RecBole's ``stopping_step``); None trains every epoch. The schedule stays the
    planned one, and a private run that stops early has spent less than its target epsilon.
    """

    arch: Arch = "transformer"
    tied: bool = True
    d_model: int = 64
    n_heads: int = 1
    n_layers: int = 2
    dropout: float = 0.2
    max_len: int = 200
    train_targets: str = "every"
    reattention: bool = False
    norm_first: bool = True
    clipping: str = ClippingMethod.PHANTOM.value
    epsilon: float | None = None
    delta: float | None = None
    clip_norm: float = 1.0
    normalize: bool = True
    accountant: str = Accountant.RDP.value
    secure_mode: bool = False
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float = 1e-5
    warmup_frac: float = 0.2
    eval_every: int = 1
    seed: int = 0
    device: str = "cpu"
    max_steps: int | None = None
    patience: int | None = None

    def __post_init__(self) -> None:
        self._check_model()
        self._check_privacy()
        self._check_optimisation()

    @property
    def private(self) -> bool:
        """Whether this run is differentially private (``clipping != "nonprivate"``)."""
        return self.clipping != ClippingMethod.NONPRIVATE.value

    def _check_model(self) -> None:
        if self.arch not in get_args(Arch):
            raise ConfigError(f"unknown arch={self.arch!r}; known: {', '.join(get_args(Arch))}")
        for name in ("tied", "reattention", "normalize", "norm_first", "secure_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        for name in ("d_model", "n_heads", "n_layers", "max_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {name}={value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model must be divisible by n_heads, got d_model={self.d_model}, n_heads={self.n_heads}"
            )
        if not _is_real(self.dropout) or not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got dropout={self.dropout!r}")
        if self.reattention and self.arch != "transformer":
            raise ConfigError(
                f"reattention=True needs attention, but arch={self.arch!r} has none; use arch='transformer'"
            )
        if not self.norm_first and self.arch != "transformer":
            raise ConfigError(
                f"norm_first=False (post-LN blocks) needs arch='transformer', got arch={self.arch!r}; "
                "leave norm_first=True for the RNNs"
            )

    def _check_privacy(self) -> None:
        name = self.clipping.value if isinstance(self.clipping, ClippingMethod) else self.clipping
        if not isinstance(name, str) or name not in CLIPPERS:
            raise ConfigError(f"unknown clipping={self.clipping!r}; known: {', '.join(CLIPPERS)}")
        object.__setattr__(self, "clipping", name)
        object.__setattr__(self, "accountant", Accountant(self.accountant).value)
        if self.private:
            if self.epsilon is None or not _is_real(self.epsilon) or self.epsilon <= 0:
                raise ConfigError(
                    f"epsilon must be a finite number > 0 for private training (clipping={self.clipping!r}), "
                    f"got epsilon={self.epsilon!r}; or train without DP with clipping='nonprivate'"
                )
        elif self.secure_mode:
            raise ConfigError(
                "secure_mode=True secures the DP noise, but clipping='nonprivate' adds none; "
                "leave secure_mode=False or pick a clipping method (e.g. 'phantom')"
            )
        elif self.epsilon is not None or self.delta is not None:
            raise ConfigError(
                f"clipping='nonprivate' trains without DP, so epsilon and delta must be None, got "
                f"epsilon={self.epsilon!r}, delta={self.delta!r}; pick a clipping method (e.g. 'phantom')"
            )
        if self.delta is not None and not (_is_real(self.delta) and 0 < self.delta < 1):
            raise ConfigError(
                f"delta must be in (0, 1) and below 1/N, got delta={self.delta!r}; "
                "None uses default_delta(N) = 1/(10 N)"
            )
        if not _is_real(self.clip_norm) or self.clip_norm <= 0:
            raise ConfigError(f"clip_norm must be a finite number > 0, got clip_norm={self.clip_norm!r}")
        if self.clipping == ClippingMethod.OPACUS_GHOST.value and self.tied:
            raise ConfigError(
                "clipping='opacus_ghost' does not support the tied embedding (Opacus refuses parameter "
                "tying); set tied=False (method 'transformer_opacus_ghost_untied') or use 'phantom'"
            )

    def _check_optimisation(self) -> None:
        for name in ("epochs", "batch_size", "eval_every"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {name}={value!r}")
        if self.max_steps is not None and (not _is_int(self.max_steps) or self.max_steps < 1):
            raise ConfigError(f"max_steps must be a positive integer or None, got max_steps={self.max_steps!r}")
        if self.patience is not None and (not _is_int(self.patience) or self.patience < 1):
            raise ConfigError(f"patience must be a positive integer or None, got patience={self.patience!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got seed={self.seed!r}")
        if not _is_real(self.lr) or self.lr <= 0:
            raise ConfigError(f"lr must be a finite number > 0, got lr={self.lr!r}; the paper uses 1e-3..9e-3")
        if self.train_targets not in TRAIN_TARGETS:
            raise ConfigError(
                f"train_targets must be one of {list(TRAIN_TARGETS)}, got train_targets={self.train_targets!r}"
            )
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be a finite number >= 0, got weight_decay={self.weight_decay!r}")
        if not _is_real(self.warmup_frac) or not 0 <= self.warmup_frac < 1:
            raise ConfigError(
                f"warmup_frac must be in [0, 1), got warmup_frac={self.warmup_frac!r}; the paper uses 0.2"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"device must be a torch device string such as 'cpu' or 'cuda:0', got {self.device!r}"
            ) from None


#: Which next-item targets a run trains on (:class:`DPTrainConfig`, ``train_targets``).
TRAIN_TARGETS = ("every", "last_window")

_COMMON: dict[str, Any] = {"arch": "transformer", "tied": True, "reattention": False, "clipping": "phantom"}
_POST_LN: dict[str, Any] = {"norm_first": False}  # App. E.2: Vaswani et al.'s (post-LN) encoder

#: The compared methods as partial :class:`DPTrainConfig` s (see the module docstring).
METHODS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        name: MappingProxyType(_COMMON | partial)
        for name, partial in {
            "gru": {"arch": "gru"},
            "lstm": {"arch": "lstm"},
            "transformer_untied": _POST_LN | {"tied": False},
            "transformer": _POST_LN,
            "dpformer": _POST_LN | {"reattention": True},
            "transformer_opacus_hooks": _POST_LN | {"clipping": "opacus_hooks"},
            "transformer_opacus_ghost_untied": _POST_LN | {"clipping": "opacus_ghost", "tied": False, "d_model": 32},
        }.items()
    }
)

#: A method's model width relative to the width the comparison is run at: the Opacus ghost-clipping peer refuses
#: tied parameters, so its untied model halves ``d_model`` and its two embedding tables hold about as many
#: parameters as the others' one shared table (DPFormer footnote 5). Every other method: 1.
WIDTH_FACTOR: Mapping[str, float] = MappingProxyType({"transformer_opacus_ghost_untied": 0.5})

_FIELDS = frozenset(f.name for f in fields(DPTrainConfig))


def method_d_model(name: str, d_model: int) -> int:
    """The ``d_model`` method ``name`` runs at when the comparison's width is ``d_model`` (:data:`WIDTH_FACTOR`);
    ConfigError for an unknown method or a width that is not a positive int."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    if not _is_int(d_model) or d_model < 1:
        raise ConfigError(f"d_model must be a positive int, got {d_model!r}")
    return max(1, int(d_model * WIDTH_FACTOR.get(name, 1.0)))


def method_config(name: str, **overrides: Any) -> DPTrainConfig:
    """The :class:`DPTrainConfig` of method ``name`` with ``overrides`` (which win) applied.

    ``epochs``, ``batch_size`` and ``lr`` must be given, and ``epsilon`` unless
    ``clipping="nonprivate"``. Raises ConfigError for an unknown method (listing the known ones) or
    an unknown field.
    """
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise ConfigError(f"unknown DPTrainConfig field(s) {unknown}; known: {', '.join(sorted(_FIELDS))}")
    try:
        return DPTrainConfig(**(dict(METHODS[name]) | overrides))
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"method {name!r}: {err}; pass epochs=, batch_size= and lr=") from None


def build_reattention(
    model: TransformerSeqRec,
    train_inputs: Tensor,
    train_targets: Tensor,
    *,
    noise_multiplier: float,
    clip_norm: float,
    expected_batch_size: float,
    window: int | None = None,
) -> BlockReAttention:
    """Re-Attention (Sec. 5.2) in every block of ``model``, trained on the windows ``train_inputs``/``train_targets``.

    ``train_inputs``/``train_targets``: (N, L) item ids, one row per user; ``window``: the rows hold
    consecutive windows of ``window`` positions (:meth:`~core.data.sequential.SequentialDataset.train_windows`),
    and position ``j`` counts a user whose any window reaches it.

    Item variances: Claim 5.4 with ``p_i`` = fraction of rows (users) containing item ``i`` (eq. C.3),
    floored at ``1 / N``; every block parameter: Claim 5.3; position ``j``: Claim 5.4 with the fraction
    of rows with a window whose input is not padding at ``j`` (a padded position gets no gradient). The
    frequencies are treated as public (Remark C.1) although computed from the data.

    :class:`~core.dp.propagation.BlockReAttention` propagates them block by block, pre-LN or post-LN as
    the model is built, to each block's attention logits and corrects every block by its own logit
    variance (:mod:`core.dp.propagation`).
    """
    if not isinstance(model, TransformerSeqRec):
        raise ConfigError(f"Re-Attention needs a TransformerSeqRec (attention), got {type(model).__name__}")
    n = train_inputs.shape[0]
    sizes = {"noise_multiplier": noise_multiplier, "clip_norm": clip_norm, "batch_size": expected_batch_size}
    windows = torch.cat([train_inputs, train_targets], dim=1).cpu()
    item_freq = token_presence_frequency(windows, num_embeddings=model.cfg.vocab_size)
    item_var = embedding_error_variance(**sizes, frequencies=item_freq, min_frequency=1 / n)
    n_pos = train_inputs.shape[1] if window is None else window
    if train_inputs.shape[1] % n_pos:
        raise DataError(f"train_inputs have {train_inputs.shape[1]} columns, not a multiple of window={window}")
    reached = (train_inputs != PADDING_ID).reshape(n, -1, n_pos).any(dim=1)  # (N, positions)
    position_freq = reached.float().mean(dim=0).cpu()
    position_var = embedding_error_variance(**sizes, frequencies=position_freq, padding_idx=None, min_frequency=1 / n)
    device = model.item_emb.weight.device
    errors = EffectiveErrors(
        item=item_var.to(device), position=position_var.to(device), block=block_error_variance(**sizes)
    )
    return BlockReAttention(model, errors)
