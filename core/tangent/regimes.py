"""DP fine-tuning regimes of TAFT (Sec. 3.4, Sec. 4.5, Table 3): which parameters DP-SGD trains.

Table 3 compares, under DP-SGD at ``epsilon in {1, 3, 8}``, fine-tuning the *linearised*
parameters ``Delta-w`` of a :class:`~core.tangent.model.TangentModel` ("Ours") against fine-tuning
the *original* parameters ``w`` of the same non-linear suffix (``NonlinearSuffix``, "Reg"), in four
regimes. Both model kinds read the same cached frozen prefix ``h = prefix(x): (n, N, D)`` of the
first ``L - k`` blocks, and a regime selects the *same* HF parameters in both (a delta ``d_x``
perturbs the weight ``x`` it names in ``TangentModel.source_names``):

============  =====================================================================================
``full``      every parameter of the last ``k`` blocks (attention q/k/v/o, MLP fc1/fc2, both block
              LayerNorms, Dinov2 layer-scales) + the final LayerNorm + the head (App. A: "the last
              attention block ... along with the last normalization and fully connected layer").
``bitfit``    BitFit (Ben Zaken et al.) bias terms: every ``bias`` of the last ``k`` blocks
              (q/k/v/o, fc1/fc2 and the LayerNorm shifts) + the final LayerNorm bias + the head.
``layernorm`` the affine ``weight``/``bias`` of every LayerNorm module that is fine-tuned: the two
              LayerNorms of each of the last ``k`` blocks and the final LayerNorm + the head.
``fc``        the classification head (``weight`` and ``bias``) only.
============  =====================================================================================

Choices (the caption of Table 3 leaves them open):

* The head is trained in every regime. A downstream task needs a new classifier: with a frozen
  (random) head, ``bitfit``/``layernorm`` could not learn the label map, and Table 3's BitFit and
  LayerNorm accuracies match or beat FC, which they could not without a trainable classifier.
  BitFit itself (Ben Zaken et al., Sec. 2) trains "the bias terms and the task-specific
  classification layer". The head weight is therefore in ``bitfit``, not only its bias.
* Only LayerNorms *after* the frozen prefix are trainable: the prefix is cached once (Sec. 5), and
  TAFT linearises only the last ``k`` blocks, so earlier LayerNorms have no tangent counterpart.
* Dinov2 layer-scale ``lambda1`` is multiplicative, neither a bias nor a LayerNorm affine
  parameter: it is only in ``full``.
* A TangentModel's ``d_cls`` (CLS-token shift, ``linearize_cls_token``) has no counterpart in the
  regular model, so no regime trains it (it stays at zero).

:func:`train_dp` is DP-SGD on any named subset of parameters (per-example gradients by
``vmap(grad(functional_call))``, Poisson sampling, clipping, Gaussian noise calibrated by the
accountant; :func:`core.tangent.train.dp_sgd`). :func:`train_regime_dp` builds the model of one
Table 3 cell and trains the regime's parameters. App. A: DP uses cross-entropy (``loss="ce"``),
predicts with the JVP output only (``predict_jvp_only``), 50 epochs without lr decay.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from core.dp.accounting import PrivacyLedger
from core.errors import ConfigError, DataError
from core.tangent.baselines import NonlinearSuffix
from core.tangent.layers import TangentLayerNorm
from core.tangent.model import TangentModel
from core.tangent.train import TangentTrainConfig, TrainStats, check_data, dp_sgd

__all__ = [
    "REGIMES",
    "RegimeName",
    "RegimeResult",
    "build_regime_model",
    "force_eager_attention_",
    "regime_parameter_names",
    "regular_names",
    "train_dp",
    "train_regime_dp",
]

RegimeName = Literal["full", "bitfit", "layernorm", "fc"]
REGIMES: tuple[str, ...] = get_args(RegimeName)

_HF_BLOCK = re.compile(r"^(?:encoder\.layer|layers)\.\d+\.(.+)$")  # "encoder.layer.11.norm1.weight"


def _check_regime(regime: object) -> str:
    if not isinstance(regime, str) or regime not in REGIMES:
        raise ConfigError(f"unknown regime={regime!r}; known: {', '.join(REGIMES)} (Table 3)")
    return regime


def _check_model(model: object) -> None:
    if not isinstance(model, TangentModel | NonlinearSuffix):
        raise ConfigError(f"regimes apply to a TangentModel or a NonlinearSuffix, got {type(model).__name__}")


def regular_names(model: TangentModel | NonlinearSuffix) -> dict[str, str]:
    """``{own parameter name: the NonlinearSuffix parameter it corresponds to}`` for every
    regime-eligible parameter, in ``named_parameters`` order.

    For a NonlinearSuffix this is the identity. For a TangentModel, ``blocks.j.attn.q.d_weight``
    (perturbing ``encoder.layer.i.attention.q_proj.weight``, ``i = L - k + j``) maps to
    ``blocks.j.attention.q_proj.weight``; ``layernorm.d_bias -> layernorm.bias``,
    ``head.d_weight -> head.weight``. ``d_cls`` has no counterpart and is left out.
    """
    _check_model(model)
    if isinstance(model, NonlinearSuffix):
        return {n: n for n, _ in model.named_parameters()}
    out = {}
    for name, _ in model.named_parameters():
        src = model.source_names.get(name)
        if src is None or name == "d_cls":
            continue
        if name.startswith("blocks."):
            j = name.split(".")[1]
            match = _HF_BLOCK.match(src)
            if match is None:  # pragma: no cover - TangentModel names its blocks this way
                raise ConfigError(f"cannot map delta {name!r} (source {src!r}) to a block parameter")
            out[name] = f"blocks.{j}.{match.group(1)}"
        else:
            out[name] = src  # layernorm.weight / layernorm.bias / head.weight / head.bias
    return out


def _selected(model: TangentModel | NonlinearSuffix, name: str, regular: str, regime: str) -> bool:
    """Does ``regime`` train parameter ``name`` (whose regular counterpart is ``regular``)?"""
    if regime == "full" or regular.startswith("head."):
        return True
    if regime == "bitfit":
        return regular.endswith(".bias")
    if regime == "layernorm":
        owner = model.get_submodule(name.rpartition(".")[0])
        return isinstance(owner, nn.LayerNorm | TangentLayerNorm)
    return False  # fc: the head only


def regime_parameter_names(model: TangentModel | NonlinearSuffix, regime: str) -> list[str]:
    """Names (in ``model.named_parameters()``) of the parameters ``regime`` fine-tunes (Table 3).

    TangentModel: delta names (``blocks.0.attn.q.d_bias``, ...) -- "Ours"; NonlinearSuffix:
    original parameter names (``blocks.0.attention.q_proj.bias``, ...) -- "Reg". For the same
    backbone and ``k`` the two lists correspond one to one through :func:`regular_names`.
    Raises :class:`ConfigError` for an unknown regime or model type.
    """
    regime = _check_regime(regime)
    return [n for n, r in regular_names(model).items() if _selected(model, n, r, regime)]


def force_eager_attention_(module: nn.Module) -> nn.Module:
    """Switch every HF attention in ``module`` to the eager implementation, in place.

    ``torch.func.vmap`` has no batching rule for the fused SDPA kernels and falls back to a slow
    per-example loop (with a warning); eager attention is plain matmul + softmax, the same function.
    Only the configs held by ``module``'s submodules are changed (a ``NonlinearSuffix`` holds deep
    copies, so the backbone is untouched). Returns ``module``.
    """
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", "eager") != "eager":
            cfg._attn_implementation = "eager"
    return module


def train_dp(
    module: nn.Module,
    trainable_names: Sequence[str],
    cached: Tensor,
    labels: Tensor,
    cfg: TangentTrainConfig,
    *,
    target_epsilon: float,
    clip_norm: float,
    delta: float | None = None,
    accountant: str = "rdp",
    generator: torch.Generator | None = None,
    max_physical_batch: int | None = 256,
) -> tuple[TrainStats, PrivacyLedger]:
    """DP-SGD on the parameters ``trainable_names`` of ``module``, in place (Sec. 3.4).

    ``module`` has ``forward_from_cache(h): (B, N, D) -> (B, C)`` (TangentModel or NonlinearSuffix).
    Per-example gradients ``vmap(grad(functional_call))``; Poisson batches of expected size
    ``q n = cfg.batch_size``; each clipped to norm ``clip_norm``; ``N(0, sigma^2 C^2)`` noise with
    ``sigma`` calibrated so the accountant spends ``<= target_epsilon`` at ``delta`` (default
    ``1/(10n)``); the sum divided by ``q n``; then Adam/SGD (:func:`core.tangent.train.dp_sgd`).
    ``cfg.ridge``/``cfg.ball_radius`` act around the parameters' values at the start of training.
    Every other parameter stays bit-identical; HF attention is switched to eager
    (:func:`force_eager_attention_`) and the module runs in eval mode (no dropout).

    Returns the (non-private, monitoring) stats and the privacy ledger. Raises
    :class:`ConfigError` for an empty or unknown name set, a bad epsilon/clip norm/batch size.
    """
    if not hasattr(module, "forward_from_cache"):
        raise ConfigError(f"train_dp needs a module with forward_from_cache, got {type(module).__name__}")
    names = list(trainable_names)
    if not names:
        raise ConfigError("train_dp: trainable_names is empty; pass e.g. regime_parameter_names(model, 'fc')")
    check_data(cached, labels)
    named = dict(module.named_parameters())
    unknown = [n for n in names if n not in named]
    if unknown:
        raise ConfigError(f"train_dp: unknown parameter names {unknown} for {type(module).__name__}")
    force_eager_attention_(module)
    center = {n: named[n].detach().clone() for n in names}
    return dp_sgd(
        module,
        names,
        cached,
        labels,
        cfg,
        target_epsilon=target_epsilon,
        clip_norm=clip_norm,
        delta=delta,
        accountant=accountant,
        generator=generator,
        center=center,
        max_physical_batch=max_physical_batch,
    )


@dataclass(frozen=True)
class RegimeResult:
    """One Table 3 cell: the trained model, its stats and ledger, and what was trained."""

    model: TangentModel | NonlinearSuffix
    stats: TrainStats
    ledger: PrivacyLedger
    trainable: int  # number of trained scalars
    regime: str
    tangent: bool


def build_regime_model(
    backbone: nn.Module,
    head: nn.Linear,
    *,
    tangent: bool,
    k: int = 1,
    predict_jvp_only: bool = True,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> TangentModel | NonlinearSuffix:
    """The model of a Table 3 column: ``TangentModel(backbone, C, k, predict_jvp_only, head)``
    ("Ours") or ``NonlinearSuffix(backbone, head, k)`` ("Reg"), in ``dtype`` (default: the backbone's).
    ``backbone`` and ``head`` are not modified."""
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"head must be an nn.Linear(D, C), got {type(head).__name__}")
    if tangent:
        model: nn.Module = TangentModel(
            backbone,
            head.out_features,
            k,
            predict_jvp_only=predict_jvp_only,
            head=copy.deepcopy(head),
            seed=seed,
        )
    else:
        model = force_eager_attention_(NonlinearSuffix(backbone, head, k))
    dtype = dtype if dtype is not None else next(backbone.parameters()).dtype
    return model.to(dtype).eval()


def train_regime_dp(
    backbone: nn.Module,
    head: nn.Linear,
    cached: Tensor,
    labels: Tensor,
    *,
    regime: str,
    tangent: bool,
    cfg: TangentTrainConfig,
    target_epsilon: float,
    clip_norm: float,
    k: int = 1,
    seed: int = 0,
    delta: float | None = None,
    accountant: str = "rdp",
    predict_jvp_only: bool = True,
    max_physical_batch: int | None = 256,
) -> RegimeResult:
    """Train one Table 3 cell: ``regime`` x (``tangent``: "Ours" / else "Reg") under DP-SGD.

    Args:
        backbone: ``Dinov2Model``/``ViTModel``, the pretrained point (not modified).
        head: the initial classifier ``nn.Linear(D, C)`` (copied; shared by both kinds).
        cached: frozen prefix activations of the first ``L - k`` blocks, ``(n, N, D)``
            (``TangentModel(backbone, C, k).cache_frozen(x)``); both kinds share this cache.
        labels: ``(n,)`` classes in ``[0, C)``.
        regime: one of :data:`REGIMES`.
        cfg: optimisation settings (App. A: ``loss="ce"``, 50 epochs, no lr decay).
        target_epsilon, clip_norm, delta, accountant: the DP-SGD mechanism (:func:`train_dp`).
        k: number of fine-tuned (linearised) last blocks.
        seed: noise/sampling seed (``cfg.seed`` is ignored here for them) and the TangentModel seed.
        predict_jvp_only: tangent logits ``J Delta-w`` only (App. A; True as in the paper).
    """
    regime = _check_regime(regime)
    check_data(cached, labels)
    model = build_regime_model(
        backbone, head, tangent=tangent, k=k, predict_jvp_only=predict_jvp_only, seed=seed, dtype=cached.dtype
    )
    d = model.head.weight.shape[1]
    if cached.dim() != 3 or cached.shape[-1] != d:
        raise DataError(f"cached must be (n, N, D={d}) prefix activations, got {tuple(cached.shape)}")
    names = regime_parameter_names(model, regime)
    named = dict(model.named_parameters())
    stats, ledger = train_dp(
        model,
        names,
        cached,
        labels,
        cfg,
        target_epsilon=target_epsilon,
        clip_norm=clip_norm,
        delta=delta,
        accountant=accountant,
        generator=torch.Generator().manual_seed(seed),
        max_physical_batch=max_physical_batch,
    )
    trainable = sum(named[n].numel() for n in names)
    return RegimeResult(model, stats, ledger, trainable, regime, tangent)
