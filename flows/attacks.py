"""Stage 5 flow: attack evaluation. Part 1 (SEB paper): the attacker's priors, FILM against every victim at every
batch size with every prior, the byte-coverage curve, and SEB's utility (perplexity, BLEU; one run per seed).
Part 2: the membership-inference audit of the private-training stage's models. Runs in parallel on a process
pool."""

from __future__ import annotations

from typing import Any

from prefect import unmapped

from core.errors import ConfigError
from flows.prepare import prepare_flow
from flows.recorded import recorded_flow
from flows.runners import task_runner
from pbconfig.attacks import AttacksConfig
from pbconfig.data import PrepareConfig
from pbconfig.tangent import TangentConfig
from pbconfig.train_dp import TrainDPConfig
from storage.recording import RunRef
from tasks.attacks import (
    FilmJob,
    LMJob,
    MTJob,
    film_attack,
    plan,
    seb_coverage,
    train_prior,
    utility_lm,
    utility_translation,
)
from tasks.attacks_report import attacks_summary
from tasks.audit import AuditJob, audit_recipes, audit_seqrec, audit_unlearning, epsilon_family
from tasks.jobs import of_type, unique
from tasks.records import close_flow_record, open_flow_record

STAGE = "attacks"


@recorded_flow("attacks")
def attacks_flow(
    config: AttacksConfig,
    prepare: PrepareConfig,
    profile: str = "quick",
    parent: RunRef | None = None,
    prepared: dict[str, str] | None = None,
    train_dp: TrainDPConfig | None = None,
    seqrec: dict[str, str] | None = None,
    tangent: TangentConfig | None = None,
    vision: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``prepared`` maps text-dataset names to prepared folders, ``seqrec`` the audited sequential datasets'
    names to theirs, ``vision`` holds the tangent stage's prepared ``images`` and ``model`` folders (all prepared
    here when not given); ``train_dp`` and ``tangent`` hold the audited models' hyperparameters."""
    a = config.audit
    if a is not None and train_dp is None:
        raise ConfigError("attacks.audit needs the train_dp section (the audited models' hyperparameters)")
    unlearning = a is not None and a.unlearning
    if unlearning and tangent is None:
        raise ConfigError("attacks.audit.unlearning needs the tangent section; add it or set unlearning: false")
    if prepared is None or (a is not None and seqrec is None) or (unlearning and vision is None):
        wanted = PrepareConfig(
            texts=tuple(prepare.text_dataset(n) for n in config.text_datasets()),
            datasets=tuple(prepare.dataset(n) for n in (a.datasets if a else ())),
            images=(prepare.image_dataset(tangent.dataset),) if unlearning else (),
            models=(prepare.model(tangent.model),) if unlearning else (),
        )
        done = prepare_flow(wanted, profile=profile, parent=parent)
        prepared = {n: d["path"] for n, d in done["texts"].items()}
        seqrec = {n: d["path"] for n, d in done["datasets"].items()}
        if unlearning:
            vision = {"images": done["images"][tangent.dataset]["path"], "model": done["models"][tangent.model]["path"]}
    run = open_flow_record(flow="attacks", stage=STAGE, config=config, profile=profile, parent=parent)
    u, f = config.utility, config.film
    prior = cov = None
    if f is not None:  # first in the pool's queue: every FILM run waits for the priors
        prior = {
            p.name: train_prior.submit(
                f,
                p,
                {n: prepared[n] for n in p.public} if p.kind == "trained" and p.path is None else {},
                run,
                threads=config.threads_per_worker,
            )
            for p in f.priors
        }
        cov = seb_coverage.submit(config, run)
    jobs = plan(config)
    targets = of_type(jobs, AuditJob)
    recipes = audit_recipes(train_dp, a, profile) if targets else {}
    audits = audit_seqrec.map(
        [t.dataset for t in targets],
        [t.method for t in targets],
        [t.epsilon for t in targets],
        [t.config for t in targets],
        unmapped(train_dp),
        [seqrec[t.dataset] for t in targets],
        unmapped(run),
        threads=unmapped(config.threads_per_worker),
        recipes=unmapped(recipes),
        family=unmapped(epsilon_family(a) if a is not None else None),
    )
    forget = audit_unlearning.submit(tangent, a, vision["images"], vision["model"], run) if unlearning else None
    film = None
    if f is not None:  # queued behind the audits (which run while the priors train), ahead of the utility models
        prior_dirs = {name: fut.result() for name, fut in prior.items()}
        private = {n: prepared[n] for n in f.private}
        victims = unique([j.victim for j in of_type(jobs, FilmJob)])
        film = film_attack.map(victims, unmapped(config), unmapped(private), unmapped(prior_dirs), unmapped(run))
    lm_jobs = of_type(jobs, LMJob)
    lm = utility_lm.map(
        [j.dataset for j in lm_jobs],
        [j.embedding for j in lm_jobs],
        unmapped(config),
        [prepared[j.dataset] for j in lm_jobs],
        unmapped(run),
        seed=[j.seed for j in lm_jobs],
        matched=[j.matched for j in lm_jobs],
    )
    mt_jobs = of_type(jobs, MTJob)
    mt = utility_translation.map(
        [j.embedding for j in mt_jobs],
        unmapped(config),
        unmapped(prepared[u.translation] if u is not None and u.translation and mt_jobs else ""),
        unmapped(run),
        seed=[j.seed for j in mt_jobs],
    )
    film_runs = [row for rows in film.result() for row in rows] if film is not None else []
    coverage = cov.result() if cov is not None else None
    summary = attacks_summary(
        film=film_runs,
        coverage=coverage,
        lm=lm.result(),
        mt=mt.result(),
        audit=audits.result(),
        unlearning=forget.result() if forget is not None else None,
    )
    summary["run_id"] = run.run_id
    close_flow_record(run, metrics=summary.pop("metrics"), summary=summary)
    return summary


def attacks_runner(config: AttacksConfig) -> Any:
    """Attack runs execute in parallel processes; on the Dask cluster of ``PRIVBENCH_DASK_ADDRESS`` when it is
    set (several machines)."""
    return task_runner(config.workers)
