"""Attack-stage tasks, part 1 (SEB paper): SEB's utility (LM perplexity, translation BLEU), one recorded run per
model and seed; the FILM tasks (the attacker's priors, FILM, the byte-coverage curve) live in
:mod:`tasks.attacks_film` and are re-exported here.

Runs (``technique``, tag ``privbench.result_group``): ``seb-lm-<embedding>`` and ``seb-mt-<embedding>``
(``utility``): perplexity / BLEU with embedding parameter counts, the same model shape and step budget for every
embedding, one run per seed of ``utility.run_seeds`` (the run's config carries ``seed`` at its top level, so the
claims pair the embeddings by seed and give intervals). An LM run's config carries the vocabulary it trained at as
``utility.lm_vocab`` (``compact`` or ``full``; runs recorded before the setting existed have none and are compact),
so a claim selects one setting with ``where: {config.utility.lm_vocab: full}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from prefect import task

from core.errors import ConfigError, DataError
from pbconfig.attacks import AttacksConfig
from storage.recording import Recorder, RunRef
from tasks.attacks_film import (  # noqa: F401  (re-exported: the stage's tasks in one place)
    client_sentences,
    film_attack,
    load_prior,
    seb_coverage,
    train_prior,
    vocab_ids,
)
from tasks.audit import audit_targets
from tasks.jobs import Job, Recorded
from tasks.records import RESUMABLE, task_record


def tokenizer():
    from core.mpc.textdata import gpt2_tokenizer

    return gpt2_tokenizer()  # one per thread


def _texts(path: str) -> dict[str, Any]:
    from tasks.prepare_texts import load_prepared_texts

    return load_prepared_texts(path)


def _encode(sentences: list[str]) -> list[list[int]]:
    tok = tokenizer()
    return [tok.encode(s) for s in sentences]


def _mapping(cfg: AttacksConfig, vocab_size: int) -> torch.Tensor:
    from core.attacks.seb import build_byte_mapping

    s = cfg.seb
    return build_byte_mapping(vocab_size, n_bytes=s.n_bytes, byte_vocab=s.byte_vocab, seed=s.seed)


def _utility_seed(cfg: AttacksConfig, seed: int | None) -> int:
    """A utility task's start: the worker's intra-op threads set; returns the run's seed (None: ``utility.seed``)."""
    torch.set_num_threads(cfg.threads_per_worker)
    return cfg.utility.seed if seed is None else seed


# ----------------------------------------------------------------------------------------------- utility


@contextmanager
def _utility_record(
    cfg: AttacksConfig,
    parent: RunRef,
    technique: str,
    dataset: str,
    embedding: str,
    seed: int,
    utility: dict[str, Any],
    run_name: str,
) -> Iterator[Recorder]:
    """The run of one utility model (result group ``utility``): its config carries the ``seed`` at its top level
    (the claims pair the embeddings by seed), the ``utility`` settings it trained with and SEB's."""
    config = {
        "seed": seed,
        "dataset": dataset,
        "embedding": embedding,
        "utility": utility,
        "seb": cfg.seb.model_dump(mode="json"),
    }
    with task_record(parent=parent, technique=technique, config=config, dataset=dataset, run_name=run_name) as rec:
        rec.tag("privbench.result_group", "utility")
        yield rec


def _lm_blocks(seqs: list[list[int]], max_len: int, eos: int) -> torch.Tensor:
    """The corpus as one stream (sentences separated by EOS) cut into blocks of ``max_len`` tokens (n, max_len)."""
    stream = [t for s in seqs for t in (*s, eos)]
    n = len(stream) // max_len
    if n < 1:
        raise DataError(f"text too short for one block of {max_len} tokens ({len(stream)} tokens)")
    return torch.tensor(stream[: n * max_len], dtype=torch.long).view(n, max_len)  # (n_blocks, max_len)


@task(name="seb-lm", **RESUMABLE)
def utility_lm(
    dataset: str,
    embedding: str,
    cfg: AttacksConfig,
    path: str,
    parent: RunRef,
    seed: int | None = None,
    vocab: str | None = None,
    matched: bool = False,
) -> dict[str, Any]:
    """Perplexity of a small causal LM on ``dataset``'s test split with ``embedding`` (Sec. 5.2.3's analogue),
    initialised and trained with ``seed`` (None: ``utility.seed``) at the vocabulary ``vocab`` (None:
    ``utility.lm_vocab``; ``compact`` or ``full``). ``matched`` (SEB only; technique ``seb-lm-<embedding>-matched``):
    SEB's FFN hidden width is the widest whose module has no more parameters than the subword arm's table at this
    vocabulary (``core.attacks.seb.matched_hidden``), recorded as ``seb_hidden`` beside ``subword_embedding_params``.

    Both arms tie their output layer to the input embedding (subword: ``lm_head`` is ``wte``; SEB: logits against
    the input SEB module's table), so ``embedding_params`` counts the input module once; ``output_head_params``
    records the output layer's own parameters (0: tied) and ``vocab_size`` the logits' width. At ``full`` the
    subword table has GPT-2's 50,257 rows and SEB its usual size, the paper's Table 6 relation."""
    from core.attacks.lm import (
        Plateau,
        build_causal_lm,
        count_parameters,
        embedding_parameter_count,
        embedding_parameters,
        perplexity,
        train_lm,
    )
    from core.attacks.seb import matched_hidden
    from core.attacks.vocab import GPT2_EOS, GPT2_VOCAB, LM_VOCABS, lm_vocabulary

    seed = _utility_seed(cfg, seed)
    u = cfg.utility
    vocab = u.lm_vocab if vocab is None else vocab
    if vocab not in LM_VOCABS:  # refused before a run is recorded
        raise ConfigError(f"utility LM vocab={vocab!r} is unknown; use one of {LM_VOCABS} (None: utility.lm_vocab)")
    if matched and not embedding.startswith("seb_"):
        raise ConfigError(
            f"matched=True narrows an SEB module to the subword table's size; embedding={embedding!r} is not SEB "
            "(list SEB variants in utility.matched)"
        )
    # the vocabulary this run trained at, and whether its SEB FFN was narrowed to the subword table's size
    utility = u.model_dump(mode="json") | {"lm_vocab": vocab, "matched_params": matched}
    technique = f"seb-lm-{embedding}" + ("-matched" if matched else "")
    run_name = (
        f"LM {embedding}{' (matched parameters)' if matched else ''} on {dataset} ({vocab} vocabulary), seed {seed}"
    )
    with _utility_record(cfg, parent, technique, dataset, embedding, seed, utility, run_name) as rec:
        data = _texts(path)
        train, test = _encode(data["train"]), _encode(data["test"])
        plateau = None
        if u.lm_eval_every is not None:  # the first sentences of the (shuffled) training split, the same every seed
            n_val = max(1, round(len(train) * u.lm_val_fraction))
            val, train = train[:n_val], train[n_val:]
        words = lm_vocabulary(vocab, train)
        tr = words.encode(_lm_blocks(train, u.lm_max_len, GPT2_EOS))
        te = words.encode(_lm_blocks(test, u.lm_max_len, GPT2_EOS))
        if u.lm_eval_every is not None:
            va = words.encode(_lm_blocks(val, u.lm_max_len, GPT2_EOS))
            plateau = Plateau(va, torch.ones_like(va, dtype=torch.bool), every=u.lm_eval_every, patience=u.lm_patience)

        def build(size: int, kind: str = embedding, hidden: int = cfg.seb.hidden) -> torch.nn.Module:
            return build_causal_lm(
                size,
                embedding=kind,
                n_layer=u.lm_shape.n_layer,
                n_embd=u.lm_shape.n_embd,
                n_head=u.lm_shape.n_head,
                n_positions=u.lm_max_len,
                mapping=_mapping(cfg, size) if kind != "subword" else None,
                byte_dim=cfg.seb.byte_dim,
                hidden=hidden,
                output="tied",
                tie_subword=True,
                seed=seed,
            )

        hidden = None if embedding == "subword" else cfg.seb.hidden
        subword_params = None
        if matched:  # the subword arm's table at this vocabulary, counted as its runs count it (tied: once)
            subword_params = embedding_parameter_count(build(words.size, "subword"))
            shape = {"d_model": u.lm_shape.n_embd, "n_bytes": cfg.seb.n_bytes, "byte_vocab": cfg.seb.byte_vocab}
            hidden = matched_hidden(subword_params, embedding.removeprefix("seb_"), byte_dim=cfg.seb.byte_dim, **shape)
        model = build(words.size, hidden=hidden or cfg.seb.hidden)  # subword: no hidden width
        counted = embedding_parameters(model)
        # the same model at GPT-2's whole vocabulary (as the paper counts, Table 6): the trained one at `full`, else
        # built only to be counted
        full_vocab_params = (
            counted.total
            if vocab == "full"
            else embedding_parameter_count(build(GPT2_VOCAB, hidden=hidden or cfg.seb.hidden))
        )
        t0 = time.perf_counter()
        fit = train_lm(
            model,
            tr,
            torch.ones_like(tr, dtype=torch.bool),
            steps=u.lm_steps,
            batch_size=u.lm_batch_size,
            lr=u.lm_lr,
            seed=seed,
            max_seconds=u.max_seconds,
            plateau=plateau,
        )
        train_s = time.perf_counter() - t0
        ppl = perplexity(model.eval(), te, torch.ones_like(te, dtype=torch.bool))
        out = {
            "perplexity": ppl,
            "embedding_params": counted.total,
            "input_embedding_params": counted.input,
            "output_head_params": counted.output_untied,
            "embedding_params_full_vocab": full_vocab_params,
            "params": count_parameters(model),
            "train_s": train_s,
            "steps": fit["steps"],
            "train_loss": fit["train_loss"],
            "vocab_size": counted.vocab_size,
            "test_unk_rate": words.unk_rate(te),
        }
        if hidden is not None:
            out["seb_hidden"] = hidden
        if subword_params is not None:
            out["subword_embedding_params"] = subword_params
        if plateau is not None:
            out |= {k: float(fit[k]) for k in ("best_step", "val_perplexity", "plateaued")}
            for step, ppl in fit["val_curve"]:
                rec.metric("val_perplexity_curve", ppl, step=step)
        rec.metrics(out, units={"train_s": "s"})
    return {"dataset": dataset, "embedding": embedding, "seed": seed, "lm_vocab": vocab, "matched": matched, **out}


@task(name="seb-mt", **RESUMABLE)
def utility_translation(
    embedding: str, cfg: AttacksConfig, path: str, parent: RunRef, seed: int | None = None
) -> dict[str, Any]:
    """German->English BLEU of a small encoder-decoder with ``embedding`` (Sec. 5.2.1's analogue, sacreBLEU 13a),
    initialised and trained with ``seed`` (None: ``utility.seed``)."""
    from core.attacks.lm import count_parameters
    from core.attacks.translation import (
        Seq2SeqLM,
        bleu,
        embedding_parameter_count,
        train_translation,
        translate,
    )
    from core.attacks.vocab import GPT2_EOS, CompactVocab

    seed = _utility_seed(cfg, seed)
    u = cfg.utility
    utility, run_name = u.model_dump(mode="json"), f"de-en translation {embedding}, seed {seed}"
    with _utility_record(cfg, parent, f"seb-mt-{embedding}", u.translation, embedding, seed, utility, run_name) as rec:
        data = _texts(path)
        if not data["train"] or not isinstance(data["train"][0], list | tuple):
            raise DataError(
                f"utility.translation={u.translation!r} is not a sentence-pair dataset; prepare it with "
                "source: gettext-de-en"
            )
        cut = u.mt_max_len - 2

        def side(pairs: list, i: int) -> list[list[int]]:
            return [s[:cut] for s in _encode([p[i] for p in pairs])]

        src, tgt = side(data["train"], 0), side(data["train"], 1)
        test = data["test"][: u.mt_eval]
        vocab = CompactVocab.from_sequences(src + tgt)
        pad = vocab.size  # one extra id after the compact vocabulary
        enc = [vocab.encode(torch.tensor(s, dtype=torch.long)).tolist() for s in src]
        dec = [vocab.encode(torch.tensor(s, dtype=torch.long)).tolist() for s in tgt]
        test_src = [vocab.encode(torch.tensor(s, dtype=torch.long)).tolist() for s in side(test, 0)]
        eos = int(vocab.encode(torch.tensor(GPT2_EOS)))
        model = Seq2SeqLM(
            vocab.size + 1,
            d_model=u.mt_d_model,
            nhead=u.mt_heads,
            num_layers=u.mt_layers,
            ff=u.mt_ff,
            max_len=u.mt_max_len,
            embedding=embedding,
            mapping=_mapping(cfg, vocab.size + 1) if embedding != "subword" else None,
            byte_dim=cfg.seb.byte_dim,
            hidden=cfg.seb.hidden,
            pad_id=pad,
            seed=seed,
        )
        t0 = time.perf_counter()
        fit = train_translation(
            model,
            enc,
            dec,
            steps=u.mt_steps,
            batch_size=u.mt_batch_size,
            lr=u.mt_lr,
            bos_id=eos,
            eos_id=eos,
            pad_id=pad,
            seed=seed,
            max_seconds=u.max_seconds,
        )
        train_s = time.perf_counter() - t0
        hyp_ids = translate(model.eval(), test_src, bos_id=eos, eos_id=eos, pad_id=pad, max_len=u.mt_max_len)
        tok = tokenizer()
        hyps = [
            tok.decode([t for t in vocab.decode(torch.tensor(h, dtype=torch.long)).tolist() if t != GPT2_EOS])
            for h in hyp_ids
        ]
        score = bleu(hyps, [p[1] for p in test])
        out = {
            "bleu": score,
            "embedding_params": embedding_parameter_count(model),
            "params": count_parameters(model),
            "train_s": train_s,
            "steps": fit["steps"],
            "train_loss": fit["train_loss"],
            "vocab_size": vocab.size,
            "n_train_pairs": len(enc),
            "n_test_pairs": len(test),
        }
        rec.metrics(out, units={"train_s": "s"})
        rec.artifact_json(
            "translations.json", [{"de": p[0], "en": p[1], "hyp": h} for p, h in zip(test, hyps, strict=True)]
        )
    return {"dataset": u.translation, "embedding": embedding, "seed": seed, **out}


# ----------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class FilmJob:
    """FILM against ``victim`` at ``batch_size`` (the victim's batch sizes run in one task, one run each)."""

    victim: str
    batch_size: int

    @property
    def technique(self) -> str:
        return f"film-{self.victim}"


@dataclass(frozen=True)
class LMJob:
    """SEB's utility: a language model with ``embedding`` on ``dataset`` at ``seed``; ``matched``: SEB narrowed to
    the subword table's parameter count."""

    dataset: str
    embedding: str
    seed: int | None
    matched: bool = False

    @property
    def technique(self) -> str:
        return f"seb-lm-{self.embedding}" + ("-matched" if self.matched else "")


@dataclass(frozen=True)
class MTJob:
    """SEB's utility: a translation model with ``embedding`` at ``seed``."""

    embedding: str
    seed: int | None

    @property
    def technique(self) -> str:
        return f"seb-mt-{self.embedding}"


def plan(cfg: AttacksConfig) -> list[Job]:
    """Every run of the stage below its flow run (:mod:`tasks.jobs`), in the order the flow starts them: the
    trained priors and the byte-coverage curve (with FILM), the audited targets (``tasks.audit.AuditJob``) and the
    unlearning audit (its feature cache, then its run), FILM against each victim at each batch size, then the
    utility models, SEB's before the subword ones. The pool takes the longer jobs first (FILM against SEB is one
    task of minutes, an SEB model costs about twice a subword one), so that it does not end with one worker on a
    long job and the other idle. Every job is seeded by its own config, so the order changes no result; a job
    capped by wall-clock time (a prior's or a utility model's ``max_seconds``) depends on the machine's load,
    whatever the order."""
    f, u, a = cfg.film, cfg.utility, cfg.audit
    jobs: list[Job] = []
    if f is not None:
        jobs += [Recorded("film-prior") for p in f.priors if p.kind == "trained" and p.path is None]
        jobs.append(Recorded("seb-coverage"))
    if a is not None:
        jobs += audit_targets(a)
        jobs += [Recorded("feature-cache"), Recorded("mia-unlearning")] if a.unlearning else []
    if f is not None:
        jobs += [FilmJob(v, b) for v in f.victims for b in f.batch_sizes]
    if u is not None:
        lms = [LMJob(d, e, s) for s in u.run_seeds for d in u.lm_datasets for e in u.embeddings]
        lms += [LMJob(d, e, s, matched=True) for s in u.run_seeds for d in u.lm_datasets for e in u.matched]
        jobs += sorted(lms, key=lambda j: j.embedding == "subword")  # stable: SEB's first, each in config order
        jobs += [MTJob(e, s) for s in u.run_seeds for e in u.mt_embeddings] if u.translation else []
    return jobs
