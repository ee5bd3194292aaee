"""Attack-stage tasks, part 1 (SEB paper): the attacker's LM prior, FILM against one victim per batch size, the
SEB byte-coverage curve, and SEB's utility (LM perplexity, translation BLEU); one recorded run each.

Runs (``technique``, tag ``privbench.result_group``):

* ``film-prior`` (``film``): the attacker's prior, trained once per content on the public text and cached in
  ``<PRIVBENCH_HOME>/models/film-prior-<key>``;
* ``film-<victim>`` (``film``): one victim at one batch size; a row in ``attack_results`` per attacker setting
  (``attack="film"``, ``target=<victim>``, ``setting="<setting>,batch=<b>"``) with ROUGE-1/2/L F and candidate
  recall, and ``recovered.json`` (every original sentence beside what was recovered);
* ``seb-coverage`` (``film``): Fig. 4's analogue, subwords covered by random byte sets;
* ``seb-lm-<embedding>`` and ``seb-mt-<embedding>`` (``utility``): perplexity / BLEU with embedding parameter
  counts, the same model and budget for every embedding.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from prefect import task

from core.errors import ConfigError, DataError
from pbconfig.attacks import AttacksConfig, FilmConfig
from pbconfig.canon import canonical_json
from pbconfig.settings import get_settings
from storage.recording import RunRef
from tasks.prepare import MANIFEST, read_manifest, write_atomically
from tasks.records import RESUMABLE, task_record

PRIOR_VERSION = "film-prior-v1"
COVERAGE_K = (8, 16, 32, 64, 96, 120, 128, 160, 192, 224, 256)


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


def _threads(cfg: AttacksConfig) -> None:
    torch.set_num_threads(cfg.threads_per_worker)


# ----------------------------------------------------------------------------------------------- the prior


@task(name="film-prior")
def train_prior(film: FilmConfig, public: dict[str, str], parent: RunRef, threads: int = 2) -> str:
    """The attacker's prior: ``film.prior.path`` (a Hugging Face causal LM with GPT-2's vocabulary), or a small
    GPT-2 trained on the training splits of the ``public`` text datasets (name -> prepared path), saved once per
    content. Returns the folder to pass to :func:`load_prior`."""
    spec = film.prior
    if spec.path is not None:
        return _check_hf_prior(spec.path)
    hashes = {name: _texts(p)["manifest"]["content_hash"] for name, p in sorted(public.items())}
    key = hashlib.sha256(f"{PRIOR_VERSION}|{canonical_json(spec)}|{json.dumps(hashes, sort_keys=True)}".encode())
    out_dir = get_settings().home / "models" / f"film-prior-{key.hexdigest()[:16]}"
    with task_record(
        parent=parent, technique="film-prior", config=spec, dataset="+".join(sorted(public)), run_name="FILM prior LM"
    ) as rec:
        rec.tag("privbench.result_group", "film")
        manifest = read_manifest(out_dir, PRIOR_VERSION)
        cached = manifest is not None
        if manifest is None:
            torch.set_num_threads(threads)
            manifest = _build_prior(film, public, key.hexdigest(), hashes, out_dir)
        rec.metrics({k: v for k, v in manifest["stats"].items() if isinstance(v, int | float)}, units={"train_s": "s"})
        rec.metric("cache_hit", float(cached))
        rec.artifact_json("manifest.json", manifest)
    return str(out_dir)


def _build_prior(
    film: FilmConfig, public: dict[str, str], key: str, hashes: dict[str, str], out_dir: Path
) -> dict[str, Any]:
    from core.attacks.lm import build_causal_lm, perplexity, train_lm
    from core.attacks.vocab import GPT2_EOS, CompactVocab, pack

    spec = film.prior
    train, test = [], []
    for path in public.values():
        data = _texts(path)
        train += _encode(data["train"])
        test += _encode(data["test"])
    # each sentence framed by EOS: the beam search starts from EOS as GPT-2 does
    frame = [[GPT2_EOS, *s[: spec.max_len - 2], GPT2_EOS] for s in train if s]
    vocab = CompactVocab.from_sequences(frame)
    ids, mask = pack(frame, max_len=spec.max_len)
    t_ids, t_mask = pack([[GPT2_EOS, *s[: spec.max_len - 2], GPT2_EOS] for s in test if s], max_len=spec.max_len)
    model = build_causal_lm(
        vocab.size,
        embedding="subword",
        n_layer=spec.shape.n_layer,
        n_embd=spec.shape.n_embd,
        n_head=spec.shape.n_head,
        n_positions=spec.max_len,
        tie_subword=True,
        seed=film.seed,
    )
    t0 = time.perf_counter()
    fit = train_lm(
        model,
        vocab.encode(ids),
        mask,
        steps=spec.steps,
        batch_size=spec.batch_size,
        lr=spec.lr,
        seed=film.seed,
        max_seconds=spec.max_seconds,
    )
    stats = {
        "train_s": time.perf_counter() - t0,
        "steps": fit["steps"],
        "train_loss": fit["train_loss"],
        "test_perplexity_compact": perplexity(model.eval(), vocab.encode(t_ids), t_mask),
        "vocab_size": vocab.size,
        "n_train_sentences": len(frame),
        "n_train_tokens": int(mask.sum()),
    }
    manifest = {
        "prep_version": PRIOR_VERSION,
        "cache_key": key,
        "public": hashes,
        "spec": spec.model_dump(mode="json"),
        "stats": stats,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        (tmp / "vocab.json").write_text(json.dumps(vocab.state()))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    write_atomically(out_dir, write)
    return manifest


def _check_hf_prior(path: str) -> str:
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise DataError(
            f"film.prior.path={path!r} is not a Hugging Face model folder (no config.json); give a "
            "folder saved with save_pretrained, or unset it to train the prior on film.prior.public"
        )
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    if vocab != 50257:
        raise ConfigError(
            f"film.prior.path={path!r} has vocab_size={vocab}, not GPT-2's 50257: the attacker's prior "
            "must share the victim's tokenizer"
        )
    return str(folder)


def load_prior(path: str) -> Any:
    """An ``LMPrior`` from a folder of :func:`train_prior`."""
    from transformers import AutoModelForCausalLM

    from core.attacks.priors import CompactPrior, HFPrior
    from core.attacks.vocab import CompactVocab

    folder = Path(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if (folder / "vocab.json").is_file():
        return CompactPrior(model, CompactVocab.from_state(json.loads((folder / "vocab.json").read_text())))
    return HFPrior(model)


# ----------------------------------------------------------------------------------------------- FILM


def client_sentences(film: FilmConfig, private: dict[str, str]) -> list[list[list[int]]]:
    """Each client's private sentences (GPT-2 ids, ``min_tokens``..``max_tokens`` long): every private dataset's
    training split is shuffled with the seed and dealt round-robin, datasets cycled over clients."""
    pools = []
    for name in film.private:
        sents = [s for s in _encode(_texts(private[name])["train"]) if film.min_tokens <= len(s) <= film.max_tokens]
        if len(sents) < film.n_clients:
            raise DataError(
                f"private text dataset {name!r} has {len(sents)} sentences of {film.min_tokens}.."
                f"{film.max_tokens} tokens, fewer than n_clients={film.n_clients}; lower n_clients or "
                "widen the token range"
            )
        order = torch.randperm(len(sents), generator=torch.Generator().manual_seed(film.seed)).tolist()
        pools.append([sents[i] for i in order])
    clients: list[list[list[int]]] = [[] for _ in range(film.n_clients)]
    for d, pool in enumerate(pools):
        for i, s in enumerate(pool):
            clients[(i + d) % film.n_clients].append(s)
    return clients


def _victim_model(victim: str, cfg: AttacksConfig, mapping: torch.Tensor) -> torch.nn.Module:
    from core.attacks.evaluate import build_victim

    f = cfg.film
    return build_victim(
        victim,
        mapping=mapping,
        n_layer=f.shape.n_layer,
        n_embd=f.shape.n_embd,
        n_head=f.shape.n_head,
        n_positions=f.max_tokens + 1,
        byte_dim=cfg.seb.byte_dim,
        hidden=cfg.seb.hidden,
        seed=f.seed,
    )


@task(name="film-attack", **RESUMABLE)
def film_attack(
    victim: str, batch_size: int, cfg: AttacksConfig, private: dict[str, str], prior_dir: str, parent: RunRef
) -> dict[str, Any]:
    """FILM on one victim at one batch size: FedSGD warm-up, then ``batches_per_size`` attacked client batches."""
    from core.attacks.evaluate import attack_batches, settings_for, summarize, warm_up
    from core.attacks.lm import embedding_parameter_count
    from core.attacks.vocab import GPT2_VOCAB

    _threads(cfg)
    f = cfg.film
    if f is None:
        raise ConfigError("attacks.film is not configured")
    settings = settings_for(victim, f.settings)
    if not settings:
        raise ConfigError(
            f"no attacker setting of film.settings={list(f.settings)} applies to victim {victim!r}; "
            "subword victims need 'subwords', SEB victims 'bytes', 'relaxed' or (SEB_co) 'positional'"
        )
    config = {
        "victim": victim,
        "batch_size": batch_size,
        "film": f.model_dump(mode="json"),
        "seb": cfg.seb.model_dump(mode="json"),
    }
    with task_record(
        parent=parent,
        technique=f"film-{victim}",
        config=config,
        dataset="+".join(f.private),
        run_name=f"FILM vs {victim}, batch {batch_size}",
    ) as rec:
        rec.tag("privbench.result_group", "film")
        mapping = _mapping(cfg, GPT2_VOCAB)
        clients = client_sentences(f, private)
        model = _victim_model(victim, cfg, mapping)
        losses = warm_up(
            model, clients, rounds=f.warmup_rounds, batch_size=f.client_batch_size, lr=f.fed_lr, seed=f.seed
        )
        gen = torch.Generator().manual_seed(f.seed * 1000 + batch_size)
        batches = []
        for k in range(f.batches_per_size):
            pool = clients[k % len(clients)]
            batches.append([pool[i] for i in torch.randperm(len(pool), generator=gen)[:batch_size].tolist()])
        prior = load_prior(prior_dir)
        t0 = time.perf_counter()
        results = attack_batches(
            model,
            batches,
            victim=victim,
            settings=settings,
            mapping=mapping,
            byte_vocab=cfg.seb.byte_vocab,
            prior=prior,
            decode=tokenizer().decode,
            beam_width=f.beam_width,
            reorder_passes=f.reorder_passes,
            relaxed_random=f.relaxed_random,
            seed=f.seed,
            repeat_penalty=f.repeat_penalty,
            reorder_moves=f.reorder_moves,
        )
        attack_s = time.perf_counter() - t0
        summary = summarize(results)
        for setting, vals in summary.items():
            rec.metrics({f"{setting}.{k}": v for k, v in vals.items()})
            best = max((r for r in results if r.setting == setting), key=lambda r: r.rougeL)
            rec.attack(
                attack="film",
                target=victim,
                setting=f"{setting},batch={batch_size}",
                rouge1=vals["rouge1"],
                rouge2=vals["rouge2"],
                rougeL=vals["rougeL"],
                recall=vals["recall"],
                extra={
                    "batch_size": batch_size,
                    **vals,
                    "best_original": best.best_original,
                    "best_recovered": best.best_recovered,
                },
            )
        n_emb = embedding_parameter_count(model)
        rec.metrics(
            {
                "attack_s": attack_s,
                "embedding_params": n_emb,
                "warmup_final_loss": losses[-1] if losses else float("nan"),
            },
            units={"attack_s": "s"},
        )
        rec.artifact_json("recovered.json", [asdict(r) for r in results])
    return {
        "victim": victim,
        "batch_size": batch_size,
        "settings": summary,
        "embedding_params": n_emb,
        "best": {
            s: max((r.rougeL, r.best_original, r.best_recovered) for r in results if r.setting == s) for s in summary
        },
    }


@task(name="seb-coverage")
def seb_coverage(cfg: AttacksConfig, parent: RunRef) -> dict[str, Any]:
    """Fig. 4's analogue on the GPT-2 vocabulary: for a random set of k bytes, how many subwords are made only
    of those bytes (what the ``bytes`` attacker keeps) and how many contain at least one of them."""
    from core.attacks.film import byte_coverage
    from core.attacks.vocab import GPT2_VOCAB

    with task_record(parent=parent, technique="seb-coverage", config=cfg.seb, run_name="SEB byte coverage") as rec:
        rec.tag("privbench.result_group", "film")
        ks = [k for k in COVERAGE_K if k <= cfg.seb.byte_vocab]
        cov = byte_coverage(_mapping(cfg, GPT2_VOCAB), ks, trials=20, seed=cfg.seb.seed)
        for k, v in cov.items():
            rec.metrics({f"only.k{k}": v["only"], f"any.k{k}": v["any"]})
        rec.artifact_json("coverage.json", {str(k): v for k, v in cov.items()})
    return {str(k): v for k, v in cov.items()}


# ----------------------------------------------------------------------------------------------- utility


def _lm_blocks(seqs: list[list[int]], max_len: int, eos: int) -> torch.Tensor:
    """The corpus as one stream (sentences separated by EOS) cut into blocks of ``max_len`` tokens (n, max_len)."""
    stream = [t for s in seqs for t in (*s, eos)]
    n = len(stream) // max_len
    if n < 1:
        raise DataError(f"text too short for one block of {max_len} tokens ({len(stream)} tokens)")
    return torch.tensor(stream[: n * max_len], dtype=torch.long).view(n, max_len)  # (n_blocks, max_len)


@task(name="seb-lm", **RESUMABLE)
def utility_lm(dataset: str, embedding: str, cfg: AttacksConfig, path: str, parent: RunRef) -> dict[str, Any]:
    """Perplexity of a small causal LM on ``dataset``'s test split with ``embedding`` (Sec. 5.2.3's analogue)."""
    from core.attacks.lm import (
        build_causal_lm,
        count_parameters,
        embedding_parameter_count,
        perplexity,
        train_lm,
    )
    from core.attacks.vocab import GPT2_EOS, CompactVocab

    _threads(cfg)
    u = cfg.utility
    config = {
        "dataset": dataset,
        "embedding": embedding,
        "utility": u.model_dump(mode="json"),
        "seb": cfg.seb.model_dump(mode="json"),
    }
    with task_record(
        parent=parent,
        technique=f"seb-lm-{embedding}",
        config=config,
        dataset=dataset,
        run_name=f"LM {embedding} on {dataset}",
    ) as rec:
        rec.tag("privbench.result_group", "utility")
        data = _texts(path)
        train, test = _encode(data["train"]), _encode(data["test"])
        vocab = CompactVocab.from_sequences(train)
        tr = vocab.encode(_lm_blocks(train, u.lm_max_len, GPT2_EOS))
        te = vocab.encode(_lm_blocks(test, u.lm_max_len, GPT2_EOS))
        model = build_causal_lm(
            vocab.size,
            embedding=embedding,
            n_layer=u.lm_shape.n_layer,
            n_embd=u.lm_shape.n_embd,
            n_head=u.lm_shape.n_head,
            n_positions=u.lm_max_len,
            mapping=_mapping(cfg, vocab.size) if embedding != "subword" else None,
            byte_dim=cfg.seb.byte_dim,
            hidden=cfg.seb.hidden,
            output="tied",
            tie_subword=True,
            seed=u.seed,
        )
        t0 = time.perf_counter()
        fit = train_lm(
            model,
            tr,
            torch.ones_like(tr, dtype=torch.bool),
            steps=u.lm_steps,
            batch_size=u.lm_batch_size,
            lr=u.lm_lr,
            seed=u.seed,
            max_seconds=u.max_seconds,
        )
        train_s = time.perf_counter() - t0
        ppl = perplexity(model.eval(), te, torch.ones_like(te, dtype=torch.bool))
        out = {
            "perplexity": ppl,
            "embedding_params": embedding_parameter_count(model),
            "params": count_parameters(model),
            "train_s": train_s,
            "steps": fit["steps"],
            "train_loss": fit["train_loss"],
            "vocab_size": vocab.size,
            "test_unk_rate": float((te == vocab.unk).float().mean()),
        }
        rec.metrics(out, units={"train_s": "s"})
    return {"dataset": dataset, "embedding": embedding, **out}


@task(name="seb-mt", **RESUMABLE)
def utility_translation(embedding: str, cfg: AttacksConfig, path: str, parent: RunRef) -> dict[str, Any]:
    """German->English BLEU of a small encoder-decoder with ``embedding`` (Sec. 5.2.1's analogue, sacreBLEU 13a)."""
    from core.attacks.lm import count_parameters
    from core.attacks.translation import (
        Seq2SeqLM,
        bleu,
        embedding_parameter_count,
        train_translation,
        translate,
    )
    from core.attacks.vocab import GPT2_EOS, CompactVocab

    _threads(cfg)
    u = cfg.utility
    config = {
        "dataset": u.translation,
        "embedding": embedding,
        "utility": u.model_dump(mode="json"),
        "seb": cfg.seb.model_dump(mode="json"),
    }
    with task_record(
        parent=parent,
        technique=f"seb-mt-{embedding}",
        config=config,
        dataset=u.translation,
        run_name=f"de-en translation {embedding}",
    ) as rec:
        rec.tag("privbench.result_group", "utility")
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
            seed=u.seed,
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
            seed=u.seed,
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
    return {"dataset": u.translation, "embedding": embedding, **out}
