"""``privbench bench recbole-sasrec``: the peer check of the non-private baselines (issue 17). RecBole 1.2.1's own
SASRec, trained by RecBole on its bundled MovieLens-100k under the protocol of privbench's ``train-dp`` stage, its
best checkpoint scored both by RecBole and by privbench's own evaluation, so that our non-private Transformer's test
NDCG@10 can be held against a standard peer's under each of the stage's two protocols.

Protocol (both sides): the 5-core of ml-100k (users and items with >= 5 interactions, filtered until none is
left: RecBole's ``user_inter_num_interval`` / ``item_inter_num_interval`` ``[5,inf)``, privbench's
``prepare.datasets[].min_interactions: 5``), each user's items in time order (``order: TO``; equal timestamps in
file order on both sides, see :mod:`privbench.bench.recbole_worker`), leave-one-out (``split: {LS:
valid_and_test}``: the last item is the test target, the one before it the validation target), inputs cut to the
last ``max_len`` = 50 items, full ranking over every item, NDCG@10 and Hit@10. The worker checks, before training,
that RecBole's validation and test example of every user (inputs and target) and its items are privbench's.

What RecBole's own figures are: RecBole's full-sort evaluation masks the user's earlier items only for
non-sequential models. For a sequential model such as SASRec, ``FullSortEvalDataLoader.collate_fn`` returns no
history index and ``Trainer._full_sort_batch_eval`` sets only the padding item's score to -inf, so RecBole's
``test_ndcg_at_10`` ranks the user's earlier items with the rest: privbench's history-ranked protocol
(``ndcg_at_10``), not its masked one, with ties in whatever order ``torch.topk`` returns them. privbench's scoring of
the same checkpoint (``core.metrics.rank_of_target``, pessimistic ties, as ``train-dp``) gives both protocols:
``*_ranked_ours`` (the user's earlier items compete: ``train-dp``'s ``ndcg_at_10``) and ``*_masked_ours`` (they are
excluded, ``SequentialDataset.history_mask``: ``train-dp``'s ``ndcg_at_10_masked``).

Model and training (RecBole's SASRec with our shape): d = 64, 2 blocks, **1 head** (as privbench's Transformer;
RecBole's default is 2), feed-forward 256, hidden and attention dropout 0.2 (privbench's MovieLens dropout),
cross-entropy over all items (``loss_type: CE``, no negative sampling), RecBole's defaults otherwise: Adam, lr
1e-3, batch 2,048 (one training example per prefix: RecBole's sequence augmentation), no weight decay. Early
stopping on RecBole's VALIDATION NDCG@10 (history ranked) every epoch (``stopping_step`` 10: training ends after 11
validations without a new best), all test figures of that one best validation checkpoint; the test split is never
used to select. (``train-dp`` selects each protocol's best epoch on that protocol's validation NDCG@10; here both
protocols' figures come from the checkpoint RecBole selected.)

Profiles (:data:`PROFILES`): ``paper`` is the protocol above, up to 300 epochs, one seed per run (run again with
``--set recbole.seed=1`` ... for more: each run is one replicate in the store, pooled by seed); ``quick`` checks
the wiring in a few minutes: the first 150 users of the file, 3 epochs. ``--set recbole.KEY=VALUE`` overrides any
field of :class:`Setting` (``epochs``, ``users``, ``seed``, ...), validated before anything runs.

RecBole runs in a fresh worker process (:mod:`privbench.bench.recbole_worker` through ``privbench.bench._worker``,
``PRIVBENCH_BENCH_THREADS`` threads), offline, on ``recbole.device``: ``auto`` (the default) trains on the GPU when
torch sees one, else on the CPU; ``cpu`` and ``cuda`` force one (``cuda`` without a GPU is refused before anything
runs). The device changes how long a run takes, not the protocol; the JSON's ``setting.device`` and ``trained_on``
say where it ran. RecBole reads the rows of its bundled ``ml-100k.inter`` (the first ``users`` users where the
setting says so) from a temporary folder, as the dataset ``ml-100k-all`` or ``ml-100k-first<N>``, each timestamp
replaced by its rank in time order (:func:`privbench.bench.recbole_worker.write_inter_file`); it writes nothing
else (``save_dataset`` off). Checkpoints go to a temporary folder, removed afterwards. The shims RecBole needs on
numpy 2 / torch 2.13 are in :mod:`privbench.bench.recbole_compat` and live only in that process.

JSON (and the run's metrics): RecBole's own figures ``test_ndcg_at_10``, ``test_hit_at_10``, ``valid_ndcg_at_10``,
``valid_hit_at_10`` (history ranked, at the best epoch); privbench's scoring of the same checkpoint
``{valid,test}_{ndcg,hit}_at_10_{ranked,masked}_ours`` and ``{valid,test}_target_ties_ours`` (users whose target
ties another candidate's score, where the tie rules differ); ``best_epoch`` (1-based), ``epochs_run``, ``train_s``
(training and validation), ``eval_s`` (RecBole's test), ``eval_ours_s`` (privbench's scoring, both splits),
``data.{users, items, interactions}`` (after the 5-core), ``valid_curve`` and ``train_loss`` (per epoch; lists: in
the artifact only), ``stopped_early``, ``trained_on``; ``setting`` (the run's config) holds the seed and the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from core.errors import ConfigError
from pbconfig.base import FrozenConfig, require_heads_divide
from pbconfig.benchmark import with_overrides
from privbench.bench.harness import Progress, bench_threads, register, run_in_fresh_process

NAME = "recbole-sasrec"
DATASET = "ml-100k"
SECTION = "recbole"  # --set recbole.epochs=2
WORKER_TARGET = "privbench.bench.recbole_worker:train_and_test"
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
        require_heads_divide(self, "hidden_size", "n_heads")
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
    """The name of the dataset the worker writes for RecBole: ``ml-100k-all``, or ``ml-100k-first<N>`` for the first
    ``N`` users (never ``ml-100k``, which RecBole would read from its bundled folder)."""
    return f"{DATASET}-all" if setting.users is None else f"{DATASET}-first{setting.users}"


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
    explicitly: the worker's dataset (another name than ``ml-100k``) gets RecBole's generic dataset defaults."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"RecBole device {device!r} is not cpu or cuda")
    interval = f"[{setting.kcore},inf)"
    return {
        "data_path": data_path,  # where the worker writes the dataset (recbole_dataset)
        "field_separator": "\t",
        "USER_ID_FIELD": "user_id",
        "ITEM_ID_FIELD": "item_id",
        "TIME_FIELD": "timestamp",
        "normalize_all": False,  # the timestamps are ranks (recbole_worker.write_inter_file), exact in float32
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
        "protocol": (
            "leave-one-out, time order (equal timestamps in file order), full ranking over every item; RecBole's own "
            "test_ndcg_at_10 ranks the user's history, privbench's scoring of the same checkpoint both ranks it "
            "(*_ranked_ours) and masks it (*_masked_ours), pessimistic ties"
        ),
        "device": device,
        "threads": bench_threads(),
    }


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    setting = resolve_setting(profile, options)
    return _setting_json(setting, options, resolve_device(setting))


@register(
    NAME,
    "the peer check: RecBole 1.2.1's own SASRec on its bundled ml-100k under the train-dp protocol "
    "(leave-one-out, full ranking, L 50, d 64, 2 blocks), early stopping on validation, its best checkpoint scored by "
    "RecBole (history ranked) and by privbench (history ranked and masked)",
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
    progress.print(
        f"  privbench's scoring: test NDCG@10 {out['test_ndcg_at_10_ranked_ours']:.4f} history ranked, "
        f"{out['test_ndcg_at_10_masked_ours']:.4f} masked (HIT@10 {out['test_hit_at_10_ranked_ours']:.4f} / "
        f"{out['test_hit_at_10_masked_ours']:.4f})"
    )
    return {"setting": _setting_json(setting, options, device), **out}
