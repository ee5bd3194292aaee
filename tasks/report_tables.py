"""The stage tables of the claims report (:mod:`tasks.report`): what the stages measured beside the verdicts, one
section a table, each rendered from a :mod:`storage.views` frame (an empty frame renders nothing):

* the train-dp recipe search on validation (:func:`search_section`);
* every secure-inference method's decrypted text quality (:func:`quality_section`);
* SEB's utility language models beside their sizes (:func:`seb_utility_section`);
* how far DPFormer's Re-Attention moves attention (:func:`reattention_section`).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from storage.leaderboard import seed_interval


def search_section(search: pd.DataFrame, final: pd.DataFrame) -> list[str]:
    """The train-dp recipe search: per dataset, method and privacy, the grid searched on validation, the point
    chosen, and the epsilon the search and the final runs spend together (basic composition)."""
    if search.empty:
        return []
    lines = [
        "## Recipe search (train-dp)",
        "",
        (
            "Each method's learning rate and batch size were chosen on validation NDCG@10 (the test split is never "
            "read) before its runs below, at a seed none of them uses; the search's runs are recorded apart (stage "
            "`train-dp-tuning`) and no claim reads them. `epsilon with search`: the search's training runs and a final "
            "private run together under basic composition (the paper leaves the search unaccounted, footnote 9); "
            "it does not cover the choice itself, which reads the users' validation items without noise."
        ),
        "",
        (
            "| dataset | method | private | points (finished) | seed | lr x batch chosen "
            "| validation NDCG@10 (ranked / masked) | range over the search (masked) | epsilon with search |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (dataset, method, private), rows in search.groupby(["dataset", "method", "private"], sort=True):
        chosen = rows[rows["chosen"]]
        pick = chosen.iloc[0] if len(chosen) else None
        mine = final[(final["dataset"] == dataset) & (final["method"] == method) & (final["private"] == private)]
        composed = mine["epsilon_with_tuning"].dropna()
        planned = mine["tuning_points"].dropna()
        points = f"{int(planned.max())} ({len(rows)})" if len(planned) else f"- ({len(rows)})"
        with_search = (
            f"{composed.min():g}-{composed.max():g}" if len(composed) and composed.min() != composed.max()
            else (f"{composed.min():g}" if len(composed) else "-")
        )  # fmt: skip
        cells = [
            dataset,
            method,
            "yes" if private else "no",
            points,
            ", ".join(str(int(s)) for s in sorted(set(rows["seed"]))),
            "-" if pick is None else f"{pick['lr']:g} x {int(pick['batch_size'])}",
            "-" if pick is None else f"{pick['valid_ndcg_at_10']:.4f} / {pick['valid_ndcg_at_10_masked']:.4f}",
            f"{rows['valid_ndcg_at_10_masked'].min():.4f}-{rows['valid_ndcg_at_10_masked'].max():.4f}",
            with_search,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _mean_interval(values: pd.Series, spec: str) -> str:
    """The mean of ``values`` (NaN dropped; ``-`` when none) with its 95% t-interval over them when there are two or
    more, each formatted with ``spec`` (e.g. ``+.2f``)."""
    values = values.dropna()
    if values.empty:
        return "-"
    ci = seed_interval(values)
    if ci.n < 2:
        return format(ci.mean, spec)
    return f"{ci.mean:{spec}} [{ci.low:{spec}}, {ci.high:{spec}}]"


def quality_section(quality: pd.DataFrame) -> list[str]:
    """Every secure-inference method's text against the fine-tuned plaintext model's, per dataset, model, method and
    step counts: the seeds, and the ROUGE-L, chrF and embedding-F1 drops with their t-intervals over seeds (each
    seed's runs averaged first; the claims judge MERGE's, this is every method's)."""
    if quality.empty:
        return []
    lines = [
        "## Decrypted text quality (MERGE's stage)",
        "",
        (
            "Each method's greedy text on the quality prompts (decrypted under MPC on the first, its plaintext twin's "
            "on the rest) against the fine-tuned model's plaintext text on the same prompts, ROUGE-L and chrF (both "
            "0-100) and the token-embedding F1 (greedy matching over the fine-tuned model's token table, BERTScore "
            "without IDF or rescaling, in [-1, 1]) against the references; drop: the fine-tuned model's score minus "
            "the method's (points, positive is worse; the F1 in its own units), mean over the seeds with its 95% "
            "t-interval; `agreement`: the least share of decrypted tokens equal to the twin's, over `MPC prompts` "
            "prompts a seed. Steps: fine-tuning / embedding resending / merge module (the paper fine-tunes 3 epochs "
            "at batch 4 and trains MERGE 50,000 steps, Sec. 5; at most 30,000, App. C.2)."
        ),
        "",
        (
            "| dataset | model | method | steps | seeds | MPC prompts | fine-tuned ROUGE-L | ROUGE-L drop (pt) "
            "| chrF drop (pt) | embedding F1 drop | agreement |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def count(value: Any) -> str:
        return "-" if value is None or pd.isna(value) else str(int(value))

    frame = quality.assign(
        steps=[
            " / ".join(count(v) for v in row)
            for row in quality[["train_steps", "er_steps", "mm_steps"]].itertuples(index=False)
        ],
        rouge_l_drop_pt=100 * quality["rouge_l_drop"],
        seed=quality["seed"].astype(object).where(quality["seed"].notna(), quality["run_id"]),
    )
    keys = ["dataset", "model", "method", "steps"]
    for (dataset, model, method, steps), rows in frame.groupby(keys, sort=True, dropna=False):
        per_seed = rows.groupby("seed")[["base_rouge_l", "rouge_l_drop_pt", "chrf_drop", "embedding_f1_drop"]].mean()
        prompts = sorted({count(v) for v in rows["mpc_prompts"]})
        lines.append(
            f"| {dataset} | {model} | {method} | {steps} | {len(per_seed)} | {', '.join(prompts)} "
            f"| {100 * per_seed['base_rouge_l'].mean():.2f} "
            f"| {_mean_interval(per_seed['rouge_l_drop_pt'], '+.2f')} "
            f"| {_mean_interval(per_seed['chrf_drop'], '+.2f')} "
            f"| {_mean_interval(per_seed['embedding_f1_drop'], '+.3f')} | {rows['agreement'].min():.2f} |"
        )
    return [*lines, ""]


def seb_utility_section(utility: pd.DataFrame) -> list[str]:
    """SEB's utility language models beside their sizes: per dataset, vocabulary and method, the seeds, the test
    perplexity (mean and 95% t-interval over seeds), the embedding parameters, SEB's FFN width and the steps."""
    if utility.empty:
        return []
    lines = [
        "## SEB utility at its size (language models)",
        "",
        (
            "Each utility language model's test perplexity (the best validation checkpoint where the profile measures "
            "validation), mean over the seeds with its 95% t-interval, beside its embedding parameters (input module, "
            "output tied: counted once) and, for SEB, its FFN hidden width; steps: trained, best step: the checkpoint "
            "tested (means over the seeds; under a patience each model stops at its own plateau, so the arms' budgets "
            "can differ; without one every arm trains the same steps, and a best step equal to them means the model "
            "was still improving when the budget ran out). "
            "`-matched` rows narrow SEB's FFN to the widest whose module has no more parameters than the subword table "
            "of the same vocabulary (the subword row's count). Perplexities compare within a dataset and vocabulary "
            "only."
        ),
        "",
        (
            "| dataset | vocabulary | method | seeds | test perplexity | embedding parameters | SEB hidden | steps "
            "| best step |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mean(values: pd.Series) -> str:
        kept = values.dropna()
        return f"{kept.mean():,.0f}" if len(kept) else "-"

    def distinct(values: pd.Series) -> str:
        kept = sorted({int(v) for v in values if v is not None and not pd.isna(v)})
        return ", ".join(f"{v:,}" for v in kept) or "-"

    for (dataset, vocab, method), rows in utility.groupby(["dataset", "lm_vocab", "method"], sort=True):
        lines.append(
            f"| {dataset} | {vocab} | {method} | {rows['seed'].nunique()} "
            f"| {_mean_interval(rows['perplexity'], '.2f')} | {distinct(rows['embedding_params'])} "
            f"| {distinct(rows['seb_hidden'])} "
            f"| {mean(rows['steps'])} | {mean(rows['best_step'])} |"
        )
    return [*lines, ""]


def reattention_section(sizes: pd.DataFrame) -> list[str]:
    """How much attention DPFormer's Re-Attention moves, per dataset, epsilon and block, over its runs."""
    if sizes.empty:
        return []
    lines = [
        "## Re-Attention's reach (DPFormer)",
        "",
        (
            "Over the last epoch's training batches of each DPFormer run: the correction subtracted from the attention "
            "logits (median and maximum, nats) and the attention mass it moves (`attention_tv`: the mean "
            "total-variation distance between a real query's corrected and uncorrected attention). Means over the "
            "runs (seeds) of each row; a DPFormer that ties the Transformer with a small `attention_tv` had little "
            "to correct."
        ),
        "",
        (
            "| dataset | epsilon | block | runs | correction median (nats) | correction max (nats) "
            "| attention moved (TV) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for (dataset, eps, block), rows in sizes.groupby(["dataset", "epsilon", "block"], sort=True):
        lines.append(
            f"| {dataset} | {eps:g} | {int(block)} | {len(rows)} | {rows['correction_median'].mean():.4f} "
            f"| {rows['correction_max'].max():.4f} | {rows['attention_tv'].mean():.4f} |"
        )
    return [*lines, ""]
