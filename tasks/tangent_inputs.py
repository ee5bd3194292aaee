"""What the tangent stage's tasks pass each other (:class:`TangentInputs`, :class:`ShardJob`) and the core training
config of each method (:func:`train_config`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.tangent.train import TangentTrainConfig
from pbconfig.tangent import TangentConfig


@dataclass(frozen=True)
class TangentInputs:
    """What every tangent task needs, by path: the prepared images and model, the cached features, and
    the flow run's folder for trained deltas and shard models."""

    images_path: str
    model_path: str
    features_path: str
    workdir: str
    n_classes: int
    n_train: int
    n_test: int


@dataclass(frozen=True)
class ShardJob:
    """Train one model on one shard: ``kind`` is ``taft`` or ``nlft``; shard ``index`` of ``n_shards``."""

    kind: str
    n_shards: int
    index: int

    @property
    def technique(self) -> str:
        return f"{self.kind}-shard"


def shortened(tcfg: TangentTrainConfig, epochs: int) -> TangentTrainConfig:
    """``tcfg`` trained for ``epochs`` instead (e.g. the membership audit's shorter TAFT composition), keeping the
    learning-rate milestones that still fall inside the shorter schedule (``[5, 8]`` at 3 epochs: none)."""
    return replace(tcfg, epochs=epochs, lr_milestones=tuple(m for m in tcfg.lr_milestones if m < epochs))


def train_config(cfg: TangentConfig, kind: str) -> TangentTrainConfig:
    """The core training config of a method: TAFT uses the stage's loss (RSL, eq. 2) and ``lr``; NLFT and FC
    use cross-entropy with ``nlft_lr`` / ``fc_lr`` (App. A); all share epochs, batch size, ridge and seed."""
    if kind == "taft":
        return TangentTrainConfig(
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            loss=cfg.loss,
            alpha=cfg.alpha,
            kappa=cfg.kappa,
            ridge=cfg.ridge,
            ball_radius=cfg.ball_radius,
            seed=cfg.seed,
            lr_milestones=tuple(cfg.lr_milestones),
        )
    epochs = cfg.nlft_epochs or cfg.epochs
    lr = cfg.nlft_lr if kind == "nlft" else cfg.fc_lr
    milestones = tuple(m for m in cfg.lr_milestones if m < epochs)
    return TangentTrainConfig(
        epochs=epochs,
        batch_size=cfg.batch_size,
        lr=lr,
        loss="ce",
        ridge=cfg.ridge,
        seed=cfg.seed,
        lr_milestones=milestones,
    )
