"""The tangent stage's plan (:mod:`tasks.jobs`): every run a seed pass records, told from the config, in the order
its flow starts them. The flow (``flows.tangent``) dispatches its tasks from these jobs and ``flows.registry``
counts them."""

from __future__ import annotations

from dataclasses import dataclass

from pbconfig.tangent import TangentConfig
from tasks.jobs import Job, Recorded, SeedPass
from tasks.tangent import TABLE1
from tasks.tangent_inputs import ShardJob
from tasks.tangent_unlearning import FORGET_METHODS

# the three runs of Table 2 per shard count, in the order ``tasks.tangent.compose_shards`` records them
TABLE2: tuple[str, ...] = ("taft-composed", "model-soup", "sisa")


@dataclass(frozen=True)
class Table1Job:
    """Table 1: ``method`` (a key of :data:`tasks.tangent.TABLE1`) on the whole training set."""

    method: str
    k: int

    @property
    def technique(self) -> str:
        return TABLE1[self.method].format(k=self.k)


@dataclass(frozen=True)
class Table2Job:
    """Table 2: one of :data:`TABLE2` composed from ``n_shards`` shard models."""

    n_shards: int
    technique: str


@dataclass(frozen=True)
class ForgetFractionJob:
    """Fig. 1: forgetting ``fraction`` of the Fig. 1 shards by subtraction."""

    fraction: float
    technique: str = "forget-fraction"


@dataclass(frozen=True)
class DPCellJob:
    """Table 3: DP-SGD in ``regime`` on the tangent ("Ours", ``tangent``) or original ("Reg") parameters at
    ``epsilon``; the cells of one column (regime, tangent) train in one task, one run per epsilon."""

    regime: str
    tangent: bool
    epsilon: float

    @property
    def technique(self) -> str:
        return f"dp-{self.regime}"

    @property
    def column(self) -> tuple[str, bool]:
        return self.regime, self.tangent


def plan_pass(cfg: TangentConfig) -> list[Job]:
    """One seed pass: the feature cache, Table 1, the shard models, Table 2, Fig. 1 (the subtraction curve, one
    shard retrained, each forgotten fraction, the forget request's methods) and Table 3."""
    dp = cfg.dp
    table3 = [DPCellJob(r, t, e) for r in dp.regimes for t in (True, False) for e in dp.epsilons] if dp else []
    return [
        Recorded("feature-cache"),
        *(Table1Job(m, cfg.k) for m in TABLE1),
        *(ShardJob(kind, n, j) for n in cfg.shards for kind in ("taft", "nlft") for j in range(n)),
        *(Table2Job(n, t) for n in cfg.shards for t in TABLE2),
        Recorded("forget-subtraction"),
        Recorded("forget-retrain"),
        *(ForgetFractionJob(f) for f in cfg.forget_fractions),
        *(Recorded(m) for m in FORGET_METHODS),
        *table3,
    ]


def plan(cfg: TangentConfig) -> list[Job]:
    """Every run of the stage below its flow run: one pass, or with ``cfg.seeds`` each pass's own run and its
    runs."""
    if cfg.seeds is None:
        return plan_pass(cfg)
    return [job for c in cfg.seed_configs() for job in (SeedPass(c.seed), *plan_pass(c))]
