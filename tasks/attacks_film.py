"""Attack-stage tasks, FILM part (SEB paper Sec. 3.3, 5.1): the attacker's LM priors, FILM against one victim at
every batch size, and the SEB byte-coverage curve; one recorded run each.

Runs (``technique``, tag ``privbench.result_group``):

* ``film-prior`` (``film``): a trained prior, trained once per content on the public text and cached in
  ``<PRIVBENCH_HOME>/models/film-prior-<key>``; the pretrained SmolLM2 prior needs no run;
* ``film-<victim>`` (``film``): one victim at one batch size; a row in ``attack_results`` per attacker setting and
  prior (``attack="film"``, ``target=<victim>``, ``setting="<setting>,prior=<name>,batch=<b>"``) with ROUGE-1/2/L F,
  candidate recall and the seconds the attack took, and ``recovered.json`` (every original sentence beside what
  was recovered);
* ``seb-coverage`` (``film``): Fig. 4's analogue, subwords covered by random byte sets.

Victims and priors share one tokenizer (``film.vocab``): GPT-2's BPE, or SmolLM2's, whose victims are cut from the
pretrained SmolLM2-135M; that model is loaded once per FILM task and serves both the victim and the prior.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from prefect import task

from core.errors import ConfigError, DataError
from core.models import hf
from pbconfig.attacks import AttacksConfig, FilmConfig, PriorSpec
from pbconfig.canon import canonical_json
from pbconfig.settings import get_settings
from storage.recording import RunRef
from tasks.prepare import read_manifest, write_prepared
from tasks.records import RESUMABLE, task_record

PRIOR_VERSION = "film-prior-v1"
SMOLLM2_PRIOR = "smollm2"  # the prior folder of kind smollm2: the offline pretrained weights
COVERAGE_K = (8, 16, 32, 64, 96, 120, 128, 160, 192, 224, 256)


def vocab_ids(vocab: str) -> tuple[int, int]:
    """``(vocab_size, eos)`` of a FILM vocabulary: GPT-2 (50,257; EOS 50256) or SmolLM2 (49,152;
    ``<|endoftext|>`` = 0, which ends every sentence and starts every prior sequence)."""
    from core.attacks.llama_victim import SMOLLM2_EOS, SMOLLM2_VOCAB
    from core.attacks.vocab import GPT2_EOS, GPT2_VOCAB

    return (SMOLLM2_VOCAB, SMOLLM2_EOS) if vocab == "smollm2" else (GPT2_VOCAB, GPT2_EOS)


def tokenizer(vocab: str = "gpt2"):
    if vocab == "smollm2":
        from core.attacks.llama_victim import smollm2_tokenizer

        return smollm2_tokenizer()
    from core.mpc.textdata import gpt2_tokenizer

    return gpt2_tokenizer()  # one per thread


def _texts(path: str) -> dict[str, Any]:
    from tasks.prepare_texts import load_prepared_texts

    return load_prepared_texts(path)


def _encode(sentences: list[str], vocab: str = "gpt2") -> list[list[int]]:
    tok = tokenizer(vocab)
    return [tok.encode(s) for s in sentences]


def _mapping(cfg: AttacksConfig, vocab_size: int) -> torch.Tensor:
    from core.attacks.seb import build_byte_mapping

    s = cfg.seb
    return build_byte_mapping(vocab_size, n_bytes=s.n_bytes, byte_vocab=s.byte_vocab, seed=s.seed)


# ----------------------------------------------------------------------------------------------- the priors


@task(name="film-prior")
def train_prior(film: FilmConfig, spec: PriorSpec, public: dict[str, str], parent: RunRef, threads: int = 2) -> str:
    """One attacker prior: ``smollm2`` for the pretrained SmolLM2 (nothing to train), ``spec.path`` (a Hugging
    Face causal LM in the victims' vocabulary), or a small causal LM trained on the training splits of the
    ``public`` text datasets (name -> prepared path), saved once per content. Returns what :func:`load_prior`
    takes."""
    if spec.kind == "smollm2":
        return SMOLLM2_PRIOR
    if spec.path is not None:
        return _check_hf_prior(spec.path, film.vocab)
    hashes = {name: _texts(p)["manifest"]["content_hash"] for name, p in sorted(public.items())}
    # the name only labels results: it stays out of the cache key
    body = canonical_json(spec.model_copy(update={"name": "-"}))
    tag = "" if film.vocab == "gpt2" else f"|vocab={film.vocab}"
    key = hashlib.sha256(f"{PRIOR_VERSION}|{body}|{json.dumps(hashes, sort_keys=True)}{tag}".encode())
    out_dir = get_settings().home / "models" / f"film-prior-{key.hexdigest()[:16]}"
    with task_record(
        parent=parent,
        technique="film-prior",
        config=spec,
        dataset="+".join(sorted(public)),
        run_name=f"FILM prior LM {spec.name}",
    ) as rec:
        rec.tag("privbench.result_group", "film")
        manifest = read_manifest(out_dir, PRIOR_VERSION)
        cached = manifest is not None
        if manifest is None:
            torch.set_num_threads(threads)
            manifest = _build_prior(film, spec, public, key.hexdigest(), hashes, out_dir)
        rec.metrics({k: v for k, v in manifest["stats"].items() if isinstance(v, int | float)}, units={"train_s": "s"})
        rec.metric("cache_hit", float(cached))
        rec.artifact_json("manifest.json", manifest)
    return str(out_dir)


def _build_prior(
    film: FilmConfig, spec: PriorSpec, public: dict[str, str], key: str, hashes: dict[str, str], out_dir: Path
) -> dict[str, Any]:
    from core.attacks.lm import build_causal_lm, perplexity, train_lm
    from core.attacks.vocab import CompactVocab, pack

    full, eos = vocab_ids(film.vocab)
    train, test = [], []
    for path in public.values():
        data = _texts(path)
        train += _encode(data["train"], film.vocab)
        test += _encode(data["test"], film.vocab)
    # each sentence framed by EOS: the beam search starts from EOS as GPT-2 does
    frame = [[eos, *s[: spec.max_len - 2], eos] for s in train if s]
    vocab = CompactVocab(sorted({t for s in frame for t in s}), full_size=full, unk_full=eos)
    ids, mask = pack(frame, max_len=spec.max_len, pad_id=eos)
    t_ids, t_mask = pack([[eos, *s[: spec.max_len - 2], eos] for s in test if s], max_len=spec.max_len, pad_id=eos)
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
        "vocab": film.vocab,
        "stats": stats,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        (tmp / "vocab.json").write_text(json.dumps(vocab.state()))

    write_prepared(out_dir, manifest, write)
    return manifest


def _check_hf_prior(path: str, vocab_name: str = "gpt2") -> str:
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise DataError(
            f"film prior path={path!r} is not a Hugging Face model folder (no config.json); give a "
            "folder saved with save_pretrained, or unset it to train the prior on the prior's public text"
        )
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    want = vocab_ids(vocab_name)[0]
    if vocab != want:
        raise ConfigError(
            f"film prior path={path!r} has vocab_size={vocab}, not the {vocab_name} vocabulary's {want}: the "
            "attacker's prior must share the victim's tokenizer"
        )
    return str(folder)


@functools.lru_cache(maxsize=1)
def _smollm2() -> torch.nn.Module:
    from core.stip.models import load_smollm2

    return load_smollm2().eval()  # ~20-40 s, once per process; never modified


def load_prior(path: str) -> Any:
    """An ``LMPrior`` (with a KV cache) from what :func:`train_prior` returned."""
    from transformers import AutoModelForCausalLM

    from core.attacks.llama_victim import SMOLLM2_EOS
    from core.attacks.priors import CompactPrior, HFPrior
    from core.attacks.vocab import CompactVocab

    if path == SMOLLM2_PRIOR:
        return HFPrior(_smollm2(), bos_id=SMOLLM2_EOS)
    folder = Path(path)
    model = hf.load(AutoModelForCausalLM.from_pretrained, folder, dtype=torch.float32).eval()
    if (folder / "vocab.json").is_file():
        vocab = CompactVocab.from_state(json.loads((folder / "vocab.json").read_text()))
        return CompactPrior(model, vocab, bos_id=vocab.unk_full)
    return HFPrior(model)


# ----------------------------------------------------------------------------------------------- FILM


def client_sentences(film: FilmConfig, private: dict[str, str]) -> list[list[list[int]]]:
    """Each client's private sentences (ids of ``film.vocab``, ``min_tokens``..``max_tokens`` long): every private
    dataset's training split is shuffled with the seed and dealt round-robin, datasets cycled over clients."""
    pools = []
    for name in film.private:
        sents = _encode(_texts(private[name])["train"], film.vocab)
        sents = [s for s in sents if film.min_tokens <= len(s) <= film.max_tokens]
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
    f = cfg.film
    if f.vocab == "smollm2":
        from core.attacks.llama_victim import smollm2_victim

        return smollm2_victim(
            victim,
            _smollm2(),
            n_layer=f.shape.n_layer,
            mapping=mapping,
            byte_dim=cfg.seb.byte_dim,
            hidden=cfg.seb.hidden,
            seed=f.seed,
        )
    from core.attacks.evaluate import build_victim

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
    victim: str, cfg: AttacksConfig, private: dict[str, str], priors: dict[str, str], parent: RunRef
) -> list[dict[str, Any]]:
    """FILM on one victim: FedSGD warm-up, then at every batch size ``film.batches_for(size)`` attacked client batches,
    each recovered with every prior of ``priors`` (name -> what :func:`train_prior` returned). One run per batch
    size; returns one summary per (batch size, prior)."""
    from core.attacks.evaluate import settings_for, warm_up

    torch.set_num_threads(cfg.threads_per_worker)
    f = cfg.film
    if f is None:
        raise ConfigError("attacks.film is not configured")
    settings = settings_for(victim, f.settings)
    if not settings:
        raise ConfigError(
            f"no attacker setting of film.settings={list(f.settings)} applies to victim {victim!r}; "
            "subword victims need 'subwords', SEB victims 'bytes', 'relaxed' or (SEB_co) 'positional'"
        )
    full, eos = vocab_ids(f.vocab)
    mapping = _mapping(cfg, full)
    clients = client_sentences(f, private)
    model = _victim_model(victim, cfg, mapping)
    losses = warm_up(
        model, clients, rounds=f.warmup_rounds, batch_size=f.client_batch_size, lr=f.fed_lr, seed=f.seed, eos_id=eos
    )
    loaded = {name: load_prior(path) for name, path in priors.items()}
    out = []
    for batch_size in f.batch_sizes:
        gen = torch.Generator().manual_seed(f.seed * 1000 + batch_size)
        batches = []
        for k in range(f.batches_for(batch_size)):
            pool = clients[k % len(clients)]
            batches.append([pool[i] for i in torch.randperm(len(pool), generator=gen)[:batch_size].tolist()])
        out += _attack_one_size(victim, batch_size, cfg, settings, model, batches, mapping, loaded, losses, parent)
    return out


def _attack_one_size(
    victim: str,
    batch_size: int,
    cfg: AttacksConfig,
    settings: list[str],
    model: torch.nn.Module,
    batches: list[list[list[int]]],
    mapping: torch.Tensor,
    priors: dict[str, Any],
    losses: list[float],
    parent: RunRef,
) -> list[dict[str, Any]]:
    from core.attacks.evaluate import attack_batches, summarize
    from core.attacks.lm import embedding_parameter_count

    f = cfg.film
    eos = vocab_ids(f.vocab)[1]
    config = {
        "victim": victim,
        "batch_size": batch_size,
        "film": f.model_dump(mode="json"),
        "seb": cfg.seb.model_dump(mode="json"),
    }
    out, dumped = [], {}
    with task_record(
        parent=parent,
        technique=f"film-{victim}",
        config=config,
        dataset="+".join(f.private),
        run_name=f"FILM vs {victim}, batch {batch_size}",
    ) as rec:
        rec.tag("privbench.result_group", "film")
        n_emb = embedding_parameter_count(model)
        for name, prior in priors.items():
            t0 = time.perf_counter()
            results = attack_batches(
                model,
                batches,
                victim=victim,
                settings=settings,
                mapping=mapping,
                byte_vocab=cfg.seb.byte_vocab,
                prior=prior,
                decode=tokenizer(f.vocab).decode,
                beam_width=f.beam_width,
                reorder_passes=f.reorder_passes,
                relaxed_random=f.relaxed_random,
                seed=f.seed,
                repeat_penalty=f.repeat_penalty,
                reorder_moves=f.reorder_moves,
                eos_id=eos,
            )
            attack_s = time.perf_counter() - t0
            summary = summarize(results)
            for setting, vals in summary.items():
                rec.metrics(
                    {f"{name}.{setting}.{k}": v for k, v in vals.items() if math.isfinite(v)},
                    units={f"{name}.{setting}.seconds": "s"},
                )
                best = max((r for r in results if r.setting == setting), key=lambda r: r.rougeL)
                rec.attack(
                    attack="film",
                    target=victim,
                    setting=f"{setting},prior={name},batch={batch_size}",
                    rouge1=vals["rouge1"],
                    rouge2=vals["rouge2"],
                    rougeL=vals["rougeL"],
                    recall=vals["recall"],
                    extra={
                        "batch_size": batch_size,
                        "prior": name,
                        **{k: (v if math.isfinite(v) else None) for k, v in vals.items()},
                        "best_original": best.best_original,
                        "best_recovered": best.best_recovered,
                    },
                )
            rec.metrics({f"{name}.attack_s": attack_s}, units={f"{name}.attack_s": "s"})
            dumped[name] = [asdict(r) for r in results]
            out.append(
                {
                    "victim": victim,
                    "prior": name,
                    "batch_size": batch_size,
                    "settings": summary,
                    "attack_s": attack_s,
                    "embedding_params": n_emb,
                    "best": {
                        s: max((r.rougeL, r.best_original, r.best_recovered) for r in results if r.setting == s)
                        for s in summary
                    },
                }
            )
        rec.metrics(
            {"embedding_params": n_emb, "warmup_final_loss": losses[-1] if losses else float("nan")},
        )
        rec.artifact_json("recovered.json", dumped)
    return out


@task(name="seb-coverage")
def seb_coverage(cfg: AttacksConfig, parent: RunRef) -> dict[str, Any]:
    """Fig. 4's analogue on the victims' vocabulary: for a random set of k bytes, how many subwords are made only
    of those bytes (what the ``bytes`` attacker keeps) and how many contain at least one of them."""
    from core.attacks.film import byte_coverage

    full = vocab_ids(cfg.film.vocab if cfg.film is not None else "gpt2")[0]
    with task_record(parent=parent, technique="seb-coverage", config=cfg.seb, run_name="SEB byte coverage") as rec:
        rec.tag("privbench.result_group", "film")
        ks = [k for k in COVERAGE_K if k <= cfg.seb.byte_vocab]
        cov = byte_coverage(_mapping(cfg, full), ks, trials=20, seed=cfg.seb.seed)
        for k, v in cov.items():
            rec.metrics({f"only.k{k}": v["only"], f"any.k{k}": v["any"]})
        rec.artifact_json("coverage.json", {str(k): v for k, v in cov.items()})
    return {str(k): v for k, v in cov.items()}
