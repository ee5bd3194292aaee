"""The secure-inference stage's models: which ones a config needs, their cache keys, and how each kind is trained
(fine-tuned, distilled MPCFormer/THE-X students, MERGE's ER model and merge module) over ``core.mpc.finetune``.
``tasks.secure_inference.train_model`` is the task that trains one of them."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.models.gpt2 import GPT2_EOS, tiny_gpt2
from core.mpc.finetune import DialogueData, dialogue_data, finetune_lm, lm_loss
from core.mpc.methods import method_spec
from core.registry import lookup
from pbconfig.secure_inference import SecureInferenceConfig
from storage.recording import Recorder

EOS = GPT2_EOS
MODELS_VERSION = "si-models-v2"  # bump when model training or the exported format changes: every cache key changes


@dataclass(frozen=True)
class ModelRef:
    """One trained model of the stage: its name (:func:`model_of`), cache key and folder (``payload.pt``: what
    the MPC methods run; ``state.pt``: the weights a dependent model starts from)."""

    name: str
    key: str
    path: str


def _gpt2(cfg: SecureInferenceConfig, vocab: int, shape: Any = None) -> Any:
    """A random GPT-2 of the stage's shape (or ``shape``: a ``ModelShape``) and positions, drawn from the global
    RNG."""
    s = shape if shape is not None else cfg
    return tiny_gpt2(
        vocab, n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, n_positions=cfg.n_positions, eos_token_id=EOS
    )


def _hf_from_student(student: Any, vocab: int, cfg: SecureInferenceConfig) -> Any:
    """A ``GPT2LMHeadModel`` holding a distilled ``ApproxGPT2`` student's modules (for ``weights_from_hf``)."""
    hf = _gpt2(cfg, vocab)
    hf.transformer.wte, hf.transformer.wpe, hf.transformer.h, hf.transformer.ln_f = (
        student.wte,
        student.wpe,
        student.h,
        student.ln_f,
    )
    hf.lm_head = student.lm_head
    return hf.eval()


def _record_curve(rec: Recorder, losses: list[Any], name: str = "train_loss", every: int = 10) -> None:
    for i, v in enumerate(losses):
        if i % every == 0 or i == len(losses) - 1:
            value = v if isinstance(v, int | float) else float(v.get("total", next(iter(v.values()))))
            rec.metric(name, float(value), step=i)


# ----------------------------------------------------------------------------------------------- models


@functools.lru_cache(maxsize=2)
def _data(
    corpus: str, max_pairs: int | None, max_len: int, batch_size: int, n_prompts: int, seed: int
) -> tuple[DialogueData, int]:
    """The stage's encoded corpus (cached per process: every model task of a flow run reads the same) and the
    tokenizer's vocabulary size."""
    from core.mpc.textdata import gpt2_tokenizer

    tok = gpt2_tokenizer()
    data = dialogue_data(
        tok, corpus, max_pairs=max_pairs, max_len=max_len, batch_size=batch_size, n_prompts=n_prompts, seed=seed
    )
    return data, len(tok)


def data_of(cfg: SecureInferenceConfig) -> tuple[DialogueData, int]:
    return _data(cfg.corpus, cfg.max_pairs, cfg.max_len, cfg.batch_size, cfg.n_prompts, cfg.seed)


def model_of(method: str) -> str:
    """The name of the model a method runs: ``finetuned``, ``distilled-<approx>``, ``er``, ``mm`` or ``merge``."""
    spec = method_spec(method)
    return f"distilled-{spec.approx}" if spec.model == "distilled" else spec.model


def kind_of(name: str) -> _ModelKind:
    """The kind of model ``name`` (the part before ``-``: ``distilled-thex`` is a ``distilled``)."""
    return lookup("secure-inference model kind", MODEL_KINDS, name.split("-", 1)[0])


def teacher_of(name: str) -> str | None:
    """The model ``name`` is trained from (none for the fine-tuned GPT-2 itself)."""
    return kind_of(name).teacher


def models_needed(cfg: SecureInferenceConfig) -> list[str]:
    """The models the configured methods need and their teachers, each after its teacher (the fine-tuned GPT-2
    always: the evaluation prompts' embedding table is its)."""
    names = {"finetuned"} | {model_of(m) for m in cfg.methods}
    names |= {t for n in names if (t := teacher_of(n)) is not None}
    rank = {kind: i for i, kind in enumerate(MODEL_KINDS)}  # teachers come first in MODEL_KINDS
    return sorted(names, key=lambda n: (rank[n.split("-", 1)[0]], n))


def model_key(name: str, cfg: SecureInferenceConfig, data_hash: str, teacher: ModelRef | None) -> str:
    """sha256 of the training version, the model's name, its config fields, the training data and its teacher's
    key: the same inputs always name the same trained model."""
    fields = cfg.model_dump(mode="json", include=set(kind_of(name).keys))
    parts = [MODELS_VERSION, name, json.dumps(fields, sort_keys=True), data_hash, teacher.key if teacher else ""]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


@dataclass
class _Trained:
    """What a trainer returns: the MPC payload, the weights dependent models start from (teachers only), and
    what its run records."""

    payload: Any
    state: dict[str, torch.Tensor] | None
    metrics: dict[str, float]
    curves: dict[str, list[float]]


def _load_teacher(ref: ModelRef, cfg: SecureInferenceConfig, vocab: int) -> Any:
    model = _gpt2(cfg, vocab)
    model.load_state_dict(torch.load(Path(ref.path) / "state.pt", weights_only=True))
    return model.eval()


def _train_finetuned(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, teacher: Any) -> _Trained:
    from core.mpc.gpt2 import weights_from_hf

    model = _gpt2(cfg, vocab)
    t0 = time.perf_counter()
    losses = finetune_lm(model, data.batches, cfg.train_steps, cfg.lr, seed=cfg.seed)
    metrics = {
        "train_s": time.perf_counter() - t0,
        "test_loss": lm_loss(model, data.test_ids, data.test_mask),
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    return _Trained(weights_from_hf(model), model.state_dict(), metrics, {"train_loss": losses})


def _train_distilled(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, teacher: Any) -> _Trained:
    from core.mpc.approx import ApproxGPT2, distill
    from core.mpc.gpt2 import weights_from_hf

    student = ApproxGPT2(teacher, name.removeprefix("distilled-"))
    t0 = time.perf_counter()
    losses = distill(teacher, student, data.batches, cfg.distill_steps, cfg.distill_lr)
    hf = _hf_from_student(student, vocab, cfg)
    return _Trained(weights_from_hf(hf), None, {"train_s": time.perf_counter() - t0}, {"train_loss": losses})


def _train_er(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, teacher: Any) -> _Trained:
    from core.mpc.gpt2 import weights_from_hf
    from core.mpc.merge import ERConfig, train_er

    er_model = teacher  # a fresh copy of the fine-tuned weights, trained in place
    t0 = time.perf_counter()
    curve = train_er(
        er_model,
        data.batches,
        cfg.er_steps,
        cfg.er_lr,
        cfg=ERConfig(dropout=cfg.er_dropout, noise=cfg.er_noise, lam=cfg.er_lambda),
        seed=cfg.seed,
    )
    er_model.eval()
    metrics = {"train_s": time.perf_counter() - t0, "test_loss": lm_loss(er_model, data.test_ids, data.test_mask)}
    curves = {"train_loss": [c["total"] for c in curve], "align_loss": [c["align"] for c in curve]}
    return _Trained(weights_from_hf(er_model), er_model.state_dict(), metrics, curves)


def _train_mm(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, teacher: Any) -> _Trained:
    from core.mpc.merge import build_merge_model, export_spec, train_mm

    short = [(i[:, : cfg.n_max], k[:, : cfg.n_max]) for i, k in data.batches]
    student = build_merge_model(teacher, short, cfg.n_max)
    t0 = time.perf_counter()
    losses = train_mm(student, teacher, short, cfg.mm_steps, cfg.mm_lr)
    student.eval()
    return _Trained(export_spec(student), None, {"train_s": time.perf_counter() - t0}, {"train_loss": losses})


@dataclass(frozen=True)
class _ModelKind:
    """How one kind of model trains and what its run is called (``{approx}``: the student's approximation)."""

    train: Callable[[str, SecureInferenceConfig, DialogueData, int, Any], _Trained]
    technique: str
    config: Callable[[SecureInferenceConfig], dict[str, Any]]
    keys: tuple[str, ...]  # the config fields it depends on (a dependent model's key includes its teacher's)
    teacher: str | None = "finetuned"  # the model it is trained from
    run_name: str | None = None


def _mm_config(source: str) -> Callable[[SecureInferenceConfig], dict[str, Any]]:
    return lambda c: {"source": source, "steps": c.mm_steps, "lr": c.mm_lr, "n_max": c.n_max}


_MM_KEYS = ("mm_steps", "mm_lr", "prefix_len", "gen_len", "scaling_gen_lens")  # n_max: the last three
# the kinds of model (the part of a model's name before "-"), each after its teacher; the only list of them
MODEL_KINDS: dict[str, _ModelKind] = {
    "finetuned": _ModelKind(
        _train_finetuned,
        "lm-train",
        lambda c: {"steps": c.train_steps, "lr": c.lr},
        (
            "corpus",
            "max_pairs",
            "max_len",
            "batch_size",
            "n_prompts",
            "seed",
            "n_layer",
            "n_embd",
            "n_head",
            "n_positions",
            "train_steps",
            "lr",
        ),
        teacher=None,
    ),
    "distilled": _ModelKind(
        _train_distilled,
        "distill-{approx}",
        lambda c: {"steps": c.distill_steps, "lr": c.distill_lr},
        ("distill_steps", "distill_lr"),
    ),
    "er": _ModelKind(
        _train_er,
        "merge-er-train",
        lambda c: {
            "steps": c.er_steps,
            "lr": c.er_lr,
            "dropout": c.er_dropout,
            "noise": c.er_noise,
            "lambda": c.er_lambda,
        },
        ("er_steps", "er_lr", "er_dropout", "er_noise", "er_lambda"),
    ),
    "mm": _ModelKind(
        _train_mm,
        "merge-mm-train",
        _mm_config("finetuned"),
        _MM_KEYS,
        run_name="merge module from the fine-tuned model",
    ),
    "merge": _ModelKind(
        _train_mm, "merge-mm-train", _mm_config("er"), _MM_KEYS, teacher="er", run_name="merge module from the ER model"
    ),
}
