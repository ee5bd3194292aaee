"""Secure-inference tasks (MERGE, stage 4): train the models every method runs, then run each method's greedy
generation under two-party MPC (CrypTen, one process per party), recording per-operation time, bytes and
rounds per party (``mpc_costs``), network projections and the quality of the decrypted text.

Runs (``technique`` column; ``privbench.result_group`` tag):

* ``models``: ``lm-train`` (the GPT-2 every method starts from, trained on the offline dialogue corpus),
  ``distill-<approx>`` (MPCFormer / THE-X students), ``merge-er-train`` (eq. 7), ``merge-mm-train`` (eq. 8-11,
  one from the fine-tuned model for ``merge_mm``, one from the ER model for ``merge``);
* ``generation``: one run per method (``vanilla``, ``vanilla_kv``, ``mpcformer_2relu``, ``mpcformer_2quad``,
  ``thex``, ``merge_er``, ``merge_mm``, ``merge``): the Table 1/2 analogues and quality;
* ``scaling``: ``scaling-<method>`` runs, time and bytes vs generated length and model size (Fig. 4).
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task

from core.errors import DataError
from core.mpc.accounting import CATEGORIES
from core.mpc.costmodel import Network, project_all
from core.mpc.methods import generate_plain, method_spec, run_method_party
from core.mpc.parties import run_local
from core.mpc.quality import text_quality
from privbench.config import SecureInferenceConfig
from privbench.settings import get_settings
from storage.recording import Recorder, RunRef
from tasks.records import RESUMABLE, task_record

EOS = 50256


@dataclass(frozen=True)
class SIModels:
    """Where the trained payloads are (one ``.pt`` per method's model), the evaluation prompts and the corpus."""

    workdir: str
    payloads: dict[str, str]  # method -> file holding its GPT2Weights / MergeSpec
    prompts_path: str  # {"prefix": (B, P) ids, "references": list of id lists, "table": (V, d) embeddings}
    corpus: str


def workdir_of(parent: RunRef) -> Path:
    return get_settings().home / "cache" / "secure-inference" / f"run-{parent.run_id}"


def _batches(ids: torch.Tensor, mask: torch.Tensor, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(seed))
    return [(ids[i], mask[i]) for i in order.split(batch_size)]


def _hf_config(cfg: SecureInferenceConfig, vocab: int, shape: Any = None) -> Any:
    from transformers import GPT2Config

    n_layer, n_embd, n_head = (shape.n_layer, shape.n_embd, shape.n_head) if shape else (cfg.n_layer, cfg.n_embd,
                                                                                         cfg.n_head)
    return GPT2Config(vocab_size=vocab, n_positions=cfg.n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      bos_token_id=EOS, eos_token_id=EOS, attn_implementation="eager")


def _hf_from_student(student: Any, config: Any) -> Any:
    """A ``GPT2LMHeadModel`` holding a distilled ``ApproxGPT2`` student's modules (for ``weights_from_hf``)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(config)
    hf.transformer.wte, hf.transformer.wpe, hf.transformer.h, hf.transformer.ln_f = (
        student.wte, student.wpe, student.h, student.ln_f)
    hf.lm_head = student.lm_head
    return hf.eval()


@torch.no_grad()
def _lm_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> float:
    model.eval()
    labels = ids.masked_fill(~mask.bool(), -100)
    return float(model(input_ids=ids, labels=labels).loss)


def _record_curve(rec: Recorder, losses: list[Any], name: str = "train_loss", every: int = 10) -> None:
    for i, v in enumerate(losses):
        if i % every == 0 or i == len(losses) - 1:
            value = v if isinstance(v, int | float) else float(v.get("total", next(iter(v.values()))))
            rec.metric(name, float(value), step=i)


# ----------------------------------------------------------------------------------------------- models


@task(name="si-train-models")
def train_models(cfg: SecureInferenceConfig, parent: RunRef) -> SIModels:
    """Train the fine-tuned GPT-2, the distilled students, the ER model and the two merge modules that the
    configured methods need; save each method's MPC payload; pick the evaluation prompts."""
    from transformers import GPT2LMHeadModel

    from core.mpc.approx import ApproxGPT2, distill
    from core.mpc.gpt2 import weights_from_hf
    from core.mpc.merge import ERConfig, build_merge_model, export_spec, train_er, train_mm
    from core.mpc.textdata import encode_pairs, gpt2_tokenizer, lm_sequences, text_pairs

    torch.manual_seed(cfg.seed)
    tok = gpt2_tokenizer()
    corpus, pairs = text_pairs(cfg.corpus, max_pairs=cfg.max_pairs)
    pairs = sorted(set(pairs))
    random.Random(cfg.seed).shuffle(pairs)
    n_test = max(cfg.n_prompts * 4, len(pairs) // 10)
    test, train = pairs[:n_test], pairs[n_test:]
    enc_train = encode_pairs(tok, train, max_len=cfg.max_len)
    enc_test = encode_pairs(tok, test, max_len=cfg.max_len)
    ids, mask = lm_sequences(enc_train, max_len=cfg.max_len)
    test_ids, test_mask = lm_sequences(enc_test, max_len=cfg.max_len)
    batches = _batches(ids, mask, cfg.batch_size, cfg.seed)
    workdir = workdir_of(parent)
    workdir.mkdir(parents=True, exist_ok=True)
    config = _hf_config(cfg, len(tok))
    need = {method_spec(m).model for m in cfg.methods}
    payloads: dict[str, str] = {}

    def save(method: str, payload: Any) -> None:
        path = workdir / f"{method}.pt"
        torch.save(payload, path)
        payloads[method] = str(path)

    common = {"corpus": corpus, "n_train_pairs": len(train), "n_test_pairs": len(test), "vocab": len(tok),
              "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "max_len": cfg.max_len}
    with task_record(parent=parent, technique="lm-train", config={**common, "steps": cfg.train_steps, "lr": cfg.lr},
                     dataset=corpus) as rec:
        rec.tag("privbench.result_group", "models")
        model = GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        model.train()
        t0, losses = time.perf_counter(), []
        for step in range(cfg.train_steps):
            b_ids, b_mask = batches[step % len(batches)]
            loss = model(input_ids=b_ids, labels=b_ids.masked_fill(~b_mask.bool(), -100)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        model.eval()
        _record_curve(rec, losses)
        rec.metrics({"train_s": time.perf_counter() - t0, "test_loss": _lm_loss(model, test_ids, test_mask),
                     "n_parameters": sum(p.numel() for p in model.parameters())}, units={"train_s": "s"})
    for m in cfg.methods:
        if method_spec(m).model == "finetuned":
            save(m, weights_from_hf(model))

    for m in cfg.methods:
        spec = method_spec(m)
        if spec.model != "distilled":
            continue
        with task_record(parent=parent, technique=f"distill-{spec.approx}",
                         config={**common, "steps": cfg.distill_steps, "lr": cfg.distill_lr}, dataset=corpus) as rec:
            rec.tag("privbench.result_group", "models")
            student = ApproxGPT2(model, spec.approx)
            t0 = time.perf_counter()
            _record_curve(rec, distill(model, student, batches, cfg.distill_steps, cfg.distill_lr))
            hf = _hf_from_student(student, config)
            rec.metrics({"train_s": time.perf_counter() - t0}, units={"train_s": "s"})
            save(m, weights_from_hf(hf))

    er_model = None
    if need & {"er", "merge"}:
        with task_record(parent=parent, technique="merge-er-train",
                         config={**common, "steps": cfg.er_steps, "lr": cfg.er_lr, "dropout": cfg.er_dropout,
                                 "noise": cfg.er_noise, "lambda": cfg.er_lambda}, dataset=corpus) as rec:
            rec.tag("privbench.result_group", "models")
            er_model = copy.deepcopy(model)
            t0 = time.perf_counter()
            curve = train_er(er_model, batches, cfg.er_steps, cfg.er_lr,
                             cfg=ERConfig(dropout=cfg.er_dropout, noise=cfg.er_noise, lam=cfg.er_lambda), seed=cfg.seed)
            er_model.eval()
            _record_curve(rec, [c["total"] for c in curve])
            _record_curve(rec, [c["align"] for c in curve], name="align_loss")
            rec.metrics({"train_s": time.perf_counter() - t0, "test_loss": _lm_loss(er_model, test_ids, test_mask)},
                        units={"train_s": "s"})
        for m in cfg.methods:
            if method_spec(m).model == "er":
                save(m, weights_from_hf(er_model))

    for kind, teacher in (("mm", model), ("merge", er_model)):
        methods = [m for m in cfg.methods if method_spec(m).model == kind]
        if not methods:
            continue
        with task_record(parent=parent, technique="merge-mm-train",
                         config={**common, "source": "finetuned" if kind == "mm" else "er", "steps": cfg.mm_steps,
                                 "lr": cfg.mm_lr, "n_max": cfg.n_max}, dataset=corpus,
                         run_name=f"merge module from the {'fine-tuned' if kind == 'mm' else 'ER'} model") as rec:
            rec.tag("privbench.result_group", "models")
            short = [(i[:, : cfg.n_max], k[:, : cfg.n_max]) for i, k in batches]
            student = build_merge_model(teacher, short, cfg.n_max)
            t0 = time.perf_counter()
            _record_curve(rec, train_mm(student, teacher, short, cfg.mm_steps, cfg.mm_lr))
            student.eval()
            rec.metrics({"train_s": time.perf_counter() - t0}, units={"train_s": "s"})
            spec = export_spec(student)
            for m in methods:
                save(m, spec)

    prompts = _eval_prompts(enc_test, cfg)
    prompts["table"] = model.transformer.wte.weight.detach().clone()
    prompts_path = workdir / "prompts.pt"
    torch.save(prompts, prompts_path)
    return SIModels(workdir=str(workdir), payloads=payloads, prompts_path=str(prompts_path), corpus=corpus)


def _eval_prompts(encoded: list[tuple[list[int], list[int]]], cfg: SecureInferenceConfig) -> dict[str, Any]:
    """``n_prompts`` test pairs whose prefix (ending in the EOS separator) has at least ``prefix_len`` tokens:
    the last ``prefix_len`` prefix tokens and the response (up to ``gen_len`` tokens, EOS dropped)."""
    chosen = [(p[-cfg.prefix_len:], [t for t in y if t != EOS][: cfg.gen_len]) for p, y in encoded
              if len(p) >= cfg.prefix_len and any(t != EOS for t in y)][: cfg.n_prompts]
    if len(chosen) < cfg.n_prompts:
        raise DataError(f"only {len(chosen)} test prompts have >= prefix_len={cfg.prefix_len} tokens; lower "
                        f"secure_inference.prefix_len or n_prompts={cfg.n_prompts}")
    return {"prefix": torch.tensor([p for p, _ in chosen]), "references": [y for _, y in chosen]}


# ----------------------------------------------------------------------------------------------- MPC runs


def _networks(cfg: SecureInferenceConfig) -> dict[str, Network]:
    return {name: Network(name, n.bandwidth_gbps * 1e9, n.rtt_ms * 1e-3) for name, n in cfg.networks.items()}


def _device(cfg: SecureInferenceConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def run_encrypted(method: str, payload: Any, prefix: torch.Tensor, n_new: int, cfg: SecureInferenceConfig) -> dict[str, Any]:
    """Two local parties generate ``n_new`` tokens after ``prefix`` with ``method``; the per-party results,
    the decrypted tokens and the summed view (max over parties: the slower party bounds the run)."""
    t0 = time.perf_counter()
    parties = run_local(run_method_party, (method, payload, prefix, n_new, tuple(prefix.shape)),
                        timeout_s=cfg.party_timeout_s, device=_device(cfg), threads_per_party=cfg.threads_per_party)
    wall = time.perf_counter() - t0
    client = parties[1]
    ops = {c: {k: max(float(p.costs[c][k]) for p in parties) for k in ("s", "bytes", "rounds")} for c in CATEGORIES}
    return {"parties": parties, "tokens": client.tokens, "wall_s": wall,
            "total_s": max(p.total_s for p in parties), "comm_bytes": max(p.comm_bytes for p in parties),
            "rounds": max(p.rounds for p in parties), "ops": ops}


def _record_costs(rec: Recorder, out: dict[str, Any], cfg: SecureInferenceConfig, phase: str | None = None) -> dict[str, Any]:
    for p in out["parties"]:
        for cat, c in p.costs.items():
            rec.mpc_cost(op_category=cat, party=p.rank, seconds=c["s"], bytes=int(c["bytes"]), rounds=int(c["rounds"]),
                         phase=phase, calls=int(c.get("calls", 0)))
    per_party = {p.rank: {"bytes": p.comm_bytes, "rounds": p.rounds} for p in out["parties"]}
    proj = project_all(out["total_s"], per_party, _networks(cfg))
    metrics = {"total_s": out["total_s"], "comm_bytes": out["comm_bytes"], "rounds": out["rounds"],
               "wall_s": out["wall_s"]}
    for cat, c in out["ops"].items():
        metrics.update({f"ops.{cat}.s": c["s"], f"ops.{cat}.bytes": c["bytes"], f"ops.{cat}.rounds": c["rounds"]})
    for net, terms in proj.items():
        metrics.update({f"{net}.{k}": v for k, v in terms.items()})
    return {"metrics": metrics, "projection": proj}


@task(name="si-generate", **RESUMABLE)
def mpc_generation(method: str, cfg: SecureInferenceConfig, models: SIModels, parent: RunRef) -> dict[str, Any]:
    """One method: encrypted greedy generation for the evaluation prompts (one batch), costs per op and party,
    the decrypted tokens checked against the plaintext twin, and text quality against the references."""
    from core.mpc.textdata import gpt2_tokenizer

    spec = method_spec(method)
    payload = torch.load(models.payloads[method], weights_only=False)
    prompts = torch.load(models.prompts_path, weights_only=False)
    prefix = prompts["prefix"]
    config = {"method": method, "engine": spec.engine, "mode": spec.mode, "model": spec.model,
              "variant": None if spec.variant is None else spec.variant.__dict__, "prefix_len": cfg.prefix_len,
              "gen_len": cfg.gen_len, "batch": int(prefix.shape[0]), "device": _device(cfg), "corpus": models.corpus}
    with task_record(parent=parent, technique=method, config=config, dataset=models.corpus,
                     run_name=f"{method}: {cfg.gen_len} tokens under 2-party MPC") as rec:
        rec.tag("privbench.result_group", "generation")
        out = run_encrypted(method, payload, prefix, cfg.gen_len, cfg)
        rec_costs = _record_costs(rec, out, cfg)
        plain = generate_plain(method, payload, prefix, cfg.gen_len)
        agreement = float((out["tokens"] == plain).double().mean())
        tok = gpt2_tokenizer()
        decode = lambda ids: tok.decode([t for t in ids if t != EOS])
        refs = prompts["references"]
        quality = text_quality(_cut(out["tokens"]), refs, decode, prompts["table"])
        plain_quality = text_quality(_cut(plain), refs, decode, prompts["table"])
        metrics = {**rec_costs["metrics"], "mpc_plain_token_agreement": agreement,
                   **{f"quality.{k}": v for k, v in quality.items()},
                   **{f"plain_quality.{k}": v for k, v in plain_quality.items()},
                   "per_token_s": out["total_s"] / cfg.gen_len}
        rec.metrics(metrics)
        samples = [{"prompt": decode(p.tolist()), "mpc": decode(c), "plain": decode(q), "reference": decode(r)}
                   for p, c, q, r in zip(prefix, _cut(out["tokens"]), _cut(plain), refs, strict=True)]
        rec.artifact_json("generations.json", samples)
        rec.artifact_json("projection.json", rec_costs["projection"])
    return {"method": method, "total_s": out["total_s"], "comm_bytes": out["comm_bytes"], "rounds": out["rounds"],
            "ops": out["ops"], "quality": quality, "plain_quality": plain_quality, "agreement": agreement,
            "projection": rec_costs["projection"]}


def _cut(tokens: torch.Tensor) -> list[list[int]]:
    """Generated ids up to (excluding) the first EOS."""
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(EOS)] if EOS in row else row)
    return out


@task(name="si-scaling", **RESUMABLE)
def scaling_point(method: str, gen_len: int, shape: Any, cfg: SecureInferenceConfig, models: SIModels,
                  parent: RunRef) -> dict[str, Any]:
    """Fig. 4: one method at one generated length (the trained model) or one model shape (random weights of that
    shape: time and bytes do not depend on the values), batch 1."""
    payload = torch.load(models.payloads[method], weights_only=False) if shape is None else \
        _random_payload(method, shape, cfg)
    prompts = torch.load(models.prompts_path, weights_only=False)
    prefix = prompts["prefix"][:1]
    label = "trained" if shape is None else f"L{shape.n_layer}-d{shape.n_embd}-h{shape.n_head}"
    with task_record(parent=parent, technique=f"scaling-{method}",
                     config={"method": method, "gen_len": gen_len, "model": label, "prefix_len": cfg.prefix_len},
                     dataset=models.corpus, run_name=f"{method}, {gen_len} tokens, {label}") as rec:
        rec.tag("privbench.result_group", "scaling")
        out = run_encrypted(method, payload, prefix, gen_len, cfg)
        metrics = _record_costs(rec, out, cfg, phase=f"gen{gen_len}")["metrics"]
        n_params = _payload_params(payload)
        rec.metrics({**metrics, "gen_len": gen_len, "n_parameters": n_params})
    return {"method": method, "gen_len": gen_len, "model": label, "n_parameters": n_params,
            "total_s": out["total_s"], "comm_bytes": out["comm_bytes"], "rounds": out["rounds"]}


def _payload_params(payload: Any) -> int:
    def count(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel()
        if isinstance(obj, list | tuple):
            return sum(count(o) for o in obj)
        if hasattr(obj, "__dataclass_fields__"):
            return sum(count(getattr(obj, f)) for f in obj.__dataclass_fields__)
        return 0

    return count(payload)


def _random_payload(method: str, shape: Any, cfg: SecureInferenceConfig) -> Any:
    """Random weights of ``shape`` for ``method`` (merge engines: constant attention averaged over random ids)."""
    from transformers import GPT2LMHeadModel

    from core.mpc.gpt2 import weights_from_hf
    from core.mpc.merge import build_merge_model, export_spec

    torch.manual_seed(cfg.seed)
    model = GPT2LMHeadModel(_hf_config(cfg, EOS + 1, shape)).eval()
    if method_spec(method).engine == "gpt2":
        return weights_from_hf(model)
    ids = torch.randint(0, EOS, (4, cfg.n_max), generator=torch.Generator().manual_seed(cfg.seed))
    return export_spec(build_merge_model(model, [ids], cfg.n_max).eval())


# ----------------------------------------------------------------------------------------------- summary


def si_summary(cfg: SecureInferenceConfig, results: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> dict[str, Any]:
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
    if "merge" in by and "vanilla_kv" in by:
        metrics["merge.speedup_over_vanilla_kv"] = by["vanilla_kv"]["total_s"] / by["merge"]["total_s"]
    quality = {m: {**r["quality"], "mpc_plain_token_agreement": r["agreement"]} for m, r in by.items()}
    return {"table1": table1, "table2": table2, "quality": quality, "scaling": scaling, "metrics": metrics,
            "markdown": _markdown(cfg, table1, table2, quality, scaling)}


def _markdown(cfg: SecureInferenceConfig, t1: dict, t2: dict, quality: dict, scaling: list) -> str:
    cats = [c for c in CATEGORIES if c != "Other"]
    lines = [(f"Table 1 analogue: seconds per category ({cfg.gen_len} tokens after {cfg.prefix_len}, "
             f"batch {cfg.n_prompts}, slower party)"), "",
             "| method | total | " + " | ".join(cats) + " | speedup |", "|---|" + "---|" * (len(cats) + 2)]
    for m, r in t1.items():
        lines.append(f"| {m} | {r['total_s']:.2f} | " + " | ".join(f"{r[c]:.2f}" for c in cats)
                     + f" | {r.get('speedup_over_vanilla', float('nan')):.2f}x |")
    lines += ["", "Table 2 analogue: MB sent per party", "",
              "| method | total | " + " | ".join(cats) + " | fraction |", "|---|" + "---|" * (len(cats) + 2)]
    for m, r in t2.items():
        lines.append(f"| {m} | {r['comm_bytes'] / 1e6:.1f} | " + " | ".join(f"{r[c] / 1e6:.1f}" for c in cats)
                     + f" | {100 * r.get('fraction_of_vanilla', float('nan')):.0f}% |")
    lines += ["", "Quality of the decrypted generations", "",
              "| method | ROUGE-L | chrF | BLEU | embedding F1 | tokens equal to plaintext |", "|---|---|---|---|---|---|"]
    for m, q in quality.items():
        lines.append(f"| {m} | {q['rouge_l']:.3f} | {q['chrf']:.1f} | {q['bleu']:.1f} | {q['embedding_f1']:.3f} | "
                     f"{100 * q['mpc_plain_token_agreement']:.0f}% |")
    if scaling:
        lines += ["", "Scaling (batch 1)", "", "| method | model | tokens | seconds | MB |", "|---|---|---|---|---|"]
        lines += [f"| {s['method']} | {s['model']} | {s['gen_len']} | {s['total_s']:.2f} | {s['comm_bytes'] / 1e6:.1f} |"
                  for s in scaling]
    return "\n".join(lines) + "\n"
