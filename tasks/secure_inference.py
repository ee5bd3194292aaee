"""Secure-inference tasks (MERGE, stage 4): train the models every method runs, then run each method's greedy
generation under two-party MPC (CrypTen, one process per party), recording per-operation time, bytes and
rounds per party (``mpc_costs``), network projections and the quality of the decrypted text.

Runs (``technique`` column; ``privbench.result_group`` tag):

* ``models``: ``lm-train`` (the GPT-2 every method starts from, trained on the offline dialogue corpus),
  ``distill-<approx>`` (MPCFormer / THE-X students), ``merge-er-train`` (eq. 7), ``merge-mm-train`` (eq. 8-11,
  one from the fine-tuned model for ``merge_mm``, one from the ER model for ``merge``): one task per model
  (:func:`train_model`), each trained once per content and kept in ``<PRIVBENCH_HOME>/cache/secure-inference/
  models/`` (a rerun of the same config and corpus reuses it, recording its training run again, tagged
  ``privbench.cache_hit``);
* ``generation``: one run per method (``vanilla``, ``vanilla_kv``, ``mpcformer_2relu``, ``mpcformer_2quad``,
  ``thex``, ``merge_er``, ``merge_mm``, ``merge``): the Table 1/2 analogues and quality;
* ``scaling``: ``scaling-<method>`` runs, time and bytes vs generated length and model size (Fig. 4).

The MPC runs record where their share randomness came from (tag ``privbench.secret_source``:
:data:`core.mpc.parties.SHARE_RANDOMNESS`, CrypTen's own ``os.urandom``-seeded generators); ``cfg.seed`` seeds
model training and the prompts only and never reaches a share.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task

from core.errors import ConfigError, DataError
from core.mpc.accounting import CATEGORIES
from core.mpc.costmodel import Network
from core.mpc.finetune import eval_prompts, usable_prompts
from core.mpc.methods import generate_plain, method_spec, run_method_party
from core.mpc.parties import SHARE_RANDOMNESS, run_local
from core.mpc.payloads import payload_params, random_payload
from core.mpc.quality import quality_drop, text_quality
from core.mpc.recipes import MERGE_FORMS
from core.mpc.run_costs import EncryptedRun, RunMetrics, aggregate_parties, run_metrics
from core.secret_source import SECRET_SOURCE_TAG
from pbconfig.base import ModelShape
from pbconfig.secure_inference import SecureInferenceConfig
from pbconfig.settings import get_settings
from storage.recording import Recorder, RunRef
from tasks.jobs import Job, SeedPass
from tasks.prepare import read_manifest, write_prepared
from tasks.records import RESUMABLE, task_record
from tasks.secure_inference_models import (
    EOS,
    MODELS_VERSION,
    TOKEN_TABLE,
    ModelRef,
    curve_from_json,
    curve_json,
    data_of,
    eos_of,
    gpt2_shape,
    kind_of,
    model_fields,
    model_key,
    model_of,
    models_needed,
    pretrain_data_of,
    record_curve,
    state_of,
    teacher_of,
    tokenizer_of,
)


@dataclass(frozen=True)
class SIModels:
    """Where the trained payloads are (one ``.pt`` per method's model), the evaluation prompts and the corpus."""

    workdir: str
    payloads: dict[str, str]  # method -> file holding its GPT2Weights / MergeSpec
    prompts_path: str  # {"prefix": (B, P) ids, "references": list of id lists, "table": (V, d) embeddings}
    corpus: str


@dataclass(frozen=True)
class TrainJob:
    """One model's training run (each after its teacher)."""

    name: str

    @property
    def technique(self) -> str:
        return kind_of(self.name).technique.format(approx=self.name.removeprefix("distilled-"))


@dataclass(frozen=True)
class GenerationJob:
    """One method's encrypted generation (Tables 1-2 and quality)."""

    method: str

    @property
    def technique(self) -> str:
        return self.method


@dataclass(frozen=True)
class ScalingJob:
    """One point of the scaling sweep: ``method`` generating ``gen_len`` tokens, at model shape ``size`` (None: the
    stage's own model)."""

    method: str
    gen_len: int
    size: ModelShape | None

    @property
    def technique(self) -> str:
        return f"scaling-{self.method}"


def plan_pass(cfg: SecureInferenceConfig) -> list[TrainJob | GenerationJob | ScalingJob]:
    """The runs of one seed pass in the order it starts them: the models (teachers first), each method's generation
    in ``run_order``, then the scaling sweep (lengths, then sizes)."""
    lengths = [ScalingJob(m, n, None) for m in cfg.scaling_methods if m in cfg.methods for n in cfg.scaling_gen_lens]
    sizes = [ScalingJob(m, cfg.gen_len, s) for m in cfg.scaling_methods for s in cfg.scaling_sizes]
    return [
        *(TrainJob(n) for n in models_needed(cfg)),
        *(GenerationJob(m) for m in cfg.run_order),
        *lengths,
        *sizes,
    ]


def plan(cfg: SecureInferenceConfig) -> list[Job]:
    """Every run of the stage below its flow run: one pass, or with ``cfg.seeds`` each pass's own run and its
    runs."""
    if cfg.seeds is None:
        return list(plan_pass(cfg))
    return [job for c in cfg.seed_configs() for job in (SeedPass(c.seed), *plan_pass(c))]


def workdir_of(parent: RunRef) -> Path:
    return get_settings().home / "cache" / "secure-inference" / f"run-{parent.run_id}"


@task(name="si-train-model")
def train_model(name: str, cfg: SecureInferenceConfig, parent: RunRef, teacher: ModelRef | None = None) -> ModelRef:
    """Train one model (``name`` of :func:`models_needed`; ``teacher``: the trained model it starts from,
    :func:`teacher_of`) once per content: a model already trained with the same config, data and teacher is
    reused from the cache. Either way one run records its training (curves, time, test loss)."""
    kind = kind_of(name)
    want = teacher_of(name, cfg)
    if (teacher is None) != (want is None) or (teacher is not None and teacher.name != want):
        raise ConfigError(f"model {name!r} is trained from {want!r}, got teacher {teacher.name if teacher else None!r}")
    data, vocab = data_of(cfg)
    # what the model learns from: the pretraining text for the pretrained GPT-2, the dialogue corpus otherwise
    data_hash = pretrain_data_of(cfg).content_hash if name == "pretrained" else data.content_hash()
    key = model_key(name, cfg, data_hash, teacher)
    out_dir = get_settings().home / "cache" / "secure-inference" / "models" / f"{name}-{key[:16]}"
    common = {
        "corpus": data.corpus,
        "base": cfg.base,
        "n_train_pairs": data.n_train_pairs,
        "n_test_pairs": data.n_test_pairs,
        "vocab": vocab,
        **model_fields(cfg),
        "max_len": cfg.max_len,
    }
    technique = kind.technique.format(approx=name.removeprefix("distilled-"))
    with task_record(
        parent=parent,
        technique=technique,
        config={**common, **kind.config(cfg)},
        dataset=data.corpus,
        run_name=kind.run_name,
    ) as rec:
        rec.tag("privbench.result_group", "models")
        manifest = read_manifest(out_dir, MODELS_VERSION)
        rec.tag("privbench.cache_hit", str(manifest is not None).lower())
        if manifest is None:
            # the recipe draws from kind.seed(cfg) alone (core.mpc.recipes.seeded): the global RNG is left as it was
            start = state_of(teacher) if teacher is not None else None
            done = kind.train(name, cfg, data, vocab, start, kind.seed(cfg))
            manifest = {
                "prep_version": MODELS_VERSION,
                "cache_key": key,
                "name": name,
                "metrics": {"train_s": done.train_s, **done.metrics},
                "curves": {n: curve_json(c) for n, c in done.curves.items()},
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }

            def write(tmp: Path) -> None:
                torch.save(done.payload, tmp / "payload.pt")
                if kind.keeps_state:
                    torch.save(done.model.state_dict(), tmp / "state.pt")

            write_prepared(out_dir, manifest, write)
        for curve, values in manifest["curves"].items():
            record_curve(rec, curve, curve_from_json(values))
        rec.metrics(manifest["metrics"], units={"train_s": "s"})
    return ModelRef(name, key, str(out_dir))


@task(name="si-check-prompts")
def check_prompts(cfg: SecureInferenceConfig) -> int:
    """Fail in seconds, before any model trains, where the seed's test split holds fewer usable prompts than the
    config asks for (``collect_models`` would fail only after the training); returns how many it holds."""
    data, _ = data_of(cfg)
    usable = len(usable_prompts(data.test_pairs, prefix_len=cfg.prefix_len, eos=eos_of(cfg)))
    if usable < cfg.n_quality:
        asked = (
            f"quality_prompts={cfg.quality_prompts}" if cfg.n_quality > cfg.n_prompts else f"n_prompts={cfg.n_prompts}"
        )
        raise DataError(
            f"seed {cfg.seed}: the test split of {data.corpus!r} has {usable} prompts of >= prefix_len="
            f"{cfg.prefix_len} tokens, fewer than secure_inference.{asked} asks for; lower it to at most {usable} "
            "(or lower prefix_len), the same for every seed"
        )
    return usable


@task(name="si-eval-prompts")
def collect_models(cfg: SecureInferenceConfig, models: dict[str, ModelRef], parent: RunRef) -> SIModels:
    """Each configured method's payload (its model's), and the evaluation prompts with the fine-tuned model's
    embedding table, saved in the flow run's folder."""
    data, _ = data_of(cfg)
    workdir = workdir_of(parent)
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = eval_prompts(
        data.test_pairs, prefix_len=cfg.prefix_len, gen_len=cfg.gen_len, n_prompts=cfg.n_quality, eos=eos_of(cfg)
    )  # the first n_prompts run under MPC; quality is scored on all of them
    state = state_of(models["finetuned"])
    prompts["table"] = state[TOKEN_TABLE[cfg.base]].detach().clone()
    # what every method's decrypted text is compared with: the fine-tuned model's plaintext generation
    finetuned = torch.load(Path(models["finetuned"].path) / "payload.pt", weights_only=False)
    prompts["finetuned_tokens"] = generate_plain("vanilla", finetuned, prompts["prefix"], cfg.gen_len)
    prompts_path = workdir / "prompts.pt"
    torch.save(prompts, prompts_path)
    payloads = {m: str(Path(models[model_of(m)].path) / "payload.pt") for m in cfg.methods}
    return SIModels(workdir=str(workdir), payloads=payloads, prompts_path=str(prompts_path), corpus=data.corpus)


# ----------------------------------------------------------------------------------------------- MPC runs


def _networks(cfg: SecureInferenceConfig) -> dict[str, Network]:
    return {name: Network(name, n.bandwidth_gbps * 1e9, n.rtt_ms * 1e-3) for name, n in cfg.networks.items()}


def _device(cfg: SecureInferenceConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def run_encrypted(
    method: str, payload: Any, prefix: torch.Tensor, n_new: int, cfg: SecureInferenceConfig
) -> EncryptedRun:
    """Two local parties generate ``n_new`` tokens after ``prefix`` with ``method``: every party's result, the
    decrypted tokens and the slower party's figures (:func:`core.mpc.run_costs.aggregate_parties`)."""
    t0 = time.perf_counter()
    parties = run_local(
        run_method_party,
        (method, payload, prefix, n_new, tuple(prefix.shape)),
        timeout_s=cfg.party_timeout_s,
        device=_device(cfg),
        threads_per_party=cfg.threads_per_party,
    )
    return aggregate_parties(parties, wall_s=time.perf_counter() - t0)


def _record_costs(rec: Recorder, run: EncryptedRun, cfg: SecureInferenceConfig, phase: str | None = None) -> RunMetrics:
    """One ``mpc_costs`` row per party and op category; returns the run's metrics and network projections."""
    for p in run.parties:
        for cat, c in p.costs.items():
            rec.mpc_cost(
                op_category=cat,
                party=p.rank,
                seconds=c["s"],
                bytes=int(c["bytes"]),
                rounds=int(c["rounds"]),
                phase=phase,
                calls=int(c.get("calls", 0)),
            )
    # bytes as CrypTen logs them (sent + received); the projection takes the busiest party's bytes sent (half)
    return run_metrics(run, _networks(cfg))


@task(name="si-generate", **RESUMABLE)
def mpc_generation(method: str, cfg: SecureInferenceConfig, models: SIModels, parent: RunRef) -> dict[str, Any]:
    """One method: encrypted greedy generation for the evaluation prompts (one batch), costs per op and party,
    the decrypted tokens checked against the plaintext twin, and text quality against the references."""
    spec = method_spec(method)
    payload = torch.load(models.payloads[method], weights_only=False)
    prompts = torch.load(models.prompts_path, weights_only=False)
    prefix = prompts["prefix"][: cfg.n_prompts]  # under MPC; the rest of the prompts through the plaintext twin
    rest = prompts["prefix"][cfg.n_prompts :]
    config = {
        "method": method,
        "engine": spec.engine,
        "mode": spec.mode,
        "model": spec.model,
        "variant": None if spec.variant is None else spec.variant.__dict__,
        "prefix_len": cfg.prefix_len,
        "gen_len": cfg.gen_len,
        "batch": int(prefix.shape[0]),
        "quality_prompts": int(prompts["prefix"].shape[0]),
        "device": _device(cfg),
        "corpus": models.corpus,
        "base": cfg.base,
        **model_fields(cfg),
        # how far each model was trained (a claim's scale: the paper trains MERGE up to 30,000 steps, App. C.2)
        "train_steps": cfg.train_steps,
        "er_steps": cfg.er_steps if spec.model in ("er", "merge") else None,
        "mm_steps": cfg.mm_steps if spec.model in ("mm", "merge") else None,
        "mlp_norm": MERGE_FORMS[cfg.base]["mlp_norm"] if spec.engine == "merge" else None,
    }
    with task_record(
        parent=parent,
        technique=method,
        config=config,
        dataset=models.corpus,
        run_name=f"{method}: {cfg.gen_len} tokens under 2-party MPC",
    ) as rec:
        rec.tag("privbench.result_group", "generation")
        rec.tag(SECRET_SOURCE_TAG, SHARE_RANDOMNESS)
        out = run_encrypted(method, payload, prefix, cfg.gen_len, cfg)
        costs = _record_costs(rec, out, cfg)
        plain = generate_plain(method, payload, prefix, cfg.gen_len)
        agreement = float((out.tokens == plain).double().mean())
        eos = eos_of(cfg)
        cut = lambda tokens: _cut(tokens, eos)
        twin = cut(generate_plain(method, payload, rest, cfg.gen_len)) if len(rest) else []
        tok = tokenizer_of(cfg.base)
        decode = lambda ids: tok.decode([t for t in ids if t != eos], skip_special_tokens=True)
        refs_all = prompts["references"]
        refs = refs_all[: cfg.n_prompts]
        quality = text_quality(cut(out.tokens), refs, decode, prompts["table"])  # decrypted, MPC prompts
        plain_quality = text_quality(cut(plain) + twin, refs_all, decode, prompts["table"])
        base = cut(prompts["finetuned_tokens"])
        base_quality = text_quality(base, refs_all, decode, prompts["table"])  # what the drop is measured from
        # the method's text on every quality prompt: decrypted where it ran under MPC, its plaintext twin's after
        drop = quality_drop(base, cut(out.tokens) + twin, refs_all, decode, prompts["table"], seed=cfg.seed)
        metrics = {
            **costs.metrics,
            "mpc_plain_token_agreement": agreement,
            "quality_prompts": float(len(refs_all)),
            "mpc_prompts": float(len(refs)),
            **{f"quality.{k}": v for k, v in quality.items()},
            **{f"plain_quality.{k}": v for k, v in plain_quality.items()},
            **{f"base_quality.{k}": v for k, v in base_quality.items()},
            **{f"quality_drop.{k}": v for k, v in drop.items()},
            "per_token_s": out.total_s / cfg.gen_len,
        }
        rec.metrics(metrics)
        samples = [
            {
                "prompt": decode(p.tolist()),
                "mpc": decode(c),
                "plain": decode(q),
                "finetuned_plain": decode(f),
                "reference": decode(r),
            }
            for p, c, q, f, r in zip(prefix, cut(out.tokens), cut(plain), base[: len(refs)], refs, strict=True)
        ]
        rec.artifact_json("generations.json", samples)
        rec.artifact_json("projection.json", costs.projection)
    return {
        "method": method,
        "total_s": out.total_s,
        "comm_bytes": out.comm_bytes,
        "rounds": out.rounds,
        "ops": {c: dataclasses.asdict(o) for c, o in out.ops.items()},
        "quality": quality,
        "plain_quality": plain_quality,
        "quality_drop": drop,
        "agreement": agreement,
        "projection": costs.projection,
    }


def _cut(tokens: torch.Tensor, eos: int = EOS) -> list[list[int]]:
    """Generated ids up to (excluding) the first ``eos``."""
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(eos)] if eos in row else row)
    return out


@task(name="si-scaling", **RESUMABLE)
def scaling_point(
    method: str, gen_len: int, shape: Any, cfg: SecureInferenceConfig, models: SIModels, parent: RunRef
) -> dict[str, Any]:
    """Fig. 4: one method at one generated length (the trained model) or one model shape (random weights of that
    shape: time and bytes do not depend on the values), batch 1."""
    if shape is None:
        payload = torch.load(models.payloads[method], weights_only=False)
    else:
        payload = random_payload(method, gpt2_shape(cfg, EOS + 1, shape), n_max=cfg.n_max, seed=cfg.seed)
    prompts = torch.load(models.prompts_path, weights_only=False)
    prefix = prompts["prefix"][:1]
    label = "trained" if shape is None else f"L{shape.n_layer}-d{shape.n_embd}-h{shape.n_head}"
    with task_record(
        parent=parent,
        technique=f"scaling-{method}",
        config={"method": method, "gen_len": gen_len, "model": label, "prefix_len": cfg.prefix_len},
        dataset=models.corpus,
        run_name=f"{method}, {gen_len} tokens, {label}",
    ) as rec:
        rec.tag("privbench.result_group", "scaling")
        rec.tag(SECRET_SOURCE_TAG, SHARE_RANDOMNESS)
        out = run_encrypted(method, payload, prefix, gen_len, cfg)
        metrics = _record_costs(rec, out, cfg, phase=f"gen{gen_len}").metrics
        n_params = payload_params(payload)
        rec.metrics({**metrics, "gen_len": gen_len, "n_parameters": n_params})
    return {
        "method": method,
        "gen_len": gen_len,
        "model": label,
        "n_parameters": n_params,
        "total_s": out.total_s,
        "comm_bytes": out.comm_bytes,
        "rounds": out.rounds,
    }


# ----------------------------------------------------------------------------------------------- summary


def si_summary(
    cfg: SecureInferenceConfig, results: list[dict[str, Any]], scaling: list[dict[str, Any]]
) -> dict[str, Any]:
    """Tables 1 and 2 analogues (time and bytes per op category; speedup and communication fraction against
    vanilla), quality per method, the scaling points, flat headline metrics and a Markdown report."""
    by = {r["method"]: r for r in results}
    base = by.get("vanilla")
    metrics: dict[str, float] = {}
    table1, table2 = {}, {}
    for m, r in by.items():
        table1[m] = {"total_s": r["total_s"], **{c: r["ops"][c]["s"] for c in CATEGORIES}}
        table2[m] = {"comm_bytes": r["comm_bytes"], **{c: r["ops"][c]["bytes"] for c in CATEGORIES}}
        if base:
            table1[m]["speedup_over_vanilla"] = base["total_s"] / r["total_s"]
            table2[m]["fraction_of_vanilla"] = r["comm_bytes"] / base["comm_bytes"]
            metrics[f"{m}.speedup_over_vanilla"] = table1[m]["speedup_over_vanilla"]
            metrics[f"{m}.comm_fraction_of_vanilla"] = table2[m]["fraction_of_vanilla"]
        metrics[f"{m}.quality.rouge_l"] = r["quality"]["rouge_l"]
        metrics[f"{m}.quality_drop.rouge_l"] = r["quality_drop"]["rouge_l"]
    if "merge" in by and "vanilla_kv" in by:
        metrics["merge.speedup_over_vanilla_kv"] = by["vanilla_kv"]["total_s"] / by["merge"]["total_s"]
    quality = {
        m: {**r["quality"], "mpc_plain_token_agreement": r["agreement"], "drop": r["quality_drop"]}
        for m, r in by.items()
    }
    return {
        "table1": table1,
        "table2": table2,
        "quality": quality,
        "scaling": scaling,
        "metrics": metrics,
        "markdown": _markdown(cfg, table1, table2, quality, scaling),
    }


def _category_table(
    title: str,
    rows: dict[str, dict],
    total: str,
    last: str,
    cell: Callable[[float], str],
    tail: Callable[[dict], str],
) -> list[str]:
    """A markdown table of ``rows`` (method -> values): the ``total``, each cost category in ``cell``'s format,
    then the ``last`` column, ``tail`` of the row."""
    cats = [c for c in CATEGORIES if c != "Other"]
    lines = [
        title,
        "",
        "| method | total | " + " | ".join(cats) + f" | {last} |",
        "|---|" + "---|" * (len(cats) + 2),
    ]
    for m, r in rows.items():
        lines.append(f"| {m} | {cell(r[total])} | " + " | ".join(cell(r[c]) for c in cats) + f" | {tail(r)} |")
    return lines


def _markdown(cfg: SecureInferenceConfig, t1: dict, t2: dict, quality: dict, scaling: list) -> str:
    lines = _category_table(
        f"Table 1 analogue: seconds per category ({cfg.gen_len} tokens after {cfg.prefix_len}, "
        f"batch {cfg.n_prompts}, slower party)",
        t1,
        "total_s",
        "speedup",
        lambda v: f"{v:.2f}",
        lambda r: f"{r.get('speedup_over_vanilla', float('nan')):.2f}x",
    )
    lines += [""] + _category_table(
        "Table 2 analogue: MB sent per party",
        t2,
        "comm_bytes",
        "fraction",
        lambda v: f"{v / 1e6:.1f}",
        lambda r: f"{100 * r.get('fraction_of_vanilla', float('nan')):.0f}%",
    )
    lines += [
        "",
        f"Quality of the decrypted generations ({cfg.n_prompts} prompts under MPC)",
        "",
        (
            "Drop: the fine-tuned model's plaintext score minus the method's (the paper's Table 3 comparison; "
            f"positive is worse) over {cfg.n_quality} prompts (the method's decrypted text on the MPC prompts, its "
            "plaintext twin's on the rest), ROUGE-L's with a paired bootstrap 95% interval over the prompts."
        ),
        "",
        (
            "| method | ROUGE-L | chrF | BLEU | embedding F1 | ROUGE-L drop | chrF drop | embedding F1 drop "
            "| tokens equal to plaintext |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, q in quality.items():
        d = q["drop"]
        lines.append(
            f"| {m} | {q['rouge_l']:.3f} | {q['chrf']:.1f} | {q['bleu']:.1f} | {q['embedding_f1']:.3f} | "
            f"{d['rouge_l']:+.3f} [{d['rouge_l_lo']:+.3f}, {d['rouge_l_hi']:+.3f}] | {d['chrf']:+.1f} | "
            f"{d['embedding_f1']:+.3f} | {100 * q['mpc_plain_token_agreement']:.0f}% |"
        )
    if scaling:
        lines += ["", "Scaling (batch 1)", "", "| method | model | tokens | seconds | MB |", "|---|---|---|---|---|"]
        lines += [
            f"| {s['method']} | {s['model']} | {s['gen_len']} | {s['total_s']:.2f} | {s['comm_bytes'] / 1e6:.1f} |"
            for s in scaling
        ]
    return "\n".join(lines) + "\n"
