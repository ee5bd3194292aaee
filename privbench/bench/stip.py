"""``privbench bench stip``: the STIP protocol on the real pretrained SmolLM2-135M (LLaMA architecture) and the
attacks on its permutation.

Timing: the three parties run in one process on the same thread (``run_stip_inprocess``), so P2's seconds and the
plaintext model's seconds are measured side by side; the median over ``repeats`` of the per-repeat ratio is
reported. Bytes per generated token come from one run with three processes over loopback sockets. Attacks as
``core.stip.recovery``, on both designs at fine-tune noise 0, 1%, 10% and 50%; the user's text is the offline
dialogue corpus in the model's own tokenizer.

Secrets (every ``pi``, ``rho``, ``sigma``) come from the OS CSPRNG (``core.stip.keys``), fresh per run and never in
the JSON (``setting.secret_source`` names the source); ``seed`` drives only the model, the prompt and the public
inputs.

JSON: ``ratios.server_over_plaintext_time``, ``ratios.user_overhead_fraction``, ``errors.max_abs_err`` (float32, as
measured), ``errors.float64_max_rel_err`` (exactness, judged at 1e-9 by ``targets.exact_in_float64``),
``bytes_per_token`` (``up``: user -> cloud, ``down``: cloud -> user, per design), ``attacks.<name>.recovery_rate``
(and what each reveals of the user's input), ``targets``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from core.errors import ConfigError
from privbench.bench.harness import Progress, bench_threads, register

NAME = "stip"


@dataclass(frozen=True)
class Setting:
    model: str = "smollm2"
    prompt_len: int = 8
    gen_len: int = 8
    repeats: int = 5
    finetune_noises: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5)
    attack_queries: int = 64
    stream_tokens: int = 20000
    timeout_s: float = 600.0
    seed: int = 0


PROFILES: dict[str, Setting] = {
    "quick": Setting(),
    "paper": Setting(prompt_len=32, gen_len=64, repeats=10, attack_queries=1024, stream_tokens=100000),
}


def resolve_setting(profile: str) -> Setting:
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join(PROFILES)}")
    return PROFILES[profile]


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    return {**asdict(resolve_setting(profile)), "threads": bench_threads()}


def _model(setting: Setting) -> Any:
    from core.stip.models import build_model
    from pbconfig.stip import StipModelSpec

    spec = (
        StipModelSpec(name="smollm2-135m", source="smollm2")
        if setting.model == "smollm2"
        else StipModelSpec(name="gpt2-config", source="gpt2-config", n_layer=2, n_embd=32, n_head=2)
    )
    return spec, build_model(
        spec.source, n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head, seed=setting.seed
    )


def _json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def _by_attack(recovery: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per attack, the best it recovers over designs and noises: ``recovery_rate`` (the secret: pi, or sigma in
    ``vocab_perm``, or the tokens where it targets neither) and ``input_tokens_recovered``."""
    out: dict[str, dict[str, float]] = {}
    for design, found in recovery.items():
        secret = "sigma_recovered" if design == "vocab_perm" else "pi_recovered"
        for row in found["rows"]:
            value = row[secret] if row[secret] is not None else row["tokens_recovered"]
            best = out.setdefault(row["attack"], {"recovery_rate": 0.0, "input_tokens_recovered": 0.0})
            best["recovery_rate"] = max(best["recovery_rate"], value or 0.0)
            best["input_tokens_recovered"] = max(best["input_tokens_recovered"], row["tokens_recovered"] or 0.0)
    return out


def _worst(recovery: Mapping[str, Any], design: str, target: str) -> float:
    """The public-checkpoint attack's worst recovery of ``target`` in ``design`` over the noises <= 10%."""
    cells = recovery.get(design, {}).get("table", {}).get("checkpoint", {}).get(target, {})
    low = [v for n, v in cells.items() if float(n) <= 0.1 + 1e-12]
    return min(low) if low else math.nan


@register(
    NAME,
    "STIP three-party permutation inference on SmolLM2-135M: cloud vs plaintext time, user share, "
    "bytes per token, max error, and attacks recovering the permutation",
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    from core.stip import evaluate as E
    from core.stip.keys import SECRET_SOURCE

    setting = resolve_setting(profile)
    torch.set_num_threads(bench_threads())
    spec, model = _model(setting)
    prompt = torch.randint(
        0,
        model.get_input_embeddings().weight.shape[0],
        (1, setting.prompt_len),
        generator=torch.Generator().manual_seed(setting.seed),
    )
    progress.print(
        f"[bold]{NAME}[/] ({profile}): {spec.name}, prompt {setting.prompt_len}, {setting.gen_len} new "
        f"tokens, {setting.repeats} timing repeats"
    )
    designs = {}
    for design in ("user_embed", "vocab_perm"):
        designs[design] = E.protocol_costs(
            model,
            prompt,
            setting.gen_len,
            design=design,
            repeats=setting.repeats,
            timeout_s=setting.timeout_s,
        )
        progress.print(
            f"  {design}: P2/plaintext same work {designs[design]['server_over_plaintext_same_work_time']:.3f}, "
            f"user share {designs[design]['user_overhead_fraction']:.4f}, max err {designs[design]['max_abs_err']:.2e}"
        )
    from core.stip import recovery as R

    stream, reference = R.model_streams(model, setting.stream_tokens, setting.seed)
    recovery = {}
    for design in designs:
        rows = R.recovery_rows(
            model,
            design,
            noises=setting.finetune_noises,
            seed=setting.seed,
            stream=stream,
            reference=reference,
            activation_queries=setting.attack_queries,
            seq_len=setting.prompt_len,
        )
        recovery[design] = {
            "table": R.recovery_table(rows, setting.finetune_noises),
            "rows": [_json_row(r) for r in rows],
        }
        for prior, targets in recovery[design]["table"].items():
            progress.print(f"  {design} {prior}: " + ", ".join(f"{t} {c}" for t, c in targets.items()))
    attacks = _by_attack(recovery)
    main = designs["user_embed"]
    ratios = {
        "server_over_plaintext_time": main["server_over_plaintext_time"],
        "user_overhead_fraction": main["user_overhead_fraction"],
        "vocab_perm_server_over_plaintext_time": designs["vocab_perm"]["server_over_plaintext_time"],
        "vocab_perm_user_overhead_fraction": designs["vocab_perm"]["user_overhead_fraction"],
        # P2 against the plaintext time of its own work (user_embed: the blocks; vocab_perm: the whole step)
        "server_over_plaintext_same_work_time": main["server_over_plaintext_same_work_time"],
        "vocab_perm_server_over_plaintext_same_work_time": designs["vocab_perm"][
            "server_over_plaintext_same_work_time"
        ],
    }
    max_err = max(d["max_abs_err"] for d in designs.values())
    return {
        "setting": {
            **asdict(setting),
            "model_name": spec.name,
            "threads": bench_threads(),
            "secret_source": SECRET_SOURCE,
        },
        "ratios": ratios,
        "errors": {
            "max_abs_err": max_err,
            **{f"{k}_max_abs_err": d["max_abs_err"] for k, d in designs.items()},
            "float64_max_rel_err": max(d["float64_max_rel_err"] for d in designs.values()),
        },
        "bytes_per_token": {
            k: {"up": d["bytes_up_per_token"], "down": d["bytes_down_per_token"]} for k, d in designs.items()
        },
        "designs": {
            k: {kk: v for kk, v in d.items() if kk not in ("tokens", "plain_tokens")} for k, d in designs.items()
        },
        "recovery": recovery,
        "attacks": attacks,
        "targets": {
            "server_within_5pct": ratios["server_over_plaintext_same_work_time"] <= 1.05,
            "user_share_under_2pct": ratios["user_overhead_fraction"] < 0.02,
            "exact_in_float64": all(d["exact_float64"] == 1.0 for d in designs.values()),
            "checkpoint_sigma_ge_99pct_up_to_10pct": _worst(recovery, "vocab_perm", "sigma") >= 0.99,
            "checkpoint_tokens_ge_99pct_up_to_10pct": _worst(recovery, "user_embed", "tokens") >= 0.99,
        },
    }
