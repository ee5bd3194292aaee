"""MERGE training in plaintext: embedding resending (ER) and the merge module (MM) (Liang et al. 2024).

ER (Sec. 4.2) on any GPT-2-like model (HF ``GPT2LMHeadModel``, :class:`~core.mpc.approx.ApproxGPT2`,
:class:`MergeModel`): the input embeddings ``E`` (B, N, d) are augmented (eq. 5, ``m * (e + n)`` with
``m ~ Bernoulli(1 - p)`` elementwise, ``n ~ U(-eps, eps)``), and the model minimises
``lambda * L_c + (1 - lambda) * L_ce`` (eq. 7), with ``L_c`` the alignment loss of eq. 4
(``1 - cos(h_{t-1}, E_t)``: the last hidden state at t-1 must look like the token embedding at t) and
``L_ce`` next-token cross-entropy on the augmented input (eq. 6). Defaults are App. C: p = 0.6, eps = 0.75,
lambda = 0.75, lr = 8e-5.

MM (Sec. 4.3) is :class:`MergeModel`: per block the dynamic attention becomes a constant, causal,
row-stochastic ``C^n`` (H, N_max, N_max) initialised as the training-set average attention map (eq. 8,
:func:`average_attention`) and kept row-stochastic by a masked softmax over learned logits; the LayerNorm
before the MLP becomes ``f'_ln(x) = x * gamma + beta`` (eq. 9); GPT-2's first LayerNorm stays (eq. 11's kept
``f_ln``). :func:`export_spec` folds ``f'_ln`` into ``W_I`` (``M_u, b_u``, eq. 10) and the value bias into the
attention bias, and writes the :class:`~core.mpc.merge_spec.MergeSpec` contract (fewer weights than the GPT-2
block); the MM model is trained by weighted distillation from the ER model (:func:`train_mm`: hidden-state MSE
of every layer + logits KL; the paper gives no weights, so they are :class:`MMConfig` fields, 1 and 1 by
default).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.divergence import DivergenceGuard
from core.errors import ConfigError
from core.mpc.approx import ApproxGPT2, logits_kd_loss
from core.mpc.merge_spec import (
    ACTIVATIONS,
    MergedLayerSpec,
    MergeSpec,
    activation,
    check_length,
)

# --- ER: embedding resending (eq. 3-7) --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ERConfig:
    """Eq. 5-7 hyperparameters (App. C defaults): mask rate ``dropout`` = p, ``noise`` = eps, ``lam`` = lambda."""

    dropout: float = 0.6
    noise: float = 0.75
    lam: float = 0.75

    def __post_init__(self) -> None:
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"ERConfig.dropout must be in [0, 1), got dropout={self.dropout}")
        if self.noise < 0:
            raise ConfigError(f"ERConfig.noise must be >= 0, got noise={self.noise}")
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"ERConfig.lam must be in [0, 1], got lam={self.lam}")


@dataclass(frozen=True, kw_only=True)
class MMConfig:
    """Weighted distillation of the merge module from the ER model: ``hidden_weight * mean_n MSE(h^n)
    + logits_weight * T^2 KL(teacher || student)``.

    ``relative_hidden``: each layer's squared error divided by the teacher's mean square of that layer (detached),
    so every layer weighs alike whatever its scale. GPT-2 uses the plain MSE; SmolLM2's residual stream has a mean
    square near 1e6 at its first position (an attention sink) against about 1 to 1,000 elsewhere, so the plain MSE
    there is that position's and a few layers' error, and the logits term is orders of magnitude smaller."""

    hidden_weight: float = 1.0
    logits_weight: float = 1.0
    temperature: float = 1.0
    relative_hidden: bool = False

    def __post_init__(self) -> None:
        if self.hidden_weight < 0 or self.logits_weight < 0 or self.temperature <= 0:
            raise ConfigError(f"MMConfig weights must be >= 0 and temperature > 0, got {self}")


def augment_embeddings(
    E: torch.Tensor, *, dropout: float, noise: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Eq. 5: ``m * (e + n)`` elementwise, ``m ~ Bernoulli(1 - dropout)``, ``n ~ U(-noise, noise)``.

    No 1/(1-p) rescaling (eq. 5 has none). dropout = noise = 0 returns E unchanged.
    """
    out = E
    if noise > 0:
        n = torch.rand(E.shape, generator=generator, dtype=E.dtype, device=E.device) * 2 * noise - noise
        out = out + n
    if dropout > 0:
        keep = torch.rand(E.shape, generator=generator, dtype=E.dtype, device=E.device) >= dropout
        out = out * keep
    return out


def alignment_loss(hidden: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 4: mean over t = 1..N-1 of ``1 - cos(hidden[:, t-1], embeds[:, t])``.

    Args:
        hidden: (B, N, d) output hidden states (after the final LN, the vectors that get resent).
        embeds: (B, N, d) clean token embeddings E.
        mask: (B, N) bool, True on real tokens; a pair counts when token t is real.
    """
    cos = F.cosine_similarity(hidden[:, :-1], embeds[:, 1:], dim=-1)  # (B, N-1)
    loss = 1 - cos
    if mask is None:
        return loss.mean()
    w = mask[:, 1:].to(loss.dtype)
    return (loss * w).sum() / w.sum().clamp_min(1)


def lm_ce_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 6: next-token cross-entropy of ``logits[:, t-1]`` against ``ids[:, t]`` over real tokens."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    if mask is None:
        return ce.mean()
    w = mask[:, 1:].flatten().to(ce.dtype)
    return (ce * w).sum() / w.sum().clamp_min(1)


def token_embeddings(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings ``E = f_e(x)`` (B, N, d) of a HF causal LM (GPT-2, LLaMA: its input embeddings),
    ApproxGPT2 or a merge model (its ``wte`` or ``get_input_embeddings()``)."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings()(ids)
    return model.wte(ids)


def forward_embeds(model: nn.Module, E: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run a model on token embeddings E (B, N, d); returns (hidden states, logits (B, N, V)).

    The hidden states are n_layer + 1 tensors (B, N, d), HF's convention: input + positions, each block's
    output, the last one after the final LN (the vector that is resent). A model whose forward returns a
    :class:`MergeOutput` says so with ``returns_merge_output = True`` (the LLaMA merge model does).
    """
    if isinstance(model, (ApproxGPT2, MergeModel)) or getattr(model, "returns_merge_output", False):
        out = model(inputs_embeds=E)
        return out.hidden, out.logits
    out = model(inputs_embeds=E, output_hidden_states=True)
    return list(out.hidden_states), out.logits


@dataclass
class ERLoss:
    total: torch.Tensor
    align: torch.Tensor
    ce: torch.Tensor


def er_loss(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    cfg: ERConfig = ERConfig(),
    generator: torch.Generator | None = None,
) -> ERLoss:
    """Eq. 7 on one batch ids (B, N): one forward on the augmented embeddings gives both terms."""
    E = token_embeddings(model, ids)  # (B, N, d)
    E_aug = augment_embeddings(E, dropout=cfg.dropout, noise=cfg.noise, generator=generator)
    hidden, logits = forward_embeds(model, E_aug)
    align = alignment_loss(hidden[-1], E, mask)
    ce = lm_ce_loss(logits, ids, mask)
    return ERLoss(total=cfg.lam * align + (1 - cfg.lam) * ce, align=align, ce=ce)


def _unpack(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (batch, None) if isinstance(batch, torch.Tensor) else (batch[0], batch[1])


def _check_training(steps: int, lr: float, batches: list) -> None:
    if steps < 1 or lr <= 0:
        raise ConfigError(f"training needs steps >= 1 and lr > 0, got {steps=}, {lr=}")
    if not batches:
        raise ConfigError("training needs at least one batch, got none")


def _train_cycled(
    model: nn.Module,
    batches: Sequence | Iterable,
    steps: int,
    lr: float,
    what: str,
    step_loss: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> list[float]:
    """``steps`` AdamW steps on ``model``'s parameters, the ``batches`` (ids or (ids, mask)) cycled, each step
    minimising ``step_loss(ids, mask)``; a diverging loss stops it (``what`` names the learning rate to lower).
    Returns the per-step losses."""
    batches = list(batches)
    _check_training(steps, lr, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    guard = DivergenceGuard(hint=f"lower the {what} learning rate (lr={lr:g})")
    model.train()
    losses = []
    for step in range(steps):
        ids, mask = _unpack(batches[step % len(batches)])
        loss = step_loss(ids, mask)
        losses.append(guard.check(loss, step=step + 1))  # DivergedError: NaN/inf or exploding
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def train_er(
    model: nn.Module,
    batches: Sequence | Iterable,
    steps: int,
    lr: float = 8e-5,
    *,
    cfg: ERConfig = ERConfig(),
    seed: int = 0,
) -> list[dict[str, float]]:
    """ER fine-tuning (eq. 7) with AdamW; batches (ids or (ids, mask)) are cycled. Returns per-step losses."""
    gen = torch.Generator().manual_seed(seed)
    history = []

    def step_loss(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        loss = er_loss(model, ids, mask, cfg=cfg, generator=gen)
        history.append({k: float(getattr(loss, k).detach()) for k in ("total", "align", "ce")})
        return loss.total

    _train_cycled(model, batches, steps, lr, "ER", step_loss)
    return history


# --- MM: the merge module (eq. 8-11) -------------------------------------------------------------------


@torch.no_grad()
def average_attention(model: nn.Module, batches: Sequence | Iterable, n_max: int) -> torch.Tensor:
    """Eq. 8: the training-set average attention maps, (L, H, n_max, n_max), causal and row-stochastic.

    Row i is averaged over the sequences whose token i is real; rows no sequence reaches are uniform
    over keys 0..i (:func:`mean_attention_maps`).
    """
    fwd = model if isinstance(model, ApproxGPT2) else ApproxGPT2(model, "exact", share=True)
    was_training = fwd.training
    fwd.eval()

    def maps() -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
        for batch in batches:
            ids, mask = _unpack(batch)
            check_length(ids.shape[1], n_max)
            yield torch.stack(fwd(ids).attentions, dim=1), mask  # (B, L, H, N, N)

    try:
        return mean_attention_maps(maps(), n_max, what="average_attention")
    finally:
        fwd.train(was_training)


@torch.no_grad()
def mean_attention_maps(
    maps: Iterable[tuple[torch.Tensor, torch.Tensor | None]], n_max: int, *, what: str = "average_attention"
) -> torch.Tensor:
    """Eq. 8's accumulation: the mask-weighted mean of per-batch attention maps, (L, H, n_max, n_max).

    Args:
        maps: pairs (att (B, L, H, N, N) causal row-stochastic attention probabilities of every layer, mask (B, N)
            bool True on real tokens or None: all real), N <= n_max.
        n_max: the size of the returned maps.
        what: the caller named in the error when ``maps`` is empty.

    Row i is averaged over the sequences whose token i is real; rows no sequence reaches are uniform over keys
    0..i, so every row of the result sums to 1 and is causal.
    """
    total, count = None, torch.zeros(n_max)
    for att, mask in maps:
        n = att.shape[-1]
        w = torch.ones(att.shape[0], n, dtype=att.dtype) if mask is None else mask.to(att.dtype)  # (B, N)
        if total is None:
            total = att.new_zeros((att.shape[1], att.shape[2], n_max, n_max))
        total[:, :, :n, :n] += (att * w[:, None, None, :, None]).sum(0)
        count[:n] += w.sum(0)
    if total is None:
        raise ConfigError(f"{what} needs at least one batch, got none")
    uniform = torch.tril(torch.ones(n_max, n_max, dtype=total.dtype))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    seen = (count > 0).to(total.dtype)[:, None]  # (n_max, 1)
    return total / count.clamp_min(1).to(total.dtype)[:, None] * seen + uniform * (1 - seen)


class ConstantAttention(nn.Module):
    """Learned constant attention ``C`` (H, N_max, N_max): causal softmax of free logits, so rows sum to 1.

    Initialised from an average map ``C0`` (eq. 8): logits = log C0, hence ``probs() == C0`` at init.
    """

    def __init__(self, c0: torch.Tensor):
        super().__init__()
        n = c0.shape[-1]
        self.register_buffer("mask", torch.ones(n, n, dtype=torch.bool).tril(), persistent=False)
        self.logits = nn.Parameter(torch.log(c0.clamp_min(1e-12)).masked_fill(~self.mask, 0.0))

    @property
    def n_max(self) -> int:
        return int(self.logits.shape[-1])

    def probs(self) -> torch.Tensor:
        return torch.softmax(self.logits.masked_fill(~self.mask, float("-inf")), dim=-1)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


class MergeBlock(nn.Module):
    """One unmerged constant-attention GPT-2 block (eq. 9, pre-LN form), the reference for eq. 10-11::

    g = LN_1(h);  v = g W_V + b_V                # (B, N, d), split into heads (B, H, N, D)
    a = concat_k(C_k v_k) W_d + b_d;  x = h + a   # constant attention, residual
    u = (x * gamma_2 + beta_2) W_I + b_I           # f'_ln replaces LN_2
    out = x + act(u) W_O + b_O
    """

    def __init__(self, block: nn.Module, c0: torch.Tensor, act: str):
        super().__init__()
        d = block.ln_1.weight.shape[0]
        self.n_head = c0.shape[0]
        self.act = act
        self.ln_1 = copy.deepcopy(block.ln_1)
        self.att = ConstantAttention(c0)
        self.W_V, self.b_V = _param(block.attn.c_attn.weight[:, 2 * d :]), _param(block.attn.c_attn.bias[2 * d :])
        self.W_d, self.b_d = _param(block.attn.c_proj.weight), _param(block.attn.c_proj.bias)
        self.gamma_2, self.beta_2 = _param(block.ln_2.weight), _param(block.ln_2.bias)
        self.W_I, self.b_I = _param(block.mlp.c_fc.weight), _param(block.mlp.c_fc.bias)
        self.W_O, self.b_O = _param(block.mlp.c_proj.weight), _param(block.mlp.c_proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, N, d = h.shape
        check_length(N, self.att.n_max)
        v = (self.ln_1(h) @ self.W_V + self.b_V).view(B, N, self.n_head, -1).transpose(1, 2)  # (B, H, N, D)
        o = (self.att.probs()[:, :N, :N] @ v).transpose(1, 2).reshape(B, N, d)  # (B, N, d)
        x = h + o @ self.W_d + self.b_d
        u = (x * self.gamma_2 + self.beta_2) @ self.W_I + self.b_I  # (B, N, d_I)
        return x + activation(self.act, u) @ self.W_O + self.b_O


@dataclass
class MergeOutput:
    """hidden: n_layer + 1 tensors (B, N, d) (HF convention, last after ln_f); logits (B, N, V)."""

    hidden: list[torch.Tensor]
    logits: torch.Tensor


_HF_ACTS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


class MergeModel(nn.Module):
    """MERGE's model (MM blocks; generation by ER), built from a trained (ER) HF ``GPT2LMHeadModel``.

    Args:
        hf_model: the source GPT-2 (weights are copied).
        c0: (L, H, N_max, N_max) initial constant attention, usually :func:`average_attention`.
    """

    def __init__(self, hf_model: nn.Module, c0: torch.Tensor):
        super().__init__()
        cfg = hf_model.config
        act = _HF_ACTS.get(cfg.activation_function)
        if act is None or act not in ACTIVATIONS:
            raise ConfigError(
                f"unsupported GPT-2 activation_function={cfg.activation_function!r}; known: {', '.join(_HF_ACTS)}"
            )
        if c0.shape[:2] != (cfg.n_layer, cfg.n_head):
            raise ConfigError(
                f"c0 must have shape (n_layer={cfg.n_layer}, n_head={cfg.n_head}, N_max, N_max), got {tuple(c0.shape)}"
            )
        tr = hf_model.transformer
        self.wte, self.wpe, self.ln_f = copy.deepcopy(tr.wte), copy.deepcopy(tr.wpe), copy.deepcopy(tr.ln_f)
        self.blocks = nn.ModuleList(MergeBlock(b, c0[i].to(b.ln_1.weight.dtype), act) for i, b in enumerate(tr.h))

    @property
    def n_max(self) -> int:
        return min(self.blocks[0].att.n_max, int(self.wpe.weight.shape[0]))

    def forward(
        self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None
    ) -> MergeOutput:
        """Token ids (B, N) or token embeddings (B, N, d) -> hidden states and tied-head logits."""
        E = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        check_length(E.shape[1], self.n_max)
        h = E + self.wpe.weight[: E.shape[1]]
        hidden = [h]
        for block in self.blocks:
            h = block(h)
            hidden.append(h)
        hidden[-1] = self.ln_f(h)
        return MergeOutput(hidden=hidden, logits=hidden[-1] @ self.wte.weight.T)


def build_merge_model(er_model: nn.Module, batches: Sequence | Iterable, n_max: int) -> MergeModel:
    """Eq. 8 then MM: average the ER model's attention over ``batches`` and build the constant-attention model."""
    return MergeModel(er_model, average_attention(er_model, batches, n_max))


def mm_loss(
    student: MergeModel,
    teacher: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    cfg: MMConfig = MMConfig(),
) -> torch.Tensor:
    """Weighted distillation loss of the MM model from the ER model on ids (B, N)."""
    with torch.no_grad():
        t_hidden, t_logits = forward_embeds(teacher, token_embeddings(teacher, ids))
    s_out = student(ids)
    w = None if mask is None else mask.to(s_out.logits.dtype)[..., None]
    mse = s_out.logits.new_zeros(())
    for hs, ht in zip(s_out.hidden[1:], t_hidden[1:], strict=True):
        se = (hs - ht).pow(2)
        if cfg.relative_hidden:  # in units of the teacher's mean square of this layer (MMConfig)
            scale = ht.pow(2) if w is None else ht.pow(2) * w
            se = se / ((scale.mean() if w is None else scale.sum() / (w.sum() * se.shape[-1])).detach() + 1e-12)
        mse = mse + (se.mean() if w is None else (se * w).sum() / (w.sum() * se.shape[-1]))
    mse = mse / (len(s_out.hidden) - 1)
    kd = logits_kd_loss(s_out.logits, t_logits, mask, cfg.temperature)
    return cfg.hidden_weight * mse + cfg.logits_weight * kd


def train_mm(
    student: MergeModel,
    teacher: nn.Module,
    batches: Sequence | Iterable,
    steps: int,
    lr: float = 8e-5,
    *,
    cfg: MMConfig = MMConfig(),
) -> list[float]:
    """Train the merge module by weighted distillation from the frozen ER model; returns per-step losses."""
    teacher.eval()
    return _train_cycled(
        student, batches, steps, lr, "merge-module", lambda ids, mask: mm_loss(student, teacher, ids, mask, cfg=cfg)
    )


# --- export (eq. 10) and generation (eq. 3) --------------------------------------------------------------


@torch.no_grad()
def merge_block_spec(block: MergeBlock) -> MergedLayerSpec:
    """Eq. 10 for one block: fold f'_ln into W_I (M_u, b_u) and the value bias into b_a; W_V, W_d, C and W_O
    keep their sizes (the order and why: :mod:`core.mpc.merge_spec`)."""
    b_a = block.b_V @ block.W_d + block.b_d  # (d,)  exact: every row of C_k sums to 1
    return MergedLayerSpec(
        C=block.att.probs().detach().clone(),
        ln_gamma=block.ln_1.weight.detach().clone(),
        ln_beta=block.ln_1.bias.detach().clone(),
        ln_eps=float(block.ln_1.eps),
        W_V=block.W_V.detach().clone(),
        W_d=block.W_d.detach().clone(),
        b_a=b_a,
        M_u=block.gamma_2[:, None] * block.W_I,  # (d, d_I)  diag(gamma_2) W_I
        b_u=block.beta_2 @ block.W_I + block.b_I,  # (d_I,)
        W_O=block.W_O.detach().clone(),
        b_O=block.b_O.detach().clone(),
        act=block.act,
    )


@torch.no_grad()
def export_spec(model: MergeModel) -> MergeSpec:
    """The :class:`~core.mpc.merge_spec.MergeSpec` the encrypted executor runs (plaintext tensors)."""
    return MergeSpec(
        layers=tuple(merge_block_spec(b) for b in model.blocks),
        wpe=model.wpe.weight.detach().clone(),
        lnf_gamma=model.ln_f.weight.detach().clone(),
        lnf_beta=model.ln_f.bias.detach().clone(),
        lnf_eps=float(model.ln_f.eps),
        lm_head=model.wte.weight.detach().clone(),
    )


@torch.no_grad()
def merge_generate(model: nn.Module, prefix_ids: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation by embedding resending (eq. 3) with a MergeModel, ApproxGPT2 or HF GPT-2.

    Args:
        prefix_ids: (B, N_p) or (N_p,) prefix tokens; only they are looked up in the embedding table.
        n_new: tokens to generate, >= 1.

    Returns:
        (tokens (B, n_new), hidden (B, n_new, d)): the resent last hidden states and their greedy tokens
        under the LM head (tokens never feed back into the model).
    """
    if n_new < 1:
        raise ConfigError(f"n_new must be >= 1, got {n_new=}")
    squeeze = prefix_ids.dim() == 1
    ids = prefix_ids.unsqueeze(0) if squeeze else prefix_ids
    n_max = model.n_max if isinstance(model, MergeModel) else _n_positions(model)
    check_length(ids.shape[1] + n_new - 1, n_max)
    was_training = model.training
    model.eval()
    E = token_embeddings(model, ids)  # (B, N_p, d)
    outs, toks = [], []
    for step in range(n_new):
        hidden, logits = forward_embeds(model, E)
        outs.append(hidden[-1][:, -1])
        toks.append(logits[:, -1].argmax(-1))
        if step + 1 < n_new:
            E = torch.cat([E, hidden[-1][:, -1:]], dim=1)  # eq. 3
    model.train(was_training)
    tokens, hid = torch.stack(toks, 1), torch.stack(outs, 1)
    return (tokens[0], hid[0]) if squeeze else (tokens, hid)


def _n_positions(model: nn.Module) -> int:
    if isinstance(model, ApproxGPT2):
        return model.n_positions
    return int(model.config.n_positions)
