"""Table 3 of the tangent stage: DP-SGD fine-tuning of one regime's tangent ("Ours") or original ("Reg") parameters
at every epsilon, each column with App. A's recipe and its own (lr, PT) chosen on validation data.

One task per (regime, column) runs the search of :mod:`core.tangent.dp_search` (on a validation part carved from
the DP training images, never the test set; at every epsilon, or once at ``dp.search_epsilon``), retrains the
chosen point on all the DP training images at each epsilon and records one run per (regime, column, epsilon) cell
(technique ``dp-<regime>``, tag ``privbench.parameters`` = ``ours``/``reg``) with its privacy ledger, the chosen
``lr`` and ``pretrained`` (PT) in its config and metrics, and the search's validation accuracies (``tuning.*``) and
privacy cost under basic composition (``epsilon_with_tuning``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prefect import task
from torch import Tensor, nn

from core.dp.accounting import default_delta
from core.errors import ConfigError, DataError, PrivbenchError
from core.tangent import experiments as X
from core.tangent.dp_search import DPPoint, DPSearch, dp_train_config, search_dp, search_grid, validation_split
from core.tangent.train import DP_NEIGHBOURING, DP_PRIVACY_UNIT, TangentTrainConfig
from pbconfig.tangent import TangentConfig, TangentDPConfig
from storage.recording import Recorder, RunRef
from tasks.records import RESUMABLE, task_record
from tasks.tangent import config_json, load_backbone, load_features, record_epochs, record_search, set_threads
from tasks.tangent_inputs import TangentInputs

# the search's runs draw their noise from the stage seed + this, the final runs from the stage seed itself
SEARCH_SEED_OFFSET = 1


def dp_images(dp: TangentDPConfig, inputs: TangentInputs) -> int:
    """How many training images (the first ones) the DP cells train on."""
    return inputs.n_train if dp.n_train is None else min(dp.n_train, inputs.n_train)


def check_dp(cfg: TangentConfig, inputs: TangentInputs) -> None:
    """Refuse a DP section the training set cannot serve before anything trains: more images than there are, a
    Poisson batch larger than the DP training set, or a validation part that would leave either side empty."""
    dp = cfg.dp
    if dp is None:
        return
    if dp.n_train is not None and dp.n_train > inputs.n_train:
        raise DataError(
            f"tangent.dp.n_train={dp.n_train} exceeds the {inputs.n_train} training images; lower it "
            "or leave it null for all"
        )
    n = dp_images(dp, inputs)
    if dp.batch_size is not None and dp.batch_size > n:
        raise DataError(
            f"tangent.dp.batch_size={dp.batch_size} exceeds the {n} DP training images; lower it, or use "
            "full_batch: true (every step takes them all)"
        )
    if dp.search_points > 1:
        validation_split(n, dp.val_fraction, cfg.seed)


@dataclass(frozen=True)
class DPColumn:
    """One column ("Ours" or "Reg") of one regime and what its runs read: the DP training images ``h, y`` (the
    first ``n`` training images), the test set, the backbone and the stage's head, and the delta of the images."""

    regime: str
    tangent: bool
    cfg: TangentConfig
    dp: TangentDPConfig
    backbone: nn.Module
    head: nn.Linear
    h: Tensor
    y: Tensor
    test_h: Tensor
    test_y: Tensor
    delta: float

    @property
    def kind(self) -> str:
        return "ours" if self.tangent else "reg"

    def schedule(self, n: int, lr: float, seed: int) -> TangentTrainConfig:
        """DP-SGD on ``n`` of the DP images: full batch, or Poisson at the whole DP set's sample rate."""
        batch = None if self.dp.full_batch else self.dp.batch_size
        return dp_train_config(n, epochs=self.dp.epochs, lr=lr, seed=seed, batch_size=batch, n_full=self.h.shape[0])

    def search(self, epsilon: float) -> DPSearch:
        """The (lr, PT) search at ``epsilon`` on the fitting/validation split of the DP images (the final runs'
        sample rate and steps on the fitting part, noise from the stage seed + :data:`SEARCH_SEED_OFFSET`)."""
        dp, seed = self.dp, self.cfg.seed
        fit, val = validation_split(self.h.shape[0], dp.val_fraction, seed)
        return search_dp(
            self.backbone,
            self.head,
            (self.h[fit], self.y[fit]),
            (self.h[val], self.y[val]),
            search_grid(dp.lrs, dp.pts),
            regime=self.regime,
            tangent=self.tangent,
            cfg=self.schedule(fit.numel(), dp.lrs[0], seed + SEARCH_SEED_OFFSET),
            target_epsilon=epsilon,
            clip_norm=dp.clip_norm,
            init_seed=seed,
            k=self.cfg.k,
            delta=self.delta,
            accountant=dp.accountant,
            batch_size=self.cfg.eval_batch_size,
            reg_start=dp.reg_start,
        )

    def final(self, rec: Recorder, epsilon: float, point: DPPoint, tcfg: TangentTrainConfig) -> dict[str, Any]:
        """Train the cell at ``point`` on all the DP training images, evaluate it on the test set, record it."""
        dp = self.dp
        cell = X.dp_regime_cell(
            self.backbone,
            self.head,
            self.h,
            self.y,
            self.test_h,
            self.test_y,
            regime=self.regime,
            tangent=self.tangent,
            cfg=tcfg,
            target_epsilon=epsilon,
            clip_norm=dp.clip_norm,
            k=self.cfg.k,
            delta=self.delta,
            accountant=dp.accountant,
            batch_size=self.cfg.eval_batch_size,
            reg_start=dp.reg_start,
            pretrained=point.pretrained,
            init_seed=self.cfg.seed,
        )
        if not math.isfinite(cell.test_accuracy):
            raise DataError(f"DP {self.regime} {self.kind} eps={epsilon}: accuracy is not finite")
        rec.ledger(cell.ledger, unit=DP_PRIVACY_UNIT, neighbouring=DP_NEIGHBOURING)
        record_epochs(rec, cell.stats)
        result = {
            "regime": self.regime,
            "parameters": self.kind,
            "target_epsilon": epsilon,
            "test_accuracy": cell.test_accuracy,
            "epsilon": cell.ledger.epsilon,
            "noise_multiplier": cell.ledger.noise_multiplier,
            "sample_rate": cell.ledger.sample_rate,
            "steps": cell.ledger.steps,
            "train_s": cell.stats.seconds,
            "trainable_parameters": cell.trainable,
            "lr": point.lr,
        }
        rec.metrics({k: v for k, v in result.items() if isinstance(v, int | float)}, units={"train_s": "s"})
        rec.metric("pretrained", float(point.pretrained))
        return result | {"pretrained": point.pretrained}


def _record_search(rec: Recorder, search: DPSearch, epsilon: float, delta: float, ran_here: bool) -> dict[str, Any]:
    """The search behind a cell (:func:`tasks.tangent.record_search`) and the privacy of the search and this run
    together under basic composition; its wall seconds in the cell that ran it."""
    extra = {
        "epsilon_with_tuning": search.epsilon_with_tuning(epsilon),
        "delta_with_tuning": (search.points + 1) * delta,
    }
    return record_search(rec, search, ran_here=ran_here, extra=extra)


@task(name="tangent-table3", **RESUMABLE)
def train_dp_regime(
    regime: str, tangent: bool, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef
) -> list[dict[str, Any]]:
    """Table 3, one column of one regime at every epsilon of ``cfg.dp`` (one recorded run each, in epsilon order):
    DP-SGD (:func:`core.tangent.experiments.dp_regime_cell`) of the tangent ("Ours", ``tangent=True``) or original
    ("Reg") parameters at the (lr, PT) the search chose for this column on validation data (the one point when the
    grid has one), trained on all the DP training images and evaluated on the test set."""
    if cfg.dp is None:
        raise ConfigError("tangent.dp is not set; add a dp section to run Table 3")
    set_threads(cfg)
    dp = cfg.dp
    f = load_features(inputs.features_path)
    n = dp_images(dp, inputs)
    backbone = load_backbone(inputs.model_path)
    col = DPColumn(
        regime=regime,
        tangent=tangent,
        cfg=cfg,
        dp=dp,
        backbone=backbone,
        head=X.make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed),
        h=f["train_h"][:n],
        y=f["train_y"][:n],
        test_h=f["test_h"],
        test_y=f["test_y"],
        delta=dp.delta if dp.delta is not None else default_delta(n),
    )
    grid = search_grid(dp.lrs, dp.pts)
    search: DPSearch | None = None
    results = []
    for epsilon in dp.epsilons:
        base = {
            "regime": regime,
            "parameters": col.kind,
            "target_epsilon": epsilon,
            "n_train": n,
            "k": cfg.k,
            "clip_norm": dp.clip_norm,
            "accountant": dp.accountant,
            "delta": dp.delta,
            "reg_start": dp.reg_start,
            "full_batch": dp.full_batch,
        }
        if len(grid) > 1:
            base |= {
                "search_grid": [[p.lr, p.pretrained] for p in grid],
                "val_fraction": dp.val_fraction,
                "search_epsilon": dp.search_epsilon if dp.search_epsilon is not None else epsilon,
            }
        record = {"parent": parent, "technique": f"dp-{regime}", "dataset": cfg.dataset}
        run_name = f"DP {regime} {col.kind} eps={epsilon:g}"
        ran_here = len(grid) > 1 and (search is None or dp.search_epsilon is None)
        if ran_here:
            try:
                search = col.search(dp.search_epsilon if dp.search_epsilon is not None else epsilon)
            except PrivbenchError:
                with task_record(**record, config=base, run_name=run_name):  # the cell that needed it fails with it
                    raise
        point = search.point if search is not None else grid[0]
        tcfg = col.schedule(n, point.lr, cfg.seed)
        config = base | {"pretrained": point.pretrained, **config_json(tcfg)}
        with task_record(**record, config=config, run_name=run_name) as rec:
            rec.tag("privbench.result_group", "table3")
            rec.tag("privbench.parameters", col.kind)
            result = col.final(rec, epsilon, point, tcfg)
            if search is not None:
                result |= _record_search(rec, search, epsilon, col.delta, ran_here)
        results.append(result)
    return results
