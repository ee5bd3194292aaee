"""``privbench bench recbole-sasrec``: the peer check of the non-private baselines (issue 17). RecBole 1.2.1's own
SASRec, trained and evaluated by RecBole on its bundled MovieLens-100k under the protocol of privbench's
``train-dp`` stage, so that our non-private Transformer's test NDCG@10 can be held against a standard peer's.

Protocol (both sides): the 5-core of ml-100k (users and items with >= 5 interactions, filtered until none is
left: RecBole's ``user_inter_num_interval`` / ``item_inter_num_interval`` ``[5,inf)``, privbench's
``prepare.datasets[].min_interactions: 5``), each user's items in time order (``order: TO``), leave-one-out
(``split: {LS: valid_and_test}``: the last item is the test target, the one before it the validation target),
inputs cut to the last ``max_len`` = 50 items, full ranking over every item with the user's earlier items masked
(RecBole's full-sort protocol; privbench's ``*_masked`` metrics), NDCG@10 and Hit@10.

Model and training (RecBole's SASRec with our shape): d = 64, 2 blocks, **1 head** (as privbench's Transformer;
RecBole's default is 2), feed-forward 256, hidden and attention dropout 0.2 (privbench's MovieLens dropout),
cross-entropy over all items (``loss_type: CE``, no negative sampling), RecBole's defaults otherwise: Adam, lr
1e-3, batch 2,048 (one training example per prefix: RecBole's sequence augmentation), no weight decay. Early
stopping on VALIDATION NDCG@10 every epoch (``stopping_step`` 10: training ends after 11 validations without a
new best), test metrics of the best validation checkpoint; the test split is never used to select.

Profiles (:data:`PROFILES`): ``paper`` is the protocol above, up to 300 epochs, one seed per run (run again with
``--set recbole.seed=1`` ... for more: each run is one replicate in the store, pooled by seed); ``quick`` checks
the wiring in a few minutes: the first 150 users of the file, 3 epochs. ``--set recbole.KEY=VALUE`` overrides any
field of :class:`Setting` (``epochs``, ``users``, ``seed``, ...), validated before anything runs.

RecBole runs in a fresh worker process (``privbench.bench._worker``, ``PRIVBENCH_BENCH_THREADS`` threads), offline,
on ``recbole.device``: ``auto`` (the default) trains on the GPU when torch sees one, else on the CPU; ``cpu`` and
``cuda`` force one (``cuda`` without a GPU is refused before anything runs). The device changes how long a run
takes, not the protocol; the JSON's ``setting.device`` and ``trained_on`` say where it ran.
For the dataset named ``ml-100k`` RecBole always reads its own bundled folder
(``recbole/dataset_example/ml-100k``, whatever ``data_path`` says) and writes nothing there (``save_dataset``
off), so the full dataset is read in place; a ``users`` subsample is written to a temporary folder as the dataset
``ml-100k-first<N>`` with the same settings. Checkpoints go to a temporary folder, removed afterwards. The shims
RecBole needs on numpy 2 / torch 2.13 are in :mod:`privbench.bench.recbole_compat` and live only in that process.

JSON (and the run's metrics): ``test_ndcg_at_10``, ``test_hit_at_10``, ``valid_ndcg_at_10``,
``valid_hit_at_10`` (at the best epoch), ``best_epoch`` (1-based), ``epochs_run``, ``train_s`` (training and
validation), ``eval_s``, ``data.{users, items, interactions}`` (after the 5-core), ``valid_curve`` and
``train_loss`` (per epoch; lists: in the artifact only), ``stopped_early``, ``trained_on``; ``setting`` (the run's
config) holds the seed and the device.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from core.errors import ConfigError
from pbconfig.base import FrozenConfig
from pbconfig.benchmark import with_overrides
from privbench.bench.harness import Progress, bench_threads, register, run_in_fresh_process

NAME = "recbole-sasrec"
DATASET = "ml-100k"
SECTION = "recbole"  # --set recbole.epochs=2
WORKER_TARGET = "privbench.bench.recbole_sasrec:train_and_test"
RECBOLE_VERSION = "1.2.1"


class Setting(FrozenConfig):
    """One RecBole SASRec run: the protocol (module docstring), the schedule cap and the seed."""

    seed: int = Field(0, ge=0)
    epochs: int = Field(ge=1)  # the cap: early stopping on validation usually ends sooner
    stopping_step: int = Field(10, ge=1)  # validations without a new best before stopping (RecBole's semantics)
    users: int | None = Field(None, ge=10)  # keep the first N users of the file before the k-core (None: all 943)
    kcore: int = Field(5, ge=1)
    max_len: int = Field(50, ge=1)
    hidden_size: int = Field(64, ge=1)
    inner_size: int = Field(256, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(1, ge=1)
    dropout: float = Field(0.2, ge=0.0, lt=1.0)  # hidden and attention dropout
    learning_rate: float = Field(0.001, gt=0.0, allow_inf_nan=False)
    train_batch_size: int = Field(2048, ge=1)
    eval_batch_size: int = Field(4096, ge=1)
    timeout_s: float = Field(gt=0.0, allow_inf_nan=False)  # the worker is killed after this
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when torch sees a GPU, else CPU

    @model_validator(mode="after")
    def _heads_divide(self) -> Setting:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of n_heads={self.n_heads}")
        return self


class _Overridable(FrozenConfig):
    """``--set recbole.KEY=VALUE`` addresses the setting under the section name ``recbole``."""

    recbole: Setting


PROFILES: dict[str, Setting] = {
    "quick": Setting(epochs=3, users=150, timeout_s=1800.0),
    "paper": Setting(epochs=300, timeout_s=172800.0),
}


def resolve_setting(profile: str, options: Mapping[str, Any]) -> Setting:
    """The profile's setting with ``options["overrides"]`` (``--set recbole.KEY=VALUE``) applied; ConfigError
    naming the bad key or value."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join(PROFILES)}")
    overrides = tuple(options.get("overrides") or ())
    if not overrides:
        return PROFILES[profile]
    return with_overrides(_Overridable(recbole=PROFILES[profile]), overrides, example=f"{SECTION}.epochs=2").recbole


def recbole_dataset(setting: Setting) -> str:
    """The dataset name RecBole gets: ``ml-100k`` (its bundled folder) or ``ml-100k-first<N>`` (a subsample)."""
    return DATASET if setting.users is None else f"{DATASET}-first{setting.users}"


def resolve_device(setting: Setting) -> str:
    """``cpu`` or ``cuda``: the setting's device, ``auto`` resolved by what torch sees. ConfigError for ``cuda``
    where no GPU is visible (RecBole itself would fall back to the CPU without a word)."""
    import torch

    available = torch.cuda.is_available()
    if setting.device == "auto":
        return "cuda" if available else "cpu"
    if setting.device == "cuda" and not available:
        raise ConfigError("recbole.device=cuda but torch sees no GPU on this machine; use recbole.device=cpu (or auto)")
    return setting.device


def recbole_config(setting: Setting, data_path: str, checkpoint_dir: str, device: str = "cpu") -> dict[str, Any]:
    """RecBole's ``config_dict`` for ``setting``: the protocol of the module docstring, on ``device`` (``cpu`` or
    ``cuda``: RecBole's first visible GPU), offline. The keys of RecBole's ``ml-100k.yaml`` that matter are given
    explicitly, so a subsample (another dataset name, which gets RecBole's generic dataset defaults) is read the
    same way."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"RecBole device {device!r} is not cpu or cuda")
    interval = f"[{setting.kcore},inf)"
    return {
        "data_path": data_path,  # ignored by RecBole for the dataset named ml-100k (its bundled folder)
        "field_separator": "\t",
        "USER_ID_FIELD": "user_id",
        "ITEM_ID_FIELD": "item_id",
        "TIME_FIELD": "timestamp",
        "normalize_all": True,  # min-max scales the timestamps (order kept), as ml-100k.yaml does
        "checkpoint_dir": checkpoint_dir,
        # RecBole picks CUDA whenever gpu_id is set and a GPU is visible (and sets CUDA_VISIBLE_DEVICES to it)
        "gpu_id": "0" if device == "cuda" else "",
        "use_gpu": device == "cuda",
        "seed": setting.seed,
        "reproducibility": True,
        "show_progress": False,
        "save_dataset": False,
        "save_dataloaders": False,
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
        "user_inter_num_interval": interval,
        "item_inter_num_interval": interval,
        "eval_args": {"split": {"LS": "valid_and_test"}, "order": "TO", "group_by": "user", "mode": "full"},
        "MAX_ITEM_LIST_LENGTH": setting.max_len,
        "hidden_size": setting.hidden_size,
        "inner_size": setting.inner_size,
        "n_layers": setting.n_layers,
        "n_heads": setting.n_heads,
        "hidden_dropout_prob": setting.dropout,
        "attn_dropout_prob": setting.dropout,
        "loss_type": "CE",
        "train_neg_sample_args": None,
        "learning_rate": setting.learning_rate,
        "train_batch_size": setting.train_batch_size,
        "eval_batch_size": setting.eval_batch_size,
        "epochs": setting.epochs,
        "eval_step": 1,
        "stopping_step": setting.stopping_step,
        "metrics": ["NDCG", "Hit"],
        "topk": [10],
        "valid_metric": "NDCG@10",
        "metric_decimal_place": 8,
    }


def _setting_json(setting: Setting, options: Mapping[str, Any], device: str) -> dict[str, Any]:
    return {
        **setting.model_dump(mode="json"),
        "overrides": list(options.get("overrides") or ()),
        "model": "SASRec",
        "recbole": RECBOLE_VERSION,
        "dataset": DATASET,
        "protocol": "leave-one-out, time order, full ranking with the user's history masked (RecBole)",
        "device": device,
        "threads": bench_threads(),
    }


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    setting = resolve_setting(profile, options)
    return _setting_json(setting, options, resolve_device(setting))


@register(
    NAME,
    "the peer check: RecBole 1.2.1's own SASRec on its bundled ml-100k under the train-dp protocol "
    "(leave-one-out, full ranking, history masked, L 50, d 64, 2 blocks), early stopping on validation",
    options=("overrides",),
    setting=_config,
    dataset=DATASET,
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    setting = resolve_setting(profile, options)
    device = resolve_device(setting)
    threads = bench_threads()
    who = "all users" if setting.users is None else f"the first {setting.users} users"
    progress.print(
        f"[bold]{NAME}[/] ({profile}): RecBole {RECBOLE_VERSION} SASRec on {DATASET} ({who}, {setting.kcore}-core), "
        f"L={setting.max_len} d={setting.hidden_size} {setting.n_layers} blocks {setting.n_heads} head(s), "
        f"up to {setting.epochs} epochs (stop after {setting.stopping_step} without a better validation NDCG@10), "
        f"seed {setting.seed}, {device}, {threads} threads"
    )
    out = run_in_fresh_process(
        WORKER_TARGET,
        {"setting": setting.model_dump(mode="json"), "threads": threads, "device": device},
        label=f"RecBole SASRec (seed {setting.seed})",
        timeout=setting.timeout_s,
        threads=threads,
    )
    progress.print(
        f"  test NDCG@10 {out['test_ndcg_at_10']:.4f}  HIT@10 {out['test_hit_at_10']:.4f}  (valid NDCG@10 "
        f"{out['valid_ndcg_at_10']:.4f} at epoch {out['best_epoch']} of {out['epochs_run']}, {out['train_s']:.0f} s)"
    )
    return {"setting": _setting_json(setting, options, device), **out}


# ------------------------------------------------------------------------------------------ worker side


def write_inter_file(source: Path, target: Path, users: int) -> None:
    """Copy RecBole's atomic ``.inter`` file, keeping only the first ``users`` distinct users (file order)."""
    kept: set[str] = set()
    with source.open(encoding="utf-8") as src, target.open("w", encoding="utf-8") as dst:
        dst.write(src.readline())  # the header: user_id:token item_id:token rating:float timestamp:float
        for line in src:
            user = line.split("\t", 1)[0]
            if user not in kept and len(kept) < users:
                kept.add(user)
            if user in kept:
                dst.write(line)


def train_and_test(*, setting: dict[str, Any], threads: int, device: str = "cpu") -> dict[str, Any]:
    """Worker side: train RecBole's SASRec with early stopping on validation, test the best checkpoint."""
    from privbench.bench import recbole_compat

    stubbed = recbole_compat.install()
    import warnings

    import torch

    warnings.filterwarnings("ignore", module=r"recbole\.")  # pandas 3 / torch deprecation notices inside RecBole
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_seed

    from core.data import recbole_ml100k_path

    s = Setting.model_validate(setting)
    torch.set_num_threads(int(threads))
    name = recbole_dataset(s)
    folder = Path(tempfile.mkdtemp(prefix="privbench-recbole-"))
    try:
        if s.users is not None:
            (folder / "data" / name).mkdir(parents=True)
            write_inter_file(recbole_ml100k_path(), folder / "data" / name / f"{name}.inter", s.users)
        with recbole_compat.no_command_line():
            config = Config(
                model="SASRec",
                dataset=name,
                config_dict=recbole_config(s, str(folder / "data"), str(folder / "saved"), device),
            )
        init_seed(config["seed"], config["reproducibility"])
        dataset = create_dataset(config)
        train_data, valid_data, test_data = data_preparation(config, dataset)
        init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
        model = SASRec(config, train_data.dataset).to(config["device"])
        trainer = Trainer(config, model)
        curve: list[float] = []
        t0 = time.perf_counter()
        best_valid, best_result = trainer.fit(
            train_data, valid_data, verbose=False, saved=True, callback_fn=lambda _e, score: curve.append(score)
        )
        train_s = time.perf_counter() - t0
        # torch >= 2.6 loads weights only; RecBole's checkpoint (written just now by this run) pickles its Config
        checkpoint = torch.load(trainer.saved_model_file, map_location="cpu", weights_only=False)
        model.load_state_dict(checkpoint["state_dict"])
        t1 = time.perf_counter()
        test = trainer.evaluate(test_data, load_best_model=False, show_progress=False)
        eval_s = time.perf_counter() - t1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    epochs_run = len(trainer.train_loss_dict)
    return {
        "test_ndcg_at_10": float(test["ndcg@10"]),
        "test_hit_at_10": float(test["hit@10"]),
        "valid_ndcg_at_10": float(best_valid),
        "valid_hit_at_10": float(best_result["hit@10"]),
        "best_epoch": int(checkpoint["epoch"]) + 1,
        "epochs_run": epochs_run,
        "stopped_early": epochs_run < s.epochs,
        "train_s": train_s,
        "eval_s": eval_s,
        "data": {
            "users": int(dataset.user_num - 1),  # RecBole counts the padding id
            "items": int(dataset.item_num - 1),
            "interactions": int(dataset.inter_num),
        },
        "valid_curve": [float(v) for v in curve],
        "train_loss": [float(v) if math.isfinite(v) else None for v in trainer.train_loss_dict.values()],
        "stubbed_modules": stubbed,
        "trained_on": str(config["device"]),  # what RecBole really used (torch.device)
    }
