"""Stage 2 (train-dp): DP-SGD training of sequential recommenders (the ``train_dp`` section)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from pbconfig.base import Delta, Epsilon, FrozenConfig

TrainMethod = Literal["gru", "lstm", "transformer_untied", "transformer", "dpformer"]
TRAIN_METHODS: tuple[str, ...] = get_args(TrainMethod)
PeerMethod = Literal["transformer_opacus_hooks", "transformer_opacus_ghost_untied"]
PEER_METHODS: tuple[str, ...] = get_args(PeerMethod)


class TrainDatasetSpec(FrozenConfig):
    """A prepared dataset to train on, with its dropout (App. E: 0.2 MovieLens, 0.5 Amazon)."""

    name: str
    dropout: float = Field(0.2, ge=0.0, lt=1.0)


class NonPrivateSchedule(FrozenConfig):
    """The non-private baselines' own schedule; a key left out (None) keeps the private grid point's value.

    Lets the baseline train to convergence (e.g. more epochs, a larger learning rate) while the private runs
    keep theirs: DP-SGD's noise and the baseline want different schedules, and a baseline cut at the private
    runs' epoch count understates the cost of privacy.
    """

    epochs: int | None = Field(None, ge=1, description="None: train_dp.epochs")
    lr: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="None: each of train_dp.lrs")
    batch_size: int | None = Field(None, ge=1, description="None: each of train_dp.batch_sizes")
    patience: int | None = Field(
        None, ge=1, description="stop after this many evaluations without a better validation NDCG@10; None: never"
    )

    @model_validator(mode="after")
    def _not_empty(self) -> NonPrivateSchedule:
        if self.epochs is None and self.lr is None and self.batch_size is None and self.patience is None:
            raise ValueError(
                "nonprivate_schedule sets none of epochs, lr, batch_size, patience; set at least one, "
                "or use nonprivate_schedule=null for the private grid point's schedule"
            )
        return self


class TuningConfig(FrozenConfig):
    """The learning-rate x batch-size search on validation that picks each method's recipe (DPFormer App. E.3).

    Before the grid, every method of ``methods`` (None: all of ``train_dp.methods``) trains once per
    ``train_dp.lrs`` x ``train_dp.batch_sizes`` point at ``epsilon`` and ``seed`` (and, with ``nonprivate``, each
    non-private baseline once per learning rate that ``nonprivate_schedule`` leaves open). Each method keeps the
    point with the highest validation NDCG@10 under ``protocol`` (its best evaluation over the epochs; the test
    split is never read), and the grid then runs every epsilon and seed at that point only. ``seed`` must not be
    one of ``train_dp.seeds``: the search's best run at that seed would be the best of several on validation, and
    counting it among the results would bias them upward (a winner's curse). Methods left out of
    ``methods`` run at the first learning rate and batch size. The search is recorded (stage ``train-dp-tuning``),
    and every final private run records the epsilon and delta of the search's training runs and its own under basic
    composition (footnote 9 of the paper leaves the search unaccounted); the choice itself reads the validation
    items without noise, which that bound does not cover.
    """

    epsilon: Epsilon = 8.0
    seed: int = Field(100, ge=0)
    methods: tuple[TrainMethod, ...] | None = None
    protocol: Literal["masked", "ranked"] = "masked"
    nonprivate: bool = True


class TrainDPConfig(FrozenConfig):
    """Stage 2: DP-SGD training of sequential recommenders (DPFormer Sec. 6, App. E).

    The grid is datasets x methods x epsilons x seeds (x learning rates x batch sizes), plus each
    method trained without DP when ``nonprivate`` is set (except ``dpformer``: without DP noise its
    Re-Attention corrects nothing and it is the vanilla ``transformer``), plus the Opacus peers at
    ``peer_epsilons``. ``nonprivate_schedule`` (None: the private grid point's) gives the non-private runs
    their own epochs / learning rate / batch size; non-private points that it makes identical run once.

    ``secure_mode`` (default false, so that research runs are reproducible): a private run's noise is otherwise
    drawn from a generator seeded by the recorded seed, and anyone who reads the seed regenerates it; with
    ``secure_mode`` it comes from the OS CSPRNG and is never recorded (``core.dp.noise``). Every run records which
    (tag ``privbench.noise_source``, ``noise_source`` in its config).
    """

    datasets: tuple[TrainDatasetSpec, ...] = Field(min_length=1)
    methods: tuple[TrainMethod, ...] = TRAIN_METHODS
    epsilons: tuple[Epsilon, ...] = Field((5.0, 8.0, 10.0), min_length=1)
    seeds: tuple[int, ...] = Field((0,), min_length=1)
    nonprivate: bool = True
    nonprivate_schedule: NonPrivateSchedule | None = None
    tuning: TuningConfig | None = None
    peers: tuple[PeerMethod, ...] = PEER_METHODS
    peer_epsilons: tuple[Epsilon, ...] = (8.0,)
    delta: Delta | None = Field(None, description="None: 1/(10 N) for N users, always below 1/N")
    clip_norm: float = Field(1.0, gt=0.0)
    normalize: bool = True
    accountant: Literal["rdp", "prv"] = "rdp"
    secure_mode: bool = Field(
        False,
        description="private runs draw DP noise and Poisson batches from OS-CSPRNG-seeded generators that are never "
        "recorded (not reproducible); false: from the recorded seed, which regenerates the noise stream",
    )
    epochs: int = Field(100, ge=1)
    lrs: tuple[float, ...] = Field((1e-3,), min_length=1)
    batch_sizes: tuple[int, ...] = Field((256,), min_length=1)
    weight_decay: float = Field(1e-5, ge=0.0)
    warmup_frac: float = Field(0.2, ge=0.0, lt=1.0)
    max_len: int = Field(200, ge=2)
    train_targets: Literal["every", "last_window"] = Field(
        "every",
        description="every: each user's every next-item target, in windows of max_len clipped together as the "
        "user's one unit (RecBole's SASRec also trains on every target); last_window: the last max_len only",
    )
    d_model: int = Field(64, ge=2)
    n_heads: int = Field(1, ge=1)
    n_layers: int = Field(2, ge=1)
    eval_every: int = Field(5, ge=1)
    workers: int = Field(2, ge=1, description="grid points trained in parallel (one process each)")
    threads_per_worker: int = Field(1, ge=1)

    @field_validator("lrs", "batch_sizes")
    @classmethod
    def _positive(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not v > 0]
        if bad:
            raise ValueError(f"learning rates and batch sizes must be > 0, got {bad}")
        return values

    @model_validator(mode="after")
    def _tuning_has_a_grid(self) -> TrainDPConfig:
        if self.tuning is None:
            return self
        if len(self.lrs) * len(self.batch_sizes) < 2:
            raise ValueError(
                f"tuning is set but the grid lrs={list(self.lrs)} x batch_sizes={list(self.batch_sizes)} has one "
                "point: list several learning rates or batch sizes, or set tuning=null"
            )
        if self.tuning.seed in self.seeds:
            raise ValueError(
                f"tuning.seed={self.tuning.seed} is also one of seeds {list(self.seeds)}: that seed's run at the "
                "chosen point would be the search's best of several on validation and bias the results upward; pick a "
                "tuning.seed outside seeds (default 100)"
            )
        unknown = sorted(set(self.tuning.methods or ()) - set(self.methods))
        if unknown:
            raise ValueError(
                f"tuning.methods {unknown} are not in train_dp.methods {list(self.methods)}; "
                "add them there or drop them"
            )
        return self

    @model_validator(mode="after")
    def _schedule_needs_nonprivate(self) -> TrainDPConfig:
        if self.nonprivate_schedule is not None and not self.nonprivate:
            raise ValueError(
                f"nonprivate_schedule={self.nonprivate_schedule.model_dump(exclude_none=True)} is set but "
                "nonprivate=false: no run would use it; set nonprivate=true or nonprivate_schedule=null"
            )
        return self
