"""STIP tasks (stage 6): build a model, run the three-party protocol per design (correctness and costs), and run
each attack on the permutation (recovered fraction and what it reveals of the user's input); one run each.

Runs (``technique``): ``stip-<design>`` (tag ``privbench.result_group`` = ``protocol``) and ``attack-<name>``
(``attacks``, rows in ``attack_results`` with ``recovered_fraction``).

Secrets: every permutation (the protocol's ``pi``, ``rho``, ``sigma`` and each attack's target) is drawn from the OS
CSPRNG inside ``core.stip`` and never leaves it; ``cfg.seed`` drives only the model, the prompt and the corpus
split. Each run records where its secrets came from (tag ``privbench.secret_source``), never a secret."""

from __future__ import annotations

from typing import Any

import torch
from prefect import task

from core.stip import evaluate as E
from core.stip.keys import SECRET_SOURCE, SECRET_SOURCE_TAG
from core.stip.models import build_model
from pbconfig.stip import StipConfig, StipModelSpec
from tasks.records import RESUMABLE, task_record


def _model(spec: StipModelSpec, seed: int) -> torch.nn.Module:
    """The spec's model (``core.stip.models.build_model``, cached per process; do not modify it)."""
    return build_model(spec.source, n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head, seed=seed)


def _prompt(model: torch.nn.Module, length: int, seed: int) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@task(name="stip-protocol", **RESUMABLE)
def protocol(spec: StipModelSpec, design: str, cfg: StipConfig, parent: Any) -> dict[str, Any]:
    """One design on one model: tokens and logits vs the unpermuted model, P2 vs plaintext time, P3's share,
    bytes per generated token each way."""
    model = _model(spec, cfg.seed)
    config = {
        "model": spec.model_dump(),
        "design": design,
        "prompt_len": cfg.prompt_len,
        "gen_len": cfg.gen_len,
        "repeats": cfg.timing_repeats,
    }
    with task_record(
        parent=parent,
        technique=f"stip-{design}",
        config=config,
        dataset=spec.name,
        run_name=f"STIP {design} on {spec.name}",
    ) as rec:
        rec.tag("privbench.result_group", "protocol")
        rec.tag(SECRET_SOURCE_TAG, SECRET_SOURCE)
        out = E.protocol_costs(
            model,
            _prompt(model, cfg.prompt_len, cfg.seed),
            cfg.gen_len,
            design=design,
            repeats=cfg.timing_repeats,
            timeout_s=cfg.party_timeout_s,
        )
        rec.metrics(
            {k: v for k, v in out.items() if isinstance(v, int | float)},
            units={"p2_s": "s", "plaintext_s": "s", "three_process_wall_s": "s"},
        )
        rec.artifact_json("tokens.json", {"stip": out["tokens"], "plaintext": out["plain_tokens"]})
    return {"model": spec.name, **{k: v for k, v in out.items() if k not in ("tokens", "plain_tokens")}}


@task(name="stip-attack", **RESUMABLE)
def attack(spec: StipModelSpec, name: str, cfg: StipConfig, parent: Any) -> dict[str, Any]:
    """One attack on the permutation of one model (see ``core.stip.evaluate``)."""
    model = _model(spec, cfg.seed)
    config = {
        "model": spec.model_dump(),
        "attack": name,
        "finetune_noise": cfg.finetune_noise,
        "queries": cfg.attack_queries,
        "stream_tokens": cfg.stream_tokens,
    }
    with task_record(
        parent=parent,
        technique=f"attack-{name}",
        config=config,
        dataset=spec.name,
        run_name=f"{name} attack on {spec.name}",
    ) as rec:
        rec.tag("privbench.result_group", "attacks")
        rec.tag(SECRET_SOURCE_TAG, SECRET_SOURCE)
        if name == "weight_matching":
            out = E.attack_weight_matching(model, rel_noise=cfg.finetune_noise, seed=cfg.seed)
        elif name == "activation_stats":
            out = E.attack_activation_stats(
                model, n_queries=cfg.attack_queries, seq_len=cfg.prompt_len, rel_noise=cfg.finetune_noise, seed=cfg.seed
            )
        else:
            stream, reference, vocab = E.corpus_streams(cfg.stream_tokens, cfg.seed)
            out = E.attack_token_frequency(stream, reference, vocab)
        flat = {k: v for k, v in out.items() if isinstance(v, int | float)}
        rec.metrics(flat)
        rec.attack(
            attack=f"stip_{name}",
            target=f"stip:{spec.name}",
            setting=name,
            recovered_fraction=out["recovery_rate"],
            extra={k: v for k, v in out.items() if k != "coverage_recovery"}
            | {"coverage_recovery": {str(k): v for k, v in out.get("coverage_recovery", {}).items()}},
        )
    return {"model": spec.name, "attack": name, **flat}
