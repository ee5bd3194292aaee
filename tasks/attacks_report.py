"""The attack stage's report (part 1, SEB): recovery curves (Fig. 5), candidate statistics (Fig. 3), byte
coverage (Fig. 4), best recovered sentences (Table 2) and the utility table (Tables 3 and 6) as nested JSON,
their headline numbers as flat metrics for the flow's parent run, and a Markdown rendering."""

from __future__ import annotations

from typing import Any

# what each membership-inference attack measured, in the audit table and the forgetting table alike
ATTACK_MEASURES = ("auc", "tpr_at_0.1pct_fpr", "tpr_at_1pct_fpr", "empirical_epsilon", "empirical_epsilon_ci")


def attacks_summary(
    *,
    film: list[dict[str, Any]],
    coverage: dict[str, Any] | None,
    lm: list[dict[str, Any]],
    mt: list[dict[str, Any]],
    audit: list[dict[str, Any]] | None = None,
    unlearning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    recovery = []
    for run in sorted(film, key=lambda r: (r.get("prior", ""), r["victim"], r["batch_size"])):
        for setting, vals in run["settings"].items():
            recovery.append(
                {
                    "victim": run["victim"],
                    "setting": setting,
                    "prior": run.get("prior", "kjv-small"),
                    "batch_size": run["batch_size"],
                    "seconds": vals.get("seconds", float("nan")),
                    **{
                        k: vals[k]
                        for k in (
                            "rouge1",
                            "rouge2",
                            "rougeL",
                            "recall",
                            "precision",
                            "n_candidates",
                            "n_tokens",
                            "n_unique_subwords",
                            "n_unique_bytes",
                            "n_batches",
                        )
                    },
                }
            )
    best = []
    for run in film:
        if run["batch_size"] == min(r["batch_size"] for r in film):
            for setting, (score, original, recovered) in run["best"].items():
                best.append(
                    {
                        "victim": run["victim"],
                        "setting": setting,
                        "prior": run.get("prior", "kjv-small"),
                        "batch_size": run["batch_size"],
                        "rougeL": score,
                        "original": original,
                        "recovered": recovered,
                    }
                )
    metrics: dict[str, float] = {}
    for row in recovery:
        key = f"film.{row['prior']}.{row['victim']}.{row['setting']}.b{row['batch_size']}"
        metrics.update(
            {
                f"{key}.rouge1": row["rouge1"],
                f"{key}.rougeL": row["rougeL"],
                f"{key}.recall": row["recall"],
                f"{key}.n_candidates": row["n_candidates"],
                f"{key}.seconds": row["seconds"],
            }
        )
    for row in lm:
        metrics[f"utility.lm.{row['dataset']}.{row['embedding']}.s{row.get('seed', 0)}.perplexity"] = row["perplexity"]
    for row in mt:
        metrics[f"utility.mt.{row['embedding']}.s{row.get('seed', 0)}.bleu"] = row["bleu"]
    lm_rows = [
        {"seed": r.get("seed", 0)}
        | {k: r[k] for k in ("dataset", "embedding", "perplexity", "embedding_params", "params", "steps", "train_s")}
        # counted at GPT-2's whole vocabulary, and the validation plateau (when the LM was trained to one)
        | {k: r[k] for k in ("embedding_params_full_vocab", "best_step", "val_perplexity", "plateaued") if k in r}
        for r in lm
    ]
    mt_rows = [
        {"seed": r.get("seed", 0)}
        | {k: r[k] for k in ("dataset", "embedding", "bleu", "embedding_params", "params", "steps", "train_s")}
        for r in mt
    ]
    audit_rows = []
    for t in audit or []:
        label = "nonprivate" if t["epsilon"] is None else f"eps={t['epsilon']:g}"
        for name, r in t["attacks"].items():
            audit_rows.append(
                {
                    "dataset": t["dataset"],
                    "method": t["method"],
                    "dp": label,
                    "attack": name,
                    "accountant_epsilon": t["accountant_epsilon"],
                    "delta": t["delta"],
                    "test_ndcg_at_10": t["target_test_ndcg_at_10"],
                    **{k: r[k] for k in (*ATTACK_MEASURES, "certifiable_epsilon_max")},
                }
            )
            key = f"audit.{t['dataset']}.{t['method']}.{label.replace('=', '')}.{name}"
            metrics.update(
                {
                    f"{key}.auc": r["auc"],
                    f"{key}.empirical_epsilon_lo": r["empirical_epsilon_ci"][0],
                    f"{key}.certifiable_epsilon_max": r["certifiable_epsilon_max"],
                }
            )
    forget_rows = []
    if unlearning is not None:
        for setting, r in unlearning["settings"].items():
            forget_rows.append(
                {
                    "setting": setting,
                    **{k: r[k] for k in (*ATTACK_MEASURES, "n_members", "n_nonmembers")},
                }
            )
        metrics["audit.unlearning.after_forgotten.auc"] = unlearning["settings"]["after: forgotten vs non-members"][
            "auc"
        ]
        metrics["audit.unlearning.before.auc"] = unlearning["settings"]["before: members vs non-members"]["auc"]
        metrics["audit.unlearning.forgotten_ks_pvalue"] = unlearning["two_sample"]["ks_pvalue"]
    markdown = (
        markdown_report(recovery, best, coverage, lm_rows, mt_rows)
        + audit_markdown(audit_rows)
        + unlearning_markdown(forget_rows, unlearning)
    )
    return {
        "recovery": recovery,
        "best_sentences": best,
        "coverage": coverage,
        "utility_lm": lm_rows,
        "utility_mt": mt_rows,
        "audit": audit_rows,
        "unlearning": {
            "rows": forget_rows,
            "two_sample": unlearning["two_sample"],
            "removed": unlearning["removed"],
            "n_shards": unlearning["n_shards"],
        }
        if unlearning
        else None,
        "markdown": markdown,
        "metrics": metrics,
    }


def unlearning_markdown(rows: list[dict[str, Any]], unlearning: dict[str, Any] | None) -> str:
    if not rows or unlearning is None:
        return ""
    t = unlearning["two_sample"]
    title = (
        f"### TAFT unlearning audit ({unlearning['n_shards']} shards, {len(unlearning['removed'])} forgotten "
        "by subtraction; loss-threshold attack)"
    )
    lines = [
        "",
        title,
        "",
        "| members vs non-members | AUC | TPR@1%FPR | empirical eps [95% CI] | n |",
        "|---|---:|---:|---|---:|",
    ]
    for r in rows:
        lo, hi = r["empirical_epsilon_ci"]
        lines.append(
            f"| {r['setting']} | {r['auc']:.3f} | {r['tpr_at_1pct_fpr']:.3f} | {r['empirical_epsilon']:.2f} "
            f"[{lo:.2f}, {hi:.2f}] | {r['n_members']} / {r['n_nonmembers']} |"
        )
    lines.append(
        f"\nForgotten vs non-member losses after unlearning: Kolmogorov-Smirnov p = {t['ks_pvalue']:.3g}, "
        f"Mann-Whitney p = {t['mw_pvalue']:.3g}."
    )
    return "\n".join(lines) + "\n"


def audit_markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = [
        "",
        "### Membership-inference audit (member unit: a user's sequence)",
        "",
        (
            "| dataset | model | DP | attack | AUC | TPR@0.1%FPR | TPR@1%FPR | empirical eps [95% CI] "
            "| accountant eps | certifiable eps max |"
        ),
        "|---|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lo, hi = r["empirical_epsilon_ci"]
        acc = "-" if r["accountant_epsilon"] is None else f"{r['accountant_epsilon']:.2f}"
        lines.append(
            f"| {r['dataset']} | {r['method']} | {r['dp']} | {r['attack']} | {r['auc']:.3f} | "
            f"{r['tpr_at_0.1pct_fpr']:.3f} | {r['tpr_at_1pct_fpr']:.3f} | {r['empirical_epsilon']:.2f} "
            f"[{lo:.2f}, {hi:.2f}] | {acc} | {r['certifiable_epsilon_max']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def markdown_report(
    recovery: list[dict[str, Any]],
    best: list[dict[str, Any]],
    coverage: dict[str, Any] | None,
    lm: list[dict[str, Any]],
    mt: list[dict[str, Any]],
) -> str:
    lines: list[str] = []
    if recovery:
        lines += [
            "### FILM recovery (ROUGE F, mean over attacked batches)",
            "",
            (
                "| prior | victim | attacker setting | batch | ROUGE-1 | ROUGE-2 | ROUGE-L | candidates | recall | "
                "unique subwords | unique bytes | seconds per batch |"
            ),
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in recovery:
            lines.append(
                f"| {r['prior']} | {r['victim']} | {r['setting']} | {r['batch_size']} | {r['rouge1']:.3f} | "
                f"{r['rouge2']:.3f} | {r['rougeL']:.3f} | {r['n_candidates']:.0f} | {r['recall']:.2f} | "
                f"{r['n_unique_subwords']:.1f} | {r['n_unique_bytes']:.1f} | {r['seconds']:.1f} |"
            )
        lines.append("")
    if best:
        lines += [
            "### Best recovered sentence (smallest batch, by ROUGE-L)",
            "",
            "| prior | victim | setting | ROUGE-L | original | recovered |",
            "|---|---|---|---:|---|---|",
        ]
        for b in best:
            lines.append(
                f"| {b['prior']} | {b['victim']} | {b['setting']} | {b['rougeL']:.3f} | {_cell(b['original'])} | "
                f"{_cell(b['recovered'])} |"
            )
        lines.append("")
    if coverage:
        lines += [
            "### Subwords covered by k random bytes (the victims' vocabulary)",
            "",
            "| k bytes | made only of them | containing one of them |",
            "|---:|---:|---:|",
        ]
        for k, v in coverage.items():
            lines.append(f"| {k} | {v['only']:.1f} | {v['any']:.1f} |")
        lines.append("")
    if lm:
        lines += [
            "### Language modelling (test perplexity, same model and budget)",
            "",
            "| dataset | embedding | seed | perplexity | embedding params | all params |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in lm:
            lines.append(
                f"| {r['dataset']} | {r['embedding']} | {r['seed']} | {r['perplexity']:.2f} | "
                f"{r['embedding_params']:,} | {r['params']:,} |"
            )
        lines.append("")
    if mt:
        lines += [
            "### German->English translation (sacreBLEU, 13a)",
            "",
            "| embedding | seed | BLEU | embedding params | all params |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in mt:
            lines.append(
                f"| {r['embedding']} | {r['seed']} | {r['bleu']:.2f} | {r['embedding_params']:,} | {r['params']:,} |"
            )
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
