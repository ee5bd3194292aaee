"""STIP tasks (stage 6): build a model, run the three-party protocol per design (correctness and costs), and run
each attack on the permutation (recovered fraction and what it reveals of the user's input); one run each.

Runs (``technique``): ``stip-<design>`` (tag ``privbench.result_group`` = ``protocol``) and ``attack-<name>``
(``attacks``, rows in ``attack_results`` with ``recovered_fraction``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from prefect import task

from core.stip import evaluate as E
from privbench.config import StipConfig, StipModelSpec
from tasks.records import RESUMABLE, task_record

GPT2_VOCAB = 50257


@functools.lru_cache(maxsize=2)
def build_model(spec: StipModelSpec, seed: int) -> torch.nn.Module:
    """``gpt2-config``: a seeded GPT-2 of the spec's shape with the real vocabulary and non-trivial norm weights
    (random init leaves them at 1 and 0, which would hide a transform that forgets them); ``smollm2``: the real
    pretrained SmolLM2-135M (loaded once per process: ~18 s). Callers must not modify the returned model."""
    if spec.source == "smollm2":
        from core.stip.models import load_smollm2

        return load_smollm2().eval()
    from transformers import GPT2Config, GPT2LMHeadModel

    from core.stip.models import randomize_norms

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=GPT2_VOCAB, n_positions=256, n_embd=spec.n_embd, n_layer=spec.n_layer,
                     n_head=spec.n_head, attn_implementation="eager")
    return randomize_norms(GPT2LMHeadModel(cfg), seed=seed).eval()


def _prompt(model: torch.nn.Module, length: int, seed: int) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@task(name="stip-protocol", **RESUMABLE)
def protocol(spec: StipModelSpec, design: str, cfg: StipConfig, parent: Any) -> dict[str, Any]:
    """One design on one model: tokens and logits vs the unpermuted model, P2 vs plaintext time, P3's share,
    bytes per generated token each way."""
    model = build_model(spec, cfg.seed)
    config = {"model": spec.model_dump(), "design": design, "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len,
              "repeats": cfg.timing_repeats}
    with task_record(parent=parent, technique=f"stip-{design}", config=config, dataset=spec.name,
                     run_name=f"STIP {design} on {spec.name}") as rec:
        rec.tag("privbench.result_group", "protocol")
        out = E.protocol_costs(model, _prompt(model, cfg.prompt_len, cfg.seed), cfg.gen_len, design=design,
                               seed=cfg.seed, repeats=cfg.timing_repeats, timeout_s=cfg.party_timeout_s)
        rec.metrics({k: v for k, v in out.items() if isinstance(v, int | float)},
                    units={"p2_s": "s", "plaintext_s": "s", "three_process_wall_s": "s"})
        rec.artifact_json("tokens.json", {"stip": out["tokens"], "plaintext": out["plain_tokens"]})
    return {"model": spec.name, **{k: v for k, v in out.items() if k not in ("tokens", "plain_tokens")}}


@task(name="stip-attack", **RESUMABLE)
def attack(spec: StipModelSpec, name: str, cfg: StipConfig, parent: Any) -> dict[str, Any]:
    """One attack on the permutation of one model (see ``core.stip.evaluate``)."""
    model = build_model(spec, cfg.seed)
    config = {"model": spec.model_dump(), "attack": name, "finetune_noise": cfg.finetune_noise,
              "queries": cfg.attack_queries, "stream_tokens": cfg.stream_tokens}
    with task_record(parent=parent, technique=f"attack-{name}", config=config, dataset=spec.name,
                     run_name=f"{name} attack on {spec.name}") as rec:
        rec.tag("privbench.result_group", "attacks")
        if name == "weight_matching":
            out = E.attack_weight_matching(model, rel_noise=cfg.finetune_noise, seed=cfg.seed)
        elif name == "activation_stats":
            out = E.attack_activation_stats(model, n_queries=cfg.attack_queries, seq_len=cfg.prompt_len,
                                            rel_noise=cfg.finetune_noise, seed=cfg.seed)
        else:
            stream, reference, vocab = corpus_streams(spec, cfg)
            out = E.attack_token_frequency(stream, reference, vocab, seed=cfg.seed)
        flat = {k: v for k, v in out.items() if isinstance(v, int | float)}
        rec.metrics(flat)
        rec.attack(attack=f"stip_{name}", target=f"stip:{spec.name}", setting=name,
                   recovered_fraction=out["recovery_rate"], extra={k: v for k, v in out.items() if k != "coverage_recovery"}
                   | {"coverage_recovery": {str(k): v for k, v in out.get("coverage_recovery", {}).items()}})
    return {"model": spec.name, "attack": name, **flat}


def corpus_streams(spec: StipModelSpec, cfg: StipConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Public text as GPT-2 BPE token ids (the offline dialogue corpus): the user's stream (``stream_tokens``
    ids, substituted by the attack) and a disjoint reference half whose unigram frequencies the attacker knows.
    The substitution attack acts on the vocabulary alone, so GPT-2's tokenizer stands in for every model."""
    from core.mpc.textdata import gpt2_tokenizer, text_pairs

    tok = gpt2_tokenizer()
    _, pairs = text_pairs("auto")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    halves = [order[0::2], order[1::2]]  # seeded random halves: both from the same distribution of topics
    user = torch.tensor([t for i in halves[0] for t in tok.encode(pairs[i][0] + " " + pairs[i][1])], dtype=torch.long)
    public = torch.tensor([t for i in halves[1] for t in tok.encode(pairs[i][0] + " " + pairs[i][1])],
                          dtype=torch.long)
    return user[: cfg.stream_tokens], public, GPT2_VOCAB
