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

:func:`build_regime_model` builds the model of one Table 3 cell and :func:`regime_parameter_names` picks the
regime's parameters; :func:`core.tangent.train.train_dp` trains them under DP-SGD (per-example gradients by
``vmap(grad(functional_call))``, Poisson sampling, clipping, Gaussian noise calibrated by the accountant).
App. A: DP uses cross-entropy (``loss="ce"``), predicts with the JVP output only (``predict_jvp_only``), 50
epochs without lr decay, each step's gradient over the whole training set, and PT (linearise the pretrained last
block, or reset it first) searched per epsilon: :mod:`core.tangent.dp_search` holds that recipe.
"""

from __future__ import annotations

import copy
import re
from typing import Literal, get_args

import torch
from torch import nn

from core.errors import ConfigError
from core.tangent.baselines import NonlinearSuffix
from core.tangent.layers import TangentLayerNorm
from core.tangent.model import TangentModel, force_eager_attention_

__all__ = [
    "REGIMES",
    "REG_STARTS",
    "RegStart",
    "RegimeName",
    "build_regime_model",
    "regime_parameter_names",
    "regular_names",
]

RegimeName = Literal["full", "bitfit", "layernorm", "fc"]
REGIMES: tuple[str, ...] = get_args(RegimeName)
RegStart = Literal["zero", "head"]
REG_STARTS: tuple[str, ...] = get_args(RegStart)

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


def build_regime_model(
    backbone: nn.Module,
    head: nn.Linear,
    *,
    tangent: bool,
    k: int = 1,
    predict_jvp_only: bool = True,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    reg_start: str = "zero",
    pretrained: bool = True,
) -> TangentModel | NonlinearSuffix:
    """The model of a Table 3 column: ``TangentModel(backbone, C, k, predict_jvp_only, head)``
    ("Ours") or ``NonlinearSuffix(backbone, head, k)`` ("Reg"), in ``dtype`` (default: the backbone's).
    ``backbone`` and ``head`` are not modified.

    ``reg_start`` is where "Reg" starts: ``"zero"`` (default) centres it (``f(w) - f(w_0)``,
    ``NonlinearSuffix(centered=True)``) so that both columns start from the zero function with the same head at
    ``w_0`` ("Ours" predicts its JVP only, zero at ``Delta-w = 0``); ``"head"`` keeps the random head's output
    ``f(w_0)`` as its start, an offset "Ours" does not have. In the ``fc`` regime the two columns are then the same
    linear model of the same features, and with ``"zero"`` the same model from the same start: DP-SGD with the same
    noise trains them to the same logits (the control that separates the set-up from the method).

    ``pretrained`` is App. A's PT: ``True`` starts both columns at the pretrained last block; ``False`` (PT=F)
    resets it first (:func:`~core.tangent.model.reinit_block_` from ``seed``, the same weights in both columns) and
    "Ours" linearises around the reset block. The classifier is ``head`` either way: a new task's head is a fresh
    random layer (:func:`core.tangent.experiments.make_head`), so it is already "reset"."""
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"head must be an nn.Linear(D, C), got {type(head).__name__}")
    if reg_start not in REG_STARTS:
        raise ConfigError(f"unknown reg_start={reg_start!r}; known: {', '.join(REG_STARTS)}")
    if tangent:
        model: nn.Module = TangentModel(
            backbone,
            head.out_features,
            k,
            predict_jvp_only=predict_jvp_only,
            head=copy.deepcopy(head),
            seed=seed,
            reinit_last_block=not pretrained,
        )
    else:
        suffix = NonlinearSuffix(
            backbone, head, k, centered=reg_start == "zero", reinit_last_block=not pretrained, seed=seed
        )
        model = force_eager_attention_(suffix)
    dtype = dtype if dtype is not None else next(backbone.parameters()).dtype
    return model.to(dtype).eval()
