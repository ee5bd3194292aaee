"""``privbench bench stip``: the STIP protocol on the real pretrained SmolLM2-135M (LLaMA architecture) and the
attacks on its permutation.

Timing: the three parties run in one process on the same thread (``run_stip_inprocess``), so P2's seconds and the
plaintext model's seconds are measured side by side; the median over ``repeats`` of the per-repeat ratio is
reported. Bytes per generated token come from one run with three processes over loopback sockets. Attacks as
``core.stip.evaluate``; the token-frequency attack uses the offline dialogue corpus in GPT-2 BPE ids.

Secrets (every ``pi``, ``rho``, ``sigma``) come from the OS CSPRNG (``core.stip.keys``), fresh per run and never in
the JSON (``setting.secret_source`` names the source); ``seed`` drives only the model, the prompt and the public
inputs.

JSON: ``ratios.server_over_plaintext_time``, ``ratios.user_overhead_fraction``, ``errors.max_abs_err`` (float32, as
measured), ``errors.float64_max_rel_err`` (exactness, judged at 1e-9 by ``targets.exact_in_float64``),
``bytes_per_token`` (``up``: user -> cloud, ``down``: cloud -> user, per design), ``attacks.<name>.recovery_rate``
(and what each reveals of the user's input), ``targets``.
"""

from __future__ import annotations

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
    finetune_noise: float = 0.01
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
            f"  {design}: P2/plaintext {designs[design]['server_over_plaintext_time']:.3f}, user share "
            f"{designs[design]['user_overhead_fraction']:.4f}, max err {designs[design]['max_abs_err']:.2e}"
        )
    attacks = {
        "weight_matching": E.attack_weight_matching(model, rel_noise=setting.finetune_noise, seed=setting.seed),
        "activation_stats": E.attack_activation_stats(
            model,
            n_queries=setting.attack_queries,
            seq_len=setting.prompt_len,
            rel_noise=setting.finetune_noise,
            seed=setting.seed,
        ),
    }
    stream, reference, vocab = E.corpus_streams(setting.stream_tokens, seed=0)  # the corpus split of StipConfig's seed
    attacks["token_frequency"] = E.attack_token_frequency(stream, reference, vocab)
    for name, a in attacks.items():
        progress.print(f"  attack {name}: recovery {a['recovery_rate']:.3f}")
    main = designs["user_embed"]
    ratios = {
        "server_over_plaintext_time": main["server_over_plaintext_time"],
        "user_overhead_fraction": main["user_overhead_fraction"],
        "vocab_perm_server_over_plaintext_time": designs["vocab_perm"]["server_over_plaintext_time"],
        "vocab_perm_user_overhead_fraction": designs["vocab_perm"]["user_overhead_fraction"],
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
        "attacks": {
            k: {kk: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()}) for kk, v in a.items()}
            for k, a in attacks.items()
        },
        "targets": {
            "server_within_5pct": ratios["server_over_plaintext_time"] <= 1.05,
            "user_share_under_2pct": ratios["user_overhead_fraction"] < 0.02,
            "exact_in_float64": all(d["exact_float64"] == 1.0 for d in designs.values()),
        },
    }
