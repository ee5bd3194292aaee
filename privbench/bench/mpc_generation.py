"""``privbench bench mpc-generation``: encrypted greedy GPT-2 generation per method under two-party CrypTen
(MERGE paper, Tables 1-2): seconds, bytes and rounds in total and per operation category.

Setting: a GPT-2 with the real 50,257-token vocabulary and random weights of the profile's shape (time, bytes
and rounds do not depend on the weight values; the merge modules' constant attention is averaged over random
ids), ``gen_len`` tokens after a ``prefix_len``-token prompt for a batch of ``batch_size`` prompts (1), both
parties as local processes on this machine (CPU, or CUDA when ``PRIVBENCH_BENCH_DEVICE=cuda``). Quick: 2 layers
of width 64, prefix 6, 6 tokens (minutes on 2 cores). Paper: the GPT-2 124M shape (12 layers, 768, 12 heads)
generating up to sequence length 128 (Table 1) — hours on a CPU.

JSON: ``methods.<name>.{total_s, comm_bytes, rounds, ops.<category>.{s, bytes, rounds}}`` for ``vanilla``,
``vanilla_kv``, ``mpcformer_2relu``, ``mpcformer_2quad``, ``thex``, ``merge_er``, ``merge_mm``, ``merge``
(slower party: max over the two), ``ratios.merge_speedup_over_vanilla``,
``ratios.merge_comm_fraction_of_vanilla``, ``ratios.merge_speedup_over_vanilla_kv`` and per-method speedups,
``targets`` (paper: >= 7.75x and <= 38% of vanilla's bytes; quick: >= 5x), and network projections
(``projection.<lan|wan>``, from the busiest party's bytes sent: half of the logged sent + received bytes).

The shape can be changed without a new profile: ``--set secure_inference.KEY=VALUE`` (repeatable, the same
syntax and validation as ``privbench run --set``) overrides any field of :class:`Setting` (``n_layer``,
``n_embd``, ``n_head``, ``prefix_len``, ``gen_len``, ``batch_size``, ``vocab``, ``repeats``, ``seed``,
``timeout_s``, ``methods`` as ``a,b``, the targets); the JSON's ``setting`` and the recorded run config hold
the shape actually run, and ``setting.overrides`` the items given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from core.errors import ConfigError
from pbconfig.base import FrozenConfig
from pbconfig.benchmark import with_overrides
from pbconfig.secure_inference import SI_METHODS, SIMethod
from privbench.bench.harness import Progress, bench_threads, register

NAME = "mpc-generation"
METHOD_NAMES: tuple[str, ...] = SI_METHODS
SECTION = "secure_inference"  # the --set prefix, as for ``privbench run``: --set secure_inference.n_layer=4


class Setting(FrozenConfig):
    """The shape one run measures: a random-weight GPT-2 (``n_layer``, ``n_embd``, ``n_head``, vocabulary
    ``vocab``) generating ``gen_len`` tokens after ``prefix_len`` for a batch of ``batch_size`` prompts, every
    method of ``methods`` ``repeats`` times (the fastest repeat is kept), each run killed after ``timeout_s``."""

    n_layer: int = Field(ge=1)
    n_embd: int = Field(ge=2)
    n_head: int = Field(ge=1)
    prefix_len: int = Field(ge=1)
    gen_len: int = Field(ge=1)
    batch_size: int = Field(1, ge=1)
    vocab: int = Field(50257, ge=2)
    repeats: int = Field(1, ge=1)
    timeout_s: float = Field(1800.0, gt=0.0, allow_inf_nan=False)
    target_speedup: float = Field(5.0, gt=0.0)
    target_comm_fraction: float | None = Field(None, gt=0.0)
    seed: int = Field(0, ge=0)
    methods: tuple[SIMethod, ...] = Field(SI_METHODS, min_length=1)

    @field_validator("methods", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):  # --set secure_inference.methods=vanilla,merge
            return tuple(m.strip() for m in value.split(",") if m.strip())
        return value

    @model_validator(mode="after")
    def _shape(self) -> Setting:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be distinct, got {list(self.methods)}")
        return self


class _Overridable(FrozenConfig):
    """``--set secure_inference.KEY=VALUE`` addresses the setting under the section name ``privbench run`` uses."""

    secure_inference: Setting


PROFILES: dict[str, Setting] = {
    "quick": Setting(n_layer=2, n_embd=64, n_head=2, prefix_len=6, gen_len=6),
    "paper": Setting(
        n_layer=12,
        n_embd=768,
        n_head=12,
        prefix_len=8,
        gen_len=120,
        repeats=1,
        timeout_s=36000.0,
        target_speedup=7.75,
        target_comm_fraction=0.38,
    ),
}


def resolve_setting(profile: str, options: Mapping[str, Any]) -> Setting:
    """The profile's setting with ``options["methods"]`` (``--methods``), then ``options["overrides"]``
    (``--set secure_inference.KEY=VALUE`` items) applied; ConfigError naming the bad key or value."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join(PROFILES)}")
    setting = PROFILES[profile]
    methods = options.get("methods")
    if methods:
        unknown = [m for m in methods if m not in METHOD_NAMES]
        if unknown:
            raise ConfigError(f"unknown methods {unknown}; known: {', '.join(METHOD_NAMES)}")
        setting = Setting.model_validate({**setting.model_dump(), "methods": tuple(methods)})
    overrides = tuple(options.get("overrides") or ())
    if not overrides:
        return setting
    wrapped = with_overrides(_Overridable(secure_inference=setting), overrides, example=f"{SECTION}.n_layer=4")
    return wrapped.secure_inference


def _device() -> str:
    return os.environ.get("PRIVBENCH_BENCH_DEVICE", "cpu")


def _setting_json(setting: Setting, options: Mapping[str, Any]) -> dict[str, Any]:
    """The shape actually run (overrides applied) and where: the JSON's ``setting`` and the run's config."""
    return {
        **setting.model_dump(mode="json"),
        "overrides": list(options.get("overrides") or ()),
        "device": _device(),
        "threads": bench_threads(),
        "weights": "random (GPT-2 shape)",
    }


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    return _setting_json(resolve_setting(profile, options), options)


def payloads(setting: Setting, methods: tuple[str, ...]) -> dict[str, Any]:
    """Each method's MPC payload from ONE random GPT-2 of the setting's shape."""
    import torch

    from core.models.gpt2 import tiny_gpt2
    from core.mpc.gpt2 import weights_from_hf
    from core.mpc.merge import build_merge_model, export_spec
    from core.mpc.methods import method_spec

    torch.manual_seed(setting.seed)
    n_pos = setting.prefix_len + setting.gen_len
    model = tiny_gpt2(
        setting.vocab, n_layer=setting.n_layer, n_embd=setting.n_embd, n_head=setting.n_head, n_positions=n_pos
    ).eval()
    weights = weights_from_hf(model)
    out: dict[str, Any] = {}
    spec = None
    for m in methods:
        if method_spec(m).engine == "gpt2":
            out[m] = weights
        else:
            if spec is None:
                ids = torch.randint(0, setting.vocab, (2, n_pos), generator=torch.Generator().manual_seed(setting.seed))
                spec = export_spec(build_merge_model(model, [ids], n_pos).eval())
            out[m] = spec
    return out


@register(
    NAME,
    "encrypted GPT-2 greedy generation per method under 2-party CrypTen (MERGE Tables 1-2): "
    "seconds, bytes and rounds per op category",
    options=("methods", "overrides"),
    setting=_config,
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    from core.mpc.accounting import CATEGORIES
    from core.mpc.costmodel import NETWORKS, project_all
    from core.mpc.methods import run_method_party
    from core.mpc.parties import run_local

    setting = resolve_setting(profile, options)
    methods = setting.methods
    threads = bench_threads()
    progress.print(
        f"[bold]{NAME}[/] ({profile}): GPT-2 L={setting.n_layer} d={setting.n_embd} h={setting.n_head} "
        f"vocab={setting.vocab}, batch {setting.batch_size}, prefix {setting.prefix_len}, {setting.gen_len} new "
        f"tokens, {len(methods)} methods, 2 parties on {_device()}"
    )
    loads = payloads(setting, methods)
    prefix = torch.randint(
        0,
        setting.vocab,
        (setting.batch_size, setting.prefix_len),
        generator=torch.Generator().manual_seed(setting.seed + 1),
    )  # (B, prefix_len)
    per_thread = max(1, threads // 2)
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for r in range(setting.repeats):
        for m in methods if r % 2 == 0 else tuple(reversed(methods)):
            parties = run_local(
                run_method_party,
                (m, loads[m], prefix, setting.gen_len, tuple(prefix.shape)),
                timeout_s=setting.timeout_s,
                device=_device(),
                threads_per_party=per_thread,
            )
            ops = {
                c: {k: max(float(p.costs[c][k]) for p in parties) for k in ("s", "bytes", "rounds")} for c in CATEGORIES
            }
            sample = {
                "total_s": max(p.total_s for p in parties),
                "comm_bytes": max(p.comm_bytes for p in parties),
                "rounds": max(p.rounds for p in parties),
                "ops": ops,
                "per_party": {p.rank: {"bytes": p.comm_bytes, "rounds": p.rounds} for p in parties},
            }
            samples[m].append(sample)
            progress.print(
                f"  {m}: {sample['total_s']:.2f} s, {sample['comm_bytes'] / 1e6:.1f} MB, {sample['rounds']} rounds"
            )
    out_methods = {}
    for m, ss in samples.items():
        best = min(ss, key=lambda s: s["total_s"])  # least-disturbed repeat; bytes and rounds are deterministic
        out_methods[m] = {
            "total_s": best["total_s"],
            "comm_bytes": best["comm_bytes"],
            "rounds": best["rounds"],
            "ops": best["ops"],
            "per_token_s": best["total_s"] / setting.gen_len,
            "projection": project_all(best["total_s"], best["per_party"], NETWORKS),
            "samples_s": [s["total_s"] for s in ss],
        }
    ratios: dict[str, float] = {}
    if "vanilla" in out_methods:
        van = out_methods["vanilla"]
        for m, r in out_methods.items():
            ratios[f"{m}_speedup_over_vanilla"] = van["total_s"] / r["total_s"]
            ratios[f"{m}_comm_fraction_of_vanilla"] = r["comm_bytes"] / van["comm_bytes"]
        if "merge" in out_methods:
            ratios["merge_speedup_over_vanilla"] = van["total_s"] / out_methods["merge"]["total_s"]
            ratios["merge_comm_fraction_of_vanilla"] = out_methods["merge"]["comm_bytes"] / van["comm_bytes"]
    if "merge" in out_methods and "vanilla_kv" in out_methods:
        ratios["merge_speedup_over_vanilla_kv"] = out_methods["vanilla_kv"]["total_s"] / out_methods["merge"]["total_s"]
    targets = {}
    if "merge_speedup_over_vanilla" in ratios:
        targets["merge_speedup_ge_target"] = ratios["merge_speedup_over_vanilla"] >= setting.target_speedup
        if setting.target_comm_fraction is not None:
            targets["merge_comm_le_target"] = ratios["merge_comm_fraction_of_vanilla"] <= setting.target_comm_fraction
    return {
        "setting": _setting_json(setting, options),
        "methods": out_methods,
        "ratios": ratios,
        "targets": targets,
    }
