"""The secure-inference stage's training recipes (MERGE, Sec. 5.2): one function per model the methods run, each
building its GPT-2 from a seed, training it and returning a :class:`TrainedModel` (the trained module, its MPC
payload, the training time, its curves and its evaluation figures).

* :func:`train_pretrained`: next-token pretraining on blocks of English text (:func:`~core.mpc.finetune.pretrain_lm`;
  the validation loss also under the softmax over the whole vocabulary, :func:`~core.mpc.finetune.blocks_loss`);
* :func:`train_finetuned`: the GPT-2 every method starts from, fine-tuned on the dialogue corpus
  (:func:`~core.mpc.finetune.finetune_lm`), from a random GPT-2 or from the pretrained one's weights;
* :func:`train_distilled`: an MPCFormer / THE-X student (Li et al. 2022, Chen et al. 2022), distilled from the
  fine-tuned teacher (:func:`~core.mpc.approx.distill`);
* :func:`train_er`: embedding resending (Sec. 4.2), ``lambda L_c + (1 - lambda) L_ce`` (eq. 7) on augmented
  embeddings (eq. 5) from the fine-tuned weights (:func:`~core.mpc.merge.train_er`);
* :func:`train_mm`: the merge module (Sec. 4.3): constant attention initialised as the teacher's average
  attention map over the training sequences cut to ``n_max`` tokens (eq. 8), merged products (eq. 9-11),
  distilled from the teacher (:func:`~core.mpc.merge.train_mm`).

Two model families. A :class:`GPT2Shape` builds a GPT-2 of that shape (random, or a teacher's weights loaded over
the draw); :class:`SmolLM2Base` starts from the released SmolLM2-135M (LLaMA architecture), fine-tuned and then
trained into its ER model and merge modules by the same recipes (:func:`build_model`, :func:`payload_of`; its merge
module is :mod:`core.mpc.llama_merge`). The MPCFormer / THE-X students and the pretraining are GPT-2's only.

Randomness. Every recipe runs under :func:`seeded` (``torch.manual_seed(seed)`` inside ``fork_rng``): the GPT-2 is
drawn first (:func:`build_gpt2`; a teacher's weights are loaded over the draw), then dropout draws from the same
stream, so the result depends on ``seed`` only and the caller's global RNG is left as it was.

Every curve is a :class:`Curve` (ER's and MM's alike): one loss per optimizer step, or a validation curve measured
at the steps it names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from core.errors import ConfigError
from core.models.gpt2 import GPT2_EOS, tiny_gpt2
from core.mpc import merge
from core.mpc.approx import ApproxGPT2, distill
from core.mpc.finetune import DialogueData, blocks_loss, finetune_lm, lm_loss, pretrain_lm
from core.mpc.gpt2 import weights_from_hf

__all__ = [
    "Curve",
    "GPT2Shape",
    "SmolLM2Base",
    "TrainedModel",
    "build_gpt2",
    "build_model",
    "payload_of",
    "seeded",
    "train_distilled",
    "train_er",
    "train_finetuned",
    "train_mm",
    "train_pretrained",
]

State = Mapping[str, Tensor]


@dataclass(frozen=True, kw_only=True)
class GPT2Shape:
    """A GPT-2 language model's shape: vocabulary, layers, width, heads, positions and its BOS/EOS token."""

    vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    eos: int = GPT2_EOS

    def __post_init__(self) -> None:
        for name in ("vocab", "n_layer", "n_embd", "n_head", "n_positions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPT2Shape.{name} must be >= 1, got {name}={getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPT2Shape: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not 0 <= self.eos < self.vocab:
            raise ConfigError(f"GPT2Shape: eos={self.eos} must be a token id below vocab={self.vocab}")


SMOLLM2_EOS = 2  # SmolLM2's <|im_end|>: its tokenizer's EOS


@dataclass(frozen=True, kw_only=True)
class SmolLM2Base:
    """The released SmolLM2-135M as the stage's model (``core.stip.models.load_smollm2``: 30 blocks of width 576,
    9 heads on 3 K/V heads, 49,152 tokens); ``n_positions``: how many positions the encrypted runs take rotary
    tables for."""

    n_positions: int
    eos: int = SMOLLM2_EOS

    def __post_init__(self) -> None:
        if self.n_positions < 2:
            raise ConfigError(f"SmolLM2Base.n_positions must be >= 2, got {self.n_positions}")


Shape = GPT2Shape | SmolLM2Base

# How each family's merge module replaces the norm before the MLP (core.mpc.llama_merge.MLP_NORMS) and weighs its
# hidden-state distillation (core.mpc.merge.MMConfig.relative_hidden): GPT-2 as the paper; SmolLM2 keeps the norm
# (eq. 9 diverges on it) and distils each layer relative to its scale (its attention sink dominates a plain MSE).
MERGE_FORMS: dict[str, dict[str, str]] = {
    "gpt2": {"mlp_norm": "gain", "hidden_loss": "mse"},
    "smollm2": {"mlp_norm": "rms", "hidden_loss": "relative"},
}


def family_of(shape: Shape) -> str:
    """``gpt2`` or ``smollm2``: the key of :data:`MERGE_FORMS` (and ``secure_inference.base``) of ``shape``."""
    return "gpt2" if isinstance(shape, GPT2Shape) else "smollm2"


@dataclass(frozen=True)
class Curve:
    """One training curve. ``steps`` None: one value per optimizer step, the i-th at step i (counted from 0);
    otherwise ``values[i]`` was measured after step ``steps[i]`` (a validation curve)."""

    values: tuple[float, ...]
    steps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and len(self.steps) != len(self.values):
            raise ConfigError(
                f"a curve needs one step per value, got {len(self.steps)} steps, {len(self.values)} values"
            )

    @classmethod
    def per_step(cls, values: Any) -> Curve:
        return cls(tuple(float(v) for v in values))

    @classmethod
    def at_steps(cls, points: Any) -> Curve:
        """From ``[(step, value), ...]``."""
        pairs = [(int(s), float(v)) for s, v in points]
        return cls(tuple(v for _, v in pairs), tuple(s for s, _ in pairs))


@dataclass(frozen=True, eq=False)
class TrainedModel:
    """What a recipe returns: the trained ``model`` (eval mode), the ``payload`` the MPC methods run
    (``GPT2Weights`` for the gpt2 engine, ``MergeSpec`` for the merge engine), the training seconds, the curves
    (``train_loss`` always) and the evaluation figures (``test_loss``, ``n_parameters``, ...)."""

    model: nn.Module
    payload: Any  # GPT2Weights / LlamaWeights (gpt2 engine), MergeSpec / LlamaMergeSpec (merge engine)
    train_s: float
    curves: Mapping[str, Curve]
    metrics: Mapping[str, float] = field(default_factory=dict)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The global CPU RNG seeded with ``seed`` inside the block, restored to what it was after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_gpt2(shape: GPT2Shape, state: State | None = None) -> nn.Module:
    """A ``GPT2LMHeadModel`` of ``shape`` (dropout 0.1) drawn from the global RNG as it stands (call under
    :func:`seeded`), with ``state`` loaded over the draw when given; eval mode."""
    model = tiny_gpt2(
        shape.vocab,
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        n_positions=shape.n_positions,
        eos_token_id=shape.eos,
    )
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def build_model(shape: Shape, state: State | None = None) -> nn.Module:
    """The model a recipe trains: :func:`build_gpt2` for a :class:`GPT2Shape`; for :class:`SmolLM2Base` the
    released SmolLM2-135M (float32), with ``state`` (a fine-tuned or ER model's weights) loaded over it; eval mode."""
    if isinstance(shape, GPT2Shape):
        return build_gpt2(shape, state)
    from core.stip.models import load_smollm2

    model = load_smollm2()
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def payload_of(model: nn.Module, shape: Shape) -> Any:
    """What the gpt2-engine methods run for a trained ``model``: its :class:`~core.mpc.gpt2.GPT2Weights`, or for
    SmolLM2 its :class:`~core.mpc.llama.LlamaWeights` with rotary tables for ``shape.n_positions`` positions."""
    if isinstance(shape, GPT2Shape):
        return weights_from_hf(model)
    from core.mpc import llama

    return llama.weights_from_hf(model, n_positions=shape.n_positions)


def _n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_pretrained(
    shape: GPT2Shape,
    train: Tensor,
    val: Tensor,
    keep: Tensor | None,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    warmup: int,
    eval_every: int,
    seed: int,
) -> TrainedModel:
    """A random GPT-2 pretrained on text blocks ``train``/``val`` ``(rows, T)`` (softmax over the ids ``keep``).

    Metrics: ``val_loss`` (the last point of the validation curve), ``val_perplexity`` = exp(val_loss),
    ``val_loss_full_vocab`` (the same blocks under the softmax over every id), ``n_parameters``,
    ``pretrain_vocab``, ``train_tokens``, ``val_tokens`` and ``epochs`` = steps * batch_size * T / train_tokens.
    Curves: ``train_loss`` (every step) and ``val_loss_curve`` (every ``eval_every`` steps)."""
    with seeded(seed):
        model = build_gpt2(shape)
        t0 = time.perf_counter()
        fit = pretrain_lm(
            model,
            train,
            val,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            warmup=warmup,
            eval_every=eval_every,
            keep=keep,
            seed=seed,
        )
        train_s = time.perf_counter() - t0
        n_train = train.numel()
        metrics = {
            "val_loss": fit["val_loss"],
            "val_perplexity": math.exp(fit["val_loss"]),
            # the same blocks under the softmax over every id (the ids the text lacks given their share of mass)
            "val_loss_full_vocab": blocks_loss(model, val, None, batch_size),
            "n_parameters": _n_parameters(model),
            "pretrain_vocab": shape.vocab if keep is None else keep.numel(),
            "train_tokens": n_train,
            "val_tokens": val.numel(),
            "epochs": steps * batch_size * train.shape[1] / n_train,
        }
    curves = {"train_loss": Curve.per_step(fit["train_loss"]), "val_loss_curve": Curve.at_steps(fit["val_curve"])}
    return TrainedModel(model, weights_from_hf(model), train_s, curves, metrics)


def train_finetuned(
    shape: Shape, data: DialogueData, start: State | None = None, *, steps: int, lr: float, seed: int
) -> TrainedModel:
    """The model every method runs, fine-tuned on ``data``'s batches from ``start`` (the pretrained GPT-2's
    weights), from a random GPT-2, or from the released SmolLM2. Metrics: ``test_loss`` on the test sequences
    (and ``start_test_loss``, the same before fine-tuning, for SmolLM2), ``n_parameters``."""
    with seeded(seed):
        model = build_model(shape, start)
        before = {}
        if not isinstance(shape, GPT2Shape):  # what the released model scores before fine-tuning
            before["start_test_loss"] = lm_loss(model, data.test_ids, data.test_mask)
        t0 = time.perf_counter()
        losses = finetune_lm(model, data.batches, steps, lr, seed=seed)
        train_s = time.perf_counter() - t0
        metrics = {
            "test_loss": lm_loss(model, data.test_ids, data.test_mask),
            **before,
            "n_parameters": _n_parameters(model),
        }
    return TrainedModel(model, payload_of(model, shape), train_s, {"train_loss": Curve.per_step(losses)}, metrics)


def train_distilled(
    shape: Shape, data: DialogueData, teacher: State, *, approx: str, steps: int, lr: float, seed: int
) -> TrainedModel:
    """An :class:`~core.mpc.approx.ApproxGPT2` student (SmolLM2: :class:`~core.mpc.approx_llama.ApproxLlama`) with
    the ``approx`` nonlinearities (a registry name), distilled from the fine-tuned ``teacher`` on ``data``'s batches
    (SmolLM2: each layer's hidden error relative to its scale, the family's ``hidden_loss`` in :data:`MERGE_FORMS`);
    its payload is the student's modules in their model (what the gpt2 engine runs with the matching MPC
    variant)."""
    if not isinstance(shape, GPT2Shape):
        from core.mpc.approx_llama import ApproxLlama

        relative = MERGE_FORMS[family_of(shape)]["hidden_loss"] == "relative"
        with seeded(seed):
            start = build_model(shape, teacher)
            student = ApproxLlama(start, approx)
            t0 = time.perf_counter()
            losses = distill(start, student, data.batches, steps, lr, relative=relative)
            train_s = time.perf_counter() - t0
        return TrainedModel(
            student.eval(), payload_of(student.hf, shape), train_s, {"train_loss": Curve.per_step(losses)}
        )
    with seeded(seed):
        start = build_gpt2(shape, teacher)
        student = ApproxGPT2(start, approx)
        t0 = time.perf_counter()
        losses = distill(start, student, data.batches, steps, lr)
        hf = _hf_from_student(student, shape)
        train_s = time.perf_counter() - t0
    return TrainedModel(student.eval(), weights_from_hf(hf), train_s, {"train_loss": Curve.per_step(losses)})


def _hf_from_student(student: ApproxGPT2, shape: GPT2Shape) -> nn.Module:
    """A ``GPT2LMHeadModel`` holding the student's modules (for ``weights_from_hf``); its own draw is replaced."""
    hf = build_gpt2(shape)
    hf.transformer.wte, hf.transformer.wpe, hf.transformer.h, hf.transformer.ln_f = (
        student.wte,
        student.wpe,
        student.h,
        student.ln_f,
    )
    hf.lm_head = student.lm_head
    return hf.eval()


def train_er(
    shape: Shape, data: DialogueData, teacher: State, *, steps: int, lr: float, er: merge.ERConfig, seed: int
) -> TrainedModel:
    """The ER model (Sec. 4.2): the fine-tuned ``teacher``'s weights trained on eq. 7 with the augmentation of
    eq. 5 (``er``: p, eps, lambda), augmentation noise from ``seed``. Curves: ``train_loss`` (eq. 7's total) and
    ``align_loss`` (L_c, eq. 4); metrics: ``test_loss`` (plain next-token loss on the test sequences)."""
    with seeded(seed):
        model = build_model(shape, teacher)
        t0 = time.perf_counter()
        history = merge.train_er(model, data.batches, steps, lr, cfg=er, seed=seed)
        model.eval()
        train_s = time.perf_counter() - t0
        metrics = {"test_loss": lm_loss(model, data.test_ids, data.test_mask)}
    curves = {
        "train_loss": Curve.per_step(h["total"] for h in history),
        "align_loss": Curve.per_step(h["align"] for h in history),
    }
    return TrainedModel(model, payload_of(model, shape), train_s, curves, metrics)


def train_mm(
    shape: Shape, data: DialogueData, teacher: State, *, n_max: int, steps: int, lr: float, seed: int
) -> TrainedModel:
    """A merge module (Sec. 4.3) of the ``teacher`` (the fine-tuned or the ER model): the training sequences cut
    to ``n_max`` tokens give the constant attention's start (eq. 8) and the distillation batches; the payload is
    the exported :class:`~core.mpc.merge_spec.MergeSpec` (eq. 10), or for SmolLM2 the
    :class:`~core.mpc.llama_merge.LlamaMergeSpec`."""
    short = [(ids[:, :n_max], mask[:, :n_max]) for ids, mask in data.batches]  # (B, n_max) each
    form = MERGE_FORMS[family_of(shape)]
    with seeded(seed):
        source = build_model(shape, teacher)
        if isinstance(shape, GPT2Shape):
            student = merge.build_merge_model(source, short, n_max)
        else:
            from core.mpc import llama_merge

            student = llama_merge.build_llama_merge_model(source, short, n_max, mlp_norm=form["mlp_norm"])
        t0 = time.perf_counter()
        mm = merge.MMConfig(relative_hidden=form["hidden_loss"] == "relative")
        losses = merge.train_mm(student, source, short, steps, lr, cfg=mm)
        student.eval()
        train_s = time.perf_counter() - t0
    if isinstance(shape, GPT2Shape):
        spec = merge.export_spec(student)
    else:
        spec = llama_merge.export_llama_spec(student)
    return TrainedModel(student, spec, train_s, {"train_loss": Curve.per_step(losses)})
