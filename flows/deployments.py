"""Deployment entry points: one flow per stage plus ``benchmark``, whose parameters are a profile name and
``--set``-style overrides (what a Prefect deployment, a schedule or the Prefect UI can pass). Each loads and
validates the config, then runs the stage's flow exactly as ``privbench run <stage>`` does (same task runners),
as a subflow. A retried flow run (``prefect flow-run retry ID`` after a lost worker) first marks the rows its dead
attempt left ``running`` failed, then reuses the tasks that attempt completed (``tasks.records.RESUMABLE``).
``deploy/prefect.yaml`` points its deployments here; ``privbench serve`` serves them locally.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.registry import run_flow
from pbconfig.benchmark import load_config
from tasks.records import reclaim_retried_runs


def _run(stage: str, profile: str, overrides: list[str] | None) -> dict[str, Any]:
    cfg = load_config(profile, overrides=tuple(overrides or ()))
    reclaim_retried_runs()
    return run_flow(stage, cfg)


@flow(name="prepare-profile")
def prepare_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run prepare --profile PROFILE --set ...``: stage 1, dataset preparation."""
    return _run("prepare", profile, overrides)


@flow(name="train-dp-profile")
def train_dp_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run train-dp``: stage 2, the DP-SGD grid (DPFormer vs Opacus and baselines)."""
    return _run("train-dp", profile, overrides)


@flow(name="tangent-profile")
def tangent_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run tangent``: stage 3, TAFT composition and unlearning vs SISA and Model Soup."""
    return _run("tangent", profile, overrides)


@flow(name="secure-inference-profile")
def secure_inference_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run secure-inference``: stage 4, MERGE vs vanilla MPC, MPCFormer and THE-X; runs on CPU
    unchanged where no GPU exists (``device: auto``)."""
    return _run("secure-inference", profile, overrides)


@flow(name="stip-profile")
def stip_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run stip``: stage 4, the STIP three-party permutation protocol and its attacks."""
    return _run("stip", profile, overrides)


@flow(name="attacks-profile")
def attacks_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run attacks``: stage 5, FILM vs SEB and the membership-inference audits."""
    return _run("attacks", profile, overrides)


@flow(name="benchmark-profile")
def benchmark_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run benchmark``: every stage in order under one parent run."""
    return _run("benchmark", profile, overrides)


PROFILE_FLOWS = {
    "prepare": prepare_profile,
    "train-dp": train_dp_profile,
    "tangent": tangent_profile,
    "secure-inference": secure_inference_profile,
    "stip": stip_profile,
    "attacks": attacks_profile,
    "benchmark": benchmark_profile,
}
