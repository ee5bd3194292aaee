"""``privbench bench mpc-generation``: encrypted greedy GPT-2 generation per method under two-party CrypTen
(MERGE paper, Tables 1-2): seconds, bytes and rounds in total and per operation category.

Setting: a GPT-2 with the real 50,257-token vocabulary and random weights of the profile's shape (time, bytes
and rounds do not depend on the weight values; the merge modules' constant attention is averaged over random
ids), ``gen_len`` tokens after a ``prefix_len``-token prompt for a batch of ``batch_size`` prompts (1), both
parties as local processes on this machine (CPU, or CUDA when ``PRIVBENCH_BENCH_DEVICE=cuda``). Quick: 2 layers
of width 64, 6 tokens after a prompt of 6 (length 12), then 2 after 16 and 2 after 24 (lengths 18 and 26; a few
minutes on 2 cores). Paper (alias ``paper-shape``): the GPT-2 124M shape (12 layers, 768, 12 heads) for seven
methods, measured at 6 tokens after a prompt of 8 (length 14), 3 after 20 (23) and 3 after 40 (43). With three or
more measured lengths each step's cost is fitted against the length (:mod:`core.mpc.length_fit`) and projected to
the paper's lengths 128 and 512 (``fits``, ``lengths.L<total>`` with ``kind: projected``); the same fit without
the longest measured run predicts that run (``validation``), and the measured runs' ratios stand on their own
(``measured``, ``measured_growth``; about 18 minutes on 2 cores).

JSON: ``methods.<name>.{total_s, comm_bytes, rounds, ops.<category>.{s, bytes, rounds}}`` for ``vanilla``,
``vanilla_kv``, ``mpcformer_2relu``, ``mpcformer_2quad``, ``thex``, ``merge_er``, ``merge_mm``, ``merge``
(slower party: max over the two), ``ratios.merge_speedup_over_vanilla``,
``ratios.merge_comm_fraction_of_vanilla``, ``ratios.merge_speedup_over_vanilla_kv`` and per-method speedups,
``targets`` (paper: >= 7.75x and <= 38% of vanilla's bytes; quick: >= 5x), and network projections
(``projection.<lan|wan>``, from the busiest party's bytes sent: half of the logged sent + received bytes), all
from the first measured run (``prefix_len``, ``gen_len``); :func:`_lengths` for what further runs add.

T5 (``--set secure_inference.arch=t5``, MERGE's T5 rows): the profile's T5 setting (:data:`T5_PROFILES`) is the
start, other overrides apply on top: a random T5 (``core.mpc.t5``; ``n_layer`` blocks per stack, FFN 4 x width,
``feed_forward_proj``), a ``prefix_len``-token prompt to the encoder (run once per prompt) and ``gen_len`` decoder
steps; every measured run has the same prompt length (the length fit then sees the decoder's length alone), and
a total length is prompt + generated tokens, as for GPT-2. Paper: the paper's T5 (138M: 6 + 6 blocks of width 768,
12 heads, FFN 3,072 with GELU, the 50,257-token vocabulary), prompt 8, measured to totals 12, 14 and 28,
projected to 128 and 512, targets >= 5x and <= 26% of vanilla's bytes. The merge modules' constant attention
(encoder, decoder and cross-attention: ``core.mpc.t5_merge``) is averaged over random ids.

The shape can be changed without a new profile: ``--set secure_inference.KEY=VALUE`` (repeatable, the same
syntax and validation as ``privbench run --set``) overrides any field of :class:`Setting` (``n_layer``,
``n_embd``, ``n_head``, ``prefix_len``, ``gen_len``, ``batch_size``, ``vocab``, ``repeats``, ``seed``,
``timeout_s``, ``methods`` as ``a,b``, ``more_runs`` as ``20+3,40+3``, ``project_lengths`` as ``128,512``, the
targets); the JSON's ``setting`` and the recorded run config hold the shape actually run, and
``setting.overrides`` the items given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from core.errors import ConfigError
from core.models import hf
from pbconfig.base import FrozenConfig, require_heads_divide
from pbconfig.benchmark import with_overrides
from pbconfig.secure_inference import SI_METHODS, SIMethod
from privbench.bench.harness import Progress, bench_threads, register

NAME = "mpc-generation"
METHOD_NAMES: tuple[str, ...] = SI_METHODS
SECTION = "secure_inference"  # the --set prefix, as for ``privbench run``: --set secure_inference.n_layer=4
UNITS = ("s", "bytes", "rounds")  # what each step and phase is measured in


class Setting(FrozenConfig):
    """The shape one run measures: a random-weight GPT-2 or T5 (``arch``; ``n_layer`` blocks, per stack for T5,
    ``n_embd``, ``n_head``, vocabulary ``vocab``; T5's FFN ``feed_forward_proj``, 4 x ``n_embd`` wide) generating
    ``gen_len`` tokens after ``prefix_len`` (T5: a ``prefix_len``-token prompt to the encoder, ``gen_len``
    decoder steps) for a batch of ``batch_size`` prompts, every method of ``methods`` ``repeats`` times (the
    fastest repeat is kept), each run killed after ``timeout_s``."""

    arch: Literal["gpt2", "t5"] = "gpt2"
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
    more_runs: tuple[tuple[int, int], ...] = ()  # further measured runs (prompt, new tokens) at other lengths
    project_lengths: tuple[int, ...] = ()  # total lengths (prompt + new tokens) the fitted costs are projected to
    feed_forward_proj: Literal["relu", "gelu_new", "gated-gelu"] = "gelu_new"  # T5's FFN (T5Config's field)
    # T5's non-MERGE methods: the encoder once per prompt, or rerun with its cross K/V every step (the released
    # benchmark's baseline, with vanilla_kv); MERGE runs it once either way, as the released code does
    t5_encoder: Literal["once", "every_step"] = "once"

    @field_validator("methods", "project_lengths", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.field_name == "project_lengths":  # --set secure_inference.project_lengths=
            return ()
        if isinstance(value, str):  # --set secure_inference.methods=vanilla,merge; project_lengths=128,512
            return tuple(m.strip() for m in value.split(",") if m.strip())
        if isinstance(value, int):
            return (value,)
        return value

    @field_validator("more_runs", mode="before")
    @classmethod
    def _runs_text(cls, value: Any) -> Any:
        if value is None:  # --set secure_inference.more_runs=
            return ()
        if isinstance(value, str):  # --set secure_inference.more_runs=20+3,40+3 (prompt + new tokens)
            out = []
            for item in (t.strip() for t in value.split(",") if t.strip()):
                prompt, plus, new = item.partition("+")
                if not plus or not prompt.strip().isdigit() or not new.strip().isdigit():
                    raise ValueError(f"run {item!r} must read PROMPT+NEW (e.g. 20+3: 3 tokens after a 20-token prompt)")
                out.append((int(prompt), int(new)))
            return tuple(out)
        return value

    @model_validator(mode="after")
    def _shape(self) -> Setting:
        require_heads_divide(self, "n_embd", "n_head")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be distinct, got {list(self.methods)}")
        bad = [f"{p}+{g}" for p, g in self.more_runs if p < 1 or g < 1]
        if bad:
            raise ValueError(f"more_runs {bad}: prompt and new tokens must be >= 1")
        runs = self.runs()
        if self.arch == "t5" and len({p for p, _ in runs}) > 1:
            raise ValueError(
                f"T5 runs {runs} must share one prompt length: a T5 step's cost depends on the decoder's length "
                f"and, through cross-attention, on the prompt's, so the length fit needs the prompt fixed (e.g. "
                f"more_runs={self.prefix_len}+6,{self.prefix_len}+20; --profile paper with arch=t5 sets them)"
            )
        totals = [p + g for p, g in runs]
        if len(set(totals)) != len(totals):
            raise ValueError(
                f"measured runs (prompt, new tokens) {runs} repeat a total length {totals}: each run measures "
                "another length, change one in more_runs"
            )
        if len(runs) >= 3:  # the longest is held out: the others alone must be enough to fit
            fit_runs = [r for r in runs if sum(r) != max(totals)]
            if len(_step_lengths(fit_runs)) < 4:
                raise ValueError(
                    f"the hold-out fit (every run but the longest, {fit_runs}) needs steps at 4 or more sequence "
                    f"lengths, got {_step_lengths(fit_runs)}: raise gen_len to 5 or more, or add a run to more_runs"
                )
        if self.project_lengths:
            if len(runs) < 3:
                raise ValueError(
                    f"project_lengths needs 3 or more measured runs (the longest is held out to check the fit), got "
                    f"{runs}: set more_runs, e.g. more_runs=20+3,40+3, or project_lengths= to project nothing"
                )
            too_short = [n for n in self.project_lengths if n <= self.prefix_len]
            if too_short:
                raise ValueError(f"project_lengths {too_short} must exceed prefix_len={self.prefix_len}")
            both = sorted(set(self.project_lengths) & set(totals))
            if both:
                raise ValueError(f"project_lengths {both} are measured lengths {totals}: leave them out")
        return self

    def runs(self) -> list[tuple[int, int]]:
        """The measured (prompt length, new tokens) pairs: the main run, then ``more_runs``."""
        return [(self.prefix_len, self.gen_len), *self.more_runs]


def _step_lengths(runs: list[tuple[int, int]]) -> list[int]:
    """The sequence lengths of the steps i >= 1 of ``runs``, the points the length fit sees."""
    return sorted({p + i for p, g in runs for i in range(1, g)})


class _Overridable(FrozenConfig):
    """``--set secure_inference.KEY=VALUE`` addresses the setting under the section name ``privbench run`` uses."""

    secure_inference: Setting


PAPER_METHODS = ("vanilla", "vanilla_kv", "mpcformer_2quad", "thex", "merge_er", "merge_mm", "merge")
PROFILES: dict[str, Setting] = {
    # measured at lengths 12, 18 and 26 (steps at 7-11, 17, 25), the longest held out, projected to 128 and 512
    "quick": Setting(
        n_layer=2,
        n_embd=64,
        n_head=2,
        prefix_len=6,
        gen_len=6,
        more_runs=((16, 2), (24, 2)),
        project_lengths=(128, 512),
    ),
    # GPT-2 124M's shape, measured at lengths 14, 23 and 43 (steps at 9-13, 21-22, 41-42), projected to 128 and 512
    "paper": Setting(
        n_layer=12,
        n_embd=768,
        n_head=12,
        prefix_len=8,
        gen_len=6,
        more_runs=((20, 3), (40, 3)),
        project_lengths=(128, 512),
        repeats=1,
        timeout_s=7200.0,
        target_speedup=5.0,
        target_comm_fraction=0.38,
        methods=PAPER_METHODS,
    ),
}
T5_PROFILES: dict[str, Setting] = {
    # ``--set secure_inference.arch=t5`` starts from these (MERGE Tables 1-2's T5 rows); their runs share one prompt
    # length (Setting._shape); any other override applies on top. Quick: the GPT-2 quick shape per stack
    "quick": Setting(
        arch="t5",
        n_layer=2,
        n_embd=64,
        n_head=2,
        prefix_len=6,
        gen_len=6,
        more_runs=((6, 8), (6, 16)),
        project_lengths=(128, 512),
    ),
    # the paper's T5 (138M): 6 + 6 blocks of width 768, 12 heads, FFN 3,072 (GELU) and the 50,257-token vocabulary,
    # as its authors' released benchmark builds it; an 8-token prompt, measured to decoder lengths 12, 14 and 28
    "paper": Setting(
        arch="t5",
        n_layer=6,
        n_embd=768,
        n_head=12,
        prefix_len=8,
        gen_len=4,
        more_runs=((8, 6), (8, 20)),
        project_lengths=(128, 512),
        repeats=1,
        timeout_s=7200.0,
        target_speedup=5.0,
        target_comm_fraction=0.26,
        methods=PAPER_METHODS,
    ),
}
PROFILE_ALIASES = {"paper-shape": "paper"}


def resolve_setting(profile: str, options: Mapping[str, Any]) -> Setting:
    """The profile's setting with ``options["methods"]`` (``--methods``), then ``options["overrides"]``
    (``--set secure_inference.KEY=VALUE`` items) applied; ConfigError naming the bad key or value."""
    profile = PROFILE_ALIASES.get(profile, profile)
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join([*PROFILES, *PROFILE_ALIASES])}")
    overrides = tuple(options.get("overrides") or ())
    t5 = any(o.replace(" ", "") == f"{SECTION}.arch=t5" for o in overrides)
    setting = (T5_PROFILES if t5 else PROFILES)[profile]
    methods = options.get("methods")
    if methods:
        unknown = [m for m in methods if m not in METHOD_NAMES]
        if unknown:
            raise ConfigError(f"unknown methods {unknown}; known: {', '.join(METHOD_NAMES)}")
        setting = Setting.model_validate({**setting.model_dump(), "methods": tuple(methods)})
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
        "weights": f"random ({'T5' if setting.arch == 't5' else 'GPT-2'} shape)",
    }


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    return _setting_json(resolve_setting(profile, options), options)


def payloads(setting: Setting, methods: tuple[str, ...]) -> dict[str, Any]:
    """Each method's MPC payload from ONE random GPT-2 (or T5) of the setting's shape."""
    import torch

    if setting.arch == "t5":
        return _t5_payloads(setting, methods)
    from core.models.gpt2 import tiny_gpt2
    from core.mpc.gpt2 import weights_from_hf
    from core.mpc.merge import build_merge_model, export_spec
    from core.mpc.methods import method_spec
    from core.mpc.recipes import seeded

    n_pos = max(p + g for p, g in setting.runs())
    with seeded(setting.seed):  # drawn from the seed; the caller's global RNG is left as it was
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


def _t5_payloads(setting: Setting, methods: tuple[str, ...]) -> dict[str, Any]:
    """A random T5 (HF's initialisation, drawn under the seed) and its merged form, constant attention averaged
    over two random prompts and decoder inputs of the longest measured lengths (eq. 8)."""
    import dataclasses

    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from core.mpc.methods import method_spec
    from core.mpc.recipes import seeded
    from core.mpc.t5 import weights_from_hf
    from core.mpc.t5_merge import average_attentions, merge_spec_from_t5

    cfg = T5Config(
        vocab_size=setting.vocab,
        d_model=setting.n_embd,
        d_kv=setting.n_embd // setting.n_head,
        d_ff=4 * setting.n_embd,
        num_layers=setting.n_layer,
        num_decoder_layers=setting.n_layer,
        num_heads=setting.n_head,
        feed_forward_proj=setting.feed_forward_proj,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    with seeded(setting.seed):
        model = hf.build(T5ForConditionalGeneration, cfg).eval()
    weights = weights_from_hf(model)
    if setting.t5_encoder == "every_step":
        weights = dataclasses.replace(weights, rerun_encoder=True)
    if all(method_spec(m).engine != "merge" for m in methods):
        return dict.fromkeys(methods, weights)
    gen = torch.Generator().manual_seed(setting.seed)
    n_max = max(g for _, g in setting.runs())
    enc = torch.randint(0, setting.vocab, (2, setting.prefix_len), generator=gen)
    dec = torch.randint(0, setting.vocab, (2, n_max), generator=gen)
    spec = merge_spec_from_t5(weights, average_attentions(model, enc, dec))
    return {m: spec if method_spec(m).engine == "merge" else weights for m in methods}


@register(
    NAME,
    "encrypted GPT-2 greedy generation per method under 2-party CrypTen (MERGE Tables 1-2): "
    "seconds, bytes and rounds per op category",
    options=("methods", "overrides"),
    setting=_config,
    profile_aliases=PROFILE_ALIASES,
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    from core.mpc.costmodel import NETWORKS, project_all

    setting = resolve_setting(profile, options)
    methods = setting.methods
    arch = "T5 (L per stack)" if setting.arch == "t5" else "GPT-2"
    progress.print(
        f"[bold]{NAME}[/] ({profile}): {arch} L={setting.n_layer} d={setting.n_embd} h={setting.n_head} "
        f"vocab={setting.vocab}, batch {setting.batch_size}, (prefix, new tokens) {setting.runs()}, "
        f"{len(methods)} methods, 2 parties on {_device()}"
    )
    loads = payloads(setting, methods)
    measured = [_measure(setting, loads, p, g, k, progress) for k, (p, g) in enumerate(setting.runs())]
    out_methods = {}
    for m in methods:
        best = measured[0][m]
        out_methods[m] = {
            **{k: best[k] for k in ("total_s", "comm_bytes", "rounds", "ops")},
            "per_token_s": best["total_s"] / setting.gen_len,
            "projection": project_all(best["total_s"], best["per_party"], NETWORKS),
            "samples_s": best["samples_s"],
        }
    ratios = _ratios(out_methods)
    targets = _targets(ratios, setting)
    out: dict[str, Any] = {
        "setting": _setting_json(setting, options),
        "methods": out_methods,
        "ratios": ratios,
        "targets": targets,
    }
    if len(measured) >= 2:
        out.update(_lengths(setting, measured))
    return out


def _measure(
    setting: Setting, loads: dict[str, Any], prefix_len: int, gen_len: int, k: int, progress: Progress
) -> dict[str, dict[str, Any]]:
    """Every method's generation of ``gen_len`` tokens after a random ``prefix_len``-token prompt, ``repeats``
    times (the fastest repeat is kept; bytes and rounds are deterministic): totals, ops, per-step and phase
    costs, each the slower party's."""
    import torch

    from core.mpc.accounting import CATEGORIES
    from core.mpc.methods import run_method_party
    from core.mpc.parties import run_local

    gen = torch.Generator().manual_seed(setting.seed + 1 + k)
    prefix = torch.randint(0, setting.vocab, (setting.batch_size, prefix_len), generator=gen)  # (B, prefix_len)
    per_thread = max(1, bench_threads() // 2)
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in setting.methods}
    for r in range(setting.repeats):
        for m in setting.methods if r % 2 == 0 else tuple(reversed(setting.methods)):
            parties = run_local(
                run_method_party,
                (m, loads[m], prefix, gen_len, tuple(prefix.shape)),
                timeout_s=setting.timeout_s,
                device=_device(),
                threads_per_party=per_thread,
            )
            worst = lambda values: max(float(v) for v in values)  # the slower party's
            sample = {
                "total_s": max(p.total_s for p in parties),
                "comm_bytes": max(p.comm_bytes for p in parties),
                "rounds": max(p.rounds for p in parties),
                "ops": {c: {u: worst(p.costs[c][u] for p in parties) for u in UNITS} for c in CATEGORIES},
                "per_party": {p.rank: {"bytes": p.comm_bytes, "rounds": p.rounds} for p in parties},
                "steps": {
                    u: [worst(v) for v in zip(*(getattr(p, f"step_{u}") for p in parties), strict=True)] for u in UNITS
                },
                "phases": {
                    ph: {u: worst(p.phases[ph][u] for p in parties) for u in UNITS} for ph in ("prefix", "decode")
                },
            }
            samples[m].append(sample)
            progress.print(
                f"  {m} (prefix {prefix_len}, {gen_len} new): {sample['total_s']:.2f} s, "
                f"{sample['comm_bytes'] / 1e6:.1f} MB, {sample['rounds']} rounds"
            )
    return {
        m: {**min(ss, key=lambda s: s["total_s"]), "samples_s": [s["total_s"] for s in ss]} for m, ss in samples.items()
    }


def _ratios(methods: Mapping[str, Mapping[str, Any]], key: str = "total_s") -> dict[str, float]:
    """Every method's speedup over vanilla (in ``total_s`` or another seconds key) and bytes fraction of vanilla,
    MERGE's speedup over vanilla_kv."""
    ratios: dict[str, float] = {}
    if "vanilla" in methods:
        van = methods["vanilla"]
        for m, r in methods.items():
            ratios[f"{m}_speedup_over_vanilla"] = van[key] / r[key]
            ratios[f"{m}_comm_fraction_of_vanilla"] = r["comm_bytes"] / van["comm_bytes"]
    if "merge" in methods and "vanilla_kv" in methods:
        ratios["merge_speedup_over_vanilla_kv"] = methods["vanilla_kv"][key] / methods["merge"][key]
        ratios["merge_comm_fraction_of_vanilla_kv"] = (
            methods["merge"]["comm_bytes"] / methods["vanilla_kv"]["comm_bytes"]
        )
    return ratios


def _targets(ratios: Mapping[str, float], setting: Setting, *, lan: Mapping[str, float] | None = None) -> dict:
    targets: dict[str, bool] = {}
    if "merge_speedup_over_vanilla" in ratios:
        targets["merge_speedup_ge_target"] = ratios["merge_speedup_over_vanilla"] >= setting.target_speedup
        if setting.target_comm_fraction is not None:
            targets["merge_comm_le_target"] = ratios["merge_comm_fraction_of_vanilla"] <= setting.target_comm_fraction
    if lan and "merge_speedup_over_vanilla" in lan:
        targets["merge_lan_speedup_ge_target"] = lan["merge_speedup_over_vanilla"] >= setting.target_speedup
    if "merge_speedup_over_vanilla_kv" in ratios:
        targets["merge_faster_than_vanilla_kv"] = ratios["merge_speedup_over_vanilla_kv"] > 1.0
    return targets


def _generations(setting: Setting, measured: list[dict[str, dict[str, Any]]], m: str) -> dict[str, list[Any]]:
    """Method ``m``'s measured runs as :class:`core.mpc.length_fit.MeasuredGeneration` per unit."""
    from core.mpc.length_fit import MeasuredGeneration

    gens: dict[str, list[MeasuredGeneration]] = {}
    for u in UNITS:
        gens[u] = []
        for (p, g), res in zip(setting.runs(), measured, strict=True):
            ph, steps = res[m]["phases"], tuple(res[m]["steps"][u])
            gens[u].append(MeasuredGeneration(p, g, ph["prefix"][u], steps, ph["decode"][u]))
    return gens


def _fit(gens: Mapping[str, list[Any]]) -> dict[str, Any]:
    """The length fits of one method's runs: ``s`` (seconds priced by bytes and rounds), ``s_poly`` (the seconds'
    own polynomial), ``bytes`` and ``rounds``."""
    from core.mpc.length_fit import fit_length, fit_seconds

    rate = fit_seconds(gens["s"], gens["bytes"], gens["rounds"])  # fits bytes and rounds on the way
    return {"s": rate, "s_poly": fit_length(gens["s"]), "bytes": rate.bytes_fit, "rounds": rate.rounds_fit}


_TOTALS = {"s": "total_s", "s_poly": "total_s_poly", "bytes": "comm_bytes", "rounds": "rounds"}
_VALIDATED = {"s": "time", "s_poly": "time_poly", "bytes": "bytes", "rounds": "rounds"}


def _validation(setting: Setting, measured: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The hold-out check of the length fit: fitted on every measured run but the longest, each method's
    seconds, bytes and rounds at the longest predicted (its steps i >= 1 and decoding from the fit, after its own
    measured head) and compared with the measurement, and so the ratios there."""
    from core.mpc.length_fit import predict_held_out, rel_err, split_longest

    runs = setting.runs()
    held = max(range(len(runs)), key=lambda j: sum(runs[j]))
    out: dict[str, Any] = {
        "held_out_length": sum(runs[held]),
        "held_out_prefix_len": runs[held][0],
        "held_out_gen_len": runs[held][1],
        "fit_lengths": sorted(sum(r) for j, r in enumerate(runs) if j != held),
        "longest_fit_length": max(sum(r) for j, r in enumerate(runs) if j != held),
    }
    predicted: dict[str, dict[str, float]] = {}
    for m in setting.methods:
        gens = _generations(setting, measured, m)
        split = {u: split_longest(gens[u]) for u in UNITS}
        models = _fit({u: list(split[u][0]) for u in UNITS})
        row: dict[str, float] = {}
        predicted[m] = {}
        for u, f in models.items():
            unit = u.removesuffix("_poly")
            total = measured[held][m][_TOTALS[unit]]
            h = predict_held_out(f, split[unit][1], measured_total=total)
            name = _VALIDATED[u]
            suffix = "_s" if unit == "s" else ""
            row[f"{name}_predicted{suffix}"], row[f"{name}_measured{suffix}"] = h.predicted, h.measured
            row[f"{name}_rel_err"], row[f"{name}_tail_rel_err"] = h.rel_err, h.tail_rel_err
            predicted[m][_TOTALS[u]] = h.predicted
        out[m] = row
    ratios_p, ratios_m = _ratios(predicted), _ratios(measured[held])
    out["ratios"] = {
        k: {"predicted": ratios_p[k], "measured": ratios_m[k], "rel_err": rel_err(ratios_p[k], ratios_m[k])}
        for k in ratios_p
    }
    out["max_time_rel_err"] = max(out[m]["time_rel_err"] for m in setting.methods)
    out["max_bytes_rel_err"] = max(out[m]["bytes_rel_err"] for m in setting.methods)
    return out


def _lengths(setting: Setting, measured: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """What two or more measured runs at different lengths give: ``lengths.L<total length>`` for each measured run
    (``kind: measured``, ``projected: 0``) and, with three or more, each projected length (``kind: projected``,
    ``projected: 1``), with the methods (total_s, comm_bytes, rounds, per_token_s, lan_s, wan_s; projections also
    total_s_poly, measured runs fit_rel_err), ratios (loopback and ``lan`` / ``wan``) and targets;
    ``measured.<L<total>|shortest|longest>`` the measured runs' ratios alone and ``measured_growth`` the longest
    measured run's ratios over the shortest's. With three or more runs also ``fits.<method>.<s|s_poly|bytes|rounds>``
    (:mod:`core.mpc.length_fit` on every measured run: the projections' fits) and ``validation`` (the same fit on
    every run but the longest, predicting the longest: :func:`_validation`)."""
    from core.mpc.costmodel import NETWORKS, project_all
    from core.mpc.length_fit import project

    runs = setting.runs()
    fitted = len(runs) >= 3
    fits: dict[str, dict[str, Any]] = {}
    rows: dict[int, dict[str, Any]] = {}
    for (p, g), res in zip(runs, measured, strict=True):
        rows[p + g] = {"kind": "measured", "projected": 0, "prefix_len": p, "gen_len": g, "methods": {}}
        for m in setting.methods:
            r = res[m]
            rows[p + g]["methods"][m] = {"total_s": r["total_s"], "comm_bytes": r["comm_bytes"], "rounds": r["rounds"]}
    for m in setting.methods if fitted else ():
        gens = _generations(setting, measured, m)
        models = _fit(gens)
        heads = {u: [g.head for g in gens[u.removesuffix("_poly")]] for u in models}
        fits[m] = {u: f.as_dict() for u, f in models.items()}
        for j, (p, g) in enumerate(runs):
            v = rows[p + g]["methods"][m]
            v["fit_rel_err"] = {  # each fit against this measured run's own totals
                u: abs(project(f, heads[u][j], p, p + g) - v[_TOTALS[u]]) / max(v[_TOTALS[u]], 1e-300)
                for u, f in models.items()
                if u != "s_poly"
            }
        p0 = runs[0][0]
        for total in setting.project_lengths:
            row = rows.setdefault(
                total, {"kind": "projected", "projected": 1, "prefix_len": p0, "gen_len": total - p0, "methods": {}}
            )
            row["methods"][m] = {_TOTALS[u]: project(f, heads[u][0], p0, total) for u, f in models.items()}
    for row in rows.values():
        for v in row["methods"].values():
            v["per_token_s"] = v["total_s"] / row["gen_len"]
            nets = project_all(v["total_s"], {0: {"bytes": v["comm_bytes"], "rounds": v["rounds"]}}, NETWORKS)
            for net, proj in nets.items():
                v[f"{net}_s"] = proj["projected_s"]
        row["ratios"] = _ratios(row["methods"])
        for net in NETWORKS:
            net_ratios = _ratios(row["methods"], key=f"{net}_s")
            row["ratios"].update({f"{net}.{k}": x for k, x in net_ratios.items() if "speedup" in k})
        if row["projected"]:
            poly = _ratios(row["methods"], key="total_s_poly")
            row["ratios"].update({f"poly.{k}": x for k, x in poly.items() if "speedup" in k})
        lan = {k.removeprefix("lan."): x for k, x in row["ratios"].items() if k.startswith("lan.")}
        row["targets"] = _targets(row["ratios"], setting, lan=lan)
    out: dict[str, Any] = {"lengths": {f"L{n}": {"total_len": n, **rows[n]} for n in sorted(rows)}}
    totals = sorted(p + g for p, g in runs)
    only = {f"L{n}": {"total_len": n, **{k: rows[n][k] for k in ("prefix_len", "gen_len", "ratios")}} for n in totals}
    out["measured"] = {**only, "shortest": only[f"L{totals[0]}"], "longest": only[f"L{totals[-1]}"]}
    first, last = only[f"L{totals[0]}"]["ratios"], only[f"L{totals[-1]}"]["ratios"]
    out["measured_growth"] = {
        "from_length": totals[0],
        "to_length": totals[-1],
        **{k: last[k] / first[k] for k in first if k in last and first[k] > 0},
    }
    if fitted:
        out["fits"] = fits
        out["validation"] = _validation(setting, measured)
    return out
