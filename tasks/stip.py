"""STIP tasks (stage 6): build a model, run the three-party protocol per design (correctness and costs), and run
each attack on the permutation (recovered fraction and what it reveals of the user's input); one run each.

Runs (``technique``): ``stip-<design>`` (tag ``privbench.result_group`` = ``protocol``) and ``attacks-<design>``
(``attacks``: every attack at every fine-tune noise, rows in ``attack_results`` with ``recovered_fraction``).

Protocol runs are tagged ``privbench.timing_order`` (``abba``: the plaintext model and the protocol are timed in
alternating order over the rounds, see ``core.stip.evaluate``).

Secrets: every permutation (the protocol's ``pi``, ``rho``, ``sigma`` and each attack's target) is drawn from the OS
CSPRNG inside ``core.stip`` and never leaves it; ``cfg.seed`` drives only the model, the prompt and the corpus
split. Each run records where its secrets came from (tag ``privbench.secret_source``), never a secret."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from prefect import task

from core.secret_source import SECRET_SOURCE_TAG
from core.stip import evaluate as E
from core.stip import recovery as R
from core.stip.keys import SECRET_SOURCE
from core.stip.models import build_model
from pbconfig.stip import StipConfig, StipModelSpec
from storage.recording import Recorder
from tasks.records import RESUMABLE, task_record


@dataclass(frozen=True)
class StipJob:
    """One run of the stage: the protocol (``step`` ``protocol``) or every attack (``attack``) on one design of
    one model."""

    step: Literal["protocol", "attack"]
    model: StipModelSpec
    design: str

    @property
    def technique(self) -> str:
        return f"{'stip' if self.step == 'protocol' else 'attacks'}-{self.design}"


def plan(cfg: StipConfig) -> list[StipJob]:
    """Every run of the stage in the order the flow starts them: the protocol on each model's designs, then the
    attacks on each design of the models that are attacked (``attacks`` not empty)."""
    designs = [(m, d) for m in cfg.models for d in (m.designs or cfg.designs)]
    attacked = [(m, d) for m, d in designs if m.attacks is None or m.attacks]
    return [StipJob("protocol", m, d) for m, d in designs] + [StipJob("attack", m, d) for m, d in attacked]


def _model(spec: StipModelSpec, seed: int) -> torch.nn.Module:
    """The spec's model (``core.stip.models.build_model``, cached per process; do not modify it)."""
    return build_model(spec.source, n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head, seed=seed)


@contextmanager
def _stip_record(
    parent: Any, group: str, technique: str, config: dict[str, Any], spec: StipModelSpec, run_name: str
) -> Iterator[Recorder]:
    """The run of one STIP task on ``spec``'s model: in result group ``group``, tagged with where its secrets came
    from."""
    with task_record(parent=parent, technique=technique, config=config, dataset=spec.name, run_name=run_name) as rec:
        rec.tag("privbench.result_group", group)
        rec.tag(SECRET_SOURCE_TAG, SECRET_SOURCE)
        yield rec


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
    with _stip_record(parent, "protocol", f"stip-{design}", config, spec, f"STIP {design} on {spec.name}") as rec:
        out = E.protocol_costs(
            model,
            _prompt(model, cfg.prompt_len, cfg.seed),
            cfg.gen_len,
            design=design,
            repeats=cfg.timing_repeats,
            timeout_s=cfg.party_timeout_s,
        )
        rec.tag("privbench.timing_order", out["timing_order"])  # plaintext/protocol order over the timing rounds
        rec.metrics(
            {k: v for k, v in out.items() if isinstance(v, int | float)},
            units={"p2_s": "s", "plaintext_s": "s", "three_process_wall_s": "s"},
        )
        for i, ratio in enumerate(out["round_ratios"]):  # the rounds behind the median and its interval
            rec.metric("server_over_plaintext_same_work_time_round", ratio, step=i)
        rec.artifact_json("tokens.json", {"stip": out["tokens"], "plaintext": out["plain_tokens"]})
    return {"model": spec.name, **{k: v for k, v in out.items() if k not in ("tokens", "plain_tokens")}}


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


@task(name="stip-attack", **RESUMABLE)
def attack(spec: StipModelSpec, design: str, cfg: StipConfig, parent: Any) -> dict[str, Any]:
    """Every attack on one design of one model at every fine-tune noise (``core.stip.recovery``): one run with the
    recovered fractions of pi, rho, sigma and the user's tokens as metrics (``<prior>.<target>_recovered...``) and
    one ``attack_results`` row per attack and noise (``recovered_fraction``: the secret the design hides the input
    behind, sigma in ``vocab_perm`` and pi in ``user_embed``, or the tokens for the frequency attack there)."""
    model = _model(spec, cfg.seed)
    config = {
        "model": spec.model_dump(),
        "design": design,
        "attacks": list(spec.attacks if spec.attacks is not None else cfg.attacks),
        "finetune_noises": list(cfg.finetune_noises),
        "queries": cfg.attack_queries,
        "stream_tokens": cfg.stream_tokens,
    }
    run_name = f"attacks on STIP {design} on {spec.name}"
    with _stip_record(parent, "attacks", f"attacks-{design}", config, spec, run_name) as rec:
        stream, reference = R.model_streams(model, cfg.stream_tokens, cfg.seed)
        rows = R.recovery_rows(
            model,
            design,
            noises=cfg.finetune_noises,
            seed=cfg.seed,
            stream=stream,
            reference=reference,
            activation_queries=cfg.attack_queries,
            seq_len=cfg.prompt_len,
            attacks=config["attacks"],
        )
        metrics = R.recovery_metrics(rows, cfg.finetune_noises)
        rec.metrics(metrics)
        for row in rows:
            secret = "sigma" if design == "vocab_perm" else "pi"
            value = row[f"{secret}_recovered"]
            if math.isnan(value):
                value = row["tokens_recovered"]
            rec.attack(
                attack=f"stip_{row['attack']}",
                target=f"stip:{spec.name}",
                setting=f"{design}, prior={row['prior']}, noise={_clean(row['noise'])}",
                recovered_fraction=_clean(value),
                extra={k: _clean(v) for k, v in row.items()}
                | {
                    "design": design,
                    "recovery_rate": _clean(value),
                    "input_tokens_recovered": _clean(row["tokens_recovered"]),
                },
            )
    return {"model": spec.name, "design": design, "rows": rows, "metrics": metrics}
