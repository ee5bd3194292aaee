"""The tangent stage's report: the four result groups (Tables 1-3, Fig. 1) as nested JSON, their headline numbers
as flat metrics for the flow's parent run, and a Markdown rendering (accuracies in %)."""

from __future__ import annotations

import math
from typing import Any

from pbconfig.tangent import TangentConfig


def tangent_summary(
    cfg: TangentConfig,
    *,
    table1: list[dict[str, Any]],
    table2: list[dict[str, Any]],
    fig1: dict[str, Any],
    table3: list[dict[str, Any]],
) -> dict[str, Any]:
    """The four result groups as nested JSON, their headline numbers as flat metrics, and a Markdown report."""
    t1 = {r["method"]: r["test_accuracy"] for r in table1}
    t2 = {str(r["n_shards"]): {m: r[m]["test_accuracy"] for m in ("taft", "soup", "sisa")} for r in table2}
    t3: dict[str, dict[str, dict[str, float]]] = {}
    for r in table3:
        t3.setdefault(r["regime"], {}).setdefault(r["parameters"], {})[f"{r['target_epsilon']:g}"] = r["test_accuracy"]
    sub, one = fig1["subtraction"], fig1["retrain_one"]
    metrics: dict[str, float] = {f"table1.{m}.test_accuracy": v for m, v in t1.items()}
    for n, row in t2.items():
        metrics.update({f"table2.n{n}.{m}.test_accuracy": v for m, v in row.items()})
    metrics.update(
        {
            "fig1.taft_drop_half_removed": sub["taft_drop_half_removed"],
            "fig1.mean_taft_minus_sisa": sub["mean_taft_minus_sisa"],
            "fig1.unlearning_max_abs_err": sub["unlearning_max_abs_err"],
            "fig1.full_over_shard_retrain_time": one["full_over_shard_retrain_time"],
        }
    )
    for fr in fig1["fractions"]:
        metrics[f"fig1.forget_{fr['fraction']:g}.accuracy_after"] = fr["accuracy_after"]
    request = fig1.get("request")
    for method, row in _request_rows(request).items():
        metrics.update({f"fig1.{method}.{m}": row[m] for m in REQUEST_METRICS})
    for regime, kinds in t3.items():
        for kind, row in kinds.items():
            metrics.update({f"table3.{regime}.{kind}.eps{e}.test_accuracy": v for e, v in row.items()})
    gap = fc_control_gap(t3)
    if gap is not None:
        metrics["table3.fc_control_max_gap"] = gap
    max_comp = max(r["taft"]["composition_max_abs_err"] for r in table2)
    metrics["table2.composition_max_abs_err"] = max_comp
    return {
        "table1": t1,
        "table2": t2,
        "table3": t3,
        "fig1": {
            "n_shards": sub["n_shards"],
            "removed": sub["removed"],
            "taft_accuracy": sub["taft_accuracy"],
            "sisa_accuracy": sub["sisa_accuracy"],
            "unlearning_max_abs_err": sub["unlearning_max_abs_err"],
            "retrain_one": one,
            "fractions": fig1["fractions"],
            "request": request,
        },
        "details": {"table1": table1, "table2": table2, "table3": table3},
        "markdown": markdown_report(
            cfg, t1, t2, sub, one, fig1["fractions"], t3, request, table3_choices(table3), table1_choices(table1)
        ),
        "metrics": metrics,
    }


def fc_control_gap(t3: dict[str, dict[str, dict[str, float]]]) -> float | None:
    """The control of Table 3: the largest |Ours - Reg| test accuracy over the epsilons of the ``fc`` regime, where
    both columns are the same linear model from the same start, trained with the same noise and search (it ties up
    to float32 rounding); None without both ``fc`` columns."""
    fc = t3.get("fc", {})
    ours, reg = fc.get("ours", {}), fc.get("reg", {})
    both = [e for e in ours if e in reg]
    return max(abs(ours[e] - reg[e]) for e in both) if both else None


def table1_choices(table1: list[dict[str, Any]]) -> dict[str, str]:
    """``{method: "lr [PT CLS] (validation %)"}`` for the Table 1 methods a search chose (none without one); Table 2's
    shards of TAFT and NLFT train at these points."""
    out = {}
    for r in table1:
        if "tuning.points" not in r:
            continue
        knobs = f" PT={'T' if r['pretrained'] else 'F'} CLS={'T' if r['cls'] else 'F'}" if "pretrained" in r else ""
        out[r["method"]] = f"{r['lr']:g}{knobs} ({100 * r['tuning.valid_accuracy']:.1f} of {r['tuning.points']})"
    return out


def table3_choices(table3: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, str]]]:
    """``{regime: {ours|reg: {epsilon: "lr PT (validation %)"}}}`` for the cells a search chose (none without one)."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for r in table3:
        if "tuning.points" not in r:
            continue
        pt = "T" if r["pretrained"] else "F"
        label = f"{r['lr']:g} PT={pt} ({100 * r['tuning.valid_accuracy']:.1f})"
        out.setdefault(r["regime"], {}).setdefault(r["parameters"], {})[f"{r['target_epsilon']:g}"] = label
    return out


# the forget request's metrics that go to the flow run (``fig1.<method>.<metric>``) and the report
REQUEST_METRICS = ("forget_s", "forget_steps", "accuracy_after_forget", "inference_forwards", "inference_s_per_batch")


def _request_rows(request: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The per-method rows of :func:`tasks.tangent.forget_request_costs`'s result (none without one)."""
    if request is None:
        return {}
    return {m: r for m, r in request.items() if m.startswith("forget-")}


def markdown_report(
    cfg: TangentConfig,
    t1: dict[str, float],
    t2: dict[str, dict[str, float]],
    sub: dict[str, Any],
    one: dict[str, Any],
    fractions: list[dict[str, Any]],
    t3: dict[str, Any],
    request: dict[str, Any] | None = None,
    choices: dict[str, dict[str, dict[str, str]]] | None = None,
    table1_chosen: dict[str, str] | None = None,
) -> str:
    """Tables 1-3 and Fig. 1 as Markdown (accuracies in %), for the run's ``summary.json`` and the README."""
    pct = lambda v: f"{100 * v:.1f}"
    lines = [
        f"Table 1 ({cfg.dataset}, k={cfg.k})",
        "",
        "| " + " | ".join(t1) + " |",
        "|" + "---|" * len(t1),
        "| " + " | ".join(pct(v) for v in t1.values()) + " |",
        "",
    ]
    if table1_chosen:
        lines += [
            "Tables 1-2, each searched method's point chosen on validation (its validation accuracy %, of n points)",
            "",
            "| " + " | ".join(table1_chosen) + " |",
            "|" + "---|" * len(table1_chosen),
            "| " + " | ".join(table1_chosen.values()) + " |",
            "",
        ]
    lines += [
        "Table 2",
        "",
        "| shards | Model Soup | TAFT (composed) | SISA |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {pct(r['soup'])} | {pct(r['taft'])} | {pct(r['sisa'])} |" for n, r in t2.items()]
    lines += [
        "",
        f"Fig. 1 ({sub['n_shards']} shards, mean of {cfg.fig1_trials} removal orders)",
        "",
        "| shards removed | TAFT (subtraction) | SISA |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r} | {pct(a)} | {pct(b)} |"
        for r, a, b in zip(sub["removed"], sub["taft_accuracy"], sub["sisa_accuracy"], strict=True)
    ]
    lines += [
        "",
        (
            f"One forget request: shard retraining {one['shard_retrain_s']:.2f} s vs full retraining "
            f"{one['full_retrain_s']:.2f} s ({one['full_over_shard_retrain_time']:.1f}x); accuracy "
            f"{pct(one['shard_retrain_accuracy'])} vs {pct(one['full_retrain_accuracy'])}."
        ),
    ]
    lines += [
        f"Forgetting {fr['fraction']:.0%} by shard retraining: {pct(fr['accuracy_before'])} -> "
        f"{pct(fr['accuracy_after'])}."
        for fr in fractions
    ]
    rows = _request_rows(request)
    if request is not None and rows:
        head = f"{len(request['examples'])} images in {len(request['shards'])} of {request['n_shards']} shards"
        lines += [
            "",
            f"One forget request ({head}): cost, accuracy and inference cost after forgetting",
            "",
            "| method | forget s | training steps | accuracy after | forwards / batch | s / batch | x plain forward |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {m} | {r['forget_s']:.3f} | {r['forget_steps']} | {pct(r['accuracy_after_forget'])} | "
            f"{r['inference_forwards']:g} | {r['inference_s_per_batch']:.4f} | "
            f"{r['inference_over_plain_forward']:.1f} |"
            for m, r in rows.items()
        ]
    if t3:
        eps = sorted({e for kinds in t3.values() for row in kinds.values() for e in row}, key=float)
        lines += [
            "",
            "Table 3 (DP-SGD; Ours = tangent parameters, Reg = original parameters)",
            "",
            "| epsilon | " + " | ".join(f"{r} Ours | {r} Reg" for r in t3) + " |",
            "|---|" + "---|---|" * len(t3),
        ]
        for e in eps:
            cells = [
                f"{pct(t3[r].get('ours', {}).get(e, math.nan))} | {pct(t3[r].get('reg', {}).get(e, math.nan))}"
                for r in t3
            ]
            lines.append(f"| {e} | " + " | ".join(cells) + " |")
    if choices:
        lines += [
            "",
            "Table 3, each column's (lr, PT) chosen on validation (its validation accuracy, %)",
            "",
            "| epsilon | " + " | ".join(f"{r} Ours | {r} Reg" for r in choices) + " |",
            "|---|" + "---|---|" * len(choices),
        ]
        for e in sorted({e for kinds in choices.values() for row in kinds.values() for e in row}, key=float):
            cells = [" | ".join(choices[r].get(kind, {}).get(e, "") for kind in ("ours", "reg")) for r in choices]
            lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
