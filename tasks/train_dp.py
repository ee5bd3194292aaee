"""Private-training tasks: expand the grid, train one grid point, recorded as one run with curves and ledger."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from prefect import task

from core.data.sequential import SequentialDataset
from core.dp.methods import method_d_model
from core.dp.trainer import (
    EVAL_PROTOCOL,
    NEIGHBOURING,
    PRIVACY_UNIT,
    DPTrainConfig,
    EpochLog,
    TrainResult,
    method_config,
    noise_source_of,
    train_seqrec,
)
from core.errors import DivergedError
from core.models.popularity import popularity_metrics
from pbconfig.train_dp import TrainDPConfig
from storage.recording import Recorder, RunRef
from tasks.jobs import FLOW
from tasks.prepare import load_prepared
from tasks.records import RESUMABLE, task_record

_RANKING = ("valid_ndcg10", "valid_hit10", "test_ndcg10", "test_hit10")
CURVES = ("train_loss", *_RANKING, *(f"{name}_masked" for name in _RANKING), "epsilon_spent")
_METRIC_NAMES = {
    f"{name}{masked}": f"{name[:-2]}_at_10{masked}" for name in _RANKING for masked in ("", "_masked")
}  # valid_ndcg10 -> valid_ndcg_at_10, valid_ndcg10_masked -> valid_ndcg_at_10_masked, ...

logger = logging.getLogger("privbench.train_dp")


@dataclass(frozen=True)
class Tuned:
    """How a final grid point's (lr, batch size) was chosen: ``points`` runs of the search at ``epsilon`` and
    ``seed`` (``epsilon`` None: a non-private search), the highest validation NDCG@10 under ``protocol``
    (``valid``) among them, run ``run_id``."""

    points: int
    epsilon: float | None
    seed: int
    protocol: str
    valid: float
    run_id: str = ""


@dataclass(frozen=True)
class GridPoint:
    """One training run of the grid: method, privacy level (None: non-private), seed and optimiser setting.

    ``epochs`` None trains ``train_dp.epochs``; a non-private point takes it (and ``lr``, ``batch_size``) from
    ``train_dp.nonprivate_schedule`` where that sets them.
    """

    dataset: str
    dataset_path: str
    dropout: float
    method: str
    epsilon: float | None
    seed: int
    lr: float
    batch_size: int
    epochs: int | None = None
    patience: int | None = None  # early stopping on validation (non-private points: nonprivate_schedule.patience)
    role: str = "final"  # "tuning": a point of the search on validation (TuningConfig), recorded apart
    tuned: Tuned | None = None  # a final point whose lr and batch size the search chose

    @property
    def technique(self) -> str:
        return self.method

    @property
    def label(self) -> str:
        eps = "nonprivate" if self.epsilon is None else f"eps{self.epsilon:g}"
        epochs = "" if self.epochs is None else f":e{self.epochs}"
        epochs += "" if self.patience is None else f":p{self.patience}"
        role = ":tuning" if self.role == "tuning" else ""
        return f"{self.method}:{self.dataset}:{eps}:seed{self.seed}:lr{self.lr:g}:b{self.batch_size}{epochs}{role}"

    @property
    def epsilon_with_tuning(self) -> float | None:
        """The epsilon of the search's ``points`` training runs and this one together under basic composition
        (``points x`` the search's epsilon ``+`` this run's; the search's seed is never one of the grid's, so this
        run is a fresh release). It covers the training runs only: choosing the best on the users' validation
        items reads them without noise, which no epsilon here covers. None for a non-private or untuned point."""
        t = self.tuned
        if self.epsilon is None or t is None or t.epsilon is None:
            return None
        return t.points * t.epsilon + self.epsilon


#: The method whose search a peer's points follow (the same model, another clipper).
PEER_BASE = {"transformer_opacus_hooks": "transformer", "transformer_opacus_ghost_untied": "transformer_untied"}

Recipes = dict[str, dict[str, Any]]
"""The search's choice per ``recipe_key``: ``{"lr", "batch_size", "points", "epsilon", "seed", "protocol",
"valid", "run_id"}``."""


def recipe_key(dataset: str, method: str, private: bool) -> str:
    return f"{dataset}|{method}|{'dp' if private else 'nonprivate'}"


def expand_grid(cfg: TrainDPConfig, prepared: dict[str, str], chosen: Recipes | None = None) -> list[GridPoint]:
    """datasets x (methods x epsilons [+ non-private] + peers x peer_epsilons) x seeds x lrs x batch sizes.

    The non-private points follow ``cfg.nonprivate_schedule`` where it is set; points it makes identical (e.g.
    one fixed ``lr`` across the ``lrs`` grid) are kept once, in grid order. With ``cfg.tuning`` the grid is run
    after the search (:func:`expand_tuning`, :func:`select_recipes`): ``chosen`` gives each searched method its
    (lr, batch size), the others (and every method when ``chosen`` is None) take the first of each.
    """
    runs: list[tuple[str, float | None]] = [(m, e) for m in cfg.methods for e in cfg.epsilons]
    if cfg.nonprivate:  # without DP noise Re-Attention corrects nothing: dpformer would repeat transformer
        runs += [(m, None) for m in cfg.methods if m != "dpformer"]
    runs += [(p, e) for p in cfg.peers for e in cfg.peer_epsilons]
    if cfg.tuning is None:
        points = (
            _scheduled(GridPoint(d.name, prepared[d.name], d.dropout, method, eps, seed, lr, batch), cfg)
            for d in cfg.datasets
            for (method, eps), seed, lr, batch in itertools.product(runs, cfg.seeds, cfg.lrs, cfg.batch_sizes)
        )
        return longest_first(list(dict.fromkeys(points)), cfg)
    chosen = chosen or {}
    out = []
    for d in cfg.datasets:
        for (method, eps), seed in itertools.product(runs, cfg.seeds):
            point = GridPoint(d.name, prepared[d.name], d.dropout, method, eps, seed, cfg.lrs[0], cfg.batch_sizes[0])
            out.append(at_recipe(point, cfg, chosen))
    return longest_first(list(dict.fromkeys(out)), cfg)


def at_recipe(point: GridPoint, cfg: TrainDPConfig, chosen: Recipes) -> GridPoint:
    """``point`` (built at the grid's first learning rate and batch size) at its recipe: the non-private schedule
    where it applies, then the (lr, batch size) the search chose for its (dataset, method, private or not) in
    ``chosen``, if any, with the search recorded (``tuned``). The grid and the membership audit both use it."""
    point = _scheduled(point, cfg)
    pick = chosen.get(recipe_key(point.dataset, PEER_BASE.get(point.method, point.method), point.epsilon is not None))
    if pick is None:
        return point
    tuned = Tuned(pick["points"], pick["epsilon"], pick["seed"], pick["protocol"], pick["valid"], pick["run_id"])
    return replace(point, lr=pick["lr"], batch_size=pick["batch_size"], tuned=tuned)


def expand_tuning(cfg: TrainDPConfig, prepared: dict[str, str]) -> list[GridPoint]:
    """The search of ``cfg.tuning``: each searched method at the search's epsilon and seed over lrs x batch sizes,
    and each non-private baseline over the learning rates (and batch sizes) ``nonprivate_schedule`` leaves open."""
    t = cfg.tuning
    if t is None:
        return []
    methods = t.methods or cfg.methods
    runs: list[tuple[str, float | None]] = [(m, t.epsilon) for m in methods]
    if cfg.nonprivate and t.nonprivate:
        runs += [(m, None) for m in methods if m != "dpformer"]
    points = (
        replace(
            _scheduled(GridPoint(d.name, prepared[d.name], d.dropout, method, eps, t.seed, lr, batch), cfg),
            role="tuning",
        )
        for d in cfg.datasets
        for (method, eps), lr, batch in itertools.product(runs, cfg.lrs, cfg.batch_sizes)
    )
    return longest_first(list(dict.fromkeys(points)), cfg)


#: How much an epoch of a method costs against the Transformer's (DPFormer's Re-Attention: 2-3x; a 10-epoch run of
#: the reference profile took 89 s against 44 s on the AMD EPYC, an epoch 18 s against 6.5 on the Intel Xeon).
#: Only the order of the queue reads it.
EPOCH_COST = {"dpformer": 2.0}


def longest_first(points: list[GridPoint], cfg: TrainDPConfig) -> list[GridPoint]:
    """``points`` in the order the worker pool should start them: the longest expected first (epochs x
    :data:`EPOCH_COST`; a non-private point's schedule may run several times the epochs), ties in grid order.
    A pool that takes the longest jobs first does not end with one worker busy on a long job and the other idle
    (longest-processing-time scheduling); every point is seeded by its own config, so the order changes no
    result, and :func:`select_recipes` breaks its ties by the grid's order, not the queue's."""

    def cost(p: GridPoint) -> float:
        return (p.epochs or cfg.epochs) * EPOCH_COST.get(p.method, 1.0)

    return sorted(points, key=cost, reverse=True)  # sorted is stable: equal costs keep the grid's order


def select_recipes(cfg: TrainDPConfig, results: list[dict[str, Any]]) -> Recipes:
    """Per (dataset, method, private or not): the search point with the highest validation NDCG@10 under
    ``cfg.tuning.protocol`` (first in grid order on ties); diverged points are skipped, and a method whose every
    point diverged raises :class:`~core.errors.DivergedError` naming it and the grid."""
    t = cfg.tuning
    if t is None:
        return {}
    metric = "valid_ndcg_at_10_masked" if t.protocol == "masked" else "valid_ndcg_at_10"
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(recipe_key(r["dataset"], r["method"], r["epsilon"] is not None), []).append(r)
    chosen: Recipes = {}
    for key, rows in groups.items():
        done = [r for r in rows if r.get("status") == "finished" and math.isfinite(r.get(metric, math.nan))]
        if not done:
            raise DivergedError(
                f"every search point of {key} diverged ({len(rows)} points, lrs={list(cfg.lrs)}, "
                f"batch_sizes={list(cfg.batch_sizes)}); add smaller learning rates to train_dp.lrs"
            )
        done.sort(key=lambda r: _grid_position(cfg, r))  # the queue ran them longest first
        best = max(done, key=lambda r: r[metric])  # max keeps the first of equal values: grid order
        chosen[key] = {
            "lr": best["lr"],
            "batch_size": best["batch_size"],
            "points": len(rows),
            "epsilon": best["epsilon"],
            "seed": t.seed,
            "protocol": t.protocol,
            "valid": float(best[metric]),
            "run_id": best["run_id"],
        }
    return chosen


def _grid_position(cfg: TrainDPConfig, result: dict[str, Any]) -> tuple[int, int]:
    """Where a search point's (lr, batch size) stands in the grid's order (lr first); a value the grid does not
    list (a non-private schedule's own) after those it does."""

    def position(values: tuple[Any, ...], value: Any) -> int:
        return values.index(value) if value in values else len(values)

    return position(tuple(cfg.lrs), result["lr"]), position(tuple(cfg.batch_sizes), result["batch_size"])


def _scheduled(point: GridPoint, cfg: TrainDPConfig) -> GridPoint:
    """``point`` with ``cfg.nonprivate_schedule`` applied if it is non-private (private points keep theirs)."""
    schedule = cfg.nonprivate_schedule
    if point.epsilon is not None or schedule is None:
        return point
    return replace(
        point,
        epochs=schedule.epochs,
        patience=schedule.patience,
        lr=point.lr if schedule.lr is None else schedule.lr,
        batch_size=point.batch_size if schedule.batch_size is None else schedule.batch_size,
    )


@dataclass(frozen=True)
class SearchRecord:
    """The run that holds the search's points (stage ``train-dp-tuning``), before the grid."""

    technique: str = FLOW


def plan(cfg: TrainDPConfig, prepared: dict[str, str] | None = None) -> list[GridPoint | SearchRecord]:
    """Every run of the stage below its flow run: with ``cfg.tuning`` the search's run and its points, then the
    grid (each searched method at the grid's first (lr, batch size) until the search has chosen: the same
    runs). ``prepared`` maps the datasets to their folders (empty paths where not given)."""
    paths = prepared if prepared is not None else {d.name: "" for d in cfg.datasets}
    search = [SearchRecord(), *expand_tuning(cfg, paths)] if cfg.tuning is not None else []
    return [*search, *expand_grid(cfg, paths)]


@task(name="plan-train-grid")
def plan_grid(cfg: TrainDPConfig, prepared: dict[str, str], chosen: Recipes | None = None) -> list[GridPoint]:
    return expand_grid(cfg, prepared, chosen)


@task(name="plan-train-tuning")
def plan_tuning(cfg: TrainDPConfig, prepared: dict[str, str]) -> list[GridPoint]:
    return expand_tuning(cfg, prepared)


@task(name="select-train-recipes")
def choose_recipes(cfg: TrainDPConfig, results: list[dict[str, Any]]) -> Recipes:
    return select_recipes(cfg, results)


@task(name="train-dp-point", **RESUMABLE)
def train_point(point: GridPoint, cfg: TrainDPConfig, parent: RunRef) -> dict[str, Any]:
    """Train one grid point; record curves (step = epoch), best/final metrics, and the privacy ledger.

    A point whose training diverges (:class:`~core.errors.DivergedError`, e.g. too large a learning rate) is
    recorded ``failed`` with the reason and no metrics, and returned with ``status="failed"``: in a sweep a
    diverging setting is an outcome, so the other points go on. Any other error fails the task (and the flow).
    """
    torch.set_num_threads(cfg.threads_per_worker)
    data = load_prepared(point.dataset_path)
    train_cfg = method_config(point.method, **train_overrides(point, cfg))
    about = {
        "label": point.label,
        "method": point.method,
        "dataset": point.dataset,
        "epsilon": point.epsilon,
        "seed": point.seed,
        "lr": point.lr,
        "batch_size": point.batch_size,
        "role": point.role,
    }
    try:
        with task_record(
            parent=parent,
            technique=point.method,
            config=_run_config(point, train_cfg),
            dataset=point.dataset,
            run_name=point.label,
        ) as rec:
            rec.tag("privbench.noise_source", noise_source_of(train_cfg))
            result = _train(data, train_cfg, rec)
            _record_result(rec, result, point)
            _record_popularity(rec, data)
    except DivergedError as exc:  # raised by training, so ``rec`` is bound and its row is already failed
        logger.warning("grid point %s diverged (run %s failed): %s", point.label, rec.run_id, exc)
        return {"run_id": rec.run_id, **about, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    return {
        "run_id": rec.run_id,
        **about,
        "status": "finished",
        "test_ndcg_at_10": result.test_ndcg10,
        "test_hit_at_10": result.test_hit10,
        "test_ndcg_at_10_masked": result.test_ndcg10_masked,
        "test_hit_at_10_masked": result.test_hit10_masked,
        "valid_ndcg_at_10": max(log.valid_ndcg10 for log in result.history),
        "valid_ndcg_at_10_masked": max(log.valid_ndcg10_masked for log in result.history),
        "wall_s": result.wall_s,
    }


def _train(data: SequentialDataset, train_cfg: DPTrainConfig, rec: Recorder) -> TrainResult:
    """``train_seqrec`` with every evaluation recorded; a divergence also names the config keys to change."""
    try:
        return train_seqrec(data, train_cfg, on_epoch=lambda log: _record_epoch(rec, log))
    except DivergedError as exc:
        keys = "train_dp.lrs, train_dp.clip_norm" if train_cfg.private else "train_dp.lrs"
        raise type(exc)(f"{exc}; config keys: {keys}") from exc


def train_overrides(point: GridPoint, cfg: TrainDPConfig) -> dict[str, Any]:
    common = {
        "dropout": point.dropout,
        "max_len": cfg.max_len,
        "train_targets": cfg.train_targets,
        "n_heads": cfg.n_heads,
        "n_layers": cfg.n_layers,
        "epochs": cfg.epochs if point.epochs is None else point.epochs,
        "batch_size": point.batch_size,
        "lr": point.lr,
        "weight_decay": cfg.weight_decay,
        "warmup_frac": cfg.warmup_frac,
        "eval_every": cfg.eval_every,
        "seed": point.seed,
        "patience": point.patience,
    }
    common["d_model"] = method_d_model(point.method, cfg.d_model)  # the untied Opacus peer's is halved
    if point.epsilon is None:
        return common | {"clipping": "nonprivate", "epsilon": None}
    return common | {
        "epsilon": point.epsilon,
        "delta": cfg.delta,
        "clip_norm": cfg.clip_norm,
        "normalize": cfg.normalize,
        "accountant": cfg.accountant,
        "secure_mode": cfg.secure_mode,
    }


def _run_config(point: GridPoint, train_cfg: DPTrainConfig) -> dict[str, Any]:
    return {
        "point": asdict(point),
        "train": asdict(train_cfg),
        "protocol": EVAL_PROTOCOL,
        "noise_source": noise_source_of(train_cfg),
    }


def _record_popularity(rec: Recorder, data: SequentialDataset) -> None:
    """The most-popular-items ranking on the same users and splits (``popularity.*``): the floor the run must
    clear to have learned more than item counts (``core.models.popularity``)."""
    for split in ("valid", "test"):
        floor = popularity_metrics(data, split)
        rec.metrics(
            {
                f"popularity.{split}_ndcg_at_10": floor.ndcg,
                f"popularity.{split}_hit_at_10": floor.hit,
                f"popularity.{split}_ndcg_at_10_masked": floor.ndcg_masked,
                f"popularity.{split}_hit_at_10_masked": floor.hit_masked,
            }
        )


def _record_epoch(rec: Recorder, log: EpochLog) -> None:
    for field in CURVES:
        value = getattr(log, field)
        if value is not None and math.isfinite(value):  # epsilon_spent is inf without DP
            rec.metric(f"curve/{_METRIC_NAMES.get(field, field)}", value, step=log.epoch)


def _record_result(rec: Recorder, result: TrainResult, point: GridPoint) -> None:
    """Best/final metrics under both protocols (``*_masked``: history masked), each at its own best epoch, and
    Re-Attention's per-block correction sizes (``reattention.block<k>.*``) where it ran."""
    best = next(log for log in result.history if log.epoch == result.best_epoch)
    best_masked = next(log for log in result.history if log.epoch == result.best_epoch_masked)
    rec.metrics(
        {
            "test_ndcg_at_10": result.test_ndcg10,
            "test_hit_at_10": result.test_hit10,
            "valid_ndcg_at_10": best.valid_ndcg10,
            "valid_hit_at_10": best.valid_hit10,
            "final_test_ndcg_at_10": result.final_test_ndcg10,
            "final_test_hit_at_10": result.final_test_hit10,
            "best_epoch": result.best_epoch,
            "test_ndcg_at_10_masked": result.test_ndcg10_masked,
            "test_hit_at_10_masked": result.test_hit10_masked,
            "valid_ndcg_at_10_masked": best_masked.valid_ndcg10_masked,
            "valid_hit_at_10_masked": best_masked.valid_hit10_masked,
            "final_test_ndcg_at_10_masked": result.final_test_ndcg10_masked,
            "final_test_hit_at_10_masked": result.final_test_hit10_masked,
            "best_epoch_masked": result.best_epoch_masked,
            "n_params": result.n_params,
            "steps": result.steps,
            "epochs_trained": result.history[-1].epoch,  # fewer than planned where patience stopped it
            "train_wall_s": result.wall_s,
        },
        units={"train_wall_s": "s"},
    )
    if result.correction_sizes:  # Re-Attention (dpformer): per-block correction size over the last epoch
        nats = {name: "nats" for name in result.correction_sizes if ".correction_" in name}
        rec.metrics(result.correction_sizes, units=nats)
    if result.ledger is not None:
        ledger = result.ledger
        rec.ledger(ledger, unit=PRIVACY_UNIT, neighbouring=NEIGHBOURING)
        rec.metric("epsilon", ledger.epsilon)
    if point.tuned is not None:  # the search that chose this point's lr and batch size (TuningConfig)
        protocol = "_masked" if point.tuned.protocol == "masked" else ""
        rec.metrics({"tuning.points": point.tuned.points, f"tuning.valid_ndcg_at_10{protocol}": point.tuned.valid})
        if point.epsilon_with_tuning is not None and result.ledger is not None:
            rec.metric("epsilon_with_tuning", point.epsilon_with_tuning)
            rec.metric("delta_with_tuning", (point.tuned.points + 1) * result.ledger.delta)
    rec.artifact_json("curves.json", [asdict(log) for log in result.history])
    rec.tag("privbench.dp", "nonprivate" if point.epsilon is None else f"eps={point.epsilon:g}")
    rec.tag("privbench.protocol", EVAL_PROTOCOL)
