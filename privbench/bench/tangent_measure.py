"""The three measurements of ``privbench bench tangent``: the linearised forward against HF and ``torch.func.jvp``,
composition by weight sums against SISA/Model Soup, and unlearning by subtraction (see ``privbench.bench.tangent``)."""

from __future__ import annotations

import copy
import statistics
import time
from typing import TYPE_CHECKING, Any

from privbench.bench.harness import Progress, interleave
from privbench.bench.tangent_reference import (
    PlainSuffix,
    group_runs,
    jvp_error_float64,
    max_rel,
    random_delta,
    reporter,
    sync_fn,
    timed,
)

if TYPE_CHECKING:
    from privbench.bench.tangent import Setting


def measure_jvp(
    backbone: Any, images: Any, setting: Setting, k: int, device: str, progress: Progress
) -> dict[str, Any]:
    """Linearised forward vs plain HF forward vs ``torch.func.jvp`` for the last ``k`` blocks."""
    import torch

    from core.tangent.experiments import make_head
    from core.tangent.model import TangentModel

    head = make_head(backbone.config.hidden_size, setting.num_classes, setting.seed).to(device)
    model = TangentModel(backbone, setting.num_classes, k=k, head=copy.deepcopy(head))
    plain = PlainSuffix(backbone, head, k)
    gen = torch.Generator().manual_seed(setting.seed + 1000 * k)
    delta = random_delta(model, setting.delta_std, gen)
    model.set_delta(delta)
    model.eval()
    h = model.features(images[: setting.batch].to(device))  # (B, N, D)
    params = plain.params()
    tangents, covered = plain.tangents(model, delta)
    sync = sync_fn(device)
    ratios = {
        "jvp_over_plain_forward_time": ("linearised", "plain"),
        "jvp_over_torch_func_jvp_time": ("linearised", "torch_func_jvp"),
    }
    with torch.no_grad():
        fns = {
            "plain": lambda: plain(h),
            "linearised": lambda: model.forward_from_cache(h),
            "torch_func_jvp": lambda: plain.jvp(h, params, tangents),
        }
        for fn in fns.values():  # warm-up
            fn()
        progress.print(
            f"[bold]k={k}[/]: linearised vs plain vs torch.func.jvp, batch {setting.batch}, "
            f"tokens {h.shape[1]}, {setting.repeats} rounds x {setting.inner} calls"
        )
        runs = interleave(
            {n: timed(fn, setting.inner, sync) for n, fn in fns.items()},
            setting.repeats,
            on_sample=reporter(progress, f"k={k}", setting.repeats),
        )
        ref_f, ref_j = plain.jvp(h, params, tangents)
        ours = model.forward_from_cache(h)
        model.predict_jvp_only = True
        try:
            ours_j = model.forward_from_cache(h)
        finally:
            model.predict_jvp_only = False
        errors = {
            "jvp_max_rel_err": max_rel(ours_j, ref_j),
            "linearised_max_rel_err": max_rel(ours, ref_f + ref_j),
            "plain_vs_torch_func_primal_max_abs_err": float((plain(h) - ref_f).abs().max()),
        }
        if setting.float64_check:
            errors["jvp_max_rel_err_float64"] = jvp_error_float64(model, plain, h, delta)
    return {
        "ratios": {key: runs.ratio(*pair) for key, pair in ratios.items()},
        "absolute": {
            "plain_forward_s": runs.median("plain"),
            "linearised_forward_s": runs.median("linearised"),
            "torch_func_jvp_s": runs.median("torch_func_jvp"),
        },
        "errors": errors,
        "tokens": int(h.shape[1]),
        "delta_params_covered": covered,
        "delta_numel": sum(t.numel() for t in delta.values()),
        "timings": group_runs(runs, ratios),
    }


def measure_composition(
    backbone: Any, images: Any, setting: Setting, device: str, progress: Progress
) -> dict[str, Any]:
    """Composed vs single vs ensemble inference; compose cost; composition and unlearning errors."""
    import torch

    from core.tangent.compose import compose, ensemble_logits, remove_component
    from core.tangent.experiments import make_head
    from core.tangent.model import TangentModel

    k, n = setting.k[0], setting.n_components
    head = make_head(backbone.config.hidden_size, setting.num_classes, setting.seed).to(device)

    def fresh() -> Any:
        return TangentModel(backbone, setting.num_classes, k=k, head=copy.deepcopy(head)).eval()

    single, composed, member = fresh(), fresh(), fresh()
    gen = torch.Generator().manual_seed(setting.seed + 7)
    deltas = [random_delta(single, setting.delta_std, gen) for _ in range(n)]
    sync = sync_fn(device)
    compose_s = []
    for _ in range(setting.compose_repeats):
        sync()
        t0 = time.perf_counter()
        mean = compose(deltas)
        sync()
        compose_s.append(time.perf_counter() - t0)
    single.set_delta(deltas[0])
    composed.set_delta(mean)
    h = single.features(images[: setting.batch].to(device))  # (B, N, D)

    def ensemble() -> Any:
        outs = []
        for d in deltas:
            member.set_delta(d)
            outs.append(member.forward_from_cache(h))
        return ensemble_logits(outs)

    with torch.no_grad():
        single.forward_from_cache(h)  # warm-up
        composed.forward_from_cache(h)
        progress.print(f"[bold]composition[/] of {n} components: composed vs single, {setting.repeats} rounds")
        pair = {"composed_over_single_inference_time": ("composed", "single")}
        runs = interleave(
            {
                "single": timed(lambda: single.forward_from_cache(h), setting.inner, sync),
                "composed": timed(lambda: composed.forward_from_cache(h), setting.inner, sync),
            },
            setting.repeats,
            on_sample=reporter(progress, "compose", setting.repeats),
        )
        progress.print(f"[bold]ensemble[/] of {n} models vs composed, {setting.ensemble_repeats} rounds")
        pair_e = {"ensemble_over_composed_inference_time": ("ensemble", "composed")}
        runs_e = interleave(
            {
                "ensemble": timed(ensemble, 1, sync),
                "composed": timed(lambda: composed.forward_from_cache(h), setting.inner, sync),
            },
            setting.ensemble_repeats,
            on_sample=reporter(progress, "ensemble", setting.ensemble_repeats),
        )
        comp_err = float((composed.forward_from_cache(h) - ensemble()).abs().max())
        j = int(torch.randint(0, n, (1,), generator=gen))
        removed = remove_component(mean, deltas[j], n)
        direct = compose(deltas[:j] + deltas[j + 1 :])
        delta_err = max(float((removed[name] - direct[name]).abs().max()) for name in direct)
        member.set_delta(removed)
        logits_removed = member.forward_from_cache(h)
        member.set_delta(direct)
        logits_err = float((logits_removed - member.forward_from_cache(h)).abs().max())
        logits_scale = float(composed.forward_from_cache(h).abs().max())
    return {
        "ratios": {
            **{key: runs.ratio(*p) for key, p in pair.items()},
            **{key: runs_e.ratio(*p) for key, p in pair_e.items()},
        },
        "absolute": {
            "single_inference_s": runs.median("single"),
            "composed_inference_s": runs.median("composed"),
            "ensemble_inference_s": runs_e.median("ensemble"),
            "compose_s": statistics.median(compose_s),
        },
        "errors": {
            "composition_max_abs_err": comp_err,
            "unlearning_max_abs_err": max(delta_err, logits_err),
            "unlearning_delta_max_abs_err": delta_err,
            "unlearning_logits_max_abs_err": logits_err,
            "logits_max_abs": logits_scale,
        },
        "removed_component": j,
        "timings": {
            "compose_samples_s": compose_s,
            "single_vs_composed": group_runs(runs, pair),
            "ensemble_vs_composed": group_runs(runs_e, pair_e),
        },
    }


def measure_unlearning(
    backbone: Any, images: Any, labels: Any, setting: Setting, device: str, progress: Progress
) -> dict[str, Any]:
    """Forget one sample: full retrain (all data but it) vs shard retrain vs subtraction (Fig. 1(c))."""
    import torch

    from core.tangent.baselines import forget_by_retraining, forget_by_subtraction
    from core.tangent.compose import compose
    from core.tangent.experiments import make_head
    from core.tangent.model import TangentModel
    from core.tangent.shards import ShardIndex
    from core.tangent.train import TangentTrainConfig, train_tangent

    k = setting.k[0]
    head = make_head(backbone.config.hidden_size, setting.num_classes, setting.seed).to(device)

    def make_model() -> Any:
        return TangentModel(backbone, setting.num_classes, k=k, head=copy.deepcopy(head))

    probe = make_model()
    n = setting.train_n
    t0 = time.perf_counter()
    cached = probe.cache_frozen(images[:n].to(device), batch_size=64)  # (n, N, D)
    cache_s = time.perf_counter() - t0
    y = labels[:n].to(device)
    index = ShardIndex.from_split(n, setting.n_shards, seed=setting.seed)
    gen = torch.Generator().manual_seed(setting.seed + 11)
    sample = int(torch.randint(0, n, (1,), generator=gen))
    keep = torch.cat([torch.arange(sample), torch.arange(sample + 1, n)]).to(device)
    cfg = TangentTrainConfig(epochs=setting.train_epochs, batch_size=setting.train_batch, seed=setting.seed)
    deltas = [random_delta(probe, setting.delta_std, gen) for _ in range(setting.n_shards)]
    composed = compose(deltas)
    sync = sync_fn(device)

    def full() -> None:
        train_tangent(make_model(), cached[keep], y[keep], cfg)

    def shard() -> None:
        forget_by_retraining(make_model, cached, y, index, sample, cfg)

    def subtract() -> None:
        forget_by_subtraction(composed, deltas, index, sample)

    progress.print(
        f"[bold]unlearning[/]: forget sample {sample} of {n} ({setting.n_shards} shards, "
        f"{setting.train_epochs} epochs, cache {cache_s:.1f} s), {setting.train_repeats} rounds"
    )
    pairs = {
        "full_retrain_over_unlearn_time": ("full_retrain", "shard_retrain"),
        "full_retrain_over_subtraction_time": ("full_retrain", "subtraction"),
    }
    runs = interleave(
        {
            "full_retrain": timed(full, 1, sync),
            "shard_retrain": timed(shard, 1, sync),
            "subtraction": timed(subtract, 1, sync),
        },
        setting.train_repeats,
        on_sample=reporter(progress, "unlearn", setting.train_repeats),
    )
    return {
        "ratios": {key: runs.ratio(*p) for key, p in pairs.items()},
        "absolute": {
            "full_retrain_s": runs.median("full_retrain"),
            "shard_retrain_s": runs.median("shard_retrain"),
            "subtraction_s": runs.median("subtraction"),
            "cache_features_s": cache_s,
        },
        "forgotten_sample": sample,
        "shard_size": int(index.shards[index.shard_of(sample)].numel()),
        "timings": group_runs(runs, pairs),
    }
